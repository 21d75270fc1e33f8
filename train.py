"""Train an LLM workflow end to end with multi-agent GRPO or actor-critic.

    python train.py                                   # Eval-Opt, shared adapter, embedded model
    python train.py --workflow voting --sharing isolated --steps 20
    python train.py --algo maac --critic central      # actor-critic (critic.py)
    python train.py --model tiny --steps 2 --out runs/smoke

One training step (Paper A, Zeng et al. 2026, arXiv 2605.24202, Sec. 3), `rl_step`:
  1. sample B problems, repeat each G times: B*G episodes;
  2. run the workflow on every episode (workflows.py), one batched generation a stage (rollout.py);
  3. score the final answers and give each call its reward (reward.credit_calls);
  4. advantages: group-relative per (problem, slot, stage) (grpo.py), or GAE (critic.py);
  5. old log-probs; every --diag_every steps first the diagnostics' pass (measure.py);
  6. update each adapter: one optimizer step (--one_step), or as in the paper one per mini-batch,
     where an isolated role of three slots takes three times the steps (docs/mechanisms.md);
  7. maac only: one pass of each critic over its inputs (value loss);
  8. log; evaluate on held-out problems every --eval_every steps; checkpoint.
Step 0: a supervised warm-up (--sft_warmup) teaches every role its contract; the first evaluation.
Under torchrun (docs/torchrun.md) every process takes the step one process would take.

Departures (docs/departures.md): defaults that fit a 2-core CPU (a 135M model, 10 steps of 8 x 4
episodes, lr 5e-4 instead of 2e-5), and one optimizer step per adapter and step, where the ratio
is 1 and the clip never acts: an on-policy policy gradient with GRPO's baseline.
"""
import math
import random
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch

from critic import (CRITICS, PER, critic_advantages, critic_key, critic_metrics, setup_critics,
                    update_critics)
from decode import decoder_plan
from grpo import (AGG_MODES, BALANCE, RATIO_LEVELS, has_signal, kl_coefs, policy_update,
                  reference_of, set_advantages)
# lab/: the run's plumbing (under torchrun `block` and the gathers split and join the processes)
from lab.checkpoint import TrainState, read_best
from lab.machine import (PROCESSES, block, catch_stop_signals, fitting_batch, gather_episodes,
                         gather_lists, gpu_rngs, log, run_main)
from lab.run import Run, estimate_minutes, evaluation_samples
from lab.settings import arg, lora_targets, parse_flags, typed_flags
from lora import (DEFAULT_TARGETS, adapter_for, adapter_parameters, freeze_copy, inject_lora,
                  narrowest, setup_adapters)
from measure import gradient_signals, step_metrics
from model import DTYPES, load_policy
from reward import CREDITS, TRUNCATED, credit_calls, cut_finals, score_batch
from rollout import Call, Rollout, chat_text, context_length
from sandbox import CODE_TIMEOUT
from tasks import DEFAULT_LEVEL, TASKS
from warmup import contract_replies, supervised_steps, warmup_roles
from workflows import (ROLES, SOLVERS, WORKFLOWS, adherence, boxed_contents, every_prompt,
                       role_of, run_workflow, slots)

# An adapter without signal in a step takes no optimizer step, and its schedule moves on anyway
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
EVAL_BATCH = 32  # held-out episodes an evaluation rolls out at once on a CPU (GPU: as fit)


# ----------------------------------------------------------------------------
# The settings: every flag, its default and its help; lab/settings.py checks them


