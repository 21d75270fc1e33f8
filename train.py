"""Train an LLM workflow end to end with multi-agent GRPO or actor-critic.

    python train.py                                   # Eval-Opt, shared adapter, embedded model
    python train.py --workflow voting --sharing isolated --steps 20
    python train.py --algo maac --critic central      # actor-critic (critic.py)
    python train.py --model tiny --steps 2 --out runs/smoke

One training step (Paper A, Zeng et al. 2026, arXiv 2605.24202, Sec. 3):
  1. sample B problems, repeat each G times: B*G episodes;
  2. run the workflow on every episode (workflows.py); each stage is one
     batched generation under its role's adapter (rollout.py), every call recorded;
  3. score the final answers and decide each call's reward (reward.credit_calls):
     the episode's outcome broadcast to all of its calls (--credit own: each call's
     own part; --truncated: what a call cut by the length limit earns);
  4. group-relative advantages per (problem, slot, stage) (grpo.py),
     or with --algo maac the critics' values and GAE (critic.py);
  5. old log-probs: the first mini-batch's own, a separate pass for the later ones;
     every --diag_every steps first the diagnostics' pass, which measures each slot's
     gradient and moves nothing (measure.py);
  6. update, adapter by adapter (one shared adapter, or one per role type): one
     optimizer step over all of its calls with a gradient (--one_step, the default);
     with --no-one_step, as in the paper, one step per mini-batch of a fixed size,
     so under --sharing isolated a role with three slots takes three times the steps;
     --balance, --damping and --role_kl are Paper A's mitigations (docs/mechanisms.md);
  7. maac only: one pass of each critic over its inputs (value loss);
  8. log; evaluate the whole workflow on held-out problems (test, and val where a
     peak is chosen) every `eval_every` steps; checkpoint.
Before step 1, step 0: a supervised warm-up (--sft_warmup) teaches every role its
contract, and the first evaluation.

Several processes (`torchrun --nproc_per_node N train.py ...`, docs/torchrun.md):
each process rolls out its block of the step's B problems, every process then
holds all the episodes, and each mini-batch's forward and backward passes are
split between the processes, whose gradients are summed before the step: every
process takes the step one process would take. Only rank 0 writes the run's files.
The flags (`Config`, `--help-all`) are lab/settings.py's; what comes before step 0 (the
settings checked, problems, model, optimizers) and the clock lab/launch.py's, the training state
and its checkpoints lab/checkpoint.py's, the run on disk lab/runs.py's, the machine (processes,
threads, signals) lab/machine.py's.

Departures from the paper (docs/departures.md): the defaults fit a 2-core CPU (an hour on
one without bf16, the README; a 135M model, 10 steps of 8 x 4 episodes, 48 new tokens, rank 16,
a learning rate of 5e-4 instead of 2e-5), and one optimizer step per adapter and step, where
the ratio is 1 and the clip never acts: an on-policy policy gradient with GRPO's baseline.
"""
import random
import sys
import time
import warnings
from collections import defaultdict
from functools import partial

import torch
from tqdm import tqdm

from critic import CriticSettings, critic_advantages, critic_metrics, update_critics
from grpo import UpdateSettings, is_live, policy_update, set_advantages
from lab.checkpoint import TrainState
from lab.launch import (NEW_LR, actors_and_critics, check_settings, estimate_minutes,
                        evaluation_samples, is_eval_step, launch, load_problems, make_optimizers,
                        resume_run, step_line, typed_flags)
# lab/: the run's plumbing. Under torchrun `block` splits the problems between the processes and
# the gather_* calls join what each did; in one process `block` is every problem and a gather
# hands back what it is given.
from lab.machine import (PROCESSES, block, catch_stop_signals, gather_episodes, gather_lists,
                         gather_stats, gpu_rngs, join_processes, log, peak_memory_mb,
                         pick_threads, pick_threads_again, rank_and_world, release_free_memory,
                         run_main, stop_requested)
from lab.runs import (NONFINITE_STOP, episode_samples, leave_processes, start_logs, stop_run,
                      write_step)
from lab.settings import Config, parse_config, warmup_roles
from lora import adapter_for, freeze_copy
from measure import gradient_signals, step_metrics
from reward import credit_calls, cut_finals, score_batch
from rollout import Call, Rollout
from warmup import contract_replies, supervised_steps
from workflows import SOLVERS, adherence, boxed_contents, role_of, run_workflow, slots

