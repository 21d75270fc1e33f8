"""Diagnose a multi-agent training run: Paper A's two failure mechanisms, measured and named.

    python diagnose.py runs/a runs/b              # report.md and plots of these runs
    python diagnose.py --probe runs/a/ckpt        # kappa, coherence and gradient shares on one batch
    python diagnose.py --watch runs/a "What is 7 + 5?"   # every call of the trained workflow, printed
    python diagnose.py --watch runs/a/best "What is 7 + 5?"   # ... as its best evaluation left it

Paper A (Zeng et al. 2026, arXiv 2605.24202) finds that multi-agent RL on one
base model fails in two ways, one per way of sharing the LoRA policy:

- gradient amplification (isolated adapters): N same-role slots see the same
  prompt and the same broadcast reward, so their gradients point the same way;
  kappa = |sum_i g_i| / sqrt(sum_i |g_i|^2) nears sqrt(N) (grpo.amplification),
  the role's adapter takes N times the optimizer steps, the update norm
  spikes and accuracy drops;
- role capture (one shared adapter): the role with the most tokens or calls
  owns most of the gradient, and the other roles drift towards its behaviour:
  their contract adherence falls and their outputs start to look like the
  dominant role's (workflows.adherence, workflows.similarity).

train.py logs every signal used here (metrics.jsonl); this file reads the
logs, plots them side by side and applies three detectors with explicit
thresholds. The thresholds are choices of this project, not the paper's. It
imports train.py (the probe drives it); grid.py, which trains the main table's
and the demos' cells, builds its tables on this file.

Exercised by: pytest tests/test_diagnose.py
"""
import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import re
import statistics
import sys
from collections import Counter

import matplotlib
import torch

matplotlib.use("Agg")  # headless: the plots are files
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

import launch
import train
from grpo import policy_update, set_advantages
from lora import adapter_for, adapter_parameters, inject_lora, load_adapters, setup_adapters
from tasks import KINDS, load_task
from rollout import Rollout, load_policy
from runs import load_run, read_best
from workflows import ROLES, role_of, run_workflow, slots

CLIFF = 0.10  # accuracy peak minus final that counts as a cliff
KAPPA_FRAC = 0.8  # kappa >= 0.8 sqrt(N) counts as "near sqrt(N)"
SPIKE = 2.0  # an update norm >= 2x the median of the earlier steps is a spike
DROP = 0.10  # a fall of reward (mean of the next 2 steps) or accuracy after the spike
SHARE = 0.70  # a role owning this share of a shared adapter's gradient dominates it
ADHERENCE_FALL = 0.20  # first-third minus last-third adherence of the captured role
SIM_RISE = 0.05  # last-third minus first-third similarity to the dominant role

# figure name -> (regex over metric keys, y-axis label); the regex's groups name the line
PLOTS = {
    "accuracy": (r"eval/accuracy", "held-out accuracy (fraction of problems, greedy)"),
    "reward": (r"reward/mean", "training reward (mean outcome, 0-1)"),
    "grad_norm": (r"role/(\w+)/grad_norm", "gradient L2 norm of the role's loss"),
    "update_norm": (r"adapter/([\w-]+)/update_norm", "L2 norm of the adapter's change in the step"),
    "kappa": (r"role/(\w+)/kappa", "kappa = |sum g_i| / sqrt(sum |g_i|^2) (1 to sqrt(N))"),
    "coherence": (r"role/(\w+)/coherence", "mean pairwise cosine of slot gradients"),
    "grad_share": (r"role/(\w+)/grad_share", "share of the shared adapter's gradient (0-1)"),
    "ppl": (r"role/(\w+)/ppl", "training perplexity (exp of -mean log-prob)"),
    "chi2": (r"role/(\w+)/chi2", "chi2 = E[ratio^2] - 1 over tokens"),
    "entropy": (r"role/(\w+)/entropy", "next-token entropy (nats)"),
    "adherence": (r"role/(\w+)/adherence", "outputs that keep the role's contract (fraction)"),
    "similarity": (r"role/(\w+)/sim/(\w+)", "word-trigram Jaccard overlap of two roles' outputs"),
    "length": (r"role/(\w+)/len", "completion length (tokens per call)"),
}


