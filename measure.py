"""What a step measures besides its loss: the papers' signals, in one room.

Every step train.py logs `step_metrics` (no pass of the model); every --diag_every steps, per
adapter before its update, also `gradient_signals`: each slot's part of the loss back-propagated
on its own, no step taken (about an update's cost, docs/performance.md).

Paper A (Zeng et al. 2026, arXiv 2605.24202): same-role slots on one prompt and one reward push an
adapter one way (`amplification`: kappa); on a shared adapter a role may take most of the gradient
(`gradient_stats`: grad_share). The gradient noise comes from two halves of the problems
(`gradient_noise`, McCandlish et al. 2018, arXiv 1812.06162). Outputs: per role and slot the
reward, length and token share; whether supervisory roles do their job (`role_jobs`); contract
adherence and how alike the roles' outputs are (role capture shows in outputs before losses).

Exercised by: pytest tests/test_grpo.py tests/test_reward.py tests/test_train.py
tests/test_diagnose.py
"""
from collections import defaultdict

import torch

from grpo import flat_grad, kl_coefs, live_groups, loss_weight, micro_loss_backward
from lora import adapter_parameters
from reward import read_by, verdicts
from rollout import ONE_PROCESS, Call, micro_batches
from workflows import adherence, parse_choice, similarity


# ----------------------------------------------------------------------------
# The gradients of the slots, at the adapter before its step


def amplification(grads: list[torch.Tensor]) -> tuple[float, float]:
    """kappa = |sum_i g_i| / sqrt(sum_i |g_i|^2), and the mean pairwise cosine: kappa is 1 for
    orthogonal gradients and sqrt(N) for identical ones (the role's step is then sqrt(N) times
    what N independent slots would give)."""
    g = torch.stack(grads)  # (N, n_params)
    kappa = (g.sum(0).norm() / g.norm(dim=1).square().sum().sqrt()).item()
    unit = g / g.norm(dim=1, keepdim=True)  # (N, n_params)
    cos = unit @ unit.t()  # (N, N)
    N = len(grads)
    coherence = ((cos.sum() - cos.diagonal().sum()) / (N * (N - 1))).item()
    return kappa, coherence


def gradient_stats(slot_grads: dict[str, torch.Tensor],
                   role_of: dict[str, str]) -> dict[str, float]:
    """Per slot and per role gradient norms, kappa and coherence of same-role slots, and each
    role's share of the roles' summed grad_norm (grad_share)."""
    stats, role_grads = {}, defaultdict(list)
    for slot, g in slot_grads.items():
        stats[f"slot/{slot}/grad_norm"] = g.norm().item()
        if g.norm() > 0:
            role_grads[role_of[slot]].append(g)
    role_norms = {role: torch.stack(gs).sum(0).norm().item() for role, gs in role_grads.items()}
    for role, gs in role_grads.items():
        stats[f"role/{role}/grad_norm"] = role_norms[role]
        if len(gs) > 1:
            stats[f"role/{role}/kappa"], stats[f"role/{role}/coherence"] = amplification(gs)
    if len(role_norms) > 1:  # roles that share one adapter
        total = sum(role_norms.values())
        for role, norm in role_norms.items():
            stats[f"role/{role}/grad_share"] = norm / total
    return stats


def gradient_noise(g0: torch.Tensor, g1: torch.Tensor, n0: int, n1: int) -> float:
    """The noise's share of |g|^2, g = g0 + g1, from two halves of n0 and n1 problems:
    n0 n1 |g0 / n0 - g1 / n1|^2 / |g|^2. For N = n0 + n1 independent problems of mean m and
    covariance C, E|g|^2 = N^2 |m|^2 + N tr C and n0 n1 E|g0 / n0 - g1 / n1|^2 = N tr C: about 1
    for noise alone, near 0 for signal."""
    return (n0 * n1 * (g0 / n0 - g1 / n1).norm() ** 2 / (g0 + g1).norm() ** 2).item()


