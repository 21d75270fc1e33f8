"""Paper A's main table in miniature and the two mechanisms' demos: which train.py runs they are,
training them, and their tables.

    python -m lab.grid --reproduce --seeds 0,1,2    # single, Eval-Opt, Voting x shared/isolated
    python -m lab.grid --demo capture --seeds 0,1,2  # a mechanism, its contrast, its mitigation
    python -m lab.grid --demo amplification
    python -m lab.grid --demo optimizer     # many AdamW steps: isolated generators, one agent
    python -m lab.grid --demo capture_dose  # the generators' share of a shared adapter, raised
    python -m lab.grid --demo critics       # Paper B: GRPO, central and decentral critics
    python -m lab.grid --demo default --seeds 0,1,2  # the default run's gain, and its source
    python -m lab.grid --demo critics --results docs/results/critics  # the logs, for committing

A cell is one train.py run in out/seed<S>/<cell>, in a process of its own: a finished cell is
not trained again, one trained with other settings is an error, an interrupted one resumes. A
demo's cells of one seed go on from one warm-up (train.py --start_from), so they differ only in
how RL updates the adapters. The tables are lab/tables.py's.

Exercised by: pytest tests/test_grid.py
"""
import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import time

from diagnose import findings, report
from lab.checkpoint import has_checkpoint
from lab.files import PROJECT, load_run
from lab.settings import (check_goes_on_from, check_settings, flag_name, idle_settings, run_config,
                          typed_flags, with_task_tokens)
from lab.tables import (Runs, claims, critics_differences, critics_table, demo_plot, demo_table,
                        gain_table, main_table, mean_table, seed_table, signal_numbers)
from tasks import TASK_KIND
from train import Config, check_algorithm_settings, parse_config
from workflows import ROLES

# ----------------------------------------------------------------------------
# Paper A's main table in miniature

GRID = [("single", "shared"), ("eval_opt", "shared"), ("eval_opt", "isolated"),
        ("voting", "shared"), ("voting", "isolated")]
# The default recipe, with an evaluation every 2 steps so that a cell's peak can be seen: it is
# chosen on 48 val problems and read on 64 test problems (standard error about 0.06).
GRID_FLAGS = ("--eval_every", "2", "--eval_problems", "64", "--val_problems", "48")


def grid_cells(train_flags: list[str], seeds: list[int]) -> list[tuple[str, list[str]]]:
    """The grid's (seed<S>/<workflow>-<sharing>, train.py flags) cells."""
    return [(f"seed{seed}/{w}-{s}", cell_flags([], ["--workflow", w, "--sharing", s,
                                                    *GRID_FLAGS, "--seed", str(seed)],
                                                train_flags))
            for seed in seeds for w, s in GRID]


def cell_flags(shared: list[str], own: list[str], train_flags: list[str]) -> list[str]:
    """A cell's train.py flags: its demo's, its own, then the caller's, each overriding the ones
    before; a demo's or caller's flag idle in this cell (settings.ONLY_UNDER) stays out."""
    idle = idle_settings(parse_config([*shared, *own, *train_flags]))
    acting = [[token for name, group in flag_groups(flags) if name not in idle for token in group]
              for flags in (shared, train_flags)]
    return [*acting[0], *own, *acting[1]]


def flag_groups(argv: list[str]) -> list[tuple[str, list[str]]]:
    """A train.py command line's flags, each with its value: ("lr", ["--lr", "0.1"]),
    ("lr", ["--lr=0.1"]), ("one_step", ["--no-one_step"]); a token that is no flag's is left
    out. Config's bool fields take no value."""
    switches = {f.name for f in dataclasses.fields(Config) if f.type is bool}
    groups, i = [], 0
    while i < len(argv):
        if not argv[i].startswith("--"):
            i += 1
            continue
        name = flag_name(argv[i])
        width = 1 if "=" in argv[i] or name in switches else 2
        groups.append((name, argv[i:i + width]))
        i += width
    return groups


# ----------------------------------------------------------------------------
# The demos: each mechanism made to happen on the embedded model, next to its mitigations
# The settings were found by the sweeps in docs/mechanisms.md.