@dataclass
class Config:
    # what to train
    workflow: str = arg("eval_opt", "workflow topology", tuple(WORKFLOWS))
    sharing: str = arg("shared", "one adapter for all roles, or one per role type",
                       ("shared", "isolated"))
    algo: str = arg("grpo", "group-relative advantages, or actor-critic with GAE", ("grpo", "maac"))
    model: str = arg("smollm2", "smollm2 (embedded), tiny (random, for tests), or a HF id/path")
    task: str = arg("arith", "problem set (dapo_math and deepcoder need the HF hub)", tuple(TASKS))
    level: int = arg(DEFAULT_LEVEL, "difficulty level of the arith task (1-5)")
    code_workers: int = arg(2, "code tasks: sandboxed programs run in parallel", bounds="[1, inf)")
    code_timeout: float = arg(CODE_TIMEOUT, "code tasks: wall-clock seconds per program (from "
                              "0.5: a sandbox takes about 0.1 s to start)", bounds="[0.5, 86400]")
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
    warmup_steps: int = arg(1, "linear warmup steps, then cosine decay", bounds="[0, inf)")
    lr_floor: float = arg(0.1, "the decay's end, a share of --lr (1: constant)", bounds="[0, 1]")
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
    micro_batch_tokens: int = arg(1024, "padded tokens a pass (memory only)", bounds="[1, inf)")
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
    critic_lr: float = arg(5e-4, "AdamW learning rate of the critics", bounds="(0, inf)")
    critic_steps: int = arg(1, "optimizer steps of every critic per training step, its rows split "
                            "evenly (at most one a row)", bounds="[1, inf)")
    vf_coef: float = arg(1.0, "value-loss coefficient (acts against grad_clip)", bounds="[0, inf)")
    value_clip: float = arg(0.0, "clip each value's move (0 = off)", bounds="[0, inf)")
    norm_adv: bool = arg(False, "normalise actor-critic advantages over the batch")
    critic_max_tokens: int = arg(768, "a critic reads the last N tokens", bounds="[1, inf)")
    # LoRA
    lora_r: int = arg(16, "LoRA rank (paper: 64)", bounds="[1, inf)")
    lora_alpha: float = arg(32.0, "LoRA alpha: the update scales by alpha / r", bounds="(0, 1e6]")
    lora_targets: str = arg(",".join(DEFAULT_TARGETS),
                            "comma-separated names of the linear layers to adapt")
    # evaluation, logging, checkpoints
    eval_every: int = arg(0, "evaluate every E steps, and before and after training "
                          "(0: only before and after)", bounds="[0, inf)")
    diag_every: int = arg(10, "the diagnostics' gradient pass (measure.py) every k steps, at "
                          "about an update's cost; 0: never", bounds="[0, inf)")
    eval_problems: int = arg(96, "test problems per evaluation (96: a standard error near 0.05)",
                             bounds="[1, inf)")
    val_problems: int = arg(48, "validation problems per evaluation, where best/ and a peak are "
                            "chosen (0: none, and no best checkpoint)", bounds="[0, inf)")
    eval_sampling: str = arg("auto", "evaluation decoding: greedy, sample (at --temperature), or "
                             "auto = sample for voting only", ("auto", "greedy", "sample"))
    eval_samples: int = arg(1, "samples per problem when evaluation samples", bounds="[1, inf)")
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
    return parse_flags(Config, argv)


def check_algorithm_settings(cfg: Config) -> None:
    """The roles of --role_kl and --sft_roles: a one-line error before anything is touched."""
    try:
        kl_coefs(cfg)
        if not cfg.resume:  # a resumed run's warm-up is behind it
            warmup_roles(cfg)
    except ValueError as e:
        raise SystemExit(str(e)) from None


# ----------------------------------------------------------------------------
# The model, the adapters and critics RL trains on it, their optimizers


def load_model(cfg: Config, device: str):
    """The base model with LoRA layers on --lora_targets (no adapter yet), and its tokenizer."""
    targets = lora_targets(cfg)
    model, tok = load_policy(cfg.model, device, cfg.dtype)
    side = narrowest(model, targets)
    if side is not None and cfg.lora_r > side:  # B A could not have that rank
        raise SystemExit(f"--lora_r {cfg.lora_r}: more than {side}, the smaller side of the "
                         f"narrowest adapted layer of {cfg.model}; give at most {side}")
    try:
        inject_lora(model, cfg.lora_r, cfg.lora_alpha, targets)
    except ValueError as e:
        raise SystemExit(f"--lora_targets: {e}") from None
    log(f"decoding: {decoder_plan(model)}")  # the static graph, or the plain loop and why
    return model, tok


