"""GRPO: group-relative advantages and the clipped policy loss.

GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300) drops PPO's critic: the advantage of
every token of an answer is the answer's reward relative to the G answers to the same prompt. The
loss is PPO's clipped surrogate (Schulman et al. 2017) with DAPO's clip-higher (Yu et al. 2025,
arXiv 2503.14476: a separate eps_high, so that unlikely tokens can still grow):

    A_i   = (r_i - mean(r_group)) / (std(r_group) + eps)
    ratio = pi(a|s) / pi_old(a|s)
    loss  = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

GSPO (Zheng et al. 2025, arXiv 2507.18071; --ratio sequence) clips one ratio per sequence,
exp(mean_t (log pi - log pi_old)). Under train.py's --one_step (the default) every ratio is 1.
Paper A (Zeng et al. 2026, arXiv 2605.24202): the episode's outcome is broadcast to every call,
and a group is one (problem, agent slot, stage), or (problem, role).

Departures: std is unbiased (Bessel), as in verl and TRL; a group without contrast gets advantage
0. The KL term (off, as in the paper) is k3 (Schulman 2020, http://joschu.net/blog/kl-approx.html)
to the base model or the warmed-up adapter (`reference_of`). `policy_update` (the actor-critic's
too) is one pass of mini-batches with Paper A's mitigations; the first is on-policy, pi_old of the
later ones comes from a pass before the first step. --tis_cap weights each token by
min(pi_old / pi_rollout, C) (truncated importance sampling, Yao et al. 2025).

Exercised by: pytest tests/test_grpo.py
"""
import time
from collections import defaultdict
from typing import Hashable, NamedTuple

import torch

from lora import adapter_parameters, use_adapter
from rollout import ONE_PROCESS, Call, micro_batches, old_logprobs, sequence_logprobs
from workflows import ROLES

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
RATIO_LEVELS = ("token", "sequence")  # PPO's importance ratio per token, or GSPO's per sequence
BALANCE = ("none", "role", "multiplicity")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (over all of them, or along dim)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def group_advantages(rewards: torch.Tensor, keys: list[Hashable],
                     eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps) per reward, grouped by key: (calls,) -> (calls,)."""
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


def set_advantages(calls: list[Call], problem_of: list[int], by: str) -> None:
    """Group-relative advantages on every call, by (problem, slot, stage) or (problem, role)."""
    keys = [(problem_of[c.episode], c.slot, c.stage) if by == "slot"
            else (problem_of[c.episode], c.role) for c in calls]
    adv = group_advantages(torch.tensor([c.reward for c in calls]), keys)
    for call, a in zip(calls, adv.tolist()):
        call.advantage = a


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
                is_weight: torch.Tensor | None = None,
                ratio_level: str = "token") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate per completion token, (B, T), for `aggregate` to reduce, and its
    statistics over the completion tokens (0-d tensors). logp, old_logp, mask, is_weight (the
    optional `tis_weight`): (B, T); advantages: (B,), spread over each sequence's tokens.
    ratio_level "token" (PPO, GRPO) or "sequence" (GSPO)."""
    adv = advantages.unsqueeze(-1)  # (B, 1)
    log_ratio = logp - old_logp  # (B, T)
    token_ratio = torch.exp(log_ratio)
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio level {ratio_level!r}; choose one of {RATIO_LEVELS}")
    ratio = token_ratio  # (B, T)
    if ratio_level == "sequence":  # GSPO: exp(token mean of log pi - log pi_old), one per sequence
        ratio = torch.exp(masked_mean(log_ratio, mask, dim=-1)).unsqueeze(-1).expand_as(logp)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    pg_loss = -torch.min(surr1, surr2)  # (B, T)
    if is_weight is not None:
        pg_loss = is_weight * pg_loss
    with torch.no_grad():
        stats = {
            "pg_loss": masked_mean(pg_loss, mask),
            "clip_frac": masked_mean((surr2 < surr1).float(), mask),
            "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask),  # KL(old || new), 2nd order
            "ratio_mean": masked_mean(ratio, mask),
            "chi2": masked_mean(token_ratio ** 2, mask) - 1,  # E[rho^2] - 1 over tokens
            "ppl": torch.exp(-masked_mean(logp, mask, dim=-1)).mean(),  # mean over sequences
        }
    return pg_loss, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """k3 to the reference per token, (B, T) (>= 0, unbiased for KL(pi || ref); Schulman 2020),
    and its mean over the completion tokens (kl_ref)."""
    log_ref_ratio = ref_logp - logp  # (B, T)
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    return kl, {"kl_ref": masked_mean(kl.detach(), mask)}


