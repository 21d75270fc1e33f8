"""A run's settings: train.py's `Config` (each field made by `arg`) read from the command line
(`parse_flags`), the checks a launch makes before a file or the model is touched
(`check_settings`, with a resumed run's config and another run's start), and a run's config.json
read back whole (`read_config`). Settings are read by field name: the run knows no algorithm.

    python train.py --help          # the flags a first week changes
    python train.py --help-all      # every flag, in groups

Exercised by: pytest tests/test_train.py, tests/test_refusals.py
"""
import argparse
import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import field
from typing import Any

from lab.checkpoint import (has_checkpoint, is_state, load_state, read_best, start_checkpoint,
                            unreadable)
from lab.files import RUN_ID, config_run_id, read_config_json, read_jsonl
from tasks import TASK_KIND

Settings = Any  # train.py's Config, read by field name

TASK_TOKENS = {"math": 48, "code": 320}  # --max_new_tokens 0: code needs room for a whole function


def arg(default, help: str, choices: tuple | None = None, bounds: str = ""):
    """A Config field; `bounds`: the interval a number must lie in, "[0, 1)" or "(0, inf)"."""
    return field(default=default, metadata={"help": help, "choices": choices, "bounds": bounds})


# --help: the flags a first week changes (the README's); --help-all: every flag, in SECTIONS
TUTORIAL = {"workflow", "sharing", "algo", "critic", "critic_per", "lam", "model", "task", "level",
            "steps", "problems_per_step", "group_size", "max_new_tokens", "lr", "lora_r",
            "eval_problems", "eval_every", "seed", "out", "resume", "overwrite", "threads",
            "one_step", "balance", "damping", "role_kl", "micro_batch_tokens"}
SECTIONS = {"workflow": "what to train", "steps": "rollout", "lr": "optimisation",
            "balance": "mitigations of Paper A's failure modes (docs/mechanisms.md)",
            "critic": "actor-critic (--algo maac, critic.py)", "lora_r": "LoRA",
            "eval_every": "evaluation, logging, checkpoints", "device": "machine"}