def longest_prompt(tok, cfg: Config, problems: list) -> int:
    """Tokens of the longest prompt around the longest question (agents' texts are cut to fit)."""
    sizes = [len(ids) for ids
             in tok([p.question for p in problems], add_special_tokens=False).input_ids]
    longest = problems[sizes.index(max(sizes))]
    # Eval-Opt's prompts do not grow with its rounds: two hold each kind (try, verdict, refine)
    chats = every_prompt(cfg.workflow, longest.question, longest.kind, cfg.n_agents,
                         min(cfg.max_rounds, 2))
    return max(len(tok(chat_text(tok, c), add_special_tokens=False).input_ids) for c in chats)


def check_context(model, tok, cfg: Config, problems: list) -> None:
    """--critic_max_tokens, and --max_new_tokens after the longest prompt, fit the context."""
    context = context_length(model)
    if context is None:
        return
    if cfg.algo == "maac" and cfg.critic_max_tokens > context:
        raise SystemExit(f"--critic_max_tokens {cfg.critic_max_tokens}: more than the {context} "
                         f"positions of model {cfg.model}; lower it to at most {context}")
    prompt = longest_prompt(tok, cfg, problems)
    if prompt + cfg.max_new_tokens > context:
        fix = (f"lower --max_new_tokens to at most {context - prompt}" if prompt < context
               else "choose a model with a longer context")
        raise SystemExit(f"--max_new_tokens {cfg.max_new_tokens}: the longest prompt of "
                         f"{cfg.workflow} on {cfg.task} takes {prompt} tokens, and model "
                         f"{cfg.model} reads {context}; {fix}")


def actors_and_critics(model, cfg: Config) -> tuple[list[str], dict]:
    """The adapters RL trains and, with --algo maac, the critics (adapter and value head)."""
    names = setup_adapters(model, ROLES[cfg.workflow], cfg.sharing)
    if cfg.algo != "maac":
        return names, {}
    agents = slots(cfg.workflow, cfg.n_agents)
    keys = {critic_key(s, role_of(s), cfg.critic, cfg.critic_per) for s in agents}
    # The critics' initial weights are drawn aside from the random numbers the run draws next,
    # so an actor-critic run warms up and samples as the GRPO run of its seed does.
    with torch.random.fork_rng(devices=gpu_rngs(model.device)):
        return names, setup_critics(model, sorted(keys))


def make_anchors(model, cfg: Config, names: list[str]) -> None:
    """A frozen copy of each adapter as it stands now, where grpo.reference_of names one."""
    for name in names:
        if ref := reference_of(cfg, name):
            freeze_copy(model, name, ref)


def make_optimizers(model, cfg: Config, names: list[str], heads) -> tuple[dict, dict]:
    """AdamW and the warmup-cosine schedule for every adapter and critic."""
    optimizers, schedulers = {}, {}
    for name in names + list(heads):
        params = adapter_parameters(model, name) + (list(heads[name].parameters()) if name in heads
                                                    else [])
        for p in params:
            p.requires_grad_(True)
            p.grad = torch.zeros_like(p)  # kept: flat_grad and sum_gradients read every one
        lr = cfg.critic_lr if name in heads else cfg.lr
        optimizers[name] = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
        schedulers[name] = torch.optim.lr_scheduler.LambdaLR(
            optimizers[name], partial(lr_factor, warmup=cfg.warmup_steps, total=cfg.steps,
                                      floor=cfg.lr_floor))
    return optimizers, schedulers


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup, then cosine decay to `floor` (1: constant); `step` = training steps taken."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min((step - warmup) / max(1, total - warmup), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------
# One RL step (the algorithm box)


