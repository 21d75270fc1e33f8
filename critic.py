"""Multi-agent actor-critic: value heads, centralized and decentralized critics, GAE.

An episode is a Dec-POMDP (Paper B: Liu, Chen, Amiri, Amato 2026, CoLLM, arXiv 2601.21972): a
stage is a time step, and the outcome is the reward of each agent's last turn (--credit own:
each turn's own). A critic's V(s) takes the place of GRPO's group mean:
  CoLLM-CC, central:   one critic "critic" reading the joint history - every agent's prompt and
                       output before step t, then the prompts of step t, in [slot] blocks; one
                       value per (episode, step), shared by the agents acting then.
  CoLLM-DC, decentral: one critic per agent slot ("critic-generator0") or per role type
                       ("critic-generator") that reads only its agent's own prompt at its turn.
A critic is the frozen base model under its own LoRA adapter plus a ValueHead; a fresh one says 0.
GAE (Schulman et al. 2016, arXiv 1506.02438) runs over each agent's own turns k = 1..K:

    delta_k = r_k + gamma * V(s_{k+1}) - V(s_k)        V(s_{K+1}) = 0 (terminal)
    A_k     = sum_l (gamma * lam)^l * delta_{k+l}
    R_k     = A_k + V(s_k)                             (the target of the loss 0.5 (V - R)^2)

lam = 0 is the one-step TD of Paper B's code (OpenMLRL/CoMLRL), lam = 1 Monte Carlo.
Departures: an agent's next state is its own next turn, and gamma discounts per agent turn; the
central critic fits the mean return of the agents acting at a joint step, and writes a prompt
they share once; a long input keeps its last max_tokens tokens.

Exercised by: pytest tests/test_critic.py; python train.py --algo maac --critic central
"""
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

from decode import forward_padded
from lora import add_adapter, use_adapter
from rollout import ONE_PROCESS, Call, left_pad, token_batches

CRITICS = ("central", "decentral")
PER = ("slot", "role")


# ----------------------------------------------------------------------------
# The value head and the critic's forward pass


