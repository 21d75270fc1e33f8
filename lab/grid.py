"""Paper A's main table in miniature and the two mechanisms' demos: which train.py runs they are,
training them, and their tables.

    python -m lab.grid --reproduce --seeds 0,1,2    # single, Eval-Opt, Voting x shared/isolated
    python -m lab.grid --demo capture --seeds 0,1,2  # a mechanism, its contrast, its mitigation
    python -m lab.grid --demo amplification
    python -m lab.grid --demo optimizer     # many AdamW steps: isolated generators, one agent
    python -m lab.grid --demo capture_dose  # the generators' share of a shared adapter, raised
    python -m lab.grid --demo critics       # Paper B: GRPO, central and decentral critics
    python -m lab.grid --demo default --seeds 0,1,2  # the default run's gain, and its source

Flags this file does not know go to every cell's train.py, after the cell's own, so they
override them (e.g. --model Qwen/Qwen3-1.7B --task dapo_math). A cell is one train.py run in
a directory of its own (out/seed<S>/<cell>), trained in a fresh process. A finished cell is
not trained again, and one trained with other settings is an error rather than a silent mix;
an interrupted cell resumes from its checkpoint, and one killed before its first starts over,
so an interrupted grid goes on where it stopped when the same command runs again. A demo's
cells of one seed go on from one warm-up and step-0 evaluation (train.py --start_from), so
they differ only in how RL updates the adapters. The tables are means over the seeds with
their range; diagnose.py's report on every cell follows them.

It sits on top of the project: it imports diagnose.py (the report and the detectors) and
train.py, and nothing imports it.

Exercised by: pytest tests/test_grid.py
"""
import argparse
import dataclasses
import math
import os
import re
import statistics
import subprocess
import sys
import time
from functools import partial

import matplotlib

matplotlib.use("Agg")  # headless: the plots are files
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from diagnose import KAPPA_FRAC, findings, multiplicity, peak_step, report, series
from lab.launch import evaluation_samples, resolve_resume, typed_flags
from lab.runs import load_run
import train
from workflows import ROLES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where train.py is

# ----------------------------------------------------------------------------
# Paper A's main table in miniature

GRID = [("single", "shared"), ("eval_opt", "shared"), ("eval_opt", "isolated"),
        ("voting", "shared"), ("voting", "isolated")]
# The default recipe, with an evaluation every 2 steps so that a cell's peak can be seen: it is
# chosen on 48 val problems and read on 64 test problems (standard error about 0.06).
GRID_FLAGS = ("--eval_every", "2", "--eval_problems", "64", "--val_problems", "48")


def grid_cells(train_flags: list[str], seeds: list[int]) -> list[tuple[str, list[str]]]:
    """The grid's (name, train.py flags) cells, seed<S>/<workflow>-<sharing> for every seed;
    `train_flags` come after the grid's and override them."""
    return [(f"seed{seed}/{w}-{s}", ["--workflow", w, "--sharing", s, *GRID_FLAGS, "--seed", str(seed), *train_flags])
            for seed in seeds for w, s in GRID]


# ----------------------------------------------------------------------------
# The demos: each mechanism made to happen on the embedded model, next to its mitigations
# The settings were found by the sweeps in docs/mechanisms.md.


@dataclasses.dataclass(frozen=True)
class Demo:
    finding: str                      # how the detector's finding starts ("": none is asked)
    flags: tuple[str, ...]            # train.py flags of every cell
    cells: dict[str, tuple[str, ...]]  # cell name -> its own flags
    shows: tuple[str, ...]            # the cells meant to show the mechanism; the others mitigate or contrast
    signals: tuple[str, ...]          # what demo.png shows, a panel each (cell_series names);
                                      # the first is also tabled seed by seed
    start: tuple[str, ...] = ()       # flags of a warm-up that every cell of a seed starts from
                                      # (train.py --start_from); () = each cell warms up itself


