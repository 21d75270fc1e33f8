"""Diagnose a multi-agent training run: Paper A's two failure mechanisms, measured and named.

    python diagnose.py runs/a runs/b                     # report.md and plots of these runs
    python diagnose.py --probe runs/a/ckpt               # kappa, coherence, gradient shares
    python diagnose.py --probe runs/a/ckpt --probe_problems 4,8,16   # ... and where kappa aligns
    python diagnose.py --watch runs/a "What is 7 + 5?"   # every call of the trained workflow
    python diagnose.py --watch runs/a/best "What is 7 + 5?"   # ... as its best evaluation left it

Paper A (Zeng et al. 2026, arXiv 2605.24202), one failure per way of sharing the LoRA policy:

- gradient amplification (isolated adapters): N same-role slots share a prompt and a reward, so
  kappa = |sum_i g_i| / sqrt(sum_i |g_i|^2) nears sqrt(N) (measure.amplification), and with
  --no-one_step (the paper's steps) the role's adapter takes N times the optimizer steps; its
  gradient norm and perplexity spike, then validation accuracy falls;
- role capture (one shared adapter): the role with the most tokens or calls owns most of the
  gradient, and the others drift towards it: their contract adherence falls while their outputs
  grow longer and alike (workflows.adherence, workflows.similarity).

This file reads train.py's metrics.jsonl, plots it and applies three detectors (a cliff and the
two signatures) with thresholds of this project's choosing; a fall counts only beyond its noise,
a peak is chosen on val where a run has one. --probe and --watch are lab/probe.py's.

Exercised by: pytest tests/test_diagnose.py
"""
import argparse
import itertools
import math
import os
import re
import statistics
import sys
from collections import Counter

import matplotlib

matplotlib.use("Agg")  # headless: the plots are files
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from lab.settings import typed_flags
from lab.probe import probe, watch, write_probe
from lab.files import load_run, writable
from workflows import ROLES, role_of, slots

# Thresholds of the detectors: choices of this project (Paper A gives none). Raise FALL_Z or
# MIN_CALLS to be stricter about noise; the others set how large an event must be.
CLIFF = 0.10  # test accuracy, peak minus final, that counts as a cliff (if also beyond noise)
FALL_Z = 2.0  # a fall counts only beyond 2 standard errors of the difference
HISTORY = 5  # a role's running median is over its last 5 logged steps,
MIN_HISTORY = 3  # of which at least 3 (so no spike is called before step 4)
GRAD_SPIKE = 2.0  # a role's gradient norm >= 2x its running median is a spike
PPL_SPIKE = 1.5  # a role's training perplexity >= 1.5x its running median is a spike
KAPPA_FRAC = 0.8  # where kappa is logged at the spike, it must be >= 0.8 sqrt(N): "near sqrt(N)"
FALL_WITHIN = 5  # the validation fall shows at an evaluation at most 5 steps after the spike,
DROP = 0.10  # and is at least 0.10 (as well as beyond noise)
SHARE = 0.70  # a role owning this share of a shared adapter's gradient dominates it
MIN_CALLS = 32  # each capture window holds >= 32 of the role's calls (a standard error <= 0.09)
ADHERENCE_FALL = 0.20  # the captured role's adherence falls by this much, early window to late,
LEN_RISE = 1.2  # while its completions grow by 20 %
SIM_RISE = 0.05  # and its word-trigram similarity to the dominant role rises by 0.05

# figure name -> (regex over metric keys, y-axis label); the regex's groups name the line
PLOTS = {
    "accuracy": (r"(eval|val)/accuracy",
                 "held-out accuracy: eval test split, val validation split"),
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
# Reading runs (files.load_run reads a run directory)


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if key in r]


def markdown(head: list[str], rows: list[list[str]]) -> list[str]:
    rule = "|" + "---|" * len(head)
    return [f"| {' | '.join(head)} |", rule, *(f"| {' | '.join(row)} |" for row in rows)]


def multiplicity(config: dict) -> dict[str, int]:
    """Slots per role type: voting with 3 agents -> generator 3, aggregator 1."""
    return dict(Counter(role_of(s) for s in slots(config["workflow"], config.get("n_agents", 3))))