class ValueHead(nn.Module):
    """V(s) from the last token's hidden state: Linear(H, H) -> tanh -> Linear(H, 1)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, 1)
        # a fresh critic predicts exactly 0 (the first advantages are plain returns); `dense`
        # gets gradient once `out` has moved
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden: (B, H)
        return self.out(torch.tanh(self.dense(hidden))).squeeze(-1)  # (B,)


def setup_critics(model: nn.Module, names: list[str]) -> nn.ModuleDict:
    """Add a fresh adapter per critic name to the shared base model; return one head per name."""
    heads = nn.ModuleDict()
    for name in names:
        add_adapter(model, name)
        heads[name] = ValueHead(model.config.hidden_size)
    return heads.to(model.device)


def critic_values(model: nn.Module, head: ValueHead, adapter: str,
                  prompt_id_lists: list[list[int]], pad_id: int) -> torch.Tensor:
    """V of each input under one critic (adapter + head): (B,). Differentiable."""
    ids, attn = (t.to(model.device) for t in left_pad(prompt_id_lists, pad_id))  # (B, L) each
    with use_adapter(model, adapter):
        # logits_to_keep=1: the LM head runs on one column only; we never use its output.
        out = forward_padded(model, ids, attn, output_hidden_states=True, logits_to_keep=1)
    last = out.hidden_states[-1][:, -1]  # (B, H): final layer (after its norm), last real token
    return head(last.float())  # (B,): the head is fp32 even over a bf16 base


@torch.no_grad()
def predict_values(model: nn.Module, heads: nn.ModuleDict, keys: list[str],
                   id_lists: list[list[int]], pad_id: int, batch_size: int = 8,
                   procs=ONE_PROCESS) -> torch.Tensor:
    """Values of every input under its own critic: (calls,). Identical inputs run once."""
    values = torch.zeros(len(keys))
    for key in sorted(set(keys)):
        rows = defaultdict(list)  # input ids -> the positions that share them
        for i, k in enumerate(keys):
            if k == key:
                rows[tuple(id_lists[i])].append(i)
        inputs = procs.share(list(rows))
        for start in range(0, len(inputs), batch_size):
            batch = inputs[start:start + batch_size]
            v = critic_values(model, heads[key], key, [list(x) for x in batch], pad_id)  # (b,)
            for x, value in zip(batch, v.tolist()):
                values[rows[x]] = value
    return procs.sum(values)


# ----------------------------------------------------------------------------
# What each critic reads


def critic_key(slot: str, role: str, critic: str, per: str = "slot") -> str:
    """The critic (= adapter and head name) that scores a call of this slot and role."""
    if critic == "central":
        return "critic"
    if critic != "decentral":
        raise ValueError(f"unknown critic {critic!r}; choose one of {CRITICS}")
    if per not in PER:
        raise ValueError(f"unknown critic grouping {per!r}; choose one of {PER}")
    return f"critic-{slot if per == 'slot' else role}"


def joint_history(episode_calls: list[Call], turn: int) -> str:
    """The central critic's input at one joint step: all prompts and outputs before `turn`, then
    the prompts at `turn`, each block labelled with its agent slot(s)."""
    blocks = []
    for t in sorted({c.stage for c in episode_calls if c.stage <= turn}):
        stage = [c for c in episode_calls if c.stage == t]
        seen_by = defaultdict(list)  # prompt -> slots that saw it (dicts keep stage order)
        for c in stage:
            seen_by[c.prompt].append(c.slot)
        blocks += [f"[{', '.join(slots)}] prompt:\n{prompt}" for prompt, slots in seen_by.items()]
        if t < turn:
            blocks += [f"[{c.slot}] output:\n{c.text}" for c in stage]
    return "\n\n".join(blocks)


def local_observation(call: Call) -> str:
    """A decentral critic's input: only this agent's own prompt at its turn."""
    return f"[{call.slot}] prompt:\n{call.prompt}"


# "1. ", "- ", "2) ": the marks of a plan's list, which a prompt may quote without them
LIST_MARK = re.compile(r"^[\s#*-]*(?:\d+\s*[.):])?\s*")


def unseen(calls: list[Call]) -> list[float | None]:
    """For every call, what the central critic reads and a decentral one does not: the share (in
    characters) of the lines of its episode's earlier outputs (list markers aside) that its own
    prompt does not quote; None on an episode's first turn. A lower bound: a short line (a bare
    number) may be found in other words."""
    by_episode = defaultdict(list)
    for c in calls:
        by_episode[c.episode].append(c)
    shares = []
    for c in calls:
        lines = (LIST_MARK.sub("", line).strip() for d in by_episode[c.episode] if d.stage < c.stage
                 for line in d.text.splitlines())
        said = [line for line in lines if line]
        total = sum(map(len, said))
        hidden = sum(len(line) for line in said if line not in c.prompt)
        shares.append(hidden / total if total else None)
    return shares


def critic_inputs(calls: list[Call], critic: str, per: str = "slot") -> tuple[list[str], list[str]]:
    """For every call, the critic that scores it and the text that critic reads."""
    keys = [critic_key(c.slot, c.role, critic, per) for c in calls]
    if critic == "decentral":
        return keys, [local_observation(c) for c in calls]
    by_episode = defaultdict(list)
    for c in calls:
        by_episode[c.episode].append(c)
    steps = {(c.episode, c.stage) for c in calls}  # co-acting agents share one joint step
    history = {(e, t): joint_history(by_episode[e], t) for e, t in steps}
    return keys, [history[(c.episode, c.stage)] for c in calls]


def encode(tok, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of each text, keeping the last max_tokens (the most recent context)."""
    rows = tok(texts, add_special_tokens=False).input_ids
    return [row[-max_tokens:] for row in rows]


# ----------------------------------------------------------------------------
# GAE over each agent's turns, and the critic's loss


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of B sequences of turns, padded on the right: (B, K) each. The mask
    is 1 on each sequence's real turns (a prefix); after the last one V = 0; padding returns 0."""
    B, K = rewards.shape
    values = values * mask  # (B, K)
    next_values = torch.cat([values[:, 1:], values.new_zeros(B, 1)], dim=1)  # (B, K): V(s_{k+1})
    delta = (rewards + gamma * next_values - values) * mask  # (B, K)
    advantages = torch.zeros_like(delta)  # (B, K)
    gae_k = delta.new_zeros(B)  # (B,): A_{k+1}, 0 past the end (padding is a suffix)
    for k in reversed(range(K)):
        gae_k = delta[:, k] + gamma * lam * gae_k  # (B,)
        advantages[:, k] = gae_k
    returns = (advantages + values) * mask  # (B, K)
    return advantages, returns


