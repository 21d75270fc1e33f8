"""The reproduction grid and the demos: which train.py runs they are, and training them.

    python diagnose.py --reproduce                 # the grid: Voting and Eval-Opt x shared/isolated, and single
    python diagnose.py --demo capture --seeds 0,1,2   # a mechanism's cells, once per seed

A cell is one train.py run in a directory of its own (out/<cell>), trained in a fresh
process. A finished cell is not trained again, and one trained with other settings is an
error rather than a silent mix; an interrupted cell resumes from its checkpoint, and one
killed before its first checkpoint starts over. A demo's cells of one seed go on from one
warm-up and step-0 evaluation (train.py --start_from), so they differ only in how RL updates
the adapters. diagnose.py reports on the cells; this file only says which runs they are and
trains them.

Exercised by: pytest tests/test_diagnose.py
"""
import dataclasses
import os
import subprocess
import sys
import time

import train
from runs import load_run, resolve_resume, typed_flags

# ----------------------------------------------------------------------------
# The reproduction grid

GRID = [("single", "shared"), ("eval_opt", "shared"), ("eval_opt", "isolated"),
        ("voting", "shared"), ("voting", "isolated")]
# On the 2-core CPU the grid fits in about an hour (docs/mechanisms.md); flags after these override.
GRID_FLAGS = ["--steps", "8", "--eval_every", "4", "--eval_problems", "32"]


def grid_cells(train_flags: list[str]) -> list[tuple[str, list[str]]]:
    """The grid's (name, train.py flags) cells; `train_flags` come after the grid's and override them."""
    return [(f"{w}-{s}", ["--workflow", w, "--sharing", s, *GRID_FLAGS, *train_flags]) for w, s in GRID]


# ----------------------------------------------------------------------------
# The demos: each mechanism made to happen on the embedded model, next to its mitigations
# The settings were found by the sweeps in docs/mechanisms.md.


@dataclasses.dataclass(frozen=True)
class Demo:
    finding: str                      # how the detector's finding starts
    flags: tuple[str, ...]            # train.py flags of every cell
    cells: dict[str, tuple[str, ...]]  # cell name -> its own flags
    shows: tuple[str, ...]            # the cells meant to show the mechanism; the others mitigate or contrast
    signals: tuple[str, ...]          # what demo.png shows, a panel each (diagnose.cell_series names);
                                      # the first is also tabled seed by seed
    start: tuple[str, ...] = ()       # flags of a warm-up that every cell of a seed starts from
                                      # (train.py --start_from); () = each cell warms up itself


# Both demos train Voting from one start per seed: a short supervised warm-up (train.py
# --sft_warmup) under a shared adapter gives the aggregator its contract and keeps the
# generators solving; every cell goes on from it (copied into each role's adapter in
# the isolated cells), so the cells differ only in how RL updates the adapters. Then
# 5 RL steps at a learning rate (1.5e-3) where the aggregator's contract breaks within
# the run in some cells and not in others. The two demos share their shared and
# isolated cells. Neither shows its mechanism at this scale; docs/mechanisms.md gives
# the seeds, the sweeps and what it would take.
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
}


def demo_cells(name: str, home: str, train_flags: list[str], seeds: list[int]) -> list[tuple[str, list[str]]]:
    """The demo's (name, train.py flags) cells in home: seed<S>/<cell> for every seed, after the
    seed's start (seed<S>/start) when the demo has one; `train_flags` override the demo's."""
    spec, cells = DEMOS[name], []
    for seed in seeds:
        mine = [*spec.flags, "--seed", str(seed)]
        if spec.start:  # the warm-up and step-0 evaluation, once; the cells go on from there
            cells.append((f"seed{seed}/start", [*mine, *spec.start, *train_flags, "--steps", "0"]))
            mine += ["--start_from", os.path.join(home, f"seed{seed}", "start")]
        cells += [(f"seed{seed}/{cell}", [*mine, *flags, *train_flags]) for cell, flags in spec.cells.items()]
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
        # an interrupted cell continues from its checkpoint; one killed before its first starts over
        again = ["--resume"] if os.path.exists(os.path.join(run_dir, "ckpt", "state.pt")) else ["--overwrite"]
        cmd = [sys.executable, "train.py", *flags, "--out", run_dir, *again]
        print(" ".join(cmd[1:]), flush=True)
        t0 = time.time()
        if subprocess.run(cmd, cwd=os.path.dirname(os.path.abspath(__file__))).returncode != 0:
            raise SystemExit(f"{run_dir}: train.py failed (see its output above)")
        print(f"{run_dir}: {time.time() - t0:.0f} s", flush=True)
    return run_dirs
