"""A training run as the loop sees it: one object (`Run`) holding the run on disk and on its
machine, so that train.py's loop reads as the algorithm. The directory is written only once the
model has loaded (`write_config`): a launch that fails leaves --out as it was.

    python train.py --out runs/a --resume                   # on from its last checkpoint, exactly
    python train.py --steps 0 --sft_warmup 4 --out runs/start  # a warm-up and step-0 evaluation
    python train.py --start_from runs/start --lr 1e-3 --out runs/b  # ... that runs start from

Exercised by: pytest tests/test_train.py, tests/test_refusals.py, tests/test_distributed.py
"""
import dataclasses
import json
import os
import shlex
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from lab.checkpoint import TrainState, restore_best
from lab.files import (RUN_ID, append_jsonl, check_run_dir, close_tensorboard, episode_samples,
                       lock_run, read_config_json, read_jsonl, start_run_dir, tensorboard_row,
                       unlock_run, write_whole)
from lab.machine import (PROCESSES, barrier, join_processes, log, peak_memory_mb, pick_threads,
                         rank_and_world, release_free_memory, stop_requested)
from lab.settings import NEW_LR, Settings, check_settings, check_start, chosen, run_id
from sandbox import layers, sandbox
from tasks import TASK_KIND, load_task


class Run:
    """One run of train.py: its settings, processes, directory, logs, checkpoints and clock."""

    def __init__(self, cfg: Settings, typed: set[str] | None = None):
        """Check the settings, join torchrun's processes, pick threads, load the problems."""
        self.cfg = check_settings(cfg, typed)
        self.device = join_processes(self.cfg.device)
        self.rank, self.world = rank_and_world()
        self.procs = PROCESSES
        torch.set_num_threads(pick_threads(self.cfg.threads, own_load=0.0))
        self.cfg, self.train_set, self.held_out = load_problems(self.cfg, self.world, typed)
        self.start_config = (check_start(self.cfg) if self.cfg.start_from and not self.cfg.resume
                             else None)
        self.step_seconds: list[float] = []  # training time of each step, evaluation excluded
        self.first = self.last = {}  # the metrics rows of the first and the latest evaluation
        self.saved = self.nonfinite = 0  # the newest checkpoint's step; non-finite steps in a row
        self.run_id = run_id(self.cfg)

    def open(self) -> None:
        """Lock the run's directory, check what a new run finds there, log the plan."""
        lock_run(self.cfg.out)
        self.held = [] if self.cfg.resume else check_run_dir(self.cfg.out, self.cfg.overwrite)
        log(plan(self.cfg, self.device))
        if TASK_KIND[self.cfg.task] == "code":  # the isolation this machine gives its programs
            log(f"sandbox: {layers(sandbox())}")

    def write_config(self) -> None:
        """A new run's directory: the old run's files gone (--overwrite), config.json written."""
        if not self.cfg.resume and self.rank == 0:
            start_run_dir(self.cfg.out, self.held,
                          {**dataclasses.asdict(self.cfg), RUN_ID: self.run_id})

    # ---- step 0

    def resume(self, state: TrainState) -> None:
        """Load the newest checkpoint and cut the logs back to it; config.json records NEW_LR."""
        out, steps = self.cfg.out, self.cfg.steps
        lrs = {k: getattr(self.cfg, k) for k in NEW_LR}
        start = state.load(out)
        saved = read_config_json(os.path.join(out, "config.json"))
        if start == steps and (new := [k for k, v in lrs.items() if saved[k] != v]):
            raise SystemExit(f"--resume: {out} is finished (step {start} of {steps}): a new "
                             f"--{new[0]} would train nothing")
        metrics_path, samples_path = (os.path.join(out, n)
                                      for n in ("metrics.jsonl", "samples.jsonl"))
        samples = read_jsonl(samples_path)  # a damaged line stops the resume before a log is cut
        # each step's row is written before its checkpoint: the log holds steps 0 to `start`, once
        rows = [row for row in read_jsonl(metrics_path) if row["step"] <= start]
        kept = [row["step"] for row in rows]
        if kept != list(range(start + 1)):
            first = next(i for i, s in enumerate(kept + [None]) if s != i)
            what = (f"step {first}'s row is missing or out of place" if first <= start
                    else f"step {kept[first]}'s row is there twice")
            raise SystemExit(f"--resume: {metrics_path} does not hold steps 0 to {start} once "
                             f"each, as the checkpoint of step {start} does ({what}: a torn, lost "
                             "or repeated line); start the run again with --overwrite")
        if self.rank == 0:
            # best/ is kept whatever its step: a peak past the checkpoint was evaluated
            restore_best(out, state.run_id)
            for path, lines in ((metrics_path, rows), (samples_path, samples)):
                write_whole(path, "".join(json.dumps(row) + "\n" for row in lines
                                          if row["step"] <= start))
            write_whole(os.path.join(out, "config.json"),
                        json.dumps({**saved, **lrs, RUN_ID: state.run_id}, indent=2))
        barrier()
        evaluated = [row for row in rows if "eval/accuracy" in row]
        if "eval/accuracy" not in rows[0]:
            raise SystemExit(f"--resume: {metrics_path} lacks the evaluation before training "
                             "(step 0)")
        self.saved, self.first, self.last = start, evaluated[0], evaluated[-1]
        log(f"resuming {out} at step {start}")

    def begin(self, state: TrainState, first: dict) -> None:
        """A new run's step 0 (`first`: its row) logged, kept as the best and saved: a run stopped
        after it resumes without its warm-up, and others start from it."""
        self.first = self.last = first
        if self.rank == 0:
            write_whole(os.path.join(self.cfg.out, "metrics.jsonl"), json.dumps(first) + "\n")
            write_whole(os.path.join(self.cfg.out, "samples.jsonl"), "")
            tensorboard_row(self.cfg.out, first)
        # the best first: a run stopped between the two has no checkpoint to resume and starts
        # over, where the other order would resume without step 0's best
        state.keep_best(self.cfg.out, first)
        state.save(self.cfg.out, 0)

    # ---- the training steps

    def steps(self):
        """The steps to train, each timed from `t0`; torch's threads chosen again after each."""
        cfg = self.cfg
        if self.saved < cfg.steps and (stop := stop_requested()):
            stop_run(cfg.out, self.saved, self.saved, stop)
        cpu_before = time.process_time()
        for step in tqdm(range(self.saved + 1, cfg.steps + 1), initial=self.saved,
                         total=cfg.steps, desc="train", file=sys.stderr,
                         disable=None if self.rank == 0 else True):
            self.t0 = time.time()
            release_free_memory()  # what the last update freed, before this rollout
            yield step
            own_load = (time.process_time() - cpu_before) / (time.time() - self.t0)  # CPU/wall
            torch.set_num_threads(pick_threads(cfg.threads, own_load))
            cpu_before = time.process_time()

    def evaluate_due(self, step: int) -> bool:
        """Whether the workflow is evaluated after `step`; if so, freed memory goes back first."""
        if due := is_eval_step(self.cfg, step):
            release_free_memory()
        return due

    def log(self, row: dict, episodes: tuple) -> None:
        """A step's row, its first episodes (calls, outcomes, problems, rewards) and its line."""
        cfg = self.cfg
        row["time/step"] = time.time() - self.t0
        row["mem/peak_mb"] = max(self.procs.gather([peak_memory_mb(self.device)]))
        self.step_seconds.append(row["time/step"] - row.get("time/eval", 0.0))
        if "time/eval" in row:
            self.last = row
        step = row["step"]
        samples = episode_samples(step, *episodes, cfg.group_size, cfg.log_samples)
        if self.rank == 0:
            append_jsonl(os.path.join(cfg.out, "metrics.jsonl"), [row])
            append_jsonl(os.path.join(cfg.out, "samples.jsonl"), samples)
            tensorboard_row(cfg.out, row, samples)
        line = (f"step {step}/{cfg.steps} | reward {row['reward/mean']:.3f} | "
                f"{row['time/step']:.1f}s")
        if "eval/accuracy" in row:
            line += f" | eval/accuracy {row['eval/accuracy']:.3f}"
        if step < cfg.steps:  # the last evaluation's seconds stand for those to come
            left = estimate_minutes(cfg, self.last.get("time/eval", 0.0), self.step_seconds, step)
            line += f" | about {left:.0f} min left"
        log(line)

    def save(self, state: TrainState, row: dict) -> None:
        """out/best, out/ckpt every --save_every steps and at the end, then stop after a signal or
        NONFINITE_STOP non-finite steps (which save nothing: the last save is from before them)."""
        cfg, step = self.cfg, row["step"]
        if "time/eval" in row:
            state.keep_best(cfg.out, row)
        self.nonfinite = self.nonfinite + 1 if any(
            v for k, v in row.items() if k.endswith("skipped_nonfinite")) else 0
        stop = stop_requested() if step < cfg.steps else 0  # Ctrl-C or SIGTERM, in any process
        if not self.nonfinite and (step % cfg.save_every == 0 or step == cfg.steps or stop):
            state.save(cfg.out, step)
            self.saved = step
        if stop or self.nonfinite == NONFINITE_STOP:
            stop_run(cfg.out, step, self.saved, stop)

    def close(self) -> dict:
        """The run's last line, held-out accuracy before and after; the directory let go."""
        cfg = self.cfg
        before, after = self.first["eval/accuracy"], self.last["eval/accuracy"]
        log(f"held-out accuracy of {cfg.workflow} ({cfg.sharing}): before {before:.3f} -> after "
            f"{after:.3f}  [{cfg.eval_problems} test problems]")
        leave_processes()
        return {"before": before, "after": after}


