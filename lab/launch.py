"""Launching a run, everything before its step 0 that is not the algorithm's: the settings
checked (lab/settings.py's checks, a resumed run's own config, another run's start), the
problems, the base model with its LoRA layers; the run's clock: its plan (the first line it
logs), the steps it evaluates at, the time it has left; and a step 0 read back from a checkpoint,
this run's (--resume) or another run's (--start_from). The adapters, critics and optimizers, the
warm-up, the first evaluation and the training loop are train.py's; the run directory is
lab/runs.py's, the training state and its checkpoints lab/checkpoint.py's. The directory is
locked first and written only once the model has loaded and the flags fit it, so a launch that
fails leaves a run in --out as it was.

    python train.py --out runs/a --resume                   # on from its last checkpoint, exactly
    python train.py --steps 0 --sft_warmup 4 --out runs/start  # a warm-up and step-0 evaluation
    python train.py --start_from runs/start --lr 1e-3 --out runs/b  # ... that runs start from

Exercised by: pytest tests/test_train.py (bad flags, the context check, the schedule, resume,
--start_from, damaged checkpoints), tests/test_distributed.py
"""
import dataclasses
import glob
import json
import os

import torch
from safetensors.torch import load_file

from lab.machine import barrier, log, rank_and_world
from lab.checkpoint import (TrainState, has_checkpoint, is_state, load_state, no_checkpoint,
                            read_best, restore_best, start_checkpoint)
from lab.runs import check_run_dir, lock_run, read_jsonl, start_run_dir, write_whole
from lab.settings import (MAAC_ONLY, Settings, check_idle_flags, check_numbers, chosen,
                          idle_settings, lora_targets, read_config, with_task_tokens)
from decode import decoder_plan
from lora import freeze_copy, inject_lora, narrowest
from model import load_policy
from tasks import TASK_KIND, load_task


# ----------------------------------------------------------------------------
# The settings: checked before a file or the model is touched


def check_settings(cfg: Settings, typed: set[str] | None) -> tuple[Settings, dict | None]:
    """The run's config (a resumed run's own) and with --start_from the start's config, checked
    before a file or the model is touched (train.py checks what the algorithm reads of them)."""
    if cfg.resume and cfg.overwrite:
        raise SystemExit("--resume continues the run in --out and --overwrite starts it over: "
                         "give one")
    cfg = resolve_resume(cfg, typed) if cfg.resume else cfg
    check_numbers(cfg)
    if not cfg.resume:  # a resumed run keeps the settings it started with, idle ones too
        check_idle_flags(cfg, typed)
        # (the default warm-up of 1 passes with --steps 1)
        if chosen(cfg, typed, "warmup_steps") and cfg.warmup_steps >= cfg.steps > 0:
            raise SystemExit(f"--warmup_steps {cfg.warmup_steps}: not fewer than the run's --steps "
                             f"{cfg.steps}, so its learning rate would never reach --lr")
    if cfg.credit == "own" and TASK_KIND[cfg.task] != "math":
        raise SystemExit(f"--credit own: task {cfg.task} has no per-call verifier "
                         "(its answers are programs); use --credit final")
    cfg = with_task_tokens(cfg)  # resolved here once (a resumed run's config holds it)
    start_config = check_start(cfg) if cfg.start_from and not cfg.resume else None
    lora_targets(cfg)  # stops here on an empty or repeated layer name
    return cfg, start_config


# ----------------------------------------------------------------------------
# The problems, the model, the adapters and their optimizers


def load_problems(cfg: Settings, world: int) -> tuple[list, dict[str, list]]:
    """The training pool and the held-out problems, {"eval": test, "val": val} (no "val" without
    --val_problems)."""
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
    return train_set, held_out


def launch(cfg: Settings, device: str) -> tuple[object, object, list[str]]:
    """The base model with LoRA layers on --lora_targets (no adapter yet), its tokenizer, and what
    --out held before (check_run_dir). The run directory is locked first (runs.lock_run) and a new
    run's is checked; start_run writes it only once the model has loaded and the flags fit it
    (train.check_context), so a failed launch leaves a run in --out as it was."""
    lock_run(cfg.out)
    held = [] if cfg.resume else check_run_dir(cfg.out, cfg.overwrite)
    log(plan(cfg, device))
    model, tok = load_policy(cfg.model, device, cfg.dtype)
    side = narrowest(model, lora_targets(cfg))
    if side is not None and cfg.lora_r > side:  # B A could not have that rank
        raise SystemExit(f"--lora_r {cfg.lora_r}: more than {side}, the smaller side of the "
                         f"narrowest adapted layer of {cfg.model}; give at most {side}")
    try:
        inject_lora(model, cfg.lora_r, cfg.lora_alpha, lora_targets(cfg))
    except ValueError as e:
        raise SystemExit(f"--lora_targets: {e}") from None
    log(f"decoding: {decoder_plan(model)}")  # the static graph, or the plain loop and why
    return model, tok, held