# A step in which no call of an adapter has a learning signal takes no optimizer step, and its
# schedule moves on all the same: torch's warning about that order says nothing here.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
EVAL_BATCH = 32  # held-out problems an evaluation rolls out at once


# ----------------------------------------------------------------------------
# Pieces of one step


def rollout_step(model, tok, cfg: Config, problems, greedy: bool,
                 label: str = "rollout") -> tuple[Rollout, list, list[float]]:
    """Run the workflow once per problem; return the recorder, outcomes and rewards.
    Each finished stage is logged, prefixed by `label`."""
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


def evaluate(model, tok, cfg: Config, problems, prefix: str = "eval") -> dict[str, float]:
    """Accuracy of the whole workflow on held-out problems (eval/: the test split; val/: the
    validation split, where a peak or a checkpoint is chosen), and on the test split what changed
    besides the answers (docs/runs.md). Greedy, except where --eval_sampling samples (Voting: greedy
    generators would give one answer three times), each problem --eval_samples times. Sampling
    draws from a generator of its own, so an evaluation never moves the training's."""
    sample = evaluation_samples(cfg)
    repeats = cfg.eval_samples if sample else 1
    # under torchrun, a block
    mine = [p for i in block(len(problems)) for p in [problems[i]] * repeats]
    seen = defaultdict(list)
    with torch.random.fork_rng(devices=gpu_rngs(model.device)):
        torch.manual_seed(cfg.seed + 7919)
        for i in range(0, len(mine), EVAL_BATCH):
            label = f"{prefix} problems {i + 1}-{min(i + EVAL_BATCH, len(mine))}/{len(mine)}"
            rollout, outcomes, r = rollout_step(model, tok, cfg, mine[i:i + EVAL_BATCH],
                                                greedy=not sample, label=label)
            seen["reward"] += r
            seen["boxed"] += [bool(boxed_contents(o.final)) for o in outcomes]
            # episode -> the score of its first solving call's own answer (calls come stage by
            # stage)
            first = {}
            for c in rollout.calls:
                if c.solved is not None:
                    first.setdefault(c.episode, c.solved)
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
    """One evaluation point: the test split (eval/...) and, where --val_problems, the val split
    (val/...)."""
    return {k: v for prefix, problems in held_out.items()
            for k, v in evaluate(model, tok, cfg, problems, prefix).items()}


def update_adapters(state: TrainState, tok, cfg: Config, step: int, calls: list[Call],
                    names: list[str], update: UpdateSettings, diag: bool) -> dict[str, list[float]]:
    """Steps 5-6 of a training step for each adapter RL trains: with `diag`, the signals of its
    gradient before it moves (measure.gradient_signals); its calls' old log-probs and its update
    (grpo.policy_update), then its learning-rate schedule; returns the statistics, a list each
    (update_means)."""
    stats = defaultdict(list)
    for name in names:
        t_name = time.time()
        mine = [c for c in calls if adapter_for(c.role, cfg.sharing) == name]
        live = [c for c in mine if is_live(c, update)]
        if diag:
            for k, v in gradient_signals(state.model, name, mine, tok.pad_token_id, update,
                                         PROCESSES).items():
                stats[k] += v
            stats[f"time/diag/{name}"].append(time.time() - t_name)
        for k, v in policy_update(state.model, name, mine, state.optimizers[name], state.rng,
                                  tok.pad_token_id, update, state.emas[name], PROCESSES).items():
            stats[k] += v
        state.schedulers[name].step()
        skipped = stats[f"adapter/{name}/skipped_nonfinite"][0]
        log(f"step {step} update | {name}: {len(live)} of {len(mine)} calls with signal, "
            f"{time.time() - t_name:.0f}s" + (f", {skipped} mini-batch(es) not applied: loss or "
                                               "gradient not finite" if skipped else ""))
    return stats


def train_critics(state: TrainState, tok, step: int, critic_batch,
                  critics: CriticSettings) -> dict[str, list[float]]:
    """Step 7 (maac): one pass of each critic over its inputs (critic.update_critics), then its
    learning-rate schedule; the critics' adapters are separate from the actors', so the order is
    free."""
    stats = update_critics(state.model, state.heads, critic_batch, state.optimizers, state.rng,
                           tok.pad_token_id, critics, PROCESSES)
    for name in state.heads:
        state.schedulers[name].step()
    if stats["critic/skipped_nonfinite"][0]:
        log(f"step {step} critics | {stats['critic/skipped_nonfinite'][0]} mini-batch(es) not "
            "applied: loss or gradient not finite")
    return stats