# The first two demos train Voting from one start per seed: a short supervised warm-up under a
# shared adapter gives the aggregator its contract and keeps the generators solving; every cell
# goes on from it (copied into each role's adapter in the isolated cells), so the cells differ
# only in how RL updates the adapters: 5 RL steps at a learning rate (1.5e-3) where the
# aggregator's contract breaks in some cells and not in others. Neither shows its mechanism at
# this scale; docs/mechanisms.md gives the seeds, the sweeps and what it would take.
DEMO_FLAGS = ("--workflow", "voting", "--sft_warmup", "4", "--lr", "1.5e-3", "--problems_per_step", "2",
              "--max_new_tokens", "32", "--steps", "5", "--eval_every", "0", "--eval_problems", "16",
              "--no-one_step")  # the paper's mini-batch steps: more steps for a role with more slots
DEMOS = {
    "amplification": Demo(
        "gradient amplification", DEMO_FLAGS,
        {"isolated": ("--sharing", "isolated"),
         "shared": ("--sharing", "shared"),
         "isolated-one_step": ("--sharing", "isolated", "--one_step")},
        ("isolated",), ("kappa", "update norm"), start=("--sharing", "shared")),
    "capture": Demo(
        "role capture", DEMO_FLAGS,
        {"shared": ("--sharing", "shared"),
         "isolated": ("--sharing", "isolated"),
         "shared-balance_role": ("--sharing", "shared", "--balance", "role")},
        ("shared",), ("adherence", "generator share"), start=("--sharing", "shared")),
    # The optimizer channel: at a constant learning rate over 12 steps, the isolated generators'
    # adapter takes an AdamW step per 4 of their calls (6 a step: 8 episodes x 3 slots; the
    # aggregator's 2), against the same adapters with one step a training step, and against a
    # single agent given as many calls and steps (6 problems x 4 episodes, 6 mini-batches).
    "optimizer": Demo(
        "gradient amplification",
        ("--workflow", "voting", "--sft_warmup", "4", "--problems_per_step", "2", "--max_new_tokens", "32",
         "--steps", "12", "--warmup_steps", "0", "--lr_floor", "1", "--minibatch_size", "4",
         "--eval_every", "3", "--eval_problems", "16", "--val_problems", "16"),
        {"isolated": ("--sharing", "isolated", "--no-one_step"),
         "isolated-one_step": ("--sharing", "isolated", "--one_step"),
         "single": ("--workflow", "single", "--problems_per_step", "6", "--no-one_step")},
        ("isolated",), ("accuracy", "update norm"), start=("--sharing", "shared")),
    # Capture as a dose: one shared adapter, the generators' share of its steps raised on purpose -
    # each call weighing the same (the default), each token (a generator's reply of 20-30 tokens
    # outweighs a verdict of 5), each token over an AdamW step per 4 calls - at a constant learning
    # rate over 10 steps, and the strongest dose with a KL anchor on the aggregator's warm-up.
    "capture_dose": Demo(
        "role capture",
        ("--workflow", "voting", "--sharing", "shared", "--sft_warmup", "4", "--problems_per_step", "2",
         "--max_new_tokens", "32", "--steps", "10", "--warmup_steps", "0", "--lr_floor", "1",
         "--minibatch_size", "4", "--eval_every", "5", "--eval_problems", "16", "--val_problems", "16"),
        {"per-call": ("--loss_agg", "seq-mean-token-mean"),
         "per-token": ("--loss_agg", "token-mean"),
         "per-token-steps": ("--loss_agg", "token-mean", "--no-one_step"),
         "per-token-steps-anchored": ("--loss_agg", "token-mean", "--no-one_step", "--role_kl", "aggregator=0.5")},
        ("per-token", "per-token-steps"), ("adherence", "generator share"), start=("--sharing", "shared")),
    # Paper B in miniature: in Orch-Workers a worker is shown one strategy, not the plan or the other
    # workers' (critic.unseen: 0.75 of what was said before it), so the central critic reads what a
    # decentral one cannot. GRPO's group baseline against the two critics, from one warm-up per seed,
    # at the main table's recipe on 4 problems a step (an episode is 5 calls). `--level 4` after
    # the demo's name asks two-digit subtraction, where fewer episodes are right: the sparse reward.
    # No mechanism to find: the detector is not asked.
    "critics": Demo(
        "",
        ("--workflow", "orch_workers", "--problems_per_step", "4", "--steps", "8", "--eval_every", "4",
         "--eval_problems", "32", "--val_problems", "32"),
        {"grpo": (), "central": ("--algo", "maac", "--critic", "central"),
         "decentral": ("--algo", "maac", "--critic", "decentral")},
        (), ("accuracy", "explained variance", "gradient noise"), start=("--algo", "grpo")),
    # The default run over seeds: its gain, split into the generator's first answers and what the
    # rest of the workflow (the evaluator and its refines) adds (gain_table).
    "default": Demo("", (), {"default": ()}, (), ("accuracy",)),
}


