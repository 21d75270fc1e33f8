"""The supervised warm-up before RL (train.py --sft_warmup): replies that keep each role's
contract, labelled by the verifier, and the steps that teach them.

The 135M model does not keep the supervisory roles' contracts by itself: the warm-up gives RL
one to keep, or to lose. train.warm_up labels one sampled rollout with the verifier
(`contract_replies`), then takes AdamW steps on the replies' negative log-likelihood
(`supervised_steps`) on the adapters RL goes on to train.

Exercised by: pytest tests/test_train.py
"""
import dataclasses
import random
from typing import Callable

import torch

from lora import adapter_for, adapter_parameters, use_adapter
from rollout import ONE_PROCESS, Call, micro_batches, sequence_logprobs
from workflows import ROLES, SOLVERS

# (problems, texts) -> 1.0 where a text solves its problem
ScoreFn = Callable[[list, list[str]], list[float]]
# The orchestrator's warm-up plans: each episode draws its own, so a worker, shown one strategy,
# does not know the others' (what a central critic reads: Paper B in miniature, docs/learning.md).
PLANS = {"math": ["Compute it directly, one operation at a time.",
                  "Write an equation and solve it.", "Work backwards from what is asked.",
                  "Split the numbers into tens and ones.", "Count on from the larger number.",
                  "Estimate first, then compute exactly.",
                  "Check the result with the opposite operation.",
                  "Say what each number stands for first."],
         "code": ["Loop over the input and build the result.", "Use Python's built-in functions.",
                  "Split the task into small helper functions.", "Handle the edge cases first.",
                  "Write the simplest version, then check it on the examples.",
                  "Use a dictionary to count.", "Sort the input first.",
                  "Build the answer with a list comprehension."]}


def contract_replies(calls: list, problems: list, score: ScoreFn, n_agents: int, rng: random.Random,
                     roles: list[str]) -> list:
    """Copies of a rollout's calls of `roles` with a reply (text) that keeps the role's contract:
    the aggregator names a correct candidate, the evaluator gives the verifier's verdict, the
    orchestrator lists a plan, and the solvers repeat their solutions that `score` accepts."""
    solutions = {(c.episode, c.stage): [] for c in calls}  # generator outputs by episode and stage
    for c in calls:  # in slot order within each episode, as the workflow made them
        if c.role == "generator":
            solutions[c.episode, c.stage].append(c.text)
    judged = [c for c in calls if c.role in ("aggregator", "evaluator")]
    read = [solutions[c.episode, c.stage - 1] for c in judged]  # what each judge saw
    flat = [(c.episode, text) for c, texts in zip(judged, read) for text in texts]
    scores = iter(score([problems[e] for e, _ in flat], [t for _, t in flat]))
    replies = []
    for c, texts in zip(judged, read):
        right = [k for k, _ in enumerate(texts, 1) if next(scores) == 1.0]
        if c.role == "aggregator":  # any correct candidate; any candidate where none is correct
            reply = f"\\boxed{{{rng.choice(right or range(1, len(texts) + 1))}}}"
        else:
            reply = "\\boxed{Correct}" if right else "\\boxed{Incorrect}"
        replies.append(dataclasses.replace(c, text=reply))
    replies = balanced_verdicts(replies, rng)
    for c in (c for c in calls if c.role == "orchestrator"):  # a plan of its own for each episode
        pool = PLANS[problems[0].kind]
        picked = rng.sample(pool, min(n_agents, len(pool)))
        replies.append(dataclasses.replace(c, text="\n".join(f"{i}. {s}"
                                                             for i, s in enumerate(picked, 1))))
    # the solvers keep their own finished solutions that the verifier accepts (rejection sampling,
    # as in STaR, Zelikman et al. 2022): else on a shared adapter they would learn \boxed{k} too
    solvers = [c for c in calls if c.role in SOLVERS]
    accepted = score([problems[c.episode] for c in solvers], [c.text for c in solvers])
    right = {(c.episode, c.slot, c.stage): c.text for c, ok in zip(solvers, accepted)
             if ok == 1.0 and not c.truncated}
    replies += [dataclasses.replace(c) for c in solvers if (c.episode, c.slot, c.stage) in right]
    # Eval-Opt's refine of a right answer (two stages back) keeps it: else on a shared adapter the
    # refine copies the verdict it has just read, \boxed{Incorrect}, instead of a solution
    replies += [dataclasses.replace(c, text=right[c.episode, c.slot, c.stage - 2]) for c in solvers
                if c.role == "generator" and (c.episode, c.slot, c.stage) not in right
                and (c.episode, c.slot, c.stage - 2) in right]
    return [c for c in replies if c.role in roles]