def written(m: dict[str, float], cfg: Config) -> dict[str, float]:
    """The step's metrics less those that repeat another key or cannot move in this run: the slot/
    keys of a role with one slot (Eval-Opt's slots are its roles: its role/ keys hold the same
    numbers); under --one_step, where every ratio is 1, the policy ratio's statistics; and with
    one critic step (--critic_steps 1), whose values are still the rollout's, the critics'
    clip_frac."""
    # each slot's role, e.g. voting: generator x 3, aggregator
    roles = [role_of(s) for s in slots(cfg.workflow, cfg.n_agents)]
    lone = tuple(f"slot/{s}/" for s, r in zip(slots(cfg.workflow, cfg.n_agents), roles)
                 if roles.count(r) == 1)
    # grpo.policy_loss's ratio statistics, constant where every ratio is 1
    fixed = ("clip_frac", "approx_kl", "ratio_mean", "chi2") if cfg.one_step else ()
    still = ("critic/clip_frac",) if cfg.critic_steps == 1 else ()  # values yet to move: 0
    return {k: v for k, v in m.items() if not k.startswith(lone) and k not in still
            and not (k.startswith(("role/", "slot/")) and k.rsplit("/", 1)[-1] in fixed)}


def update_means(stats: dict[str, list[float]]) -> dict[str, float]:
    """The update's statistics, each the plain mean of its entries (one per micro-batch for a
    role's or slot's loss figures, one per mini-batch for grad_norm, one per adapter for the
    counters and clocks); time/old_logp and, on a step with diagnostics, time/diag, parts of
    time/update, sum the adapters' passes."""
    m = {k: sum(v) / len(v) for k, v in stats.items()}
    for part in ("old_logp", "diag"):
        if any(k.startswith(f"time/{part}/") for k in m):
            m[f"time/{part}"] = sum(v for k, v in m.items() if k.startswith(f"time/{part}/"))
    return m


# ----------------------------------------------------------------------------
# Step 0: a resumed run's checkpoint, another run's step 0 (--start_from), or the supervised
# warm-up (--sft_warmup: every role learns replies that keep its contract, warmup.contract_replies,
# so that RL has a contract to keep or to lose) and the first evaluation


