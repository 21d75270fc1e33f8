"""GRPO: group-relative advantages and the clipped policy loss.

GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300) drops PPO's critic:
sample G answers to the same prompt and use each answer's reward relative to
its group as the advantage of every token of the answer,

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps).

The policy loss is PPO's clipped surrogate (Schulman et al. 2017) with
"clip-higher" (DAPO, Yu et al. 2025, arXiv 2503.14476): separate eps_low and
eps_high so that unlikely tokens can still grow,

    ratio = pi(a|s) / pi_old(a|s)
    loss  = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A).

Multi-agent workflows (Paper A, Zeng et al. 2026, arXiv 2605.24202): the
episode's outcome reward is broadcast to every call, and one group is one
(problem, agent slot, workflow step): generator0's samples of a problem form
one group, generator1's another. Grouping by (problem, role) is an option.

Departures: std is the unbiased (Bessel) estimate, as in verl and TRL; a
group whose rewards are all equal (or that has a single member) gets
advantage 0 instead of dividing by ~eps. The KL term to the reference policy
is off by default, as in the paper; when on it is the k3 estimator
(Schulman 2020, http://joschu.net/blog/kl-approx.html) against the base model.

Exercised by: pytest tests/test_grpo.py
"""
from collections import defaultdict
from typing import Hashable

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (over all of them, or along dim)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def group_advantages(rewards: torch.Tensor, keys: list[Hashable], eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for each reward, grouped by key: (N,) -> (N,)."""
    groups = defaultdict(list)
    for i, key in enumerate(keys):
        groups[key].append(i)
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for members in groups.values():
        r = rewards[members].float()  # (G,)
        if len(members) < 2 or r.std() < eps:
            continue  # no contrast inside the group: no signal
        adv[members] = (r - r.mean()) / (r.std() + eps)
    return adv


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str,
              num_seqs: int | None = None, num_tokens: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    token-mean:           sum over all tokens / number of tokens
    seq-mean-token-mean:  mean over sequences of each sequence's token mean (Paper A's default)
    seq-mean-token-sum:   mean over sequences of each sequence's token sum
    num_seqs / num_tokens override the denominators, so that micro-batches of one
    optimizer mini-batch add up to exactly the mini-batch's loss.
    """
    num_seqs = x.shape[0] if num_seqs is None else num_seqs
    if mode == "token-mean":
        num_tokens = mask.sum() if num_tokens is None else num_tokens
        return (x * mask).sum() / max(float(num_tokens), 1.0)
    if mode == "seq-mean-token-mean":
        return masked_mean(x, mask, dim=-1).sum() / num_seqs  # (B,) -> ()
    if mode == "seq-mean-token-sum":
        return (x * mask).sum(-1).sum() / num_seqs
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGG_MODES}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.28,
                agg: str = "seq-mean-token-mean", ref_logp: torch.Tensor | None = None,
                kl_coef: float = 0.0, num_seqs: int | None = None,
                num_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss over completion tokens.

    logp, old_logp, ref_logp, mask: (B, T); advantages: (B,), one per sequence,
    spread over its tokens.
    """
    adv = advantages.unsqueeze(-1)  # (B, 1)
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    pg_loss = -torch.min(surr1, surr2)  # (B, T)
    per_token = pg_loss
    kl = torch.zeros_like(logp)
    if ref_logp is not None and kl_coef > 0:
        log_ref_ratio = ref_logp - logp
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # k3 >= 0, unbiased for KL(pi || ref)
        per_token = pg_loss + kl_coef * kl
    loss = aggregate(per_token, mask, agg, num_seqs, num_tokens)
    with torch.no_grad():
        stats = {
            "pg_loss": masked_mean(pg_loss, mask).item(),
            "clip_frac": masked_mean((surr2 < surr1).float(), mask).item(),
            "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask).item(),  # KL(old || new), 2nd order
            "ratio_mean": masked_mean(ratio, mask).item(),
            "kl_ref": masked_mean(kl, mask).item(),
        }
    return loss, stats