def start_run(cfg: Settings, held: list[str], rank: int) -> None:
    """A new run's directory, written once the launch's checks have passed (rank 0's)."""
    if not cfg.resume and rank == 0:
        start_run_dir(cfg.out, held, dataclasses.asdict(cfg))


# ----------------------------------------------------------------------------
# The clock: what the run will do, and the time it has left


def is_eval_step(cfg: Settings, step: int) -> bool:
    """Whether the workflow is evaluated after `step` (step 0 = before training): every
    --eval_every-th step and the last."""
    return step in (0, cfg.steps) or bool(cfg.eval_every and step % cfg.eval_every == 0)


def evals_after(cfg: Settings, step: int) -> int:
    """How many evaluations come after `step`, counted, not listed (a run may be long)."""
    every = cfg.eval_every and (cfg.steps // cfg.eval_every - step // cfg.eval_every)
    last = step < cfg.steps and not (cfg.eval_every and cfg.steps % cfg.eval_every == 0)
    return every + last


def eval_steps_text(cfg: Settings) -> str:
    """The evaluated steps as the plan says them: all of them, or the first and the last few."""
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
            f"{cfg.save_every} step{'s' * (cfg.save_every > 1)} in {cfg.out}. "
            "Time: estimated after the step-0 evaluation.")


def estimate_minutes(cfg: Settings, eval_seconds: float, step_seconds: list[float],
                     step: int) -> float:
    """Minutes left after `step`: the mean step so far (or, before any, a step guessed from the
    evaluation: its episodes cost what evaluation episodes cost, and the update half as much again),
    plus the evaluations still to come."""
    episodes = (cfg.eval_problems + cfg.val_problems) * (cfg.eval_samples
                                                         if evaluation_samples(cfg) else 1)
    per_episode = eval_seconds / episodes  # an evaluation's: test and val, each sample
    step_time = (sum(step_seconds) / len(step_seconds) if step_seconds
                 else 1.5 * per_episode * cfg.problems_per_step * cfg.group_size)
    evals_left = evals_after(cfg, step)
    return ((cfg.steps - step) * step_time + evals_left * eval_seconds) / 60


def step_line(cfg: Settings, row: dict, eval_seconds: float, step_seconds: list[float]) -> str:
    """A training step's log line: its reward and seconds, its accuracy when it was evaluated,
    and the time left; `eval_seconds`: the last evaluation's."""
    step = row["step"]
    line = f"step {step}/{cfg.steps} | reward {row['reward/mean']:.3f} | {row['time/step']:.1f}s"
    if "eval/accuracy" in row:
        line += f" | eval/accuracy {row['eval/accuracy']:.3f}"
    if step < cfg.steps:
        line += f" | about {estimate_minutes(cfg, eval_seconds, step_seconds, step):.0f} min left"
    return line


# ----------------------------------------------------------------------------
# --resume: the run's saved config, its newest checkpoint (TrainState.save writes it)
# and its logs cut back to it

# Flags that say where and how a run is executed, not what it is: --resume may change them
# (a run started on a GPU goes on on a CPU with --device cpu).
NOT_THE_RUN = ("out", "resume", "overwrite", "threads", "device")
# And the learning rates, from the step it resumes at on (a run stopped by non-finite steps).
NEW_LR = ("lr", "critic_lr")


def flag_name(token: str) -> str:
    """The setting a command-line flag names: --lr and --lr=0.1 name lr, --no-one_step one_step."""
    name = token[2:].split("=")[0]
    return name[3:] if name.startswith("no-") else name


def typed_flags(argv: list[str]) -> set[str]:
    """The flags named on a command line, any tool's: --lr 0.1, --lr=0.1, --no-one_step."""
    return {flag_name(a) for a in argv if a.startswith("--")}


def resolve_resume(cfg: Settings, typed: set[str] | None = None,
                   new_lr: tuple[str, ...] = NEW_LR) -> Settings:
    """--resume takes the run's saved config (run_config), from its newest checkpoint on."""
    saved = run_config(cfg, typed, new_lr)
    if not has_checkpoint(cfg.out):
        raise SystemExit(no_checkpoint(cfg.out))
    return saved