def agent_turns(calls: list[Call]) -> list[list[int]]:
    """Indices into `calls`, one list per (episode, slot), in turn order."""
    by_agent = defaultdict(list)
    for i, c in enumerate(calls):
        by_agent[(c.episode, c.slot)].append(i)
    return [sorted(idx, key=lambda i: calls[i].stage) for idx in by_agent.values()]


def outcome_rewards(calls: list[Call]) -> list[float]:
    """Per-call rewards: the broadcast outcome on each agent's last turn, 0 before it."""
    rewards = [0.0] * len(calls)
    for idx in agent_turns(calls):
        rewards[idx[-1]] = calls[idx[-1]].reward
    return rewards


def call_advantages(calls: list[Call], values: torch.Tensor, gamma: float, lam: float,
                    rewards: list[float] | None = None,
                    cut_returns_zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns of every call, (calls,) each; an agent's next value is that of
    its own next call. rewards: default outcome_rewards(calls). cut_returns_zero (--truncated
    penalize): a call cut by the length limit returns 0, A = 0 - V(s), as under GRPO."""
    rewards = outcome_rewards(calls) if rewards is None else rewards
    seqs = agent_turns(calls)
    index = pad_sequence([torch.tensor(s) for s in seqs], batch_first=True)  # (B, K): call indices
    mask = pad_sequence([torch.ones(len(s)) for s in seqs], batch_first=True)  # (B, K)
    r = torch.tensor(rewards, dtype=torch.float32)[index] * mask  # (B, K)
    v = values.detach().float().cpu()[index]  # (B, K)
    adv, ret = gae(r, v, mask, gamma, lam)  # (B, K), (B, K)
    real = mask.bool()
    advantages, returns = torch.zeros(len(calls)), torch.zeros(len(calls))
    advantages[index[real]] = adv[real]  # (calls,)
    returns[index[real]] = ret[real]  # (calls,)
    if cut_returns_zero:
        cut = torch.tensor([c.truncated for c in calls], dtype=torch.bool)  # (calls,)
        advantages = torch.where(cut, -values.detach().float().cpu(), advantages)  # (calls,)
        returns = torch.where(cut, torch.zeros_like(returns), returns)  # (calls,)
    return advantages, returns


def normalize(advantages: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / (std + eps) over the batch: (calls,) -> (calls,)."""
    return (advantages - advantages.mean()) / (advantages.std(correction=0) + eps)


def explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    """1 - Var(target - pred) / Var(target); nan when the targets do not vary."""
    var_target = target.var(correction=0)
    if var_target == 0:
        return float("nan")
    return (1 - (target - pred).var(correction=0) / var_target).item()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * mean (V - R)^2, optionally PPO-clipped: (calls,) -> (), and its statistics as 0-d
    tensors. With clip, V may move at most `clip` from old_values before the loss stops rewarding
    the move (the max of clipped and unclipped errors, as in PPO2); clip_frac: the share held."""
    v_loss_unclipped = (values - returns) ** 2  # (calls,)
    v_loss, stats = v_loss_unclipped, {}
    if clip is not None:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)  # (calls,)
        v_loss_clipped = (v_clipped - returns) ** 2  # (calls,)
        v_loss = torch.max(v_loss_unclipped, v_loss_clipped)
        stats["clip_frac"] = ((values - old_values).abs() > clip).float().mean().detach()
    loss = 0.5 * v_loss.mean()
    return loss, {"value_loss": loss.detach(), **stats}


# ----------------------------------------------------------------------------
# One training step of the critics (train.py calls these three)


@dataclass
class CriticBatch:
    """What the critics saw at rollout time, one entry per call."""
    keys: list[str]          # which critic scores the call
    ids: list[list[int]]     # that critic's input tokens
    values: torch.Tensor     # (calls,) V(s) at rollout time (the "old" values)
    returns: torch.Tensor    # (calls,) GAE returns, the regression targets


def critic_advantages(model: nn.Module, tok, heads: nn.ModuleDict, calls: list[Call],
                      cfg, procs=ONE_PROCESS) -> CriticBatch:
    """Value every call's input with its critic, then set call.advantage by GAE."""
    keys, texts = critic_inputs(calls, cfg.critic, cfg.critic_per)
    ids = encode(tok, texts, cfg.critic_max_tokens)
    values = predict_values(model, heads, keys, ids, tok.pad_token_id, procs=procs)  # (calls,)
    # --credit own: each call's own reward at its turn (GAE adds the agent's later rewards to an
    # earlier turn's return); else (None) the outcome on each agent's last turn
    rewards = [c.reward for c in calls] if cfg.credit == "own" else None
    adv, returns = call_advantages(calls, values, cfg.gamma, cfg.lam, rewards,
                                   cut_returns_zero=cfg.truncated == "penalize")  # (calls,) each
    if cfg.norm_adv:
        adv = normalize(adv)
    for call, a in zip(calls, adv.tolist()):
        call.advantage = a
    return CriticBatch(keys, ids, values, returns)


def update_critics(state, batch: CriticBatch, pad_id: int, cfg,
                   procs=ONE_PROCESS) -> dict[str, list[float]]:
    """One pass of every critic over its own rows (shuffled by state.rng)."""
    stats = defaultdict(list)
    for name in state.heads:
        rows = [i for i, k in enumerate(batch.keys) if k == name]
        state.rng.shuffle(rows)
        for k, v in update_critic(state, name, batch, rows, pad_id, cfg, procs).items():
            stats[f"critic/{k}"] += v
    stats["critic/skipped_nonfinite"] = [sum(stats["critic/skipped_nonfinite"])]  # of all critics
    return stats


def update_critic(state, name: str, batch: CriticBatch, order: list[int], pad_id: int, cfg,
                  procs=ONE_PROCESS) -> dict[str, list[float]]:
    """One pass of critic `name` over the rows `order`, in cfg.critic_steps mini-batches (at most
    one per row) whose sizes differ by at most one; a non-finite gradient takes no step."""
    model, head, optimizer = state.model, state.heads[name], state.optimizers[name]
    params = optimizer.param_groups[0]["params"]
    device = params[0].device  # the critic's: its head's and its adapter's
    ids, old_values, returns = batch.ids, batch.values, batch.returns
    stats = defaultdict(list)
    nonfinite = 0
    n = min(cfg.critic_steps, len(order))  # 10 rows in 3 steps: 3, 3 and 4 rows
    for k in range(n):
        mb = order[k * len(order) // n:(k + 1) * len(order) // n]
        optimizer.zero_grad(set_to_none=False)
        rows = procs.share(mb)  # under torchrun: this process's rows; the gradients summed below
        for idx in token_batches([(len(ids[i]), 0) for i in rows], cfg.micro_batch_tokens):
            micro = [rows[j] for j in idx]
            # to the device before the forward pass is queued: a host-to-device copy waits
            v_old, v_target = old_values[micro].to(device), returns[micro].to(device)  # (b,) each
            v = critic_values(model, head, name, [ids[i] for i in micro], pad_id)  # (b,)
            loss, st = value_loss(v, v_old, v_target, cfg.value_clip or None)
            # micro-batches of one mini-batch add up to its mean loss
            (cfg.vf_coef * loss * len(micro) / len(mb)).backward()
            for stat, x in st.items():  # value_loss, and with a clip how often it held one back
                stats[stat].append(x.item())
        procs.sum_grads(params)
        total = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if not torch.isfinite(total):  # a NaN or inf loss: the step would make the critic NaN
            nonfinite += 1
            continue
        stats["grad_norm"].append(total.item())
        optimizer.step()
    stats["skipped_nonfinite"].append(nonfinite)
    return stats


def critic_metrics(calls: list[Call], batch: CriticBatch) -> dict[str, float]:
    """Explained variance of the rollout values; values, returns and advantages per role and
    slot; per role, what a central critic reads that a decentral one does not (`unseen`)."""
    m = {}
    ev = explained_variance(batch.values, batch.returns)
    if ev == ev:  # nan when every return is equal: nothing to explain, nothing logged
        m["critic/explained_variance"] = ev
    gaps = defaultdict(list)
    for c, share in zip(calls, unseen(calls)):
        if share is not None:
            gaps[c.role].append(share)
    m.update({f"role/{role}/unseen": sum(v) / len(v) for role, v in gaps.items()})
    for key in ("role", "slot"):
        groups = defaultdict(list)
        for i, c in enumerate(calls):
            groups[getattr(c, key)].append(i)
        for name, idx in groups.items():
            m[f"{key}/{name}/value"] = batch.values[idx].mean().item()
            m[f"{key}/{name}/return"] = batch.returns[idx].mean().item()
            m[f"{key}/{name}/adv"] = sum(calls[i].advantage for i in idx) / len(idx)
    return m