def rl_step(step: int, state: TrainState, tok, cfg: Config, train_set: list,
            procs) -> tuple[dict, tuple]:
    """Steps 1-7 above; returns the metrics row and the episodes for the logs."""
    t0 = time.time()
    # 1-3. problems, rollout, rewards
    picked = state.rng.sample(range(len(train_set)), cfg.problems_per_step)
    problem_of = [picked[i] for i in procs.block(len(picked)) for _ in range(cfg.group_size)]
    rollout, outcomes, rewards = run_episodes(state.model, tok, cfg,
                                              [train_set[i] for i in problem_of],
                                              greedy=False, label=f"step {step} rollout")
    calls, outcomes, rewards, problem_of = procs.episodes(rollout.calls, outcomes, rewards,
                                                          problem_of)
    t1 = time.time()
    # 4. advantages: group-relative (GRPO) or from the critics (GAE)
    if cfg.algo == "grpo":
        set_advantages(calls, problem_of, cfg.adv_group)
    else:
        critic_batch = critic_advantages(state.model, tok, state.heads, calls, cfg, procs)
    if cfg.truncated == "mask":  # a cut call keeps its place in its group's baseline, not its grad
        for c in calls:
            c.advantage = 0.0 if c.truncated else c.advantage
    advs = torch.tensor([c.advantage for c in calls])  # (calls,)
    # 5-6. old log-probs and the update, adapter by adapter (the diagnostics' pass first, when due)
    names = [n for n in state.optimizers if n not in state.heads]  # the adapters RL trains
    lr = state.optimizers[names[0]].param_groups[0]["lr"]  # the rate this step trains at
    diag = cfg.diag_every > 0 and step % cfg.diag_every == 0
    stats = update_adapters(state, tok, cfg, step, calls, names, diag, procs)
    # 7. maac: the critics, and their schedules (their adapters are not the actors': any order)
    if cfg.algo == "maac":
        stats.update(update_critics(state, critic_batch, tok.pad_token_id, cfg, procs))
        for name in state.heads:
            state.schedulers[name].step()
        if skipped := stats["critic/skipped_nonfinite"][0]:
            log(f"step {step} critics | {skipped} mini-batch(es) not applied: loss or gradient "
                "not finite")
    stats = procs.stats(stats)
    # the step's metrics
    row = {"step": step, **step_metrics(calls, rewards, outcomes, cfg.n_agents),
           "adv/zero_frac": (advs == 0).sum().item() / len(advs),
           "adv/std": advs.std(correction=0).item(), "lr": lr,
           "contract/truncated_prompts": sum(procs.gather([rollout.prompts_cut])),
           "time/rollout": t1 - t0, "time/update": time.time() - t1, **update_means(stats)}
    if cfg.algo == "maac":
        row.update(critic_metrics(calls, critic_batch))
    episodes = (calls, outcomes, [train_set[i] for i in problem_of], rewards)
    return without_repeats(row, cfg), episodes


def run_episodes(model, tok, cfg: Config, problems, greedy: bool,
                 label: str = "rollout") -> tuple[Rollout, list, list[float]]:
    """Run the workflow once per problem; each finished stage is logged after `label`."""
    rollout = Rollout(model, tok, cfg.sharing, max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.temperature, top_p=cfg.top_p, greedy=greedy,
                      progress=lambda message: log(f"{label} | {message}"))
    outcomes = run_workflow(cfg.workflow, [p.question for p in problems], rollout,
                            kind=problems[0].kind, n_agents=cfg.n_agents,
                            max_rounds=cfg.max_rounds)
    rewards = score_batch(problems, [o.final for o in outcomes], strict=cfg.strict_answer,
                          workers=cfg.code_workers, timeout=cfg.code_timeout)
    if cfg.truncated != "keep":  # an unfinished final answer is no answer, here and in evaluation
        cut = cut_finals(rollout.calls, [o.final for o in outcomes])
        rewards = [0.0 if c else r for r, c in zip(rewards, cut)]
    credit_calls(rollout.calls, problems, rewards, cfg.credit, cfg.truncated, cfg.strict_answer)
    return rollout, outcomes, rewards