@dataclasses.dataclass(frozen=True)
class Demo:
    finding: str                      # how the detector's finding starts ("": none is asked)
    flags: tuple[str, ...]            # train.py flags of every cell
    cells: dict[str, tuple[str, ...]]  # cell name -> its own flags
    shows: tuple[str, ...]            # the cells meant to show it; the others mitigate or contrast
    signals: tuple[str, ...]          # demo.png's panels (cell_series names); the first is tabled
    start: tuple[str, ...] = ()       # flags of a warm-up that every cell of a seed starts from
                                      # (train.py --start_from); () = each cell warms up itself


# The first two demos train Voting from one start per seed: a short supervised warm-up under a
# shared adapter gives the aggregator its contract and keeps the generators solving; every cell
# goes on from it (copied into each role's adapter in the isolated cells), so the cells differ
# only in how RL updates the adapters: 5 RL steps at a learning rate (1.5e-3) where the
# aggregator's contract breaks in some cells and not in others. Neither shows its mechanism at
# this scale; docs/mechanisms.md gives the seeds, the sweeps and what it would take.
# --no-one_step: the paper's mini-batch steps: more steps for a role with more slots
DEMO_FLAGS = ("--workflow", "voting", "--sft_warmup", "4", "--lr", "1.5e-3",
              "--problems_per_step", "2", "--max_new_tokens", "32", "--steps", "5",
              "--eval_every", "0", "--eval_problems", "16", "--no-one_step")
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
        ("--workflow", "voting", "--sft_warmup", "4", "--problems_per_step", "2",
         "--max_new_tokens", "32", "--steps", "12", "--warmup_steps", "0", "--lr_floor", "1",
         "--minibatch_size", "4", "--eval_every", "3", "--eval_problems", "16",
         "--val_problems", "16"),
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
        ("--workflow", "voting", "--sharing", "shared", "--sft_warmup", "4",
         "--problems_per_step", "2", "--max_new_tokens", "32", "--steps", "10",
         "--warmup_steps", "0", "--lr_floor", "1", "--minibatch_size", "4", "--eval_every", "5",
         "--eval_problems", "16", "--val_problems", "16"),
        {"per-call": ("--loss_agg", "seq-mean-token-mean"),
         "per-token": ("--loss_agg", "token-mean"),
         "per-token-steps": ("--loss_agg", "token-mean", "--no-one_step"),
         "per-token-steps-anchored": ("--loss_agg", "token-mean", "--no-one_step",
                                      "--role_kl", "aggregator=0.5")},
        ("per-token", "per-token-steps"), ("adherence", "generator share"),
        start=("--sharing", "shared")),
    # Paper B in miniature: an Orch-Workers worker is shown one strategy, not the plan or the other
    # workers' (critic.unseen: 0.46-0.66 of what was said before it), so the central critic reads
    # what a decentral one cannot: GRPO's group baseline against the two critics, at the main
    # table's recipe on 4 problems a step. `--level 4` after the demo's name gives the sparse
    # reward (two-digit sums and differences, one-digit products). No detector is asked.
    "critics": Demo(
        "",
        ("--workflow", "orch_workers", "--problems_per_step", "4", "--steps", "8",
         "--eval_every", "4", "--eval_problems", "32", "--val_problems", "32"),
        {"grpo": (), "central": ("--algo", "maac", "--critic", "central"),
         "decentral": ("--algo", "maac", "--critic", "decentral")},
        (), ("accuracy", "explained variance", "gradient noise"), start=("--algo", "grpo")),
    # The default run over seeds: its gain, split into the generator's first answers and what the
    # rest of the workflow (the evaluator and its refines) adds (gain_table).
    "default": Demo("", (), {"default": ()}, (), ("accuracy",)),
}