def parse_flags(config: type, argv: list[str] | None = None) -> Settings:
    """A `config` (train.py's Config class) from the command line."""
    every = "--help-all" in (sys.argv[1:] if argv is None else argv)  # every flag's help shown
    # no abbreviations: --resume checks the flags typed, by their full names (typed_flags);
    # --work voting, taken for --workflow, would escape that check
    parser = argparse.ArgumentParser(
        description="Train an LLM workflow end to end with multi-agent GRPO or actor-critic.",
        allow_abbrev=False, usage="%(prog)s [--flag value ...]")
    parser.add_argument("--help-all", action="help", help="show every flag, in groups, and exit")
    group = parser
    for f in dataclasses.fields(config):
        if f.name in SECTIONS:
            group = parser.add_argument_group(SECTIONS[f.name])
        # "a, b" rather than "a,b": argparse may wrap a long list between its names
        shown = "none" if f.default == "" else str(f.default).replace(",", ", ")
        help = (f"{f.metadata['help']} (default: {shown})" if every or f.name in TUTORIAL
                else argparse.SUPPRESS)
        kind = (dict(action=argparse.BooleanOptionalAction) if f.type is bool else
                dict(type=f.type, choices=f.metadata["choices"],
                     metavar={int: "N", float: "X"}.get(f.type)))  # N, X: fewer wrapped lines
        group.add_argument(f"--{f.name}", default=f.default, help=help, **kind)
    return config(**vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------
# The checks before a file or the model is touched


# The actor-critic's settings: with --algo grpo they would change nothing
MAAC_ONLY = ("critic", "critic_per", "gamma", "lam", "critic_lr", "critic_steps", "vf_coef",
             "value_clip", "norm_adv", "critic_max_tokens")


# Settings that act only under another: (the flags, whether they act, why not and what to do).
# Given where they do not act (typed, or unlike the default), they would change nothing.
ONLY_UNDER = [
    (MAAC_ONLY, lambda c: c.algo == "maac",
     "sets the critics of --algo maac; this run trains GRPO: add --algo maac or drop it"),
    (("critic_per",), lambda c: c.critic == "decentral",
     "groups the critics of --critic decentral; a central critic is one: drop it"),
    (("sft_lr", "sft_roles"), lambda c: c.sft_warmup > 0,
     "sets the warm-up, which --sft_warmup 0 leaves out: drop it or give --sft_warmup"),
    (("level",), lambda c: c.task == "arith", "is the arith task's difficulty: drop it"),
    (("strict_answer",), lambda c: TASK_KIND[c.task] == "math",
     "scores a math answer only in \\boxed{}; a code task's answer is a program: drop it"),
    (("code_workers", "code_timeout"), lambda c: TASK_KIND[c.task] == "code",
     "sets how a code task's programs run: drop it"),
    (("n_agents",), lambda c: c.workflow in ("voting", "orch_workers"),
     "counts the generators of voting and the workers of orch_workers; this workflow has "
     "neither: drop it"),
    (("max_rounds",), lambda c: c.workflow == "eval_opt",
     "counts eval_opt's generator turns; this workflow has no rounds: drop it"),
    (("eps_low", "eps_high"), lambda c: not c.one_step,
     "clips the ratio of --no-one_step's later mini-batches; under --one_step every ratio is "
     "exactly 1: drop it or give --no-one_step"),
    (("ratio",), lambda c: not c.one_step or c.tis_cap > 0,
     "chooses the ratio of --no-one_step's later mini-batches; under --one_step both are exactly "
     "1 and give one gradient (without --tis_cap): drop it or give --no-one_step"),
    (("minibatch_size",), lambda c: not c.one_step or c.sft_warmup > 0,
     "sizes the optimizer steps of --no-one_step and of the warm-up; this run has neither: "
     "drop it"),
]


def idle_settings(cfg: Settings) -> dict[str, str]:
    """The settings of ONLY_UNDER that would do nothing in a run of cfg, each with why."""
    return {name: why for flags, acts, why in ONLY_UNDER if not acts(cfg) for name in flags}


def chosen(cfg: Settings, typed: set[str] | None, name: str) -> bool:
    """Whether setting `name` was typed, or (typed None: a Config built in Python) not default."""
    return name in typed if typed is not None else getattr(cfg, name) != getattr(type(cfg), name)


def in_bounds(value: float, bounds: str) -> bool:
    """Whether value lies in an interval written "[low, high)", "(0, inf)" and so on."""
    low, high = (float(x) for x in bounds[1:-1].split(","))
    above = value >= low if bounds[0] == "[" else value > low
    below = value <= high if bounds[-1] == "]" else value < high
    return above and below


def read_config(path: str, config: type) -> Settings:
    """A run's config.json as a `config`, every setting there and of its type (a lost one would
    take its default: a Voting run resumed as Eval-Opt)."""
    saved = read_config_json(path)
    fields = {f.name: f.type for f in dataclasses.fields(config)}
    if unknown := sorted(set(saved) - set(fields) - {RUN_ID}):
        raise SystemExit(f"{path} is not a config of this project (it sets {', '.join(unknown)})")
    if missing := [name for name in fields if name not in saved]:
        raise SystemExit(f"{path} lacks {', '.join(missing)}")
    for name, kind in {**fields, RUN_ID: str}.items():
        value = saved.get(name, "")  # a run made before runs had an id has none
        if not (type(value) is kind or kind is float and type(value) is int):
            raise SystemExit(f"{path}: {name} is {value!r} (a {type(value).__name__}, "
                             f"not {kind.__name__})")
    return config(**{name: saved[name] for name in fields})


def with_task_tokens(cfg: Settings) -> Settings:
    """cfg with --max_new_tokens 0 resolved to its task's own, as a run's config.json holds it."""
    return dataclasses.replace(cfg, max_new_tokens=cfg.max_new_tokens
                               or TASK_TOKENS[TASK_KIND[cfg.task]])


def check_numbers(cfg: Settings) -> None:
    """Every flag in its interval or choices (argparse checks a typed one, not config.json)."""
    for f in dataclasses.fields(cfg):
        value, bounds, choices = getattr(cfg, f.name), f.metadata["bounds"], f.metadata["choices"]
        if bounds and not in_bounds(value, bounds):
            raise SystemExit(f"--{f.name} {value}: must be in {bounds}")
        if choices and value not in choices:
            raise SystemExit(f"--{f.name} {value!r}: must be one of {', '.join(choices)}")
    cores = len(os.sched_getaffinity(0))
    if cfg.threads > cores:
        raise SystemExit(f"--threads {cfg.threads}: this process may use {cores} core(s); "
                         "more threads than cores make every matmul wait for a core "
                         "(0 picks the free ones)")
    if cfg.algo == "grpo" and cfg.group_size < 2:
        raise SystemExit(f"--group_size {cfg.group_size}: must be >= 2 with --algo grpo "
                         "(a group of one has no contrast: every advantage is 0)")


def lora_targets(cfg: Settings) -> tuple[str, ...]:
    """--lora_targets as layer names (whether the model has them, lora.inject_lora says)."""
    names = tuple(t.strip() for t in cfg.lora_targets.split(","))
    if "" in names or len(set(names)) < len(names):
        raise SystemExit(f"--lora_targets {cfg.lora_targets!r}: give distinct layer names "
                         "separated by commas, e.g. q_proj,v_proj")
    return names


def check_settings(cfg: Settings, typed: set[str] | None) -> Settings:
    """The run's config (a resumed run's own), checked before a file or the model is touched."""
    if cfg.resume and cfg.overwrite:
        raise SystemExit("--resume continues the run in --out and --overwrite starts it over: "
                         "give one")
    if cfg.resume:
        cfg = run_config(cfg, typed)
        if not has_checkpoint(cfg.out):
            raise SystemExit(f"--resume: {cfg.out} has no checkpoint (the run stopped before its "
                             "first one); start it again without --resume, with --overwrite")
    check_numbers(cfg)
    if not cfg.resume:  # a resumed run keeps the settings it started with, idle ones too
        for name, why in idle_settings(cfg).items():
            if chosen(cfg, typed, name):
                raise SystemExit(f"--{name} {why}")
        # (the default warm-up of 1 passes with --steps 1)
        if chosen(cfg, typed, "warmup_steps") and cfg.warmup_steps >= cfg.steps > 0:
            raise SystemExit(f"--warmup_steps {cfg.warmup_steps}: not fewer than the run's --steps "
                             f"{cfg.steps}, so its learning rate would never reach --lr")
    if cfg.credit == "own" and TASK_KIND[cfg.task] != "math":
        raise SystemExit(f"--credit own: task {cfg.task} has no per-call verifier "
                         "(its answers are programs); use --credit final")
    cfg = with_task_tokens(cfg)
    lora_targets(cfg)  # stops here on an empty or repeated layer name
    return cfg


# ----------------------------------------------------------------------------
# --resume: the run's own config

# Where and how a run is executed, not what it is: --resume may change them
NOT_THE_RUN = ("out", "resume", "overwrite", "threads", "device")
# And the learning rates, from the step it resumes at on (a run stopped by non-finite steps)
NEW_LR = ("lr", "critic_lr")


def run_id(cfg: Settings) -> str:
    """A resumed run's own id, else a hash of the settings (NOT_THE_RUN's aside)."""
    if cfg.resume and (saved := config_run_id(cfg.out)):
        return saved
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_THE_RUN}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def flag_name(token: str) -> str:
    """The setting a flag names: --lr and --lr=0.1 name lr, --no-one_step one_step."""
    name = token[2:].split("=")[0]
    return name[3:] if name.startswith("no-") else name