def demo_cells(name: str, home: str, train_flags: list[str], seeds: list[int]) -> list[tuple[str, list[str]]]:
    """The demo's (name, train.py flags) cells in home: seed<S>/<cell> for every seed, after the
    seed's start (seed<S>/start) when the demo has one; `train_flags` override the demo's."""
    spec, cells = DEMOS[name], []
    for seed in seeds:
        mine, start = [*spec.flags, "--seed", str(seed)], []
        if spec.start:  # the warm-up and step-0 evaluation, once; the cells go on from there
            cells.append((f"seed{seed}/start", [*mine, *spec.start, *train_flags, "--steps", "0"]))
            start = ["--start_from", os.path.join(home, f"seed{seed}", "start")]
        for cell, flags in spec.cells.items():  # a cell of another workflow cannot go on from the
            own = "--workflow" in flags  # start (only RL settings may differ): it warms up itself
            cells.append((f"seed{seed}/{cell}", [*mine, *([] if own else start), *flags, *train_flags]))
    return cells


def seed_of(run_dir: str) -> str:
    """The seed of a demo cell's run directory, seed<S>/<cell>."""
    return os.path.basename(os.path.dirname(os.path.normpath(run_dir))).removeprefix("seed")


# ----------------------------------------------------------------------------
# Training the cells


def finished(run_dir: str) -> bool:
    """A grid run counts as done when its log reaches the configured last step."""
    try:
        config, rows = load_run(run_dir)
    except (SystemExit, OSError):
        return False
    return bool(rows) and rows[-1]["step"] == config["steps"] and "eval/accuracy" in rows[-1]


def train_cells(out: str, cells: list[tuple[str, list[str]]]) -> list[str]:
    """Train each (name, train.py flags) cell in out/name; finished cells are skipped,
    interrupted ones resumed. A finished cell trained with other settings is an error, never
    reused."""
    run_dirs = []
    for name, flags in cells:
        run_dir = os.path.join(out, name)
        run_dirs.append(run_dir)
        if finished(run_dir):
            argv = [*flags, "--out", run_dir]
            try:  # the check --resume makes: every flag given must match the run's config, --lr too
                resolve_resume(train.parse_config(argv), typed_flags(argv), new_lr=())
            except SystemExit as e:
                raise SystemExit(f"{run_dir} was trained with other settings ({str(e).removeprefix('--resume: ')}): "
                                 "remove it or choose another --out") from None
            print(f"{run_dir}: already finished")
            continue
        # an interrupted cell continues from its checkpoint (one killed between a save's two renames
        # has it in ckpt.tmp or ckpt.old: train.py puts it back); one killed before its first starts over
        saved = any(os.path.exists(os.path.join(run_dir, f"ckpt{end}", "state.pt"))
                    for end in ("", ".tmp", ".old"))
        again = ["--resume"] if saved else ["--overwrite"]
        cmd = [sys.executable, "train.py", *flags, "--out", run_dir, *again]
        print(" ".join(cmd[1:]), flush=True)
        t0 = time.time()
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            raise SystemExit(f"{run_dir}: train.py failed (see its output above)")
        print(f"{run_dir}: {time.time() - t0:.0f} s", flush=True)
    return run_dirs


# ----------------------------------------------------------------------------
# The tables


Runs = dict[str, dict[str, tuple[dict, list[dict]]]]  # cell -> seed -> a run's (config, rows)