def run_config(cfg: Settings, typed: set[str] | None = None,
               new_lr: tuple[str, ...] = NEW_LR) -> Settings:
    """The saved config of the run in --out, as --resume takes it: a flag that contradicts it is
    an error, whether it was typed (`typed`, from the command line) or differs from its default
    (settings.chosen), except the learning rates in `new_lr` and --device, which a chosen flag
    changes, and the rest of NOT_THE_RUN, this command's own. The run lives wherever --out now
    points, however that path is spelled."""
    if not os.path.exists(os.path.join(cfg.out, "config.json")):
        raise SystemExit(f"--resume: no run in {cfg.out}")
    try:
        saved = read_config(os.path.join(cfg.out, "config.json"), type(cfg))
    except SystemExit as e:
        raise SystemExit(f"--resume: {e}") from None
    for f in dataclasses.fields(cfg):
        given, old = getattr(cfg, f.name), getattr(saved, f.name)
        if not chosen(cfg, typed, f.name):
            continue
        if f.name in (*new_lr, "device"):
            saved = dataclasses.replace(saved, **{f.name: given})
        elif f.name not in NOT_THE_RUN and given != old:
            raise SystemExit(f"--resume: --{f.name} {given} differs from the run's config "
                             f"({old if old != '' else 'none'})")
    return dataclasses.replace(saved, resume=True, out=cfg.out, threads=cfg.threads)


def resume_run(out: str, state: TrainState, references: dict[str, str],
               lrs: dict[str, float], steps: int) -> tuple[int, dict, dict]:
    """Load the newest checkpoint and cut the logs back to it; returns its step and the metrics
    rows of the first evaluation (step 0) and of the last one kept. `references`: adapter ->
    its frozen KL anchor, which the checkpoint fills in; `lrs`: the learning rates from now on
    (NEW_LR), which config.json records; `steps`: the run's."""
    for name, ref in references.items():
        freeze_copy(state.model, name, ref)
    start = state.load(out)
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    if start == steps and (new := [k for k, v in lrs.items() if saved[k] != v]):
        raise SystemExit(f"--resume: {out} is finished (step {start} of {steps}): a new "
                         f"--{new[0]} would train nothing")
    metrics_path, samples_path = (os.path.join(out, n) for n in ("metrics.jsonl", "samples.jsonl"))
    # every step writes its row before its checkpoint: the log holds steps 0 to `start`, each once
    kept = [row["step"] for row in read_jsonl(metrics_path) if row["step"] <= start]
    if kept != list(range(start + 1)):
        first = next(i for i, s in enumerate(kept + [None]) if s != i)
        what = (f"step {first}'s row is missing or out of place" if first <= start
                else f"step {kept[first]}'s row is there twice")
        raise SystemExit(f"--resume: {metrics_path} does not hold steps 0 to {start} once each, "
                         f"as the checkpoint of step {start} does ({what}: a torn, lost or "
                         "repeated line); start the run again with --overwrite")
    if rank_and_world()[0] == 0:
        truncate_jsonl(metrics_path, start)
        truncate_jsonl(samples_path, start)
        # kept whatever its step: a peak past the checkpoint was evaluated all the same
        restore_best(out)
        write_whole(os.path.join(out, "config.json"), json.dumps({**saved, **lrs}, indent=2))
    barrier()
    evaluated = [row for row in read_jsonl(metrics_path) if "eval/accuracy" in row]
    if not evaluated or evaluated[0]["step"] != 0:
        raise SystemExit(f"--resume: {metrics_path} lacks the evaluation before training (step 0)")
    return start, evaluated[0], evaluated[-1]


def truncate_jsonl(path: str, last_step: int) -> list[dict]:
    """Drop log lines written after the checkpoint we resume from; return the rows kept."""
    keep = [row for row in read_jsonl(path) if row["step"] <= last_step]
    write_whole(path, "".join(json.dumps(row) + "\n" for row in keep))
    return keep


# ----------------------------------------------------------------------------
# --start_from