def typed_flags(argv: list[str]) -> set[str]:
    """The settings a command line names, any tool's."""
    return {flag_name(a) for a in argv if a.startswith("--")}


def run_config(cfg: Settings, typed: set[str] | None = None,
               new_lr: tuple[str, ...] = NEW_LR) -> Settings:
    """The saved config of the run in --out; a chosen flag changes only `new_lr` and --device."""
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


# ----------------------------------------------------------------------------
# --start_from

# Settings that act only from step 1 on: --start_from may take step 0 from a run that differs
# in them. Every other one shapes the warm-up, the step-0 evaluation or their random numbers
# (--truncated: whether a cut answer scores; --grad_clip: the warm-up clips too). A critic the
# start lacks begins fresh, as every critic begins RL.
RL_SETTINGS = ("start_from", "sharing", "steps", "lr", "warmup_steps", "lr_floor", "weight_decay",
               "eps_low", "eps_high", "loss_agg", "ratio", "adv_group", "kl_coef",
               "role_kl", "balance", "one_step", "damping", "credit", "eval_every",
               "diag_every", "log_samples", "save_every", "algo", *MAAC_ONLY)


def check_start(cfg: Settings) -> dict:
    """--start_from: the start's config, once known to differ in RL settings only, its
    checkpoint of step 0 or its best one."""
    where = cfg.start_from
    if os.path.exists(where) and not os.path.isdir(where):
        raise SystemExit(f"--start_from {where}: not a directory "
                         "(a run's, or its best checkpoint's)")
    run, ckpt = start_checkpoint(where)
    # --overwrite would delete it before it is read
    if os.path.realpath(run) == os.path.realpath(cfg.out):
        raise SystemExit(f"--start_from {where} is this run's own --out; "
                         "start it in another directory")
    best = read_best(ckpt)  # a best checkpoint: RL goes on from its step
    if os.path.exists(os.path.join(ckpt, "best.json")) and best is None:
        raise SystemExit(f"--start_from {where}: its best.json is not a best checkpoint's "
                         "(an integer step, a metric, a score and an evaluation)")
    if not os.path.isfile(os.path.join(ckpt, "state.pt")):
        raise SystemExit(f"--start_from {where}: no run with a checkpoint there "
                         "(train it with --steps 0)")
    if why := unreadable(ckpt):  # a torn adapter stops the launch here, before a file is written
        raise SystemExit(f"--start_from {where}: its run cannot be read: {why}")
    try:
        saved = read_config(os.path.join(run, "config.json"), type(cfg))
    except SystemExit as e:
        raise SystemExit(f"--start_from {where}: {e}") from None
    state = load_state(ckpt)
    if not is_state(state):
        raise SystemExit(f"--start_from {where}: its state.pt is not a checkpoint's")
    if unknown := [f.name for f in dataclasses.fields(saved) if f.metadata["choices"]
                   and getattr(saved, f.name) not in f.metadata["choices"]]:
        raise SystemExit(f"--start_from {where}: its config.json names no known {unknown[0]}")
    # every adapter and critic it trained has an optimizer in state.pt, and must be there whole
    if missing := [n for n in sorted(state["optimizers"])
                   if not os.path.isfile(os.path.join(ckpt, n, "adapter_model.safetensors"))]:
        raise SystemExit(f"--start_from {where}: its checkpoint lacks the adapter(s) "
                         f"{', '.join(missing)}")
    if best is None:  # the step-0 row this run begins its log with
        rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
        if not rows or rows[0]["step"] != 0 or "eval/accuracy" not in rows[0]:
            raise SystemExit(f"--start_from {where}: its metrics.jsonl lacks the evaluation "
                             "of step 0")
        if state["step"] != 0:
            raise SystemExit(f"--start_from {where}: its checkpoint is at step {state['step']}, "
                             "not 0 (train the start with --steps 0, or start from its best "
                             f"checkpoint, {where}/best)")
    check_goes_on_from(cfg, saved, where)
    return dataclasses.asdict(saved)


def check_goes_on_from(cfg: Settings, start: Settings, where: str) -> None:
    """Whether `cfg` may start from `start`; a setting idle in the start did not shape it."""
    idle = idle_settings(start)
    for f in dataclasses.fields(cfg):
        given, old = getattr(cfg, f.name), getattr(start, f.name)
        if f.name not in NOT_THE_RUN + RL_SETTINGS and f.name not in idle and given != old:
            raise SystemExit(f"--start_from {where}: --{f.name} {given} differs from the start's "
                             f"({old}); only RL settings may differ")
    if start.sharing == "isolated" and cfg.sharing == "shared":
        raise SystemExit(f"--start_from {where}: a start with one adapter per role cannot "
                         "become one shared adapter")