def warm_up(model, tok, cfg: Config, train_set, names: list[str]) -> dict[str, float]:
    """--sft_warmup steps of supervised learning on contract-keeping replies, before RL.

    One sampled rollout of the workflow on B x G distinct training problems (at least
    --minibatch_size of them) gives the prompts and the verifier's labels; each warm-up step
    draws a mini-batch of the replies and takes one AdamW step per adapter on their negative
    log-likelihood (warmup.supervised_steps, learning rate --sft_lr). Returns the step-0 metrics:
    the loss of the first and last step, and each role's adherence in the rollout (before)."""
    rng = random.Random(cfg.seed + 1)  # its own problems: RL draws the same ones as without warm-up
    # at least a mini-batch's worth
    n = max(cfg.problems_per_step * cfg.group_size, cfg.minibatch_size)
    picked = rng.sample(range(len(train_set)), min(len(train_set), n))
    mine = [picked[i] for i in block(len(picked))]
    rollout, outcomes, rewards = rollout_step(model, tok, cfg, [train_set[i] for i in mine],
                                              greedy=False, label="warm-up rollout")
    calls, outcomes, rewards, problem_of = gather_episodes(rollout.calls, outcomes, rewards, mine)
    score = partial(score_batch, strict=cfg.strict_answer, workers=cfg.code_workers,
                    timeout=cfg.code_timeout)
    pairs = contract_replies(calls, [train_set[i] for i in problem_of], score, cfg.n_agents, rng,
                             warmup_roles(cfg))
    before = step_metrics(calls, rewards, outcomes, cfg.n_agents, diag=True)
    m = {f"sft/adherence/{k.split('/')[1]}": v for k, v in before.items()
         if k.endswith("/adherence")}
    if not pairs:  # no solution the verifier accepts and no judging role: nothing to teach
        log(f"warm-up | no reply of {', '.join(warmup_roles(cfg))} to learn from; RL starts from "
            "the base model")
        return m
    for c in pairs:
        c.completion_ids = tok(c.text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    losses = supervised_steps(model, pairs, names, cfg.sharing, cfg.sft_warmup, cfg.minibatch_size,
                              cfg.sft_lr, rng, tok.pad_token_id, cfg.micro_batch_tokens,
                              cfg.grad_clip, log, PROCESSES)
    return {**m, "sft/loss/first": losses[0], "sft/loss/last": losses[-1]} if losses else m


def begin(state: TrainState, tok, cfg: Config, train_set, held_out: dict, names: list[str],
          start_config: dict | None, references: dict[str, str]) -> tuple[int, dict, dict]:
    """Step 0. A resumed run goes on from its newest checkpoint. A new run takes another run's
    step 0 (--start_from), or warms up (--sft_warmup) and evaluates before training, and saves
    it: a run stopped after step 0 resumes without its warm-up, and others can start from it.
    The KL anchors (`references`) are frozen copies of the policy RL starts from. Returns the
    step to go on from and the metrics rows of the first and of the last evaluation."""
    if cfg.resume:  # the checkpoint fills the anchors in
        start, first, last = resume_run(cfg.out, state, references,
                                        {k: getattr(cfg, k) for k in NEW_LR}, cfg.steps)
        log(f"resuming {cfg.out} at step {start}")
        return start, first, last
    if cfg.start_from:
        first = state.load_start(cfg.start_from, cfg.sharing, start_config)
    else:
        first = warm_up(state.model, tok, cfg, train_set, names) if cfg.sft_warmup else {}
    for name, ref in references.items():
        freeze_copy(state.model, name, ref)
    if cfg.start_from:
        log(f"step 0/{cfg.steps} | eval/accuracy {first['eval/accuracy']:.3f} | the start of "
            f"{cfg.start_from}")
    else:
        log(f"evaluating on {' and '.join(f'{len(v)} {k}' for k, v in held_out.items())} "
            "held-out problems ...")
        t_eval = time.time()
        scores = evaluations(state.model, tok, cfg, held_out)
        eval_seconds = time.time() - t_eval
        log(f"step 0/{cfg.steps} | eval/accuracy {scores['eval/accuracy']:.3f} | "
            f"{eval_seconds:.0f}s | the whole run: about "
            f"{estimate_minutes(cfg, eval_seconds, [], 0):.0f} min")
        first = {"step": 0, **scores, **first, "time/eval": eval_seconds}
    start_logs(cfg.out, first)
    # the best first: a run stopped between the two has no checkpoint to resume and starts over,
    # where the other order would resume without step 0's best
    state.keep_best(cfg.out, first)
    state.save(cfg.out, 0)
    return 0, first, first


# ----------------------------------------------------------------------------
# Main: the settings, step 0, then the training loop (steps 1-8 of the docstring)


def main(cfg: Config, typed: set[str] | None = None) -> dict:
    """Train; `typed`: the flags given on the command line (None: those that differ from their
    defaults), which --resume checks against the run."""
    # ---- settings: everything is checked before a file or the model is touched
    cfg, update, critics, start_config = check_settings(cfg, typed)
    device = join_processes(cfg.device)
    rank, world = rank_and_world()
    torch.set_num_threads(pick_threads(cfg.threads, own_load=0.0))
    torch.manual_seed(cfg.seed)  # the same adapters in every process
    rng = random.Random(cfg.seed)  # the same problems and mini-batches in every process
    # ---- data, model, run directory, adapters, optimizers
    train_set, held_out = load_problems(cfg, world)
    model, tok = launch(cfg, device, rank, train_set + [p for ps in held_out.values() for p in ps])
    names, heads = actors_and_critics(model, cfg)
    optimizers, schedulers = make_optimizers(model, cfg, names, heads)
    state = TrainState(model, heads, optimizers, schedulers, rng, emas={name: {} for name in names})
    if world > 1:
        torch.manual_seed(cfg.seed + 1000 * rank)  # each process samples its own episodes
    # ---- step 0: a resumed run's checkpoint, or a new run's start and its first evaluation
    start, first, last = begin(state, tok, cfg, train_set, held_out, names, start_config,
                               update.reference)

    step_seconds = []  # training time of each step, evaluation excluded: for the estimate
    cpu_before = time.process_time()
    # the last checkpoint's step; steps in a row with a mini-batch not applied
    saved, nonfinite = start, 0
    if start < cfg.steps and (stop := stop_requested()):  # Ctrl-C or SIGTERM before the first step
        stop_run(cfg.out, start, saved, stop)
    for step in tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps,
                     desc="train", file=sys.stderr, disable=None if rank == 0 else True):
        t0 = time.time()
        # 1-3. problems, rollout, rewards (under torchrun: this process's block of the problems,
        # then everyone's episodes)
        picked = rng.sample(range(len(train_set)), cfg.problems_per_step)
        problem_of = [picked[i] for i in block(len(picked)) for _ in range(cfg.group_size)]
        rollout, outcomes, rewards = rollout_step(model, tok, cfg,
                                                  [train_set[i] for i in problem_of],
                                                  greedy=False, label=f"step {step} rollout")
        calls, outcomes, rewards, problem_of = gather_episodes(rollout.calls, outcomes, rewards,
                                                               problem_of)
        t1 = time.time()
        # 4. advantages: group-relative (GRPO) or from the critics (GAE)
        if cfg.algo == "grpo":
            set_advantages(calls, problem_of, cfg.adv_group)
        else:
            critic_batch = critic_advantages(model, tok, heads, calls, critics, PROCESSES)
        # a cut call keeps its place in its group's baseline, not its gradient
        if cfg.truncated == "mask":
            for c in calls:
                c.advantage = 0.0 if c.truncated else c.advantage
        advs = torch.tensor([c.advantage for c in calls])  # (calls,)
        # 5-7. old log-probs and the update, adapter by adapter; maac: then the critics
        diag = cfg.diag_every > 0 and step % cfg.diag_every == 0
        lr = optimizers[names[0]].param_groups[0]["lr"]  # the rate this step trains at
        stats = update_adapters(state, tok, cfg, step, calls, names, update, diag)
        if cfg.algo == "maac":
            stats.update(train_critics(state, tok, step, critic_batch, critics))
        stats = gather_stats(stats)
        # what the backward pass freed, before the evaluation and the next rollout
        release_free_memory()
        # 8. logs, evaluation, checkpoint
        m = {"step": step, **step_metrics(calls, rewards, outcomes, cfg.n_agents, diag),
             "adv/zero_frac": (advs == 0).sum().item() / len(advs),
             "adv/std": advs.std(correction=0).item(),
             "lr": lr,
             "contract/truncated_prompts": sum(gather_lists([rollout.prompts_cut])),
             "time/rollout": t1 - t0, "time/update": time.time() - t1, **update_means(stats)}
        if cfg.algo == "maac":
            m.update(critic_metrics(calls, critic_batch))
        step_seconds.append(time.time() - t0)
        if is_eval_step(cfg, step):
            t_eval = time.time()
            m.update(evaluations(model, tok, cfg, held_out))
            m["time/eval"] = time.time() - t_eval
            state.keep_best(cfg.out, m)  # out/best: the peak so far
            last = m
        m["time/step"] = time.time() - t0
        m["mem/peak_mb"] = max(gather_lists([peak_memory_mb(device)]))  # the largest process's
        problems = [train_set[i] for i in problem_of]
        write_step(cfg.out, written(m, cfg),
                   episode_samples(step, calls, outcomes, problems, rewards, cfg.group_size,
                                   cfg.log_samples))
        log(step_line(cfg, m, last.get("time/eval", 0.0), step_seconds))
        # a step with a mini-batch not applied writes no checkpoint: the last one is from before
        # the trouble
        nonfinite = nonfinite + 1 if any(v for k, v in m.items()
                                         if k.endswith("skipped_nonfinite")) else 0
        stop = stop_requested() if step < cfg.steps else 0  # Ctrl-C or SIGTERM, in any process
        if not nonfinite and (step % cfg.save_every == 0 or step == cfg.steps or stop):
            state.save(cfg.out, step)
            saved = step
        if stop or nonfinite == NONFINITE_STOP:
            stop_run(cfg.out, step, saved, stop)
        cpu_before = pick_threads_again(cfg.threads, t0, cpu_before)  # for the next step

    before, after = first["eval/accuracy"], last["eval/accuracy"]
    log(f"held-out accuracy of {cfg.workflow} ({cfg.sharing}): "
        f"before {before:.3f} -> after {after:.3f}  [{len(held_out['eval'])} test problems]")
    leave_processes()
    return {"before": before, "after": after}


if __name__ == "__main__":
    catch_stop_signals()  # Ctrl-C and SIGTERM stop the run after its current step (lab/machine.py)
    run_main(lambda: main(parse_config(), typed=typed_flags(sys.argv[1:])))