# ----------------------------------------------------------------------------
# Reading runs (runs.load_run reads a run directory)


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if key in r]


def thirds(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last third (at least one value each)."""
    k = max(1, len(values) // 3)
    return statistics.mean(values[:k]), statistics.mean(values[-k:])


def multiplicity(config: dict) -> dict[str, int]:
    """Slots per role type: voting with 3 agents -> generator 3, aggregator 1."""
    return dict(Counter(role_of(s) for s in slots(config["workflow"], config.get("n_agents", 3))))


# ----------------------------------------------------------------------------
# Detectors: each returns findings, one line of evidence each


def find_cliff(rows: list[dict], threshold: float = CLIFF, n_problems: int = 0) -> list[str]:
    """Held-out accuracy peak minus final >= threshold (a cliff), else the deepest fall on the
    way >= threshold (a dip). With the evaluation's size, the finding says whether the fall
    exceeds two standard errors of the difference of two accuracies (unpaired, so an
    overestimate: both use the same problems)."""
    acc = series(rows, "eval/accuracy")
    if len(acc) < 2:
        return []
    peak_step, peak = max(acc, key=lambda sv: sv[1])
    final_step, final = acc[-1]
    if peak - final >= threshold:
        line = (f"accuracy cliff: held-out accuracy peaked at {peak:.3f} at step {peak_step} and "
                f"ended at {final:.3f} at step {final_step} (-{peak - final:.3f})")
        return [line + noise(peak, final, n_problems)]
    # no cliff at the end; the deepest fall on the way (a high, then a later low) may still be one
    (high_step, high), (low_step, low) = max(itertools.combinations(acc, 2), key=lambda p: p[0][1] - p[1][1])
    if high - low < threshold:
        return []
    line = (f"accuracy dip: held-out accuracy fell from {high:.3f} at step {high_step} to {low:.3f} "
            f"at step {low_step} (-{high - low:.3f}) and ended at {final:.3f}")
    return [line + noise(high, low, n_problems)]


def noise(a: float, b: float, n_problems: int) -> str:
    """Whether a fall from accuracy a to b exceeds two standard errors of the difference."""
    if not n_problems:
        return ""
    se = math.sqrt((a * (1 - a) + b * (1 - b)) / n_problems)
    return f", {'more' if a - b > 2 * se else 'less'} than two standard errors ({2 * se:.3f} at {n_problems} problems)"


def find_amplification(config: dict, rows: list[dict]) -> list[str]:
    """kappa near sqrt(N) on a role with N > 1 slots, an update-norm spike within two steps,
    then a drop of reward or accuracy. Reports the first such episode per role."""
    found = []
    rewards, acc = dict(series(rows, "reward/mean")), series(rows, "eval/accuracy")
    for role, n in multiplicity(config).items():
        adapter = "shared" if config["sharing"] == "shared" else role
        updates = series(rows, f"adapter/{adapter}/update_norm")
        coherent = [(s, k) for s, k in series(rows, f"role/{role}/kappa") if k >= KAPPA_FRAC * math.sqrt(n)]
        for (step, kappa), (i, (s, u)) in itertools.product(coherent, enumerate(updates)):
            base = statistics.median([v for _, v in updates[:i]]) if i >= 2 else math.inf
            drop = step <= s <= step + 2 and u >= SPIKE * base and (
                reward_drop(rewards, s) or accuracy_drop(acc, s))
            if drop:
                found.append(f"gradient amplification: {role} (N={n}) has kappa {kappa:.2f} "
                             f"(sqrt(N) = {math.sqrt(n):.2f}) at step {step}, the {adapter} update "
                             f"norm spikes to {u:.3g} ({u / base:.1f}x the median before) at step "
                             f"{s}, then {drop}")
                break
    return found


def reward_drop(rewards: dict[int, float], step: int) -> str | None:
    before = [rewards[s] for s in (step - 1, step) if s in rewards]
    after = [rewards[s] for s in (step + 1, step + 2) if s in rewards]
    if before and after and statistics.mean(before) - statistics.mean(after) >= DROP:
        return (f"the training reward falls from {statistics.mean(before):.3f} to "
                f"{statistics.mean(after):.3f}")
    return None


def accuracy_drop(acc: list[tuple[int, float]], step: int) -> str | None:
    before = [v for s, v in acc if s <= step]
    after = [(s, v) for s, v in acc if s > step]
    if before and after and before[-1] - after[-1][1] >= DROP:
        return f"held-out accuracy falls from {before[-1]:.3f} to {after[-1][1]:.3f} at step {after[-1][0]}"
    return None


def find_capture(config: dict, rows: list[dict]) -> list[str]:
    """Under one shared adapter: a dominant gradient share, and another role drifting to it."""
    roles = ROLES[config["workflow"]]
    if config["sharing"] != "shared" or len(roles) < 2:
        return []
    found = []
    for dominant in roles:
        shares = [v for _, v in series(rows, f"role/{dominant}/grad_share")]
        if not shares or statistics.mean(shares) < SHARE:
            continue
        for role in roles:
            evidence = drift(rows, role, dominant) if role != dominant else []
            if evidence:
                found.append(f"role capture: {dominant} holds {statistics.mean(shares):.0%} of the "
                             f"shared gradient on average, and {role} drifts: " + "; ".join(evidence))
    return found


def drift(rows: list[dict], role: str, dominant: str) -> list[str]:
    """Evidence that `role` leaves its contract for `dominant`'s behaviour, first third vs last."""
    evidence = []
    adherence = series(rows, f"role/{role}/adherence")
    if len(adherence) >= 2:
        first, last = thirds([v for _, v in adherence])
        if first - last >= ADHERENCE_FALL:
            evidence.append(f"its adherence falls from {first:.2f} to {last:.2f} "
                            f"(steps {adherence[0][0]}-{adherence[-1][0]})")
    sim = series(rows, f"role/{role}/sim/{dominant}")
    if len(sim) >= 2:
        first, last = thirds([v for _, v in sim])
        if last - first >= SIM_RISE:
            evidence.append(f"its similarity to {dominant} rises from {first:.2f} to {last:.2f}")
    return evidence


def findings(config: dict, rows: list[dict]) -> list[str]:
    return (find_cliff(rows, CLIFF, config.get("eval_problems", 0)) + find_amplification(config, rows)
            + find_capture(config, rows))


# ----------------------------------------------------------------------------
# Report: a table per run, the findings, and one plot per signal


def run_name(run_dir: str) -> str:
    return os.path.basename(os.path.normpath(run_dir))


LINESTYLES = ("-", "--", ":", "-.")  # one per run, so runs stay apart when roles share colours


def plot(runs: dict[str, list[dict]], out: str) -> list[str]:
    """One PNG per signal with a line per (run, role); returns the files written."""
    written = []
    for name, (pattern, ylabel) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (run, rows) in enumerate(runs.items()):
            keys = sorted({k for r in rows for k in r if re.fullmatch(pattern, k)})
            for key in keys:
                label = "/".join([run, *re.fullmatch(pattern, key).groups()])
                xs, ys = zip(*series(rows, key))
                ax.plot(xs, ys, LINESTYLES[i % len(LINESTYLES)], marker="o", markersize=3, label=label)
        if not ax.lines:
            plt.close(fig)
            continue
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(name)
        ax.legend(fontsize=7)
        path = os.path.join(out, f"{name}.png")
        fig.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def summary(config: dict, rows: list[dict]) -> dict[str, str]:
    """One table row: what ran, accuracy before/peak/final, and the mean of each role signal."""
    acc = [v for _, v in series(rows, "eval/accuracy")]
    row = {"workflow": config["workflow"], "sharing": config["sharing"], "algo": config["algo"],
           "steps": str(max(r["step"] for r in rows)),
           "accuracy": " / ".join(f"{a:.3f}" for a in (acc[0], max(acc), acc[-1])) if acc else "-"}
    for signal in ("kappa", "grad_share", "adherence"):
        parts = []
        for role in ROLES[config["workflow"]]:
            values = [v for _, v in series(rows, f"role/{role}/{signal}")]
            if values:
                parts.append(f"{role} {statistics.mean(values):.2f}")
        row[signal] = ", ".join(parts) or "-"
    return row


def writable(directory: str, what: str) -> None:
    """Make `directory` if it is missing; stop with one line if `what` cannot be written in it (a
    file, a read-only run), before any work that would be lost."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:  # a file in the way, or a parent that cannot be written
        why = "a file, not a directory" if os.path.isfile(directory) else e.strerror
        raise SystemExit(f"{directory}: cannot write {what} there ({why})") from None
    if not os.access(directory, os.W_OK):
        raise SystemExit(f"{directory}: cannot write {what} there (read-only)")


def report(run_dirs: list[str], out: str, names=run_name) -> str:
    """Write report.md and the plots into `out`; return the report's path. `names` gives each
    run's name in the tables and plots (default: its directory's name)."""
    runs = {names(d): load_run(d) for d in run_dirs}  # name -> (config, rows)
    writable(out, "report.md")
    table = [{"run": name, **summary(config, rows)} for name, (config, rows) in runs.items()]
    header = list(table[0])
    lines = ["# Diagnosis", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r[h] for h in header) + " |" for r in table]
    lines += ["", "accuracy: before / peak / final (greedy, held-out); kappa, grad_share, "
              "adherence: means over the logged steps, per role.", "", "## Findings", ""]
    for name, (config, rows) in runs.items():
        found = findings(config, rows)
        lines.append(f"- **{name}**: " + ("; ".join(found) if found else "nothing detected"))
    lines += ["", f"Thresholds: cliff {CLIFF}, kappa >= {KAPPA_FRAC} sqrt(N), update spike {SPIKE}x, "
              f"drop {DROP}, dominant share {SHARE}, adherence fall {ADHERENCE_FALL}, "
              f"similarity rise {SIM_RISE}.", "", "## Plots", ""]
    plots = plot({name: rows for name, (_, rows) in runs.items()}, out)
    lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------
# A trained run: the gradient probe, and watching it answer


def trained_model(ckpt: str) -> tuple[train.Config, object, object, list[str]]:
    """The run's config, its model and tokenizer, and its adapters as saved in checkpoint `ckpt`."""
    run_dir = os.path.dirname(os.path.normpath(ckpt))
    if not os.path.exists(os.path.join(ckpt, "state.pt")):
        raise SystemExit(f"{ckpt} is not a checkpoint (no state.pt)")
    cfg = train.Config(**load_run(run_dir)[0])
    model, tok = load_policy(cfg.model, "cuda" if torch.cuda.is_available() else "cpu", cfg.dtype)
    inject_lora(model, cfg.lora_r, cfg.lora_alpha, tuple(cfg.lora_targets.split(",")))
    names = setup_adapters(model, ROLES[cfg.workflow], cfg.sharing)
    try:
        load_adapters(model, ckpt, names)
    except Exception as e:  # a truncated or foreign adapter file
        raise SystemExit(f"{ckpt}: the adapters cannot be read ({type(e).__name__}: {str(e)[:80]})") from None
    return cfg, model, tok, names