def reproduce(out: str, train_flags: list[str], seeds: list[int]) -> str:
    """Train every grid cell for every seed, then write out/report.md: the main table, Paper A's
    findings checked against it, where each cell's learning signal went, the accuracy curves
    (curves.png) and diagnose.py's report on every run."""
    run_dirs = train_cells(out, grid_cells(train_flags, seeds))
    path = report(run_dirs, out, names=lambda d: os.path.relpath(d, out))
    by_cell = {f"{w}-{s}": {seed_of(d): load_run(d) for d in run_dirs if os.path.basename(d) == f"{w}-{s}"}
               for w, s in GRID}
    lines = main_table(by_cell) + ["", "Paper A's findings at this scale:", ""] + claims(by_cell)
    lines += ["", "Where the learning signal went (means over the training steps, then over the seeds):", ""]
    lines += mean_table({cell: [signal_numbers(*run) for run in runs.values()] for cell, runs in by_cell.items()})
    picture = demo_plot(("accuracy",), by_cell, os.path.join(out, "curves.png"))
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write("# Paper A's main table in miniature\n\n" + "\n".join(lines)
                + f"\n\n![curves.png]({os.path.basename(picture)})\n\n" + text)
    print("\n".join(lines))
    return path


def accuracy_numbers(config: dict, rows: list[dict]) -> dict[str, float]:
    """Test accuracy of one run: at step 0 (the base model in the run's workflow), at the peak, at
    the end, and after the middle step's evaluation. The peak is the step with the best val
    accuracy where the run has a val split (the test split is never chosen on), else the best test."""
    acc = dict(series(rows, "eval/accuracy"))
    steps = sorted(acc)
    peak = acc[peak_step(rows, steps)]
    middle = acc[min(steps, key=lambda step: abs(step - config["steps"] / 2))]
    start, end = acc[steps[0]], acc[steps[-1]]
    return {"start": start, "peak": peak, "end": end, "peak - end": peak - end,
            "end - start": end - start, "end - middle": end - middle}


def main_table(by_cell: Runs) -> list[str]:
    """Paper A's main table: a row per cell, accuracy at the start, peak and end with the two
    differences, each the mean over the seeds (range); the single agent's start is the base model."""
    lines = mean_table({cell: [accuracy_numbers(*run) for run in runs.values()] for cell, runs in by_cell.items()})
    configs = [config for runs in by_cell.values() for config, _ in runs.values()]
    sampled = sorted({c["workflow"] for c in configs if evaluation_samples(train.Config(**c))})
    decoding = "greedy" + (f" ({', '.join(sampled)}: sampled at the training temperature)" if sampled else "")
    return lines + ["", f"Held-out accuracy, {decoding}, on {configs[0]['eval_problems']} problems, every "
                    f"{configs[0]['eval_every']} of {configs[0]['steps']} steps; start = step 0, before any update."]


def signal_numbers(config: dict, rows: list[dict]) -> dict[str, float]:
    """Where one run's learning signal went, each a mean over its training steps (docs/runs.md
    says what each key is): the reward, the crowded role's own right answers, the fallbacks, the
    calls without reward contrast, the mini-batches without a live call (summed over the adapters),
    each adapter's change per step, the crowded role's gradient share, the supervisory role's
    adherence, the evaluator's verdicts that agree with the verifier; and at the last evaluation,
    the final answer's accuracy against the first one's."""
    def mean(pattern: str, per_step=statistics.mean) -> float:
        """The mean over the training steps of per_step(the step's values of the matching keys)."""
        values = []
        for r in rows:
            hits = [v for k, v in r.items() if re.fullmatch(pattern, k)]
            if hits and r["step"] > 0:  # step 0 is the evaluation before training
                values.append(per_step(hits))
        return statistics.mean(values) if values else math.nan

    n = multiplicity(config)
    crowded = max(n, key=n.get)
    judge = next((r for r in ROLES[config["workflow"]] if r != crowded), None)
    last = next(r for r in reversed(rows) if "eval/accuracy" in r)
    return {"reward": mean(r"reward/mean"), "crowded solved": mean(rf"role/{crowded}/solved"),
            "fallback": mean(r"contract/fallback_rate"), "no contrast": mean(r"adv/zero_frac"),
            "empty mini-batches": mean(r"adapter/[^/]+/empty_batches", per_step=sum),
            "update norm": mean(r"adapter/[^/]+/update_norm"),
            "crowded share": mean(rf"role/{crowded}/grad_share"),
            "judge adherence": mean(rf"role/{judge}/adherence") if judge else math.nan,
            "verdict agrees": mean(r"role/evaluator/verdict_acc"),
            "final - first answer": last["eval/accuracy"] - last.get("eval/first_answer", math.nan)}