def update_adapters(state: TrainState, tok, cfg: Config, step: int, calls: list[Call],
                    names: list[str], diag: bool, procs) -> dict[str, list[float]]:
    """Steps 5-6 for each adapter: the diagnostics' pass when due, its update, its schedule."""
    stats, kl = defaultdict(list), kl_coefs(cfg)
    for name in names:
        t_name = time.time()
        own = [c for c in calls if adapter_for(c.role, cfg.sharing) == name]
        live = [c for c in own if has_signal(c, kl)]
        if diag:
            for k, v in gradient_signals(state.model, name, own, tok.pad_token_id, cfg,
                                         procs).items():
                stats[k] += v
            stats[f"time/diag/{name}"].append(time.time() - t_name)
        for k, v in policy_update(state, name, own, tok.pad_token_id, cfg, procs).items():
            stats[k] += v
        state.schedulers[name].step()
        skipped = stats[f"adapter/{name}/skipped_nonfinite"][0]
        log(f"step {step} update | {name}: {len(live)} of {len(own)} calls with signal, "
            f"{time.time() - t_name:.0f}s" + (f", {skipped} mini-batch(es) not applied: loss or "
                                               "gradient not finite" if skipped else ""))
    return stats


def without_repeats(m: dict[str, float], cfg: Config) -> dict[str, float]:
    """The step's metrics less those that repeat another key (a lone slot's) or cannot move in
    this run (the ratio's under --one_step, the critics' clip_frac with --critic_steps 1)."""
    roles = [role_of(s) for s in slots(cfg.workflow, cfg.n_agents)]
    lone = tuple(f"slot/{s}/" for s in slots(cfg.workflow, cfg.n_agents)
                 if roles.count(role_of(s)) == 1)
    # grpo.policy_loss's ratio statistics, constant where every ratio is 1
    fixed = ("clip_frac", "approx_kl", "ratio_mean", "chi2") if cfg.one_step else ()
    still = ("critic/clip_frac",) if cfg.critic_steps == 1 else ()  # values yet to move: 0
    return {k: v for k, v in m.items() if not k.startswith(lone) and k not in still
            and not (k.startswith(("role/", "slot/")) and k.rsplit("/", 1)[-1] in fixed)}


def update_means(stats: dict[str, list[float]]) -> dict[str, float]:
    """The mean of each statistic; time/old_logp and time/diag sum the adapters' passes."""
    m = {k: sum(v) / len(v) for k, v in stats.items()}
    for part in ("old_logp", "diag"):
        if any(k.startswith(f"time/{part}/") for k in m):
            m[f"time/{part}"] = sum(v for k, v in m.items() if k.startswith(f"time/{part}/"))
    return m


# ----------------------------------------------------------------------------
# Evaluation on held-out problems


def eval_batch_here(model, tok, cfg: Config, problems, episodes: int) -> int:
    """EVAL_BATCH on a CPU (the fixed-seed recordings'); on a GPU as many as fit (lab/machine.py)
    of the widest stage: n_agents rows quoting two replies each, or one quoting n_agents + 1."""
    if model.device.type != "cuda":
        return EVAL_BATCH
    P, N, T = longest_prompt(tok, cfg, problems), cfg.n_agents, cfg.max_new_tokens
    return fitting_batch(model, max(N * (P + 3 * T), P + (N + 2) * T),
                         cfg.problems_per_step * cfg.group_size, episodes)