def probe(ckpt: str, problems: int) -> dict[str, float]:
    """kappa, coherence and gradient shares of one fresh sampled batch, without a step.

    Advantages are group-relative (GRPO) whatever the run's algorithm: the probe asks how
    the slots' policy gradients line up, not what a critic would make of them."""
    cfg, model, tok, names = trained_model(ckpt)
    writable(os.path.dirname(os.path.normpath(ckpt)), "probe.json")  # where main writes it, known before the work
    torch.manual_seed(cfg.seed + 1)  # a batch the run did not train on, the same every time
    pool = load_task(cfg.task, "train", cfg.train_problems, cfg.level, cfg.seed)
    if not 1 <= problems <= len(pool):
        raise SystemExit(f"--probe_problems {problems}: must be in [1, {len(pool)}] (the run's training pool)")
    problem_of = [i for i in range(problems) for _ in range(cfg.group_size)]
    rollout, _, rewards = train.rollout_step(model, tok, cfg, [pool[i] for i in problem_of], greedy=False)
    set_advantages(rollout.calls, problem_of, cfg.adv_group)
    result = {"reward/mean": sum(rewards) / len(rewards)}
    for name in names:
        mine = [c for c in rollout.calls if adapter_for(c.role, cfg.sharing) == name]
        frozen = torch.optim.SGD(adapter_parameters(model, name), lr=0.0)  # measure, do not move
        for p in adapter_parameters(model, name):
            p.requires_grad_(True)
            p.grad = torch.zeros_like(p)
        # one step over every call, no clip, no mitigation: the raw gradients of the run's loss
        settings = dataclasses.replace(launch.update_settings(cfg), one_step=True, grad_clip=float("inf"),
                                       balance="none", damping=0.0)
        stats = policy_update(model, name, mine, frozen, random.Random(0), tok.pad_token_id, settings)
        result.update({k: v[0] for k, v in stats.items()
                       if k.endswith(("kappa", "coherence", "grad_share", "/grad_norm"))})
    return result