# Settings that act only from step 1 on: a run may take its step 0 from a run that differs in
# them (--start_from). Every other setting shapes the warm-up, the step-0 evaluation or the
# random numbers they leave, and must match (--truncated among them: it decides whether a cut
# final answer scores in the step-0 evaluation; --grad_clip: the warm-up's steps clip too). The
# critics' settings are RL settings: a critic the start lacks begins fresh, as every critic
# begins RL.
RL_SETTINGS = ("start_from", "sharing", "steps", "lr", "warmup_steps", "lr_floor", "weight_decay",
               "eps_low", "eps_high", "loss_agg", "ratio", "adv_group", "kl_coef",
               "role_kl", "balance", "one_step", "damping", "credit", "eval_every",
               "diag_every", "log_samples", "save_every", "algo", *MAAC_ONLY)


def check_start(cfg: Settings) -> dict:
    """--start_from: the start run's config, once it is known to differ from this run's in RL
    settings only and its checkpoint to be of step 0, or its best one."""
    where = cfg.start_from
    if os.path.exists(where) and not os.path.isdir(where):
        raise SystemExit(f"--start_from {where}: not a directory "
                         "(a run's, or its best checkpoint's)")
    run, ckpt = start_checkpoint(where)
    # --overwrite would delete it before it is read
    if os.path.realpath(run) == os.path.realpath(cfg.out):
        raise SystemExit(f"--start_from {where} is this run's own --out; "
                         "start it in another directory")
    if os.path.exists(os.path.join(ckpt, "best.json")) and read_best(ckpt) is None:
        raise SystemExit(f"--start_from {where}: its best.json is not a best checkpoint's "
                         "(an integer step, a metric, a score and an evaluation)")
    try:
        state = load_state(ckpt)
        for tensors in glob.glob(os.path.join(ckpt, "**", "*.safetensors"), recursive=True):
            load_file(tensors)  # a torn adapter stops the launch here, before a file is written
        saved = read_config(os.path.join(run, "config.json"), type(cfg))
    except FileNotFoundError:
        raise SystemExit(f"--start_from {where}: no run with a checkpoint there "
                         "(train it with --steps 0)") from None
    except SystemExit as e:  # its config.json, named
        raise SystemExit(f"--start_from {where}: {e}") from None
    except Exception as e:  # a torn or foreign file: say so in one line
        raise SystemExit(f"--start_from {where}: its run cannot be read "
                         f"({type(e).__name__})") from None
    if not is_state(state):
        raise SystemExit(f"--start_from {where}: its state.pt is not a checkpoint's")
    if unknown := [f.name for f in dataclasses.fields(saved) if f.metadata["choices"]
                   and getattr(saved, f.name) not in f.metadata["choices"]]:
        raise SystemExit(f"--start_from {where}: its config.json names no known {unknown[0]}")
    # every adapter and critic it trained has an optimizer in state.pt, and must be there whole
    missing = [n for n in sorted(state["optimizers"])
               if not os.path.isfile(os.path.join(ckpt, n, "adapter_model.safetensors"))]
    if missing:
        raise SystemExit(f"--start_from {where}: its checkpoint lacks the adapter(s) "
                         f"{', '.join(missing)}")
    if read_best(ckpt) is None:  # the step-0 row this run begins its log with
        rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
        if not rows or rows[0]["step"] != 0 or "eval/accuracy" not in rows[0]:
            raise SystemExit(f"--start_from {where}: its metrics.jsonl lacks the evaluation "
                             "of step 0")
    # a best checkpoint: RL goes on from its step
    if state["step"] != 0 and read_best(ckpt) is None:
        raise SystemExit(f"--start_from {where}: its checkpoint is at step {state['step']}, not 0 "
                         "(train the start with --steps 0, or start from its best checkpoint, "
                         f"{where}/best)")
    check_goes_on_from(cfg, saved, where)
    return dataclasses.asdict(saved)


def check_goes_on_from(cfg: Settings, start: Settings, where: str) -> None:
    """Can a run of `cfg` take its step 0 from a run of `start` (in `where`)? A setting that
    acted nowhere in the start (settings.ONLY_UNDER: --minibatch_size without a warm-up or
    mini-batch steps) did not shape it, and may differ as RL settings may."""
    idle = idle_settings(start)
    for f in dataclasses.fields(cfg):
        given, old = getattr(cfg, f.name), getattr(start, f.name)
        if f.name not in NOT_THE_RUN + RL_SETTINGS and f.name not in idle and given != old:
            raise SystemExit(f"--start_from {where}: --{f.name} {given} differs from the start's "
                             f"({old}); only RL settings may differ")
    if start.sharing == "isolated" and cfg.sharing == "shared":
        raise SystemExit(f"--start_from {where}: a start with one adapter per role cannot "
                         "become one shared adapter")