def read_stats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors as numbers: on a GPU a read waits for the queue, so read after the backward."""
    return {k: v.item() for k, v in stats.items()}


def tis_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025): min(pi_old / pi_rollout, cap) per token."""
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()  # (B, T)


def mismatch_stats(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean and max of |log pi_old - log pi_rollout|, and k3 of KL(pi_rollout || pi_old)."""
    gap = old_logp - rollout_logp  # (B, T)
    return {"mismatch_mean": masked_mean(gap.abs(), mask),
            "mismatch_max": gap.abs().masked_fill(~mask.bool(), 0.0).max(),
            "mismatch_kl": masked_mean(torch.exp(gap) - gap - 1, mask)}


# ----------------------------------------------------------------------------
# The update: one pass of mini-batches, one optimizer step each


def flat_grad(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])  # (n_params,)


class LossWeight(NamedTuple):
    scale: float     # multiplies the role's aggregated loss
    num_seqs: int    # denominator of the seq-mean modes
    num_tokens: int  # denominator of token-mean


def loss_weight(mb: list[Call], role: str, balance: str) -> LossWeight:
    """Scale and denominators of one role's loss in a mini-batch.

    none: every call counts alike, so a role's weight is its share of calls or tokens;
    role: each role's loss is averaged over its own calls, then roles are averaged (the
          shared-adapter fix for role capture);
    multiplicity: the loss of a role with N slots in the mini-batch is scaled by 1/N (the
          isolated-adapter fix for amplification). Under AdamW a constant scale of an adapter's
          whole loss mostly cancels: it acts through the gradient clip and against other roles.
    """
    counted = [c for c in mb if c.role == role] if balance == "role" else mb
    scale = 1.0
    if balance == "role":
        scale = 1 / len({c.role for c in mb})
    elif balance == "multiplicity":
        scale = 1 / len({c.slot for c in mb if c.role == role})
    return LossWeight(scale, len(counted), sum(len(c.completion_ids) for c in counted))


def damped_step(optimizer, params: list[torch.Tensor], ema: dict, damping: float,
                beta: float = 0.9) -> float:
    """Coherence damping (Paper A): scale the step by 1 - damping * max(0, cos(g, EMA(g))), the
    factor returned, through the learning rate (AdamW would undo a scaled gradient). A gradient
    that keeps its recent direction is the signature of amplification."""
    g = flat_grad(params)  # (n_params,)
    factor = 1.0
    if "g" in ema:
        cos = torch.nn.functional.cosine_similarity(g, ema["g"], dim=0).item()
        factor = 1 - damping * max(0.0, cos)
        ema["g"] = beta * ema["g"] + (1 - beta) * g
    else:
        ema["g"] = g.clone()
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] *= factor
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    return factor


def kl_coefs(cfg) -> dict[str, float]:
    """The KL anchor's weight of every role of the workflow: cfg.kl_coef, overridden per role by
    cfg.role_kl ("aggregator=0.05,evaluator=0")."""
    coefs = {role: cfg.kl_coef for role in ROLES[cfg.workflow]}
    named = set()
    for item in cfg.role_kl.split(",") if cfg.role_kl.strip() else []:
        role, _, value = item.partition("=")
        role = role.strip()
        if not item.strip():
            raise ValueError(f"--role_kl {cfg.role_kl}: an empty item between commas")
        if role not in coefs:
            raise ValueError(f"--role_kl: {role!r} is not a role of {cfg.workflow} "
                             f"({', '.join(coefs)})")
        if role in named:
            raise ValueError(f"--role_kl: {role} is given twice")
        named.add(role)
        try:
            coefs[role] = float(value)
        except ValueError:
            raise ValueError(f"--role_kl: {item!r} is not role=number") from None
        if not 0 <= coefs[role] < float("inf"):  # as --kl_coef: a negative, nan or inf is no anchor
            raise ValueError(f"--role_kl {item.strip()}: must be in [0, inf)")
    return coefs


def reference_of(cfg, adapter: str) -> str | None:
    """The frozen copy "<adapter>-ref" a KL term anchors to after a warm-up; else None (base)."""
    anchored = cfg.sft_warmup > 0 and any(v > 0 for v in kl_coefs(cfg).values())
    return f"{adapter}-ref" if anchored else None


def policy_update(state, adapter: str, calls: list[Call], pad_id: int, cfg,
                  procs=ONE_PROCESS) -> dict[str, list[float]]:
    """One pass over `calls` (shuffled by state.rng) in mini-batches, one optimizer step each
    (`state`: lab/checkpoint.py's TrainState). A call without signal is skipped (its gradient is
    0) but counts in the denominators; a non-finite gradient takes no step. Under torchrun each
    process back-propagates its share, and the gradients are summed before the step."""
    model, optimizer, ema = state.model, state.optimizers[adapter], state.emas.get(adapter)
    kl = kl_coefs(cfg)
    if cfg.damping > 0 and ema is None:
        raise ValueError(f"--damping needs state.emas[{adapter!r}], the gradient EMA of its steps")
    params = adapter_parameters(model, adapter)
    theta_before = torch.cat([p.detach().reshape(-1) for p in params])  # (n_params,)
    stats = defaultdict(list)
    calls = calls[:]
    state.rng.shuffle(calls)
    size = max(1, len(calls)) if cfg.one_step else cfg.minibatch_size
    batches = [calls[i:i + size] for i in range(0, len(calls), size)]
    # pi_old of the mini-batches after the first step; the first one is on-policy
    later = [c for mb in batches[1:] for _, share in live_groups(mb, kl, "role", procs)
             for c in share]
    t = time.time()
    old = old_logprobs(model, later, adapter, pad_id, cfg.temperature,
                       cfg.micro_batch_tokens)  # id(call) -> (T_i,)
    stats[f"time/old_logp/{adapter}"].append(time.time() - t)
    empty = nonfinite = 0  # mini-batches without a live call; with a non-finite loss or gradient
    for mb in batches:
        optimizer.zero_grad(set_to_none=False)
        if not any(has_signal(c, kl) for c in mb):
            empty += 1
            if cfg.skip_empty:  # AdamW would still move the adapter, on its momentum alone
                continue
        for role, share in live_groups(mb, kl, "role", procs):
            weight = loss_weight(mb, role, cfg.balance)
            for micro in micro_batches(share, cfg.micro_batch_tokens):
                st = micro_loss_backward(model, adapter, micro, old, pad_id, cfg, weight)
                for k, v in st.items():
                    stats[f"role/{role}/{k}"].append(v)
        procs.sum_grads(params)
        total = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if not torch.isfinite(total):  # a NaN or inf in the loss reaches the gradient, and its norm
            nonfinite += 1  # not applied: one step would make the adapter and AdamW's moments NaN
            continue
        stats[f"adapter/{adapter}/grad_norm"].append(total.item())
        if cfg.damping > 0:
            stats[f"adapter/{adapter}/damping"].append(
                damped_step(optimizer, params, ema, cfg.damping))
        else:
            optimizer.step()
    stats[f"adapter/{adapter}/empty_batches"].append(empty)
    stats[f"adapter/{adapter}/skipped_nonfinite"].append(nonfinite)
    theta_after = torch.cat([p.detach().reshape(-1) for p in params])
    stats[f"adapter/{adapter}/update_norm"].append((theta_after - theta_before).norm().item())
    return stats


def has_signal(call: Call, kl: dict[str, float]) -> bool:
    """Whether a call has a gradient: an advantage, or a KL term (`kl`: kl_coefs)."""
    return call.advantage != 0 or kl.get(call.role, 0) > 0


def live_groups(mb: list[Call], kl: dict[str, float], by: str,
                procs=ONE_PROCESS) -> list[tuple[str, list[Call]]]:
    """(group, this process's share of its calls with a gradient) by role or slot."""
    live = [c for c in mb if has_signal(c, kl)]
    return [(group, procs.share([c for c in live if getattr(c, by) == group]))
            for group in sorted({getattr(c, by) for c in live})]


def overlay(base: torch.Tensor, rows: list[torch.Tensor | None]) -> torch.Tensor:
    """A copy of base (b, T), each given row (T_i,) written over the start of its own row."""
    out = base.clone()
    for i, row in enumerate(rows):
        if row is not None:
            out[i, : len(row)] = row.to(out.device)
    return out


def sampler_record(micro: list[Call],
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's log-probs under pi_rollout and where they are known (greedy or
    hand-made calls have none), laid out (b, T) as in its update."""
    T = max(max(len(c.completion_ids) for c in micro), 1)  # as rollout.pack lays them out
    # (b, T) each
    logp, known = torch.zeros(len(micro), T), torch.zeros(len(micro), T, dtype=torch.bool)
    for i, c in enumerate(micro):
        if c.rollout_logp is not None:
            logp[i, : len(c.rollout_logp)] = c.rollout_logp
            known[i, : len(c.rollout_logp)] = True
    return logp.to(device), known.to(device)


def sampler_gap(old_logp: torch.Tensor, record: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor, tis_cap: float,
                measure: bool) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The truncated importance weight (None where tis_cap is 0) and, with `measure`, the gap's
    statistics, from the sampler's record (None: no gap)."""
    if record is None:
        return None, {}
    logp, known = record  # (b, T) each
    rollout_logp = torch.where(known, logp.to(old_logp.dtype), old_logp)  # (b, T)
    is_weight = tis_weight(old_logp, rollout_logp, tis_cap) if tis_cap > 0 else None
    return is_weight, mismatch_stats(old_logp, rollout_logp, mask) if measure else {}


def micro_loss_backward(model, adapter: str, micro: list[Call], old: dict[int, torch.Tensor],
                        pad_id: int, cfg, weight: LossWeight,
                        measure: bool = False) -> dict[str, float]:
    """Forward one micro-batch (calls of one role) under `adapter`, back-propagate its weighted
    loss, return its statistics. `old`: pi_old after the first step (id(call) -> (T_i,)). With
    `measure` (the diagnostics' pass) also the entropy and the sampler's gap."""
    kl_coef = kl_coefs(cfg).get(micro[0].role, 0.0)
    # to the device before the forward pass is queued: a host-to-device copy waits for the queue
    adv = torch.tensor([c.advantage for c in micro], device=model.device)  # (b,)
    # two (b, T), or None: only the precision correction and the diagnostics read it
    record = sampler_record(micro, model.device) if cfg.tis_cap > 0 or measure else None
    with use_adapter(model, adapter):
        logp, mask, entropy = sequence_logprobs(model, micro, pad_id, cfg.temperature,
                                                with_entropy=measure)  # (b, T) each
    old_logp = logp.detach()  # (b, T) pi_old on-policy: the policy itself, so every ratio is 1
    if id(micro[0]) in old:  # a mini-batch after the first step: pi_old from the pass before it
        old_logp = overlay(old_logp, [old[id(c)] for c in micro])  # padding keeps logp, masked
    is_weight, gap = sampler_gap(old_logp, record, mask, cfg.tis_cap, measure)
    per_token, st = policy_loss(logp, old_logp, adv, mask, cfg.eps_low, cfg.eps_high, is_weight,
                                cfg.ratio)
    if kl_coef > 0:  # a KL term: kl_ref is logged only where there is one
        with torch.no_grad(), use_adapter(model, reference_of(cfg, adapter)):  # None: the base
            ref_logp, _, _ = sequence_logprobs(model, micro, pad_id, cfg.temperature)
        kl, kl_stats = kl_penalty(logp, ref_logp, mask)
        per_token = per_token + kl_coef * kl
        st.update(kl_stats)
    loss = aggregate(per_token, mask, cfg.loss_agg, weight.num_seqs, weight.num_tokens)
    (weight.scale * loss).backward()
    if measure:
        st.update(gap, entropy=masked_mean(entropy, mask))
    return read_stats(st)
