"""A run's settings: every flag of train.py with its default, its --help line, its choices and
its bounds (`Config`, read from the command line by `parse_config`), the checks a launch makes
before a file or the model is touched (lab/launch.check_settings runs them), a run's
config.json read back whole (`read_config`: --resume, --start_from, the probe), and what the
library files read from them: grpo.UpdateSettings, critic.CriticSettings and the roles the
warm-up teaches. Each value is resolved here once.

    python train.py --help          # the flags a first week changes
    python train.py --help-all      # every flag, in groups

Exercised by: pytest tests/test_train.py (bad flags, --help), tests/test_refusals.py
"""
import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field

from critic import CRITICS, PER, CriticSettings
from grpo import AGG_MODES, BALANCE, RATIO_LEVELS, UpdateSettings
from lora import DEFAULT_TARGETS, adapter_for
from model import DTYPES
from reward import CREDITS, TRUNCATED
from sandbox import CODE_TIMEOUT
from tasks import DEFAULT_LEVEL, TASK_KIND, TASKS
from workflows import ROLES, WORKFLOWS

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


@dataclass
class Config:
    # what to train
    workflow: str = arg("eval_opt", "workflow topology", tuple(WORKFLOWS))
    sharing: str = arg("shared", "one adapter for all roles, or one per role type",
                       ("shared", "isolated"))
    algo: str = arg("grpo", "group-relative advantages, or actor-critic with GAE", ("grpo", "maac"))
    model: str = arg("smollm2", "smollm2 (embedded), tiny (random, for tests), or a HF id/path")
    task: str = arg("arith", "problem set; dapo_math and deepcoder need the Hugging Face hub",
                    tuple(TASKS))
    level: int = arg(DEFAULT_LEVEL, "difficulty level of the arith task (1-5)")
    code_workers: int = arg(2, "code tasks: sandboxed programs run in parallel", bounds="[1, inf)")
    code_timeout: float = arg(CODE_TIMEOUT, "code tasks: wall-clock seconds per program",
                              bounds="(0, inf)")
    n_agents: int = arg(3, "generators in voting, workers in orch_workers", bounds="[1, inf)")
    max_rounds: int = arg(2, "eval_opt: most generator turns per episode", bounds="[1, inf)")
    # rollout
    steps: int = arg(10, "training steps", bounds="[0, inf)")
    problems_per_step: int = arg(8, "B: distinct problems per step", bounds="[1, inf)")
    group_size: int = arg(4, "G: episodes per problem (the GRPO group)", bounds="[1, inf)")
    max_new_tokens: int = arg(0, "completion length limit of every call; 0 = the task's: "
                              "48 for math, 320 for code", bounds="[0, inf)")
    temperature: float = arg(0.7, "sampling temperature of training rollouts", bounds="(0, inf)")
    top_p: float = arg(1.0, "nucleus sampling of training rollouts", bounds="(0, 1]")
    strict_answer: bool = arg(False, "score only a \\boxed{} answer (no last-number fallback)")
    credit: str = arg("final", "each call's reward: final = the episode's answer, broadcast (the "
                      "paper); own = a solver's own answer, an evaluator's verdict (math)", CREDITS)
    truncated: str = arg("penalize", "a call cut by --max_new_tokens: penalize = reward 0, mask = "
                         "no gradient; both score a cut final answer 0; "
                         "keep = scored like any other", TRUNCATED)
    # optimisation
    lr: float = arg(5e-4, "AdamW learning rate (paper: 2e-5 for runs of hundreds of steps)",
                    bounds="(0, inf)")
    warmup_steps: int = arg(1, "linear warmup steps, then cosine decay to --lr_floor",
                            bounds="[0, inf)")
    lr_floor: float = arg(0.1, "where the cosine decay ends, as a share of --lr; "
                          "1 keeps it constant", bounds="[0, 1]")
    sft_warmup: int = arg(6, "supervised steps before RL on replies that keep each role's contract "
                          "(0 = none; README)", bounds="[0, inf)")
    sft_lr: float = arg(1e-3, "AdamW learning rate of the supervised warm-up", bounds="(0, inf)")
    sft_roles: str = arg("generator,evaluator,aggregator,orchestrator,worker,synthesizer",
                         "roles the warm-up teaches, of those the workflow has")
    weight_decay: float = arg(0.0, "AdamW weight decay", bounds="[0, inf)")
    grad_clip: float = arg(1.0, "max gradient norm per optimizer step", bounds="(0, inf)")
    one_step: bool = arg(True, "one optimizer step per adapter a step (--no-one_step: one per "
                         "--minibatch_size)")
    minibatch_size: int = arg(16, "calls per optimizer step with --no-one_step, and per "
                                  "warm-up step", bounds="[1, inf)")
    micro_batch_tokens: int = arg(1024, "padded tokens a pass (memory only)",
                                  bounds="[1, inf)")
    eps_low: float = arg(0.2, "lower clip of the ratio", bounds="[0, 1)")
    eps_high: float = arg(0.28, "upper clip of the ratio (clip-higher)", bounds="[0, inf)")
    loss_agg: str = arg("seq-mean-token-mean", "loss aggregation", AGG_MODES)
    ratio: str = arg("token", "importance ratio: per token (PPO, GRPO) or per sequence (GSPO); "
                     "both are 1 under --one_step", RATIO_LEVELS)
    adv_group: str = arg("slot", "GRPO groups: (problem, slot, stage) or (problem, role)",
                         ("slot", "role"))
    kl_coef: float = arg(0.0, "k3 KL to the base model, or to the warmed-up adapters after "
                         "--sft_warmup; 0 = off, as the paper", bounds="[0, inf)")
    # mitigations of Paper A's failure modes (docs/mechanisms.md)
    balance: str = arg("none", "loss weight per role: role = equal roles (against capture), "
                       "multiplicity = 1/N for N same-role slots (against amplification)", BALANCE)
    damping: float = arg(0.0, "coherence damping: scale a step by 1 - damping * "
                         "max(0, cos(g, EMA(g)))", bounds="[0, 1]")
    role_kl: str = arg("", "KL anchor per role, e.g. 'aggregator=0.05' (the others use --kl_coef)")
    skip_empty: bool = arg(True, "no optimizer step on a mini-batch whose calls all have "
                           "advantage 0 (AdamW would move on its momentum)")
    tis_cap: float = arg(0.0, "truncated importance sampling: weight a token's loss by "
                         "min(pi_old / pi_rollout, C); 0 = off", bounds="[0, inf)")
    # actor-critic (--algo maac, critic.py)
    critic: str = arg("central", "one critic over the joint history (CoLLM-CC) "
                      "or one per agent (CoLLM-DC)", CRITICS)
    critic_per: str = arg("slot", "decentral critics: one per agent slot or per role type", PER)
    gamma: float = arg(1.0, "discount per agent turn", bounds="[0, 1]")
    lam: float = arg(0.95, "GAE lambda: 0 = one-step TD (Paper B's code), 1 = Monte Carlo",
                     bounds="[0, 1]")
    critic_lr: float = arg(5e-4, "AdamW learning rate of the critics (adapter and value head)",
                           bounds="(0, inf)")
    critic_steps: int = arg(1, "optimizer steps of every critic per training step, its rows split "
                            "evenly (a central critic takes as many as a decentral one; a critic "
                            "with fewer rows, one a row)", bounds="[1, inf)")
    vf_coef: float = arg(1.0, "value-loss coefficient (matters only against grad_clip)",
                         bounds="[0, inf)")
    value_clip: float = arg(0.0, "clip each value's move from its rollout value (0 = off)",
                            bounds="[0, inf)")
    norm_adv: bool = arg(False, "normalise actor-critic advantages over the batch")
    critic_max_tokens: int = arg(768, "a critic reads the last N tokens of its input",
                                 bounds="[1, inf)")
    # LoRA
    lora_r: int = arg(16, "LoRA rank (paper: 64)", bounds="[1, inf)")
    lora_alpha: float = arg(32.0, "LoRA alpha; the update is scaled by alpha / r",
                            bounds="(0, 1e6]")
    lora_targets: str = arg(",".join(DEFAULT_TARGETS),
                            "comma-separated names of the linear layers to adapt")
    # evaluation, logging, checkpoints
    eval_every: int = arg(0, "evaluate every E steps, and before and after training "
                          "(0: only before and after)", bounds="[0, inf)")
    diag_every: int = arg(1, "diagnostics every k steps (measure.py: the slots' gradients, "
                          "per-role figures, adherence; 0: never)", bounds="[0, inf)")
    eval_problems: int = arg(96, "test problems per evaluation (96: a standard error near 0.05)",
                             bounds="[1, inf)")
    val_problems: int = arg(0, "validation problems per evaluation, where a peak is chosen "
                            "(0: none; lab/grid.py uses 48)", bounds="[0, inf)")
    eval_sampling: str = arg("auto", "evaluation decoding: greedy, sample (at --temperature), or "
                             "auto = sample for voting only", ("auto", "greedy", "sample"))
    eval_samples: int = arg(1, "samples per held-out problem when evaluation samples",
                            bounds="[1, inf)")
    train_problems: int = arg(256, "size of the training pool", bounds="[1, inf)")
    log_samples: int = arg(2, "episodes per step written to samples.jsonl", bounds="[0, inf)")
    save_every: int = arg(1, "checkpoint every k steps and at the end: "
                          "a killed run loses at most k steps", bounds="[1, inf)")
    out: str = arg("runs/default", "run directory")
    seed: int = arg(0, "seed of problems, sampling and adapters", bounds="[0, 4294967296)")
    resume: bool = arg(False, "continue the run in --out from its last checkpoint")
    start_from: str = arg("", "begin RL at the step 0 (warm-up, first evaluation) "
                          "of the run in this directory (docs/runs.md)")
    overwrite: bool = arg(False, "start over in an --out that already holds a run (deletes it)")
    # machine
    device: str = arg("auto", "auto, cpu or cuda")
    dtype: str = arg("auto", "the frozen base weights: auto = bf16 on CUDA and on CPUs "
                     "with native bf16, else fp32; adapters are fp32", DTYPES)
    threads: int = arg(0, "CPU threads of torch; 0 = the free cores, chosen again every step",
                       bounds="[0, inf)")