def accuracies(config: dict, rows: list[dict], split: str) -> dict[int, tuple[float, float | None]]:
    """step -> (accuracy, its logged standard error, else the binomial one, else None)."""
    logged, n = dict(series(rows, f"{split}/accuracy_se")), config.get(f"{split}_problems", 0)
    return {s: (a, logged.get(s, math.sqrt(a * (1 - a) / n) if n else None))
            for s, a in series(rows, f"{split}/accuracy")}


def validation(rows: list[dict]) -> str:
    """The split that chooses peaks: val where logged, else eval (whose peak is then biased up)."""
    return "val" if any("val/accuracy" in r for r in rows) else "eval"


def peak_step(rows: list[dict], steps: list[int]) -> int:
    """The step of `steps` with the best accuracy on validation(rows), the earliest of ties."""
    chosen = dict(series(rows, f"{validation(rows)}/accuracy"))
    return max(steps, key=lambda s: (chosen.get(s, -math.inf), -s))


def fall_beyond_noise(high: tuple[float, float | None], low: tuple[float, float | None],
                      floor: float) -> str | None:
    """How a fall from `high` to `low` ((accuracy, standard error) each) of >= floor compares with
    its noise, if beyond FALL_Z standard errors; else None. Two evaluations of the same problems
    taken as independent overestimate the error: the test is conservative."""
    (a, se_a), (b, se_b) = high, low
    if a - b < floor:
        return None
    if se_a is None or se_b is None:
        return " (noise unknown: no standard error logged)"
    se = math.hypot(se_a, se_b)
    if a - b <= FALL_Z * se:
        return None
    return f", beyond {FALL_Z:g} standard errors of the difference ({FALL_Z * se:.3f})"


# ----------------------------------------------------------------------------
# Detectors: each returns findings, one line of evidence each


def find_cliff(config: dict, rows: list[dict], threshold: float = CLIFF) -> list[str]:
    """Test accuracy falling from the peak to the end (a cliff) or, failing that, to the lowest
    point after the peak (a dip), by >= threshold and beyond noise. Both points are chosen on val
    where the run has one, so the choice does not inflate the fall."""
    test = accuracies(config, rows, "eval")
    steps = sorted(test)
    if len(steps) < 2:
        return []
    split = validation(rows)
    chosen = dict(series(rows, f"{split}/accuracy"))
    peak, final = peak_step(rows, steps), steps[-1]
    low = min((s for s in steps if s >= peak), key=lambda s: (chosen.get(s, math.inf), s))
    for kind, end in (("cliff", final), ("dip", low)):
        noise = fall_beyond_noise(test[peak], test[end], threshold)
        if noise is not None:
            ended = "" if end == final else f" and ended at {test[final][0]:.3f}"
            return [f"accuracy {kind}: test accuracy fell from {test[peak][0]:.3f} at step {peak} "
                    f"(the peak, chosen on {'val' if split == 'val' else 'test'}) to "
                    f"{test[end][0]:.3f} at step {end} (-{test[peak][0] - test[end][0]:.3f})"
                    f"{ended}{noise}"]
    return []


def spikes(values: list[tuple[int, float]], factor: float) -> list[tuple[int, float, float]]:
    """(step, value, running median) of each value >= factor x the median before it (> 0)."""
    found = []
    for i, (step, value) in enumerate(values):
        before = [v for _, v in values[max(0, i - HISTORY):i]]
        if len(before) >= MIN_HISTORY and value >= factor * statistics.median(before) > 0:
            found.append((step, value, statistics.median(before)))
    return found


def validation_fall(config: dict, rows: list[dict], step: int) -> str | None:
    """Validation accuracy falling by >= DROP, beyond noise, from the last evaluation before `step`
    to one at most FALL_WITHIN steps after (the row of `step` is evaluated after its update)."""
    split = validation(rows)
    points = accuracies(config, rows, split)
    before = [s for s in sorted(points) if s < step]
    if not before:
        return None
    for s in sorted(s for s in points if step <= s <= step + FALL_WITHIN):
        noise = fall_beyond_noise(points[before[-1]], points[s], DROP)
        if noise is not None:
            return (f"{split} accuracy falls from {points[before[-1]][0]:.3f} at step "
                    f"{before[-1]} to {points[s][0]:.3f} at step {s}{noise}")
    return None