# ----------------------------------------------------------------------------
# The problems


def load_problems(cfg: Settings, world: int,
                  typed: set[str] | None = None) -> tuple[Settings, list, dict[str, list]]:
    """cfg, the training pool and {"eval": test, "val": val}. A split smaller than asked is
    refused where the number was given; a default becomes what the split holds."""
    if cfg.problems_per_step < world:
        raise SystemExit(f"--problems_per_step {cfg.problems_per_step}: fewer problems than "
                         f"the {world} processes; every process needs at least one")
    try:
        train_set = load_task(cfg.task, "train", cfg.train_problems, cfg.level, cfg.seed)
        held_out = {"eval": load_task(cfg.task, "test", cfg.eval_problems, cfg.level, cfg.seed)}
        if cfg.val_problems:
            held_out["val"] = load_task(cfg.task, "val", cfg.val_problems, cfg.level, cfg.seed)
    except ValueError as e:
        raise SystemExit(f"task {cfg.task}: {e}") from None
    if cfg.problems_per_step > len(train_set):
        raise SystemExit(f"--problems_per_step {cfg.problems_per_step}: the {cfg.task} "
                         f"training pool holds {len(train_set)} problems")
    held = {"train_problems": len(train_set), "eval_problems": len(held_out["eval"]),
            "val_problems": len(held_out.get("val", []))}
    fewer = {name: n for name, n in held.items() if n < getattr(cfg, name)}
    for name, n in fewer.items():
        if chosen(cfg, typed, name):
            raise SystemExit(f"--{name} {getattr(cfg, name)}: task {cfg.task}'s split holds {n} "
                             f"problems; give at most {n}")
    return dataclasses.replace(cfg, **fewer), train_set, held_out