def parse_config(argv: list[str] | None = None) -> Config:
    # no abbreviations: --resume checks the flags typed, by their full names (launch.typed_flags);
    # --work voting, taken for --workflow, would escape that check
    # --help shows the TUTORIAL flags' help only; --help-all every flag's
    every = "--help-all" in (sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description="Train an LLM workflow end to end with multi-agent GRPO or actor-critic.",
        allow_abbrev=False, usage="%(prog)s [--flag value ...]")
    parser.add_argument("--help-all", action="help", help="show every flag, in groups, and exit")
    group = parser
    for f in dataclasses.fields(Config):
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
    return Config(**vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------
# The checks before a file or the model is touched, and what the library files read


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


def idle_settings(cfg: Config) -> dict[str, str]:
    """The settings of ONLY_UNDER that would do nothing in a run of cfg, each with why."""
    return {name: why for flags, acts, why in ONLY_UNDER if not acts(cfg) for name in flags}


def chosen(cfg: Config, typed: set[str] | None, name: str) -> bool:
    """Whether setting `name` was given: named on the command line (`typed`), or, for a Config
    built in Python (typed None), set apart from its default."""
    return name in typed if typed is not None else getattr(cfg, name) != getattr(Config, name)


def check_idle_flags(cfg: Config, typed: set[str] | None) -> None:
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


def read_config(path: str) -> Config:
    """A run's config.json as the Config it was written from: every setting there, each of its
    type (an int where a float is asked); anything else is one line naming the file, as a setting
    that was lost would take its default (a Voting run resumed as Eval-Opt). Its values are
    check_numbers' to check."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path} cannot be read ({type(e).__name__})") from None
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
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
    return Config(**saved)


def with_task_tokens(cfg: Config) -> Config:
    """cfg with --max_new_tokens 0 resolved to its task's own (TASK_TOKENS), as a run's
    config.json holds it."""
    return dataclasses.replace(cfg, max_new_tokens=cfg.max_new_tokens
                               or TASK_TOKENS[TASK_KIND[cfg.task]])


def check_numbers(cfg: Config) -> None:
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


def kl_coefs(cfg: Config) -> dict[str, float]:
    """--kl_coef for every role of the workflow, overridden per role by --role_kl."""
    coefs = {role: cfg.kl_coef for role in ROLES[cfg.workflow]}
    named = set()
    for item in cfg.role_kl.split(",") if cfg.role_kl.strip() else []:
        role, _, value = item.partition("=")
        role = role.strip()
        if not item.strip():
            raise SystemExit(f"--role_kl {cfg.role_kl}: an empty item between commas")
        if role not in coefs:
            raise SystemExit(f"--role_kl: {role!r} is not a role of {cfg.workflow} "
                             f"({', '.join(coefs)})")
        if role in named:
            raise SystemExit(f"--role_kl: {role} is given twice")
        named.add(role)
        try:
            coefs[role] = float(value)
        except ValueError:
            raise SystemExit(f"--role_kl: {item!r} is not role=number") from None
        # as --kl_coef: a negative, nan or inf is no anchor
        if not in_bounds(coefs[role], "[0, inf)"):
            raise SystemExit(f"--role_kl {item.strip()}: must be in [0, inf)")
    return coefs


def update_settings(cfg: Config) -> UpdateSettings:
    """What grpo.policy_update reads, from the config (the same for every adapter). After a
    warm-up, a KL term anchors each adapter to a frozen copy of itself, "<adapter>-ref"."""
    kl = kl_coefs(cfg)
    adapters = {adapter_for(role, cfg.sharing) for role in ROLES[cfg.workflow]}
    anchored = cfg.sft_warmup > 0 and any(v > 0 for v in kl.values())
    return UpdateSettings(temperature=cfg.temperature, minibatch_size=cfg.minibatch_size,
                          one_step=cfg.one_step, micro_batch_tokens=cfg.micro_batch_tokens,
                          eps_low=cfg.eps_low, eps_high=cfg.eps_high, agg=cfg.loss_agg,
                          ratio=cfg.ratio, kl_coef=kl, grad_clip=cfg.grad_clip,
                          balance=cfg.balance, group_size=cfg.group_size,
                          damping=cfg.damping, tis_cap=cfg.tis_cap, skip_empty=cfg.skip_empty,
                          reference={a: f"{a}-ref" for a in sorted(adapters)} if anchored else {})


def critic_settings(cfg: Config) -> CriticSettings:
    """What critic.py's critic_advantages and update_critics read, from the config."""
    return CriticSettings(critic=cfg.critic, per=cfg.critic_per, max_tokens=cfg.critic_max_tokens,
                          gamma=cfg.gamma, lam=cfg.lam, normalize_advantages=cfg.norm_adv,
                          steps=cfg.critic_steps, micro_batch_tokens=cfg.micro_batch_tokens,
                          vf_coef=cfg.vf_coef, value_clip=cfg.value_clip or None,
                          grad_clip=cfg.grad_clip,
                          cut_returns_zero=cfg.truncated == "penalize",
                          own_rewards=cfg.credit == "own")


def warmup_roles(cfg: Config) -> list[str]:
    """The workflow's roles named in --sft_roles (another workflow's are passed over, as in the
    default, every workflow's roles, and a grid's list for all its cells): an unknown, blank or
    repeated name is a one-line error."""
    roles = [r.strip() for r in cfg.sft_roles.split(",")]
    if "" in roles or len(set(roles)) < len(roles):
        raise SystemExit(f"--sft_roles {cfg.sft_roles!r}: give distinct role names separated by "
                         "commas, e.g. generator,evaluator")
    known = {r for rs in ROLES.values() for r in rs}
    for role in roles:
        if role not in known:
            raise SystemExit(f"--sft_roles: {role!r} is not a role "
                             f"(roles: {', '.join(sorted(known))})")
    mine = [r for r in roles if r in ROLES[cfg.workflow]]
    if cfg.sft_warmup and not mine:
        raise SystemExit(f"--sft_roles: no role of {cfg.workflow} "
                         f"({', '.join(ROLES[cfg.workflow])}) to warm up")
    return mine


def lora_targets(cfg: Config) -> tuple[str, ...]:
    """--lora_targets as layer names: "q_proj, v_proj" names q_proj and v_proj (whether the
    model has such layers is known once it has loaded: lora.inject_lora says)."""
    names = tuple(t.strip() for t in cfg.lora_targets.split(","))
    if "" in names or len(set(names)) < len(names):
        raise SystemExit(f"--lora_targets {cfg.lora_targets!r}: give distinct layer names "
                         "separated by commas, e.g. q_proj,v_proj")
    return names
