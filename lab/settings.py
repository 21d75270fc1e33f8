"""A run's settings as the command line and the checks see them: train.py's `Config` (every flag
with its default, its --help line, its choices and its bounds, each field made by `arg`) read
from the command line (`parse_flags`), the checks a launch makes before a file or the model is
touched (lab/launch.check_settings runs them), and a run's config.json read back whole
(`read_config`: --resume, --start_from, the probe). The settings are read by field name: the
run knows no algorithm, and train.py turns them into the arguments the algorithm takes.

    python train.py --help          # the flags a first week changes
    python train.py --help-all      # every flag, in groups

Exercised by: pytest tests/test_train.py (bad flags, --help), tests/test_refusals.py
"""
import argparse
import dataclasses
import json
import os
import sys
from dataclasses import field
from typing import Any

from tasks import TASK_KIND

# train.py's Config, as the run sees it: settings read by field name (the run imports nothing of
# the algorithm, train.py included)
Settings = Any

TASK_TOKENS = {"math": 48, "code": 320}  # --max_new_tokens 0: code needs room for a whole function


def arg(default, help: str, choices: tuple | None = None, bounds: str = ""):
    """A Config field: its default, its --help line, its choices, and for a number the interval it
    must lie in, "[0, 1)" or "(0, inf)" (checked by check_numbers before any model work)."""
    return field(default=default, metadata={"help": help, "choices": choices, "bounds": bounds})


# --help: the flags a first week changes (those of the README's commands); --help-all: every flag
TUTORIAL = {"workflow", "sharing", "algo", "critic", "critic_per", "lam", "model", "task", "level",
            "steps", "problems_per_step", "group_size", "max_new_tokens", "lr", "lora_r",
            "eval_problems", "eval_every", "seed", "out", "resume", "overwrite", "threads",
            "one_step", "balance", "damping", "role_kl", "micro_batch_tokens"}
# both in these groups; each group starts at the field named here
SECTIONS = {"workflow": "what to train", "steps": "rollout", "lr": "optimisation",
            "balance": "mitigations of Paper A's failure modes (docs/mechanisms.md)",
            "critic": "actor-critic (--algo maac, critic.py)", "lora_r": "LoRA",
            "eval_every": "evaluation, logging, checkpoints", "device": "machine"}


def parse_flags(config: type, argv: list[str] | None = None) -> Settings:
    """A Config from the command line (`config`: the class, train.py's Config)."""
    # no abbreviations: --resume checks the flags typed, by their full names (launch.typed_flags);
    # --work voting, taken for --workflow, would escape that check
    # --help shows the TUTORIAL flags' help only; --help-all every flag's
    every = "--help-all" in (sys.argv[1:] if argv is None else argv)
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


# The actor-critic's settings: with --algo grpo they would change nothing, so giving one is an
# error.
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
    """Whether setting `name` was given: named on the command line (`typed`), or, for a Config
    built in Python (typed None), set apart from its default."""
    return name in typed if typed is not None else getattr(cfg, name) != getattr(type(cfg), name)


def check_idle_flags(cfg: Settings, typed: set[str] | None) -> None:
    """No setting given to a run where it would do nothing (ONLY_UNDER): a critic's to GRPO, a
    warm-up's to a run without one, a task's to another task, a workflow's to another workflow."""
    for name, why in idle_settings(cfg).items():
        if chosen(cfg, typed, name):
            raise SystemExit(f"--{name} {why}")


def in_bounds(value: float, bounds: str) -> bool:
    """Whether value lies in an interval written "[low, high)", "(0, inf)" and so on."""
    low, high = (float(x) for x in bounds[1:-1].split(","))
    above = value >= low if bounds[0] == "[" else value > low
    below = value <= high if bounds[-1] == "]" else value < high
    return above and below


def read_config(path: str, config: type) -> Settings:
    """A run's config.json as the Config it was written from: every setting there, each of its
    type (an int where a float is asked); anything else is one line naming the file, as a setting
    that was lost would take its default (a Voting run resumed as Eval-Opt). Its values are
    check_numbers' to check. `config`: the class, train.py's Config."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path} cannot be read ({type(e).__name__})") from None
    fields = {f.name: f.type for f in dataclasses.fields(config)}
    if not isinstance(saved, dict):
        raise SystemExit(f"{path} is not a config of this project (an object of settings)")
    if unknown := sorted(set(saved) - set(fields)):
        raise SystemExit(f"{path} is not a config of this project (it sets {', '.join(unknown)})")
    if missing := [name for name in fields if name not in saved]:
        raise SystemExit(f"{path} lacks {', '.join(missing)}")
    for name, kind in fields.items():
        value = saved[name]
        if not (type(value) is kind or kind is float and type(value) is int):
            raise SystemExit(f"{path}: {name} is {value!r} (a {type(value).__name__}, "
                             f"not {kind.__name__})")
    return config(**saved)


def with_task_tokens(cfg: Settings) -> Settings:
    """cfg with --max_new_tokens 0 resolved to its task's own (TASK_TOKENS), as a run's
    config.json holds it."""
    return dataclasses.replace(cfg, max_new_tokens=cfg.max_new_tokens
                               or TASK_TOKENS[TASK_KIND[cfg.task]])


def check_numbers(cfg: Settings) -> None:
    """Every numeric flag in its interval, before any file or model is touched."""
    for f in dataclasses.fields(cfg):
        value, bounds, choices = getattr(cfg, f.name), f.metadata["bounds"], f.metadata["choices"]
        if bounds and not in_bounds(value, bounds):
            raise SystemExit(f"--{f.name} {value}: must be in {bounds}")
        # argparse checks a typed flag; a resumed config.json too
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
    """--lora_targets as layer names: "q_proj, v_proj" names q_proj and v_proj (whether the
    model has such layers is known once it has loaded: lora.inject_lora says)."""
    names = tuple(t.strip() for t in cfg.lora_targets.split(","))
    if "" in names or len(set(names)) < len(names):
        raise SystemExit(f"--lora_targets {cfg.lora_targets!r}: give distinct layer names "
                         "separated by commas, e.g. q_proj,v_proj")
    return names