def evaluate(model, tok, cfg: Config, problems, prefix: str = "eval") -> dict[str, float]:
    """Accuracy of the workflow on held-out problems (eval/: test split, with what changed besides
    the answers, docs/runs.md; val/: where a peak is chosen). Greedy unless --eval_sampling, on a
    random state of its own so that an evaluation never moves the training's."""
    sample = evaluation_samples(cfg)
    repeats = cfg.eval_samples if sample else 1
    # under torchrun, a block
    local = [p for i in block(len(problems)) for p in [problems[i]] * repeats]
    seen = defaultdict(list)
    with torch.random.fork_rng(devices=gpu_rngs(model.device)):
        torch.manual_seed(cfg.seed + 7919)
        size = eval_batch_here(model, tok, cfg, problems, len(local))
        for i in range(0, len(local), size):
            label = f"{prefix} problems {i + 1}-{min(i + size, len(local))}/{len(local)}"
            rollout, outcomes, r = run_episodes(model, tok, cfg, local[i:i + size],
                                                greedy=not sample, label=label)
            seen["reward"] += r
            seen["boxed"] += [bool(boxed_contents(o.final)) for o in outcomes]
            first = {}  # episode -> the own score of its first solving call
            for c in rollout.calls:
                if c.own_score is not None:
                    first.setdefault(c.episode, c.own_score)
                if c.role in SOLVERS:
                    seen["len"].append(len(c.completion_ids))
                seen["truncated"].append(c.truncated)
                seen[f"{c.role}/adherence"].append(adherence(c.role, c.text, cfg.n_agents))
            seen["first_answer"] += list(first.values())
    parts = gather_lists([dict(seen)])  # one gather: every process's lists, in rank order
    seen = {k: [x for part in parts for x in part.get(k, [])]
            for k in sorted({k for part in parts for k in part})}
    per_problem = [sum(seen["reward"][i:i + repeats]) / repeats
                   for i in range(0, len(seen["reward"]), repeats)]
    mean = sum(per_problem) / len(per_problem)
    m = {f"{prefix}/accuracy": mean,
         f"{prefix}/accuracy_se": (sum((x - mean) ** 2 for x in per_problem)
                                   / max(1, len(per_problem) - 1) / len(per_problem)) ** 0.5}
    if prefix == "eval":
        m.update({f"eval/{k}": sum(v) / len(v) for k, v in seen.items()
                  if k != "reward" and v and None not in v})
    return m


def evaluations(model, tok, cfg: Config, held_out: dict[str, list]) -> dict[str, float]:
    """One evaluation point: the test split (eval/...) and, with --val_problems, val/...."""
    return {k: v for prefix, problems in held_out.items()
            for k, v in evaluate(model, tok, cfg, problems, prefix).items()}


# ----------------------------------------------------------------------------
# Step 0: a supervised warm-up on contract-keeping replies (warmup.py), or another run's step 0


