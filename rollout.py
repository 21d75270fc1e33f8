"""Rollout: generate one workflow stage in one batch, score tokens.

A workflow (workflows.py) calls `generate(role, slots, episodes, chats)` once per stage;
`Rollout.__call__` decodes all its calls in one batch (decode.py) under the role's LoRA adapter
and keeps a `Call` record of each. Sequence layout, shared by generation and scoring:

    [pad pad p p p p | c c c c eos pad]      prompt left-padded to P columns,
     <---- P ------>   <----- T ----->       completion right-padded to T

so completion token j of every row sits at column P + j, and its log-prob is
read from the logits at column P + j - 1 (the one-token shift).

Generation (KV cache, merged weights) and scoring (adapter beside the weights) round differently:
`Rollout` records log pi_rollout, which differs from pi_old, for grpo.py's tis_cap.

Exercised by: pytest tests/test_rollout.py, tests/test_distributed.py
"""
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from decode import (Sampler, as_ids, decode, end_tokens, forward_padded, graph_decode,
                    static_refusal)
from lora import adapter_for, merged_adapter, use_adapter

# The processes a pass is split between: here one, which takes every item and has nothing to add
# up. Under torchrun train.py hands in lab.machine.PROCESSES, which does it across processes.
ONE_PROCESS = SimpleNamespace(share=lambda items: items, sum=lambda t: t,
                              sum_grads=lambda params: None, gather=lambda items: items)

# ----------------------------------------------------------------------------
# Records and batching


@dataclass
class Call:
    """One LLM call of one episode, as generated; the trainer fills the rest."""
    episode: int             # index of the episode in the batch
    role: str                # role type, e.g. "generator"
    slot: str                # agent slot, e.g. "generator1"
    stage: int               # Rollout's n-th generation (Eval-Opt: 0 generator, 1 evaluator, ...)
    prompt_ids: list[int]    # (P_i,) without padding
    completion_ids: list[int]  # (T_i,) up to and including the first end token, if any
    prompt: str
    text: str                # completion decoded without special tokens
    truncated: bool = False  # stopped by max_new_tokens before its eos: an unfinished answer
    reward: float = 0.0      # the episode's outcome, broadcast (--credit own: the call's own)
    own_score: float | None = None  # a solving call's own answer, scored as a final answer
    advantage: float = 0.0
    rollout_logp: torch.Tensor | None = field(default=None, repr=False)  # (T_i,); None: greedy


def chat_text(tok, chat: list[dict[str, str]]) -> str:
    # enable_thinking=False: no <think> block in Qwen3's template; other templates ignore it
    return tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)


def context_length(model) -> int | None:
    """The most positions the model reads, prompt and completion together (None: not stated)."""
    return getattr(model.config, "max_position_embeddings", None)


def fit_prompt(ids: list[int], room: int) -> list[int]:
    """A prompt cut to `room` tokens: its head (system message, question) and its tail (the
    instruction, the assistant's turn), the middle - earlier agents' texts - dropped."""
    if len(ids) <= room:
        return ids
    head = room // 2
    return ids[:head] + ids[len(ids) - (room - head):]


def cut_at_eos(ids: list[int], eos_id: int | Collection[int]) -> list[int]:
    """Tokens up to and including the first end token (pad may equal eos: never mask by pad)."""
    ends = set(as_ids(eos_id))
    first = next((j for j, token in enumerate(ids) if token in ends), None)
    return ids if first is None else ids[: first + 1]


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """Lay sequences out as in the module docstring: input_ids (B, P+T), attention_mask (B, P+T),
    completion_mask (B, T)."""
    P = max(len(p) for p in prompts)
    T = max(max(len(c) for c in completions), 1)
    B = len(prompts)
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, P + T, dtype=torch.long)
    cmask = torch.zeros(B, T)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - len(p): P] = torch.tensor(p)
        ids[i, P: P + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, P - len(p): P + len(c)] = 1
        cmask[i, : len(c)] = 1
    return ids, attn, cmask