def demo_cells(name: str, home: str, train_flags: list[str],
               seeds: list[int]) -> list[tuple[str, list[str]]]:
    """The demo's (seed<S>/<cell>, train.py flags) cells in home, each seed's start first."""
    spec, cells = DEMOS[name], []
    for seed in seeds:
        seeded, start = [*spec.flags, "--seed", str(seed)], []
        if spec.start:  # the warm-up and step-0 evaluation, once; the cells go on from there
            cells.append((f"seed{seed}/start", [*cell_flags(seeded, [*spec.start], train_flags),
                                                "--steps", "0"]))
            start = ["--start_from", os.path.join(home, f"seed{seed}", "start")]
        for cell, flags in spec.cells.items():  # a cell of another workflow cannot go on from the
            own = "--workflow" in flags  # start (only RL settings may differ): it warms up itself
            cells.append((f"seed{seed}/{cell}",
                          cell_flags(seeded, [*([] if own else start), *flags], train_flags)))
    return cells


# train.py's flags that place a run, which the grid sets for each cell itself
PLACED = {"resume": "the grid resumes an interrupted cell itself; run the same command again",
          "overwrite": "the grid never deletes a cell: remove a cell's directory to train it again",
          "start_from": "the cells of a seed go on from that seed's own start",
          "seed": "each cell's seed is one of --seeds (a --seed for train.py would give every cell "
                  "the same one)"}


def cell_fields(demo: str | None) -> set[str]:
    """The settings that tell the cells apart (the main table's with demo None)."""
    own = ([f for w, s in GRID for f in ("--workflow", w, "--sharing", s)] if demo is None else
           [f for flags in (*DEMOS[demo].cells.values(), DEMOS[demo].start) for f in flags])
    return typed_flags(own)


def check_cells(cells: list[tuple[str, list[str]]], home: str,
                train_flags: list[str]) -> list[Config]:
    """The cells' configs, checked as train.py will check them before any file exists; a flag of
    the caller's that acts in no cell is refused."""
    configs = {}
    for name, flags in cells:
        argv = [*flags, "--out", os.path.join(home, name)]
        cfg = parse_config(argv)
        try:
            alone = dataclasses.replace(cfg, start_from="", resume=False)  # no file read yet
            check_algorithm_settings(check_settings(alone, typed_flags(argv)))
            if cfg.start_from:
                start = os.path.relpath(cfg.start_from, home)
                check_goes_on_from(cfg, configs[start], start)
        except SystemExit as e:
            raise SystemExit(f"cell {name}: {e}") from None
        configs[name] = cfg
    for name in typed_flags(train_flags):
        whys = [idle_settings(cfg).get(name) for cfg in configs.values()]
        if all(whys):
            raise SystemExit(f"--{name} {whys[0]} (in every cell)")
    return list(configs.values())


# ----------------------------------------------------------------------------
# Training the cells


def finished(run_dir: str) -> bool:
    """A grid run counts as done when its log reaches the configured last step."""
    try:
        config, rows = load_run(run_dir, ROLES)
    except (SystemExit, OSError):
        return False
    return rows[-1]["step"] == config["steps"] and "eval/accuracy" in rows[-1]


def train_cells(out: str, cells: list[tuple[str, list[str]]]) -> list[str]:
    """Train each (name, train.py flags) cell in out/name: a finished cell is skipped, an
    interrupted one resumed, and one trained with other settings is an error, never reused."""
    run_dirs = [os.path.join(out, name) for name, _ in cells]
    for (_, flags), run_dir in zip(cells, run_dirs):
        done, resumed = finished(run_dir), has_checkpoint(run_dir)
        if done or resumed:
            # the check --resume makes, of every setting that acts in the cell, --lr too: a cell
            # is one setting from its first step to its last (its checkpoint may be let go)
            cfg = with_task_tokens(parse_config([*flags, "--out", run_dir]))
            every = {f.name for f in dataclasses.fields(Config)} - set(idle_settings(cfg))
            try:
                run_config(cfg, every, new_lr=())
            except SystemExit as e:
                raise SystemExit(f"{run_dir} was trained with other settings "
                                 f"({str(e).removeprefix('--resume: ')}): "
                                 "remove it or choose another --out") from None
        if done:
            print(f"{run_dir}: already finished")
            continue
        cmd = [sys.executable, "train.py", *flags, "--out", run_dir,
               "--resume" if resumed else "--overwrite"]
        print(" ".join(cmd[1:]), flush=True)
        t0 = time.time()
        if train_cell(cmd, run_dir, resumed) != 0:
            raise SystemExit(f"{run_dir}: train.py failed (see its output above)")
        print(f"{run_dir}: {time.time() - t0:.0f} s", flush=True)
    return run_dirs