# ----------------------------------------------------------------------------
# The clock: what the run will do, and the time it has left


def is_eval_step(cfg: Settings, step: int) -> bool:
    """Whether the workflow is evaluated after `step`: step 0, every --eval_every-th, the last."""
    return step in (0, cfg.steps) or bool(cfg.eval_every and step % cfg.eval_every == 0)


def evals_after(cfg: Settings, step: int) -> int:
    """How many evaluations come after `step`, counted, not listed (a run may be long)."""
    every = cfg.eval_every and (cfg.steps // cfg.eval_every - step // cfg.eval_every)
    last = step < cfg.steps and not (cfg.eval_every and cfg.steps % cfg.eval_every == 0)
    return every + last


def eval_steps_text(cfg: Settings) -> str:
    """The evaluated steps as the plan says them: all, or the first and the last few."""
    shown = [s for s in range(min(cfg.steps, 6 * max(cfg.eval_every, 1)) + 1)
             if is_eval_step(cfg, s)]
    if evals_after(cfg, 0) + 1 <= 7:
        return ", ".join(map(str, sorted({*shown, cfg.steps})))
    last = [s for s in range(cfg.steps - 2 * cfg.eval_every, cfg.steps + 1) if is_eval_step(cfg, s)]
    return f"{', '.join(map(str, shown[:4]))}, ..., {', '.join(map(str, last))}"


def evaluation_samples(cfg: Settings) -> bool:
    """Whether evaluation samples at the training temperature rather than decoding greedily."""
    return cfg.eval_sampling == "sample" or (cfg.eval_sampling == "auto"
                                             and cfg.workflow == "voting")


def plan(cfg: Settings, device: str) -> str:
    """The first line of a run: what it will do."""
    evals = eval_steps_text(cfg)
    threads = torch.get_num_threads()
    adapters = "one shared adapter" if cfg.sharing == "shared" else "one adapter per role"
    sampled = evaluation_samples(cfg)
    samples = ""
    if cfg.eval_samples > 1:  # said, not silently dropped, where a greedy evaluation answers once
        samples = (f" x {cfg.eval_samples} samples" if sampled
                   else f" (--eval_samples {cfg.eval_samples} unused: greedy answers once)")
    return (f"{cfg.workflow} with {adapters}, {cfg.algo}, model {cfg.model} on {device} "
            f"({threads} thread{'s' * (threads > 1)}), task {cfg.task}: "
            f"{cfg.steps} steps of {cfg.problems_per_step} problems x {cfg.group_size} episodes; "
            f"{'sampled' if sampled else 'greedy'} evaluation on "
            f"{cfg.eval_problems} held-out problems{samples} at steps {evals}; a checkpoint every "
            f"{cfg.save_every} step{'s' * (cfg.save_every > 1)} in {cfg.out}, "
            + (f"and best/ chosen on {cfg.val_problems} validation problems. " if cfg.val_problems
               else "and no best/: no validation split to choose it on (--val_problems 0). ")
            + "Time: estimated after the step-0 evaluation.")


def estimate_minutes(cfg: Settings, eval_seconds: float, step_seconds: list[float],
                     step: int) -> float:
    """Minutes left after `step`: the mean step so far (before any, guessed from an evaluation's
    episodes, the update half as much again), plus the evaluations to come."""
    episodes = (cfg.eval_problems + cfg.val_problems) * (cfg.eval_samples
                                                         if evaluation_samples(cfg) else 1)
    per_episode = eval_seconds / episodes  # an evaluation's: test and val, each sample
    step_time = (sum(step_seconds) / len(step_seconds) if step_seconds
                 else 1.5 * per_episode * cfg.problems_per_step * cfg.group_size)
    return ((cfg.steps - step) * step_time + evals_after(cfg, step) * eval_seconds) / 60


# ----------------------------------------------------------------------------
# The end of a run, and stopping early

NONFINITE_STOP = 3  # steps in a row with a mini-batch not applied (non-finite loss or gradient)


def leave_processes() -> None:
    """Let the directory go; leave torchrun's group once every process is done with it (gloo
    aborts a process whose group is torn down while another uses it)."""
    close_tensorboard()
    unlock_run()
    if rank_and_world()[1] > 1:
        barrier()
        dist.destroy_process_group()


def stop_run(out: str, step: int, saved: int, signum: int) -> None:
    """End the run after `step` in one line that says how to go on: after a signal (exit status
    128 + signum), or after NONFINITE_STOP non-finite steps (signum 0, exit status 1)."""
    rank, world = rank_and_world()
    launcher = f"torchrun --nproc_per_node {world}" if world > 1 else "python"
    resume = f"{launcher} train.py --resume --out {shlex.quote(out)}"
    leave_processes()
    if signum:
        if rank == 0:
            print(f"stopped by {signal.Signals(signum).name} after step {step}, "
                  f"the checkpoint of step {saved} kept; to go on: {resume}",
                  file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)  # 130 for SIGINT, 143 for SIGTERM, as a shell reports them
    raise SystemExit(1 if rank else f"step {step}: {NONFINITE_STOP} steps in a row with a "
                     f"non-finite loss or gradient (those mini-batches were not applied); "
                     f"the last good checkpoint is step {saved} in {out}/ckpt; to go on from it "
                     f"with a lower learning rate: {resume} --lr <lower>")