def left_pad(id_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (B, P) and attention_mask (B, P), padded on the left: the last column is real."""
    rows = [torch.tensor(row, dtype=torch.long) for row in id_lists]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_id, padding_side="left")
    attn = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left")
    return ids, attn


def token_batches(sizes: list[tuple[int, int]], max_tokens: int) -> list[list[int]]:
    """Consecutive micro-batches of rows (sizes[i]: row i's prompt and completion tokens) of at
    most max_tokens padded positions, which bounds activation memory; a longer row goes alone."""
    batches, current, P, T = [], [], 0, 0
    for i, (p, t) in enumerate(sizes):
        if current and (len(current) + 1) * (max(P, p) + max(T, t)) > max_tokens:
            batches.append(current)
            current, P, T = [], 0, 0
        current.append(i)
        P, T = max(P, p), max(T, t)
    return batches + [current] if current else batches


def completion_logits(model, ids: torch.Tensor, attn: torch.Tensor, T: int) -> torch.Tensor:
    """Logits that predict the T completion columns: (B, T, V)."""
    # The LM head on the last T+1 columns only: a (B, L, V) tensor would dominate memory.
    # Column P+j-1 predicts token P+j, so drop the last column: the one-token shift.
    out = forward_padded(model, ids, attn, logits_to_keep=T + 1)
    return out.logits[:, :-1].float()  # (B, T, V)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log pi(target) under logits scaled like the sampler: (B, T, V), (B, T) -> (B, T)."""
    logp = F.log_softmax(logits / temperature, dim=-1)  # (B, T, V)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)


def sequence_logprobs(model, calls: list[Call], pad_id: int, temperature: float = 1.0,
                      with_entropy: bool = False):
    """Log-probs of the calls' completion tokens (B, T), the mask (B, T), and with_entropy the
    entropy of each next-token distribution (B, T), else None."""
    packed = pack([c.prompt_ids for c in calls], [c.completion_ids for c in calls], pad_id)
    # to the device before the forward pass is queued: a host-to-device copy waits for the queue
    ids, attn, cmask = (t.to(model.device) for t in packed)  # (B, L), (B, L), (B, T)
    T = cmask.shape[1]
    logits = completion_logits(model, ids, attn, T)
    logp = token_logprobs(logits, ids[:, -T:], temperature)  # (B, T)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            all_logp = F.log_softmax(logits / temperature, dim=-1)  # (B, T, V)
            entropy = -(all_logp.exp() * all_logp).sum(-1)  # (B, T)
    return logp, cmask, entropy


def micro_batches(calls: list[Call], max_tokens: int) -> list[list[Call]]:
    """The calls, shortest first (little padding), in micro-batches of `token_batches`."""
    calls = sorted(calls, key=lambda c: (len(c.prompt_ids), len(c.completion_ids)))
    sizes = [(len(c.prompt_ids), len(c.completion_ids)) for c in calls]
    return [[calls[i] for i in idx] for idx in token_batches(sizes, max_tokens)]


@torch.no_grad()
def old_logprobs(model, calls: list[Call], adapter: str, pad_id: int, temperature: float,
                 micro_batch_tokens: int) -> dict[int, torch.Tensor]:
    """pi_old of every completion token under `adapter`: id(call) -> (T_i,), on the device."""
    old = {}
    with use_adapter(model, adapter):
        for micro in micro_batches(calls, micro_batch_tokens):
            logp, _, _ = sequence_logprobs(model, micro, pad_id, temperature)  # (b, T)
            for call, row in zip(micro, logp):
                old[id(call)] = row[: len(call.completion_ids)]  # (T_i,)
    return old


# ----------------------------------------------------------------------------
# The generate callback


class Rollout:
    """The `generate` callback of workflows.py: one batched model call per stage."""

    def __init__(self, model, tok, sharing: str, max_new_tokens: int = 64, temperature: float = 0.7,
                 top_p: float = 1.0, greedy: bool = False,
                 progress: Callable[[str], None] | None = None,
                 merge: bool = True, decoder: Callable | None = None):
        self.model, self.tok, self.sharing = model, tok, sharing
        self.decoder = decoder  # None: decode.graph_decode on a GPU, decode.decode on a CPU
        self.merge = merge  # the adapter folded into the weights
        self.max_new_tokens, self.sampler = max_new_tokens, Sampler(temperature, top_p, greedy)
        self.progress = progress  # told of every finished stage: a stage can take minutes on a CPU
        self.calls: list[Call] = []
        self.stages = 0  # one per generate call; also the `stage` of its calls
        context = context_length(model)
        self.room = None if context is None else context - max_new_tokens  # for a prompt
        self.prompts_cut = 0

    @torch.no_grad()
    def __call__(self, role: str, slots: list[str], episodes: list[int],
                 chats: list[list[dict[str, str]]]) -> list[str]:
        tok, model, start = self.tok, self.model, time.time()
        prompts = [chat_text(tok, c) for c in chats]
        rows = tok(prompts, add_special_tokens=False).input_ids
        fitted = [row if self.room is None else fit_prompt(row, self.room) for row in rows]
        cut = [i for i, (row, fit) in enumerate(zip(rows, fitted)) if fit is not row]
        for i in cut:  # the record says what the model read
            prompts[i] = tok.decode(fitted[i])
        self.prompts_cut += len(cut)
        ids, attn = (t.to(model.device) for t in left_pad(fitted, tok.pad_token_id))  # (B, P) each
        # On a GPU each token is a replay of one CUDA graph (where decode.static_refusal lets it)
        use_graph = (model.device.type == "cuda"
                     and static_refusal(model, ids.shape[1] + self.max_new_tokens) is None)
        decoder = self.decoder or (graph_decode if use_graph else decode)
        eos = end_tokens(model, tok)  # one id, or several where the model names more (Qwen3)
        adapter = adapter_for(role, self.sharing)
        with (merged_adapter if self.merge else use_adapter)(model, adapter):
            new, sampled = decoder(model, ids, attn, self.max_new_tokens, eos, tok.pad_token_id,
                                   self.sampler)  # (B, T) each
        new, sampled = new.cpu(), (None if sampled is None else sampled.cpu())
        for i in range(len(chats)):
            completion = cut_at_eos(new[i].tolist(), eos)
            text = tok.decode(completion, skip_special_tokens=True)
            truncated = completion[-1] not in as_ids(eos)
            logp = None if sampled is None else sampled[i, : len(completion)]
            self.calls.append(Call(episodes[i], role, slots[i], self.stages, list(fitted[i]),
                                   completion, prompts[i], text, truncated, rollout_logp=logp))
        self.stages += 1
        if self.progress:
            fits = f", {len(cut)} prompt(s) cut to fit the context" if cut else ""
            seconds = time.time() - start
            self.progress(f"stage {self.stages} {role} x{len(chats)}: {seconds:.0f}s{fits}")
        return [c.text for c in self.calls[-len(chats):]]