def warm_up(model, tok, cfg: Config, train_set, names: list[str]) -> dict[str, float]:
    """One sampled rollout on B x G distinct training problems gives the prompts and the
    verifier's labels, then --sft_warmup supervised steps. Returns the step-0 metrics."""
    rng = random.Random(cfg.seed + 1)  # its own problems: RL draws the same ones as without warm-up
    # at least a mini-batch's worth
    n = max(cfg.problems_per_step * cfg.group_size, cfg.minibatch_size)
    picked = rng.sample(range(len(train_set)), min(len(train_set), n))
    local = [picked[i] for i in block(len(picked))]
    rollout, outcomes, rewards = run_episodes(model, tok, cfg, [train_set[i] for i in local],
                                              greedy=False, label="warm-up rollout")
    calls, outcomes, rewards, problem_of = gather_episodes(rollout.calls, outcomes, rewards, local)
    before = step_metrics(calls, rewards, outcomes, cfg.n_agents)
    m = {f"sft/adherence/{k.split('/')[1]}": v for k, v in before.items()
         if k.endswith("/adherence")}
    score = partial(score_batch, strict=cfg.strict_answer, workers=cfg.code_workers,
                    timeout=cfg.code_timeout)
    pairs = contract_replies(calls, [train_set[i] for i in problem_of], score, cfg.n_agents, rng,
                             warmup_roles(cfg))
    if not pairs:  # no solution the verifier accepts and no judging role: nothing to teach
        log(f"warm-up | no reply of {', '.join(warmup_roles(cfg))} to learn from; RL starts from "
            "the base model")
        return m
    for c in pairs:
        c.completion_ids = tok(c.text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    losses = supervised_steps(model, pairs, names, cfg, rng, tok.pad_token_id, log, PROCESSES)
    return {**m, "sft/loss/first": losses[0], "sft/loss/last": losses[-1]} if losses else m


def step_zero(state: TrainState, tok, cfg: Config, train_set: list, held_out: dict,
              run: Run) -> dict:
    """Another run's step 0 (--start_from), or the warm-up and first evaluation; the KL anchors."""
    names = [n for n in state.optimizers if n not in state.heads]
    if cfg.start_from:
        first = state.load_start(cfg.start_from, cfg.sharing, run.start_config)
    else:
        first = warm_up(state.model, tok, cfg, train_set, names) if cfg.sft_warmup else {}
    make_anchors(state.model, cfg, names)
    if cfg.start_from:
        best = read_best(cfg.start_from)  # a best checkpoint says where it was chosen
        kept = (f", its best checkpoint (step {best['step']}, {best['metric']} "
                f"{best['score']:.3f})" if best else ", its step 0")
        log(f"step 0/{cfg.steps} | eval/accuracy {first['eval/accuracy']:.3f} | the start of "
            f"{cfg.start_from}{kept}")
        return first
    log(f"evaluating on {' and '.join(f'{len(v)} {k}' for k, v in held_out.items())} "
        "held-out problems ...")
    t_eval = time.time()
    scores = evaluations(state.model, tok, cfg, held_out)
    seconds = time.time() - t_eval
    log(f"step 0/{cfg.steps} | eval/accuracy {scores['eval/accuracy']:.3f} | {seconds:.0f}s | "
        f"the whole run: about {estimate_minutes(cfg, seconds, [], 0):.0f} min")
    return {"step": 0, **scores, **first, "time/eval": seconds}


# ----------------------------------------------------------------------------
# Main: the settings, step 0, then the training loop


def main(cfg: Config, typed: set[str] | None = None) -> dict:
    """Train; `typed`: the flags given on the command line (None: those off their defaults)."""
    run = Run(cfg, typed)  # lab/run.py: the settings checked, the processes, threads, problems
    cfg, train_set, held_out = run.cfg, run.train_set, run.held_out  # a resumed run's settings
    check_algorithm_settings(cfg)
    torch.manual_seed(cfg.seed)  # the same adapters in every process
    rng = random.Random(cfg.seed)  # the same problems and mini-batches in every process
    # ---- the model, the adapters and critics with their optimizers
    run.open()  # the run's directory locked, its plan logged
    model, tok = load_model(cfg, run.device)
    check_context(model, tok, cfg, train_set + [p for ps in held_out.values() for p in ps])
    run.write_config()
    names, heads = actors_and_critics(model, cfg)
    optimizers, schedulers = make_optimizers(model, cfg, names, heads)
    state = TrainState(model, heads, optimizers, schedulers, rng, emas={name: {} for name in names},
                       run_id=run.run_id)
    if run.world > 1:
        torch.manual_seed(cfg.seed + 1000 * run.rank)  # each process samples its own episodes
    # ---- step 0: a resumed run's checkpoint, or a new run's start and its first evaluation
    if cfg.resume:
        make_anchors(model, cfg, names)  # the checkpoint fills them in
        run.resume(state)
    else:
        run.begin(state, step_zero(state, tok, cfg, train_set, held_out, run))
    # ---- the training loop
    for step in run.steps():
        row, episodes = rl_step(step, state, tok, cfg, train_set, run.procs)
        if run.evaluate_due(step):
            t_eval = time.time()
            row.update(evaluations(model, tok, cfg, held_out))
            row["time/eval"] = time.time() - t_eval
        run.log(row, episodes)
        run.save(state, row)  # newest and best; stops the run after a signal
    return run.close()


if __name__ == "__main__":
    catch_stop_signals()  # Ctrl-C and SIGTERM stop the run after its current step (lab/machine.py)
    run_main(lambda: main(parse_config(), typed=typed_flags(sys.argv[1:])))