def by_seed(a: dict[str, dict], b: dict[str, dict], key: str, key_b: str | None = None) -> list[float]:
    """a[seed][key] - b[seed][key_b] for every seed both cells ran: a difference paired by seed, so
    that what a seed shares (its problems, its start) cancels."""
    return [a[s][key] - b[s][key_b or key] for s in sorted(a.keys() & b.keys())]


# Two-sided 95 % critical values of Student's t by degrees of freedom, 1 to 30 (beyond: 30's, a
# little wide). A mean over n seeds has n - 1: with 3 seeds the interval is 4.30 standard errors wide
# on each side, not 2 (|t| = 2 on 2 degrees of freedom is a two-sided p of 0.18).
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
       2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
       2.052, 2.048, 2.045, 2.042)


def noise_floor(accuracies: list[float], problems: int, seeds: int) -> float:
    """The least standard error a mean over `seeds` of accuracies on `problems` problems can have:
    one evaluation's binomial noise, sqrt(p (1 - p) / problems), over sqrt(seeds). Three seeds of 64
    problems near p = 0.5: 0.036, whatever the seeds' own spread says."""
    p = statistics.mean(accuracies)
    return math.sqrt(p * (1 - p) / problems / seeds)


def interval(diffs: list[float], floor: float = 0.0) -> tuple[float, float, float]:
    """Mean of differences paired by seed, its standard error (at least `floor`), and the half-width
    of its 95 % interval from the t distribution with n - 1 degrees of freedom."""
    n = len(diffs)
    mean, se = statistics.mean(diffs), max(statistics.stdev(diffs) / math.sqrt(n), floor)
    return mean, se, T95[min(n - 1, len(T95)) - 1] * se


def paired_verdict(diffs: list[float], floor: float = 0.0) -> str:
    """A paired mean, its standard error and its 95 % t interval, and what the interval carries: it
    holds where the interval lies above 0, the opposite where below, else the seeds cannot tell."""
    if len(diffs) < 2:
        return f"{diffs[0] if diffs else math.nan:+.3f} on one seed: no verdict"
    mean, se, half = interval(diffs, floor)
    n = len(diffs)
    holds = ("holds" if mean - half > 0 else "the opposite holds" if mean + half < 0
             else f"not distinguishable at {n} seeds")
    return (f"{round(mean, 3) + 0.0:+.3f} (SE {se:.3f}; 95 % CI {mean - half:+.2f} to {mean + half:+.2f}, "
            f"t with {n - 1} df) over {n} seeds: {holds}")


def claims(by_cell: Runs) -> list[str]:
    """Paper A's findings, a line each, with this grid's numbers as differences paired by seed."""
    numbers = {cell: {seed: accuracy_numbers(*run) for seed, run in runs.items()} for cell, runs in by_cell.items()
               if runs}
    config = next(config for runs in by_cell.values() for config, _ in runs.values())
    accuracies = [x[k] for runs in numbers.values() for x in runs.values()
                  for k in ("start", "peak", "end")]
    seeds = min(len(runs) for runs in numbers.values())
    verdict = partial(paired_verdict, floor=noise_floor(accuracies, config["eval_problems"], seeds))
    lines = []
    single = numbers.get("single-shared")
    for cell, runs in ((c, r) for c, r in numbers.items() if not c.startswith("single")):
        lines.append(f"multi-agent RL above its base, {cell}: end - start {verdict(by_seed(runs, runs, 'end', 'start'))}")
        if single:
            lines.append(f"multi-agent RL above single-agent RL, {cell}: end - single's end "
                         f"{verdict(by_seed(runs, single, 'end'))}")
    for w in sorted({c.rsplit("-", 1)[0] for c in numbers}):
        iso, sh = numbers.get(f"{w}-isolated"), numbers.get(f"{w}-shared")
        if iso and sh:
            lines.append(f"isolated peaks higher, {w}: peak - shared's peak {verdict(by_seed(iso, sh, 'peak'))}")
            lines.append(f"isolated falls further at the end, {w}: (peak - end) - shared's "
                         f"{verdict(by_seed(iso, sh, 'peak - end'))}")
        if sh and w != "single":
            lines.append(f"shared plateaus, {w}: end - middle {verdict([x['end - middle'] for x in sh.values()])} "
                         "(a plateau: not distinguishable from 0)")
    return [f"- {line}" for line in lines] + [
        "", "Each difference is paired by seed: its mean, its standard error over the seeds (at least the "
        "evaluation's own noise, grid.noise_floor) and its 95 % interval from the t distribution; it holds "
        "where the interval excludes 0. The peak is the step chosen on the val split, read on test: the "
        "choice does not bias it upward."]