def find_amplification(config: dict, rows: list[dict]) -> list[str]:
    """The first spike per role with N > 1 slots and an adapter of its own (a shared adapter's
    step is every role's): its gradient norm or training perplexity spikes against its running
    median, kappa >= KAPPA_FRAC sqrt(N) there where logged, and then validation accuracy falls.
    Both signals are logged before the clip. The update norm is no signal: under AdamW the first
    steps are the largest (about lr per weight) and the rate decays."""
    if config["sharing"] == "shared":
        return []
    found = []
    for role, n in multiplicity(config).items():
        if n < 2:
            continue
        kappa = dict(series(rows, f"role/{role}/kappa"))
        events = sorted((s, signal, v, m)
                        for signal, key, factor in (("gradient norm", "grad_norm", GRAD_SPIKE),
                                                    ("perplexity", "ppl", PPL_SPIKE))
                        for s, v, m in spikes(series(rows, f"role/{role}/{key}"), factor))
        for step, signal, value, median in events:
            if step in kappa and kappa[step] < KAPPA_FRAC * math.sqrt(n):
                continue  # measured, and the slots' gradients did not line up: not this mechanism
            fall = validation_fall(config, rows, step)
            if fall:
                coherence = (f"kappa {kappa[step]:.2f} (sqrt(N) = {math.sqrt(n):.2f})"
                             if step in kappa else "kappa not logged")
                found.append(f"gradient amplification: {role} (N={n}), "
                             f"its {signal} spikes to {value:.3g} "
                             f"({value / median:.1f}x its running median) at step {step}, "
                             f"{coherence}; then {fall}")
                break
    return found