LOGS = ("config.json", "metrics.jsonl", "log.txt")  # what a figure is recomputed from


def train_cell(cmd: list[str], run_dir: str, resumed: bool) -> int:
    """Run one cell's train.py; its stdout shows here and goes to run_dir/log.txt as well."""
    os.makedirs(run_dir, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each line as it happens, through the pipe
    with open(os.path.join(run_dir, "log.txt"), "a" if resumed else "w") as log, \
            subprocess.Popen(cmd, cwd=PROJECT, env=env, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            log.flush()
    return proc.returncode


# ----------------------------------------------------------------------------
# The grid and the demos: their cells trained, then their tables (lab/tables.py)


def train_and_report(cells: list[tuple[str, list[str]]], home: str, results: str,
                     shown: list[str]) -> tuple[str, Runs]:
    """Train the cells in home, copy their LOGS (never a checkpoint; the starts' too) to
    results/<path under home>, then write diagnose.py's report on the cells named in `shown`:
    its path, and their runs."""
    trained = train_cells(home, cells)
    if results:
        for run_dir in trained:
            dest = os.path.join(results, os.path.relpath(run_dir, home))
            os.makedirs(dest, exist_ok=True)
            for name in LOGS:
                if os.path.exists(os.path.join(run_dir, name)):
                    shutil.copyfile(os.path.join(run_dir, name), os.path.join(dest, name))
        print(f"{results}: config.json, metrics.jsonl and log.txt of {len(trained)} runs")
    run_dirs = [d for d in trained if os.path.basename(d) in shown]
    path = report(run_dirs, home, names=lambda d: os.path.relpath(d, home))
    by_cell = {cell: {} for cell in shown}
    for d in run_dirs:  # home/seed<S>/<cell>
        seed = os.path.basename(os.path.dirname(d)).removeprefix("seed")
        by_cell[os.path.basename(d)][seed] = load_run(d, ROLES)
    return path, by_cell


def head_report(path: str, head: str, picture: str) -> None:
    """Put the grid's own title and tables, then its picture, above diagnose.py's report."""
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(f"{head}\n\n![{os.path.basename(picture)}]({os.path.basename(picture)})\n\n"
                + text)


def reproduce(out: str, train_flags: list[str], seeds: list[int], results: str = "") -> str:
    """Train the grid's cells, then write out/report.md: the main table, Paper A's findings,
    where the learning signal went, curves.png and diagnose.py's report."""
    cells = grid_cells(train_flags, seeds)
    check_cells(cells, out, train_flags)
    path, by_cell = train_and_report(cells, out, results, [f"{w}-{s}" for w, s in GRID])
    lines = main_table(by_cell) + ["", "Paper A's findings at this scale:", ""] + claims(by_cell)
    lines += ["", "Where the learning signal went "
              "(means over the training steps, then over the seeds):", ""]
    lines += mean_table({cell: [signal_numbers(*run) for run in runs.values()]
                         for cell, runs in by_cell.items()})
    head_report(path, "# Paper A's main table in miniature\n\n" + "\n".join(lines),
                demo_plot(("accuracy",), by_cell, os.path.join(out, "curves.png")))
    print("\n".join(lines))
    return path


def demo(name: str, out: str, train_flags: list[str], seeds: list[int],
         results: str = "") -> str:
    """Train the demo's cells for every seed (out/<name>/seed<S>/<cell>), then write
    out/<name>/report.md and its plots, headed by its tables and what the detector finds."""
    spec, home = DEMOS[name], os.path.join(out, name)
    cells = demo_cells(name, home, train_flags, seeds)
    task = check_cells(cells, home, train_flags)[0].task
    if name == "default" and TASK_KIND[task] != "math":
        raise SystemExit(f"--demo default: its table splits the gain at the generator's first "
                         f"answers, which only a math task scores (--task {task})")
    path, by_cell = train_and_report(cells, home, results, list(spec.cells))
    lines, verdict = demo_table(by_cell) + [""] + seed_table(spec.signals[0], by_cell), []
    for cell, runs in by_cell.items() if spec.finding else ():  # a comparison asks no detector
        found = sum(any(f.startswith(spec.finding) for f in findings(*run))
                    for run in runs.values())
        meant = "the mechanism" if cell in spec.shows else "a contrast or a mitigation"
        verdict.append(f"{cell} ({meant}): {spec.finding} found in {found} of {len(runs)} seeds")
    if name == "default":
        lines += [""] + gain_table(by_cell["default"])
    if name == "critics":
        lines += ["", "Seed by seed:", ""] + critics_table(by_cell) + ["", "Paired by seed:", ""]
        lines += [f"- {k}: {v}" for k, v in critics_differences(by_cell).items()]
    head_report(path, f"# Demo: {name}\n\n" + "\n".join(lines) + "\n\n"
                + "\n".join(f"- {v}" for v in verdict),
                demo_plot(spec.signals, by_cell, os.path.join(home, "demo.png")))
    print("\n".join(lines + [""] + verdict))
    return path


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This file's flags, and every other flag, in order, for each cell's train.py."""
    parser = argparse.ArgumentParser(
        prog="python -m lab.grid", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Every other flag goes to each cell's train.py in which it acts, after the cell's "
        "own (e.g. --model Qwen/Qwen3-1.7B --task dapo_math), but not one the cells set themselves "
        "(--seed, --workflow and --sharing in the main table, a demo's own cell flags).")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--reproduce", action="store_true",
                      help="train the main table's cells, then report")
    what.add_argument("--demo", choices=list(DEMOS), help="train one mechanism's demo cells "
                      "(the mechanism, its contrast, its mitigation), then report")
    parser.add_argument("--seeds", default="0,1,2", help="the seeds to run, e.g. 0,1,2")
    parser.add_argument("--out", default=None, help="where the cells and report.md go "
                        "(default: runs/reproduce, runs/demo-NAME)")
    parser.add_argument("--results", default="", help="also copy each run's config.json, "
                        "metrics.jsonl and log.txt (no checkpoint) there, e.g. "
                        "docs/results/critics, so that the figures' logs can be committed")
    args, train_flags = parser.parse_known_args(argv)
    if args.out == "":
        parser.error("--out is empty: name the directory for the cells (or leave it out)")
    given = args.seeds
    try:
        args.seeds = [int(s) for s in given.split(",")]
    except ValueError:
        parser.error(f"--seeds {given!r}: give seeds as 0,1,2")
    if len(set(args.seeds)) < len(args.seeds) or not all(0 <= s < 2 ** 32 for s in args.seeds):
        parser.error(f"--seeds {given}: give distinct seeds from 0 to 4294967295")
    typed = typed_flags(train_flags)
    if placed := sorted(typed & set(PLACED)):
        parser.error(f"--{placed[0]}: {PLACED[placed[0]]}")
    if fixed := sorted(typed & cell_fields(args.demo)):
        parser.error(f"--{fixed[0]}: the cells set it themselves (given to train.py, it would "
                     "make them one cell under different names)")
    if "steps" in typed and parse_config(train_flags).steps == 0:
        parser.error("--steps 0: the grid compares its cells after RL; give at least 1")
    return args, train_flags


def main(argv: list[str] | None = None) -> None:
    args, train_flags = parse_args(sys.argv[1:] if argv is None else argv)
    parse_config(train_flags)  # a flag train.py does not know fails here (the cells: check_cells)
    t0 = time.time()
    # the cells train with the project as their working directory: one path, wherever it is run
    out = os.path.abspath(args.out or (f"runs/demo-{args.demo}" if args.demo else "runs/reproduce"))
    if args.demo:
        path = demo(args.demo, out, train_flags, args.seeds, args.results)
    else:
        path = reproduce(out, train_flags, args.seeds, args.results)
    print(f"{path} ({time.time() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