def cell_series(config: dict, rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The signals the demos follow, step by step, in one run: the crowded role's kappa, its
    adapter's update norm, the first supervisory role's adherence, each role's gradient share,
    reward and accuracy."""
    n = multiplicity(config)
    crowded = max(n, key=n.get)  # the role with the most slots
    judge = next((r for r in ROLES[config["workflow"]] if r != crowded), crowded)
    adapter = "shared" if config["sharing"] == "shared" else crowded
    keys = {"kappa": f"role/{crowded}/kappa", "update norm": f"adapter/{adapter}/update_norm",
            "adherence": f"role/{judge}/adherence", "reward": "reward/mean", "accuracy": "eval/accuracy",
            "explained variance": "critic/explained_variance", "advantage std": "adv/std",
            "gradient noise": f"adapter/{adapter}/grad_noise"}
    keys |= {f"{r} share": f"role/{r}/grad_share" for r in ROLES[config["workflow"]]}
    return {name: series(rows, key) for name, key in keys.items()}


def cell_numbers(config: dict, rows: list[dict]) -> dict[str, float]:
    """What the demos compare, from one run: the crowded role's kappa (mean, and the share of
    steps at >= 0.8 sqrt(N)), its adapter's update norm, the first supervisory role's
    adherence (first and last step), the largest gradient share, reward and accuracy."""
    n = max(multiplicity(config).values())
    got = {name: [v for _, v in points] for name, points in cell_series(config, rows).items()}
    kappa, adh, reward, acc = got["kappa"], got["adherence"], got["reward"], got["accuracy"]
    shares = [statistics.mean(vs) for name, vs in got.items() if name.endswith(" share") and vs]
    mean = statistics.mean
    return {"kappa": mean(kappa) if kappa else math.nan,
            "coherent steps": mean(k >= KAPPA_FRAC * math.sqrt(n) for k in kappa) if kappa else math.nan,
            "update norm": mean(got["update norm"] or [math.nan]),
            "adherence first": adh[0] if adh else math.nan, "adherence last": adh[-1] if adh else math.nan,
            "top share": max(shares) if shares else math.nan,
            "reward first": reward[0] if reward else math.nan, "reward last": reward[-1] if reward else math.nan,
            "accuracy start": acc[0], "accuracy peak": max(acc), "accuracy end": acc[-1],
            **{k: mean(got[k] or [math.nan]) for k in ("explained variance", "advantage std", "gradient noise")}}


def demo(name: str, out: str, train_flags: list[str], seeds: list[int]) -> str:
    """Train the demo's cells for every seed (out/<name>/seed<S>/<cell>), then write
    out/<name>/report.md and its plots, headed by a table of the cells (mean and range over the
    seeds) and by which cells the detector names."""
    spec, home = DEMOS[name], os.path.join(out, name)
    cells = demo_cells(name, home, train_flags, seeds)
    run_dirs = [d for d in train_cells(home, cells) if os.path.basename(d) in spec.cells]
    path = report(run_dirs, home, names=lambda d: os.path.relpath(d, home))
    by_cell = {cell: {seed_of(d): load_run(d) for d in run_dirs if os.path.basename(d) == cell}
               for cell in spec.cells}  # cell -> seed -> (config, rows)
    lines, verdict = demo_table(by_cell) + [""] + seed_table(spec.signals[0], by_cell), []
    for cell, runs in by_cell.items() if spec.finding else ():  # a comparison asks no detector
        found = sum(any(f.startswith(spec.finding) for f in findings(*run)) for run in runs.values())
        meant = "the mechanism" if cell in spec.shows else "a contrast or a mitigation"
        verdict.append(f"{cell} ({meant}): {spec.finding} found in {found} of {len(runs)} seeds")
    if name == "default":
        lines += [""] + gain_table(by_cell["default"])
    picture = demo_plot(spec.signals, by_cell, os.path.join(home, "demo.png"))
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(f"# Demo: {name}\n\n" + "\n".join(lines) + "\n\n" + "\n".join(f"- {v}" for v in verdict)
                + f"\n\n![demo.png]({os.path.basename(picture)})\n\n" + text)
    print("\n".join(lines + [""] + verdict))
    return path


def demo_table(by_cell: Runs) -> list[str]:
    """One row per cell: each of cell_numbers' numbers, its mean over the seeds and its range."""
    return mean_table({cell: [cell_numbers(*run) for run in runs.values()] for cell, runs in by_cell.items()})