def windows(rows: list[dict], role: str) -> tuple[list[dict], list[dict]] | None:
    """The early and the late window of the steps that log the role's adherence and calls: the
    first and the last third, each widened until it holds MIN_CALLS of the role's calls (a third
    of a short run can be one step of a few calls, whose adherence moves by eighths); None when
    the two would overlap."""
    logged = [r for r in rows if f"role/{role}/adherence" in r and f"role/{role}/calls" in r]
    third = max(1, len(logged) // 3)
    sizes = []
    for ordered in (logged, logged[::-1]):
        total = itertools.accumulate(r[f"role/{role}/calls"] for r in ordered)
        sizes.append(next((i for i, c in enumerate(total, 1) if i >= third and c >= MIN_CALLS),
                          None))
    early, late = sizes
    if early is None or late is None or early + late > len(logged):
        return None
    return logged[:early], logged[-late:]


def weighted(rows: list[dict], role: str, signal: str) -> tuple[float | None, int]:
    """The mean of role/<role>/<signal> over the rows that log it, weighted by calls; the calls."""
    pairs = [(r[f"role/{role}/{signal}"], r[f"role/{role}/calls"]) for r in rows
             if f"role/{role}/{signal}" in r]
    calls = sum(c for _, c in pairs)
    return (sum(v * c for v, c in pairs) / calls if calls else None), calls


def captured(rows: list[dict], role: str, dominant: str) -> str | None:
    """Evidence that `role` leaves its contract for `dominant`'s behaviour, early window against
    late: its adherence falls by >= ADHERENCE_FALL and beyond FALL_Z binomial standard errors
    (pooled; the calls of one step share problems, so the true noise is somewhat larger), while
    its completions grow by LEN_RISE and its similarity to `dominant` rises by SIM_RISE."""
    if (split := windows(rows, role)) is None:
        return None
    (a1, n1), (a2, n2) = (weighted(w, role, "adherence") for w in split)
    (l1, _), (l2, _) = (weighted(w, role, "len") for w in split)
    (s1, _), (s2, _) = (weighted(w, role, f"sim/{dominant}") for w in split)
    if None in (l1, l2, s1, s2):
        return None
    pooled = (a1 * n1 + a2 * n2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if (a1 - a2 < ADHERENCE_FALL or a1 - a2 <= FALL_Z * se or l2 < LEN_RISE * l1
            or s2 - s1 < SIM_RISE):
        return None
    early, late = split
    return (f"steps {early[0]['step']}-{early[-1]['step']} ({n1} calls) against {late[0]['step']}-"
            f"{late[-1]['step']} ({n2}): its adherence falls from {a1:.2f} to {a2:.2f} "
            f"({FALL_Z:g} standard errors: {FALL_Z * se:.2f}), its length grows from {l1:.0f} to "
            f"{l2:.0f} tokens, its similarity to {dominant} rises from {s1:.2f} to {s2:.2f}")


def find_capture(config: dict, rows: list[dict]) -> list[str]:
    """Under one shared adapter: a role holding >= SHARE of the gradient, and one it captured."""
    roles = ROLES[config["workflow"]]
    if config["sharing"] != "shared" or len(roles) < 2:
        return []
    found = []
    for dominant in roles:
        shares = [v for _, v in series(rows, f"role/{dominant}/grad_share")]
        if not shares or statistics.mean(shares) < SHARE:
            continue
        for role in roles:
            evidence = captured(rows, role, dominant) if role != dominant else None
            if evidence:
                found.append(f"role capture: {dominant} holds {statistics.mean(shares):.0%} of the "
                             f"shared gradient on average, and {role} drifts to it over {evidence}")
    return found


def findings(config: dict, rows: list[dict]) -> list[str]:
    return find_cliff(config, rows) + find_amplification(config, rows) + find_capture(config, rows)


DIAGNOSTICS = ("/grad_norm", "/grad_share", "/kappa", "/adherence")  # per role, diagnostics only


def nothing_found(rows: list[dict]) -> str:
    """The findings' line where no detector fired, and what a run without --diag_every hides."""
    if any(key.startswith("role/") and key.endswith(DIAGNOSTICS) for row in rows for key in row):
        return "nothing detected"
    return ("nothing detected, but no step logged the diagnostics (--diag_every): capture was not "
            "looked for, and amplification only in the roles' perplexity")


# ----------------------------------------------------------------------------
# Report: a table per run, the findings, and one plot per signal


LINESTYLES = ("-", "--", ":", "-.")  # one per run, so runs stay apart when roles share colours


def plot(runs: dict[str, list[dict]], out: str) -> list[str]:
    """One PNG per signal with a line per (run, role); returns the files written."""
    written = []
    for name, (pattern, ylabel) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (run, rows) in enumerate(runs.items()):
            for key in sorted({k for r in rows for k in r if re.fullmatch(pattern, k)}):
                xs, ys = zip(*series(rows, key))
                ax.plot(xs, ys, LINESTYLES[i % len(LINESTYLES)], marker="o", markersize=3,
                        label="/".join([run, *re.fullmatch(pattern, key).groups()]))
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
    """One table row: what ran, test accuracy before / peak / final, each role signal's mean."""
    acc = dict(series(rows, "eval/accuracy"))
    steps = sorted(acc)
    row = {"workflow": config["workflow"], "sharing": config["sharing"], "algo": config["algo"],
           "steps": str(max(r["step"] for r in rows)),
           "accuracy": (" / ".join(f"{acc[s]:.3f}"
                                   for s in (steps[0], peak_step(rows, steps), steps[-1]))
                        if acc else "-")}
    for signal in ("kappa", "grad_share", "adherence"):
        means = {role: [v for _, v in series(rows, f"role/{role}/{signal}")]
                 for role in ROLES[config["workflow"]]}
        row[signal] = (", ".join(f"{role} {statistics.mean(vs):.2f}"
                                 for role, vs in means.items() if vs) or "-")
    return row


def report(run_dirs: list[str], out: str, names=None) -> str:
    """Write report.md and the plots into `out`; return the report's path. `names(run_dir)` names
    each run in the tables and plots (default: its directory's name)."""
    named = {}  # name -> run directory: a second run of a name would replace the first
    for d in run_dirs:
        name = names(d) if names else os.path.basename(os.path.normpath(d))
        if name in named:
            raise SystemExit(f"{named[name]} and {d} are both named {name} in the report: "
                             "give runs whose directories' names differ")
        named[name] = d
    runs = {name: load_run(d, ROLES) for name, d in named.items()}  # name -> (config, rows)
    writable(out, "report.md")
    table = [{"run": name, **summary(config, rows)} for name, (config, rows) in runs.items()]
    lines = ["# Diagnosis", "", *markdown(list(table[0]), [list(r.values()) for r in table])]
    lines += ["", "accuracy: before / peak (chosen on val where logged) / final, test split; "
              "kappa, grad_share, adherence: means over the logged steps, per role.",
              "", "## Findings", ""]
    for name, (config, rows) in runs.items():
        found = findings(config, rows)
        lines.append(f"- **{name}**: " + ("; ".join(found) if found else nothing_found(rows)))
    lines += ["", f"Thresholds: falls beyond {FALL_Z:g} standard errors; cliff {CLIFF}; "
              f"spikes of the gradient norm {GRAD_SPIKE}x or perplexity {PPL_SPIKE}x "
              f"the median of the last {HISTORY} steps, "
              f"kappa >= {KAPPA_FRAC} sqrt(N) where logged, then a fall >= {DROP} "
              f"within {FALL_WITHIN} steps; dominant share {SHARE}, "
              f"windows of >= {MIN_CALLS} calls, adherence fall {ADHERENCE_FALL}, "
              f"length x{LEN_RISE}, similarity rise {SIM_RISE}.",
              "", "## Plots", ""]
    plots = plot({name: rows for name, (_, rows) in runs.items()}, out)
    lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------
# The command: a report of runs, or a trained run probed or watched (lab/probe.py)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog="python -m lab.grid trains the main table's "
                                            "and the demos' cells.")
    parser.add_argument("runs", nargs="*", help="train.py run directories")
    parser.add_argument("--out", default=None, help="where report.md and the plots go "
                        "(default: the run directory, or the runs' common parent)")
    parser.add_argument("--probe", metavar="CHECKPOINT", help="a run's ckpt directory")
    parser.add_argument("--probe_problems", metavar="N[,N...]",
                        help="problems in the probe batch (default 4); several (4,8,16): a batch "
                        "each, and the episodes per slot at which kappa would reach the detector's "
                        "line")
    parser.add_argument("--probe_credit", default="", choices=["final", "own"],
                        help="--probe: each call's reward (default: the run's --credit)")
    parser.add_argument("--watch", nargs=2, metavar=("RUN", "QUESTION"), help="print every call "
                        "of the run's trained workflow on one question (RUN/best: its best "
                        "checkpoint)")
    parser.add_argument("--sample", action="store_true", help="--watch: sample at the run's "
                        "temperature instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="--watch --sample: the sampling "
                        "seed; --probe: which batch (0: the training pool's first problems)")
    return parser


def problem_counts(text: str | None) -> list[int]:
    """--probe_problems "4,8,16" as [4, 8, 16]; 4 where it is not given."""
    try:
        counts = [int(n) for n in ("4" if text is None else text).split(",")]
    except ValueError:
        raise SystemExit(f"--probe_problems {text}: not whole numbers separated by commas "
                         "(4, or 4,8,16)") from None
    if len(set(counts)) < len(counts):
        raise SystemExit(f"--probe_problems {text}: a batch size is given twice")
    return counts


def check_flags(args: argparse.Namespace, typed: set[str]) -> None:
    """One task at a time, and no flag `typed` where it would be ignored."""
    tasks = [task for task, given in (("run directories", args.runs), ("--probe", args.probe),
                                      ("--watch", args.watch)) if given]
    if len(tasks) > 1:
        raise SystemExit(f"{' and '.join(tasks)} given together: diagnose.py does one at a time")
    # flag -> (whether it acts, the task it goes with)
    one_task = {"out": (args.runs, "run directories"),
                "probe_problems": (args.probe, "--probe"), "probe_credit": (args.probe, "--probe"),
                "sample": (args.watch, "--watch"),
                "seed": (args.probe or args.watch and args.sample, "--probe or --watch --sample")}
    for flag, (acts, task) in one_task.items():
        if tasks and flag in typed and not acts:
            raise SystemExit(f"--{flag} goes with {task} only; with {tasks[0]} it would be "
                             "ignored")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.seed < 2 ** 32:
        parser.error(f"--seed {args.seed}: must be in [0, 2**32)")
    if args.out == "":
        raise SystemExit("--out is empty: name the directory for report.md (or leave it out)")
    if args.watch and not args.watch[1].strip():
        raise SystemExit("--watch RUN QUESTION: the question is empty")
    check_flags(args, typed_flags(argv))
    if args.watch:
        watch(*args.watch, sample=args.sample, seed=args.seed)
    elif args.probe:
        results = probe(args.probe, problem_counts(args.probe_problems), args.probe_credit,
                        args.seed)
        run_dir = os.path.dirname(os.path.normpath(args.probe))
        write_probe(results, run_dir, multiplicity(load_run(run_dir, ROLES)[0]), KAPPA_FRAC)
    elif args.runs:
        out = args.out or (args.runs[0] if len(args.runs) == 1 else os.path.commonpath(
            [os.path.abspath(r) for r in args.runs]))
        print(report(args.runs, out))
    else:
        parser.error("give run directories, --probe CHECKPOINT or --watch RUN QUESTION")


if __name__ == "__main__":
    main()