def balanced_verdicts(replies: list, rng: random.Random) -> list:
    """The rarer evaluator verdict repeated until both are as many: at a reward near 0.3 the
    verifier's labels alone would teach a constant Incorrect, and a refine of every answer."""
    by = {v: [c for c in replies if c.role == "evaluator" and c.text == f"\\boxed{{{v}}}"]
          for v in ("Correct", "Incorrect")}
    rare, common = sorted(by.values(), key=len)
    if not rare:
        return replies
    return replies + [dataclasses.replace(rng.choice(rare)) for _ in range(len(common) - len(rare))]


def warmup_roles(cfg) -> list[str]:
    """The workflow's roles in cfg.sft_roles (another workflow's passed over); a ValueError names
    an unknown, blank or repeated one."""
    roles = [r.strip() for r in cfg.sft_roles.split(",")]
    if "" in roles or len(set(roles)) < len(roles):
        raise ValueError(f"--sft_roles {cfg.sft_roles!r}: give distinct role names separated by "
                         "commas, e.g. generator,evaluator")
    known = {r for rs in ROLES.values() for r in rs}
    if unknown := [r for r in roles if r not in known]:
        raise ValueError(f"--sft_roles: {unknown[0]!r} is not a role "
                         f"(roles: {', '.join(sorted(known))})")
    taught = [r for r in roles if r in ROLES[cfg.workflow]]
    if cfg.sft_warmup and not taught:
        raise ValueError(f"--sft_roles: no role of {cfg.workflow} "
                         f"({', '.join(ROLES[cfg.workflow])}) to warm up")
    return taught


# ----------------------------------------------------------------------------
# Supervised steps: the same adapters, before RL, on replies given as the calls' completions


def supervised_steps(model, calls: list[Call], adapters: list[str], cfg, rng: random.Random,
                     pad_id: int, log=print, procs=ONE_PROCESS) -> list[float]:
    """cfg.sft_warmup AdamW steps per adapter, each on cfg.minibatch_size calls drawn from
    `calls`; each step's loss, the mean over adapters."""
    optimizers = {name: torch.optim.AdamW(adapter_parameters(model, name), lr=cfg.sft_lr,
                                          weight_decay=0.0) for name in adapters}
    losses = []
    for i in range(cfg.sft_warmup):
        mb = rng.sample(calls, min(cfg.minibatch_size, len(calls)))
        step_loss = {}
        for name in adapters:
            batch = [c for c in mb if adapter_for(c.role, cfg.sharing) == name]
            if batch:
                step_loss[name] = supervised_update(model, name, batch, optimizers[name], pad_id,
                                                    cfg.micro_batch_tokens, cfg.grad_clip, procs)
        losses.append(sum(step_loss.values()) / len(step_loss))
        log(f"warm-up {i + 1}/{cfg.sft_warmup} | loss "
            + ", ".join(f"{k} {v:.3f}" for k, v in step_loss.items()))
    return losses


def supervised_update(model, adapter: str, batch: list[Call], optimizer, pad_id: int,
                      micro_batch_tokens: int, grad_clip: float, procs=ONE_PROCESS) -> float:
    """One optimizer step on the batch's mean negative log-likelihood per token."""
    params = adapter_parameters(model, adapter)
    optimizer.zero_grad(set_to_none=False)
    n_tokens, total = sum(len(c.completion_ids) for c in batch), 0.0
    with use_adapter(model, adapter):
        for micro in micro_batches(procs.share(batch), micro_batch_tokens):
            logp, mask, _ = sequence_logprobs(model, micro, pad_id)  # (b, T)
            loss = -(logp * mask).sum() / n_tokens
            loss.backward()
            total += loss.item()
    procs.sum_grads(params)
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return sum(procs.gather([total]))