def gain_table(runs: dict[str, tuple[dict, list[dict]]]) -> list[str]:
    """Test accuracy before -> after RL seed by seed: the workflow's, its generator's first answers',
    and the rest's (the workflow's minus the first answers'), then each gain's paired interval."""
    lines = ["| seed | workflow | generator's first answers | the rest of the workflow adds |",
             "|---|---|---|---|"]
    gains = {"workflow": [], "first answers": [], "the rest": []}
    accuracies = []
    for seed, (config, rows) in sorted(runs.items(), key=lambda item: int(item[0])):
        first, last = rows[0], rows[-1]
        acc = [first["eval/accuracy"], last["eval/accuracy"]]
        answer = [first["eval/first_answer"], last["eval/first_answer"]]
        rest = [a - b for a, b in zip(acc, answer)]
        for key, pair in zip(gains, (acc, answer, rest)):
            gains[key].append(pair[1] - pair[0])
        accuracies += acc
        lines.append(f"| {seed} | " + " | ".join(f"{a:.3f} -> {b:.3f}" for a, b in (acc, answer))
                     + f" | {rest[0]:+.3f} -> {rest[1]:+.3f} |")
    floor = noise_floor(accuracies, config["eval_problems"], len(runs))
    verdicts = [f"- gain of {key}: {paired_verdict(diffs, floor)}" for key, diffs in gains.items()]
    return lines + [""] + verdicts