def gradient_signals(model, adapter: str, calls: list[Call], pad_id: int, cfg,
                     procs=ONE_PROCESS) -> dict[str, list[float]]:
    """Paper A's signals of the adapter's gradient before its update, from each slot's part of the
    on-policy loss in two halves of the problems; each slot's loss statistics, each role's entropy
    and sampler gap. No step is taken: the gradients are left at zero, every state as it was."""
    params = adapter_parameters(model, adapter)
    stats, slot_grads, halves, role_of = defaultdict(list), {}, [0, 0], {}
    for slot, share in live_groups(calls, kl_coefs(cfg), "slot", procs):
        role = role_of[slot] = next(c.role for c in calls if c.slot == slot)
        weight = loss_weight(calls, role, cfg.balance)
        for half in (0, 1):
            for p in params:  # 0, not None, where this part's loss does not reach
                p.grad = torch.zeros_like(p)
            part = [c for c in share if c.episode // cfg.group_size % 2 == half]
            for micro in micro_batches(part, cfg.micro_batch_tokens):
                st = micro_loss_backward(model, adapter, micro, {}, pad_id, cfg, weight,
                                         measure=True)
                for k, v in st.items():
                    stats[f"slot/{slot}/{k}"].append(v)
                for k in ("entropy", "mismatch_mean", "mismatch_max", "mismatch_kl"):
                    stats[f"role/{role}/{k}"].append(st[k])  # pooled over the role's slots
            g = procs.sum(flat_grad(params))  # (n_params,)
            slot_grads[slot] = slot_grads.get(slot, 0) + g
            halves[half] = halves[half] + g
    for p in params:
        p.grad = torch.zeros_like(p)
    for k, v in gradient_stats(slot_grads, role_of).items():
        stats[k].append(v)
    problems = {c.episode // cfg.group_size for c in calls}
    sizes = [sum(p % 2 == half for p in problems) for half in (0, 1)]  # problems in each half
    if torch.is_tensor(halves[0]) and min(sizes) > 0 and (halves[0] + halves[1]).norm() > 0:
        stats[f"adapter/{adapter}/grad_noise"].append(gradient_noise(*halves, *sizes))
    return stats


# ----------------------------------------------------------------------------
# The outputs: per role and slot, the roles' jobs and contracts


def role_jobs(calls: list) -> dict[str, float]:
    """Whether each supervisory role does its job beyond its format (math: needs `own_score`).
    evaluator: verdict_acc, its verdicts' agreement with the verifier, against verdict_base, an
    evaluator that always says Incorrect; refine/fixed and refine/broken: the share of rewrites
    that turned an answer right, and wrong; aggregator and synthesizer: skill, the reward of its
    answer minus the mean of the candidates it read (0: a random pick)."""
    m, skill = {}, defaultdict(list)
    judged = [(c, read[0].own_score) for c, read in read_by(calls) if c.role == "evaluator"]
    if judged:
        m["role/evaluator/verdict_acc"] = sum(right for _, right in verdicts(calls)) / len(judged)
        m["role/evaluator/verdict_base"] = sum(s != 1.0 for _, s in judged) / len(judged)
    after = {(c.episode, c.stage): c.own_score for c in calls if c.own_score is not None}
    refined = [(s, after[c.episode, c.stage + 1]) for c, s in judged
               if (c.episode, c.stage + 1) in after]
    if refined:
        m["refine/fixed"] = sum(a < b for a, b in refined) / len(refined)
        m["refine/broken"] = sum(a > b for a, b in refined) / len(refined)
    for c, read in read_by(calls):
        mean = sum(r.own_score for r in read) / len(read)
        if c.role == "aggregator":
            skill[c.role].append(read[parse_choice(c.text, len(read))[0] - 1].own_score - mean)
        elif c.role == "synthesizer":
            skill[c.role].append(c.own_score - mean)
    m.update({f"role/{role}/skill": sum(v) / len(v) for role, v in skill.items()})
    return m


def step_metrics(calls: list, rewards: list[float], outcomes, n_agents: int) -> dict[str, float]:
    """A step's figures from its calls, outcomes and rewards (the module docstring's outputs)."""
    m = {"reward/mean": sum(rewards) / len(rewards),
         "contract/fallback_rate": sum(o.info["fallback"] for o in outcomes) / len(outcomes),
         "contract/truncated": sum(c.truncated for c in calls) / len(calls)}
    all_tokens = sum(len(c.completion_ids) for c in calls)
    for key in ("role", "slot"):
        groups = defaultdict(list)
        for c in calls:
            groups[getattr(c, key)].append(c)
        for name, cs in groups.items():
            tokens = sum(len(c.completion_ids) for c in cs)
            m[f"{key}/{name}/reward"] = sum(c.reward for c in cs) / len(cs)
            m[f"{key}/{name}/len"] = tokens / len(cs)
            m[f"{key}/{name}/calls"] = len(cs)
            m[f"{key}/{name}/token_share"] = tokens / all_tokens
            solved = [c.own_score for c in cs if c.own_score is not None]
            if solved:
                m[f"{key}/{name}/solved"] = sum(solved) / len(solved)
    m.update(role_jobs(calls))
    rules = [o.info["rule"] for o in outcomes if "rule" in o.info]  # the contract's, or a fallback
    for rule in sorted(set(rules)):
        m[f"contract/rule/{rule}"] = rules.count(rule) / len(rules)
    # role capture shows in outputs: contract adherence, and likeness to the other roles
    texts = defaultdict(list)
    for c in calls:
        texts[c.role].append(c.text)
    for role, outs in texts.items():
        kept = [adherence(role, t, n_agents) for t in outs]
        if kept[0] is not None:
            m[f"role/{role}/adherence"] = sum(kept) / len(kept)
        for other in texts:
            if other != role:
                # symmetric: logged under both roles so that each role's keys are complete
                m[f"role/{role}/sim/{other}"] = similarity(outs, texts[other])
    return m