def watch(run: str, question: str, sample: bool = False, seed: int = 0) -> str:
    """Run a trained workflow on one question and print every call: stage, slot, adapter,
    prompt (as the model saw it, chat template included) and output. `run`: a run directory (its
    newest checkpoint) or a checkpoint in one, RUN/best. Returns the final text."""
    ckpt = run if os.path.exists(os.path.join(run, "state.pt")) else os.path.join(run, "ckpt")
    cfg, model, tok, _ = trained_model(ckpt)
    torch.manual_seed(seed)
    rollout = Rollout(model, tok, cfg.sharing, max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.temperature, top_p=cfg.top_p, greedy=not sample)
    outcome = run_workflow(cfg.workflow, [question], rollout, kind=KINDS[cfg.task],
                           n_agents=cfg.n_agents, max_rounds=cfg.max_rounds)[0]
    decoding = f"sampled at temperature {cfg.temperature}, seed {seed}" if sample else "greedy"
    best = read_best(ckpt)
    kept = f" (step {best['step']}, {best['metric']} {best['score']:.3f})" if best else ""
    print(f"{cfg.workflow}, {cfg.sharing} adapters, from {ckpt}{kept}; {decoding}")
    for call in rollout.calls:
        print(f"\n=== stage {call.turn + 1}: {call.slot} (adapter {adapter_for(call.role, cfg.sharing)})")
        print(f"--- prompt:\n{call.prompt}")
        print(f"--- output:\n{call.text}")
    print(f"\n=== final answer:\n{outcome.final}\n=== info: {outcome.info}")
    return outcome.final


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="grid.py trains the main table's and the demos' cells.")
    parser.add_argument("runs", nargs="*", help="train.py run directories")
    parser.add_argument("--out", default=None, help="where report.md and the plots go "
                        "(default: the run directory, or the runs' common parent)")
    parser.add_argument("--probe", metavar="CHECKPOINT", help="a run's ckpt directory")
    parser.add_argument("--probe_problems", type=int, default=4, help="problems in the probe batch")
    parser.add_argument("--watch", nargs=2, metavar=("RUN", "QUESTION"),
                        help="print every call of the run's trained workflow on one question (RUN/best: "
                        "its best checkpoint)")
    parser.add_argument("--sample", action="store_true", help="--watch: sample at the run's "
                        "temperature instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="--watch --sample: the sampling seed")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.watch:
        watch(*args.watch, sample=args.sample, seed=args.seed)
    elif args.probe:
        result = probe(args.probe, args.probe_problems)
        for k, v in result.items():
            print(f"{k:40s} {v:.4f}")
        with open(os.path.join(os.path.dirname(os.path.normpath(args.probe)), "probe.json"), "w") as f:
            json.dump(result, f, indent=2)
    elif args.runs:
        out = args.out or (args.runs[0] if len(args.runs) == 1 else os.path.commonpath(
            [os.path.abspath(r) for r in args.runs]))
        print(report(args.runs, out))
    else:
        parser.error("give run directories, --probe CHECKPOINT or --watch RUN QUESTION")


if __name__ == "__main__":
    main()