def mean_table(rows: dict[str, list[dict[str, float]]]) -> list[str]:
    """A markdown table, a row per cell: each number's mean over the seeds, and its range when
    there are several; NaN (not logged) is left out."""
    keys = [k for k in next(iter(rows.values()))[0]  # a number no cell logged gets no column
            if any(not math.isnan(x[k]) for numbers in rows.values() for x in numbers)]
    lines = ["| cell | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for cell, numbers in rows.items():
        parts = []
        for k in keys:
            vs = [x[k] for x in numbers if not math.isnan(x[k])]
            if not vs:
                parts.append("-")
            elif len(vs) == 1:
                parts.append(f"{vs[0]:.2f}")
            else:
                parts.append(f"{statistics.mean(vs):.2f} ({min(vs):.2f} to {max(vs):.2f})")
        lines.append(f"| {cell} | " + " | ".join(parts) + " |")
    return lines


def seed_table(signal: str, by_cell: Runs) -> list[str]:
    """The signal at every step it was logged, a row per seed and a column per cell."""
    cells = {cell: {seed: cell_series(*run)[signal] for seed, run in runs.items()} for cell, runs in by_cell.items()}
    seeds = sorted({seed for runs in cells.values() for seed in runs}, key=int)
    lines = [f"{signal}, step by step:", "", "| seed | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
    for seed in seeds:
        parts = [", ".join(f"{v:.2f}" for _, v in runs.get(seed, [])) or "-" for runs in cells.values()]
        lines.append(f"| {seed} | " + " | ".join(parts) + " |")
    return lines


SIGNALS = {"accuracy": "held-out accuracy (test)",
           "explained variance": "the critics' explained variance of the returns",
           "gradient noise": "noise's share of the policy gradient (grad_noise)",
           "kappa": "kappa of the crowded role's slots (dashed: the detector's 0.8 sqrt(N))",
           "update norm": "change of the crowded role's adapter in a step (L2)",
           "adherence": "the supervisory role's calls that keep its contract",
           "generator share": "the generators' share of the shared gradient"}


def demo_plot(signals: tuple[str, ...], by_cell: Runs, path: str) -> str:
    """A panel per signal: every seed of a cell as a thin line, their mean as a thick one (at each
    step, over the seeds that logged the signal there: a role with no reward contrast in a step
    has no gradient share)."""
    fig, axes = plt.subplots(1, len(signals), figsize=(5.5 * len(signals), 3.8), squeeze=False)
    for ax, signal in zip(axes[0], signals):
        for i, (cell, runs) in enumerate(by_cell.items()):
            curves = [c for c in (dict(cell_series(*run)[signal]) for run in runs.values()) if c]
            if not curves:  # e.g. no gradient share under isolated adapters
                continue
            for c in curves:
                ax.plot(list(c), list(c.values()), color=f"C{i}", alpha=0.25, linewidth=1)
            steps = sorted(set().union(*curves))  # a step's mean is over the seeds that logged it
            ax.plot(steps, [statistics.mean(c[t] for c in curves if t in c) for t in steps], color=f"C{i}",
                    linewidth=2.5, marker="o", markersize=4, label=f"{cell}, {len(curves)} seeds")
        if signal == "kappa":
            config = next(config for runs in by_cell.values() for config, _ in runs.values())
            n = max(multiplicity(config).values())
            ax.axhline(KAPPA_FRAC * math.sqrt(n), color="grey", linestyle="--", linewidth=1)
        ax.set_title(SIGNALS.get(signal, signal), fontsize=9)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged in these runs", ha="center", transform=ax.transAxes)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This file's flags, and every other flag, in order, for each cell's train.py."""
    parser = argparse.ArgumentParser(prog="python -m lab.grid", description=__doc__.split("\n")[0],
                                     allow_abbrev=False,
                                     epilog="Every other flag goes to each cell's train.py, after the cell's "
                                            "own (e.g. --model Qwen/Qwen3-1.7B --task dapo_math).")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--reproduce", action="store_true", help="train the main table's cells, then report")
    what.add_argument("--demo", choices=list(DEMOS), help="train one mechanism's demo cells "
                      "(the mechanism, its contrast, its mitigation), then report")
    parser.add_argument("--seeds", default="0,1,2", help="the seeds to run, e.g. 0,1,2")
    parser.add_argument("--out", default=None, help="where the cells and report.md go "
                        "(default: runs/reproduce, runs/demo-NAME)")
    args, train_flags = parser.parse_known_args(argv)
    given = args.seeds
    try:
        args.seeds = [int(s) for s in given.split(",")]
    except ValueError:
        parser.error(f"--seeds {given!r}: give seeds as 0,1,2")
    if len(set(args.seeds)) < len(args.seeds) or not all(0 <= s < 2 ** 32 for s in args.seeds):
        parser.error(f"--seeds {given}: give distinct seeds from 0 to 4294967295")
    if any(f == "--seed" or f.startswith("--seed=") for f in train_flags):
        parser.error("--seed: each cell's seed is one of --seeds (a --seed for train.py would give "
                     "every cell the same one)")
    return args, train_flags


def main(argv: list[str] | None = None) -> None:
    args, train_flags = parse_args(sys.argv[1:] if argv is None else argv)
    train.parse_config(train_flags)  # a wrong flag fails here, before the first cell
    t0 = time.time()
    if args.demo:
        path = demo(args.demo, args.out or f"runs/demo-{args.demo}", train_flags, args.seeds)
    else:
        path = reproduce(args.out or "runs/reproduce", train_flags, args.seeds)
    print(f"{path} ({time.time() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
