"""Decoding: the token loop of one workflow stage, on a CPU and on a GPU.

Both decoders take left-padded prompts ids/attn (B, P) and return the new tokens (B, T), pad
after each row's eos, with log pi_rollout of each (B, T) (None when greedy). A row's eos is the
first of the end tokens it is given (`end_tokens`). Positions count real tokens only, so a
left-padded row is positioned as it would be alone, and each distinct prompt (a GRPO group's
samples share one) is prefilled once, its cache rows copied to every row that asked for it.

- `decode` (the CPU's): a cache that grows by one column a token, and rows that leave the
  batch once they wrote their eos. Every operation is a host call, which a CPU pays little for.
- `graph_decode` (CUDA's): a static cache kept from stage to stage, one decoding step
  (`StaticStep`) captured as a CUDA graph per (rows, columns) bucket and replayed per token, so
  a step costs one launch instead of about a thousand (30 layers x some 30 kernels) and reads
  the columns its rows have written, rounded up to a length bucket, not the stage's whole
  length. The host asks which rows are done every CHECK_EVERY tokens only. As nano-vllm's model
  runner (graphs per batch-size bucket, one pool) and gpt-fast's `decode_one_token` do; the
  length buckets stand in for their attention over each row's own length.

`StaticStep` writes a decoder layer out by hand, and a family whose layer differs would decode
other tokens without an error or fail inside the step. So it serves the families it is written
and tested for (STATIC_FAMILIES), and checks itself once per model, dtype and device against
the model's own forward pass. Every other model, a rotary table that changes with the length,
and a stage longer than a sliding window go to `decode`: the rollout asks `static_refusal`
which decoder to run, and `graph_decode` refuses such a model rather than decode it wrong.

Exercised by: pytest tests/test_decode.py, tests/test_rollout.py
"""
import itertools
import math
import warnings
import weakref
from collections.abc import Collection
from dataclasses import dataclass

import torch
from transformers import DynamicCache

CHECK_EVERY = 8  # tokens between the GPU decoder's questions "which rows are done?"
# A step attends over the written columns rounded up to a multiple of COLUMNS (wider: fewer
# graphs, more masked columns read), over a bucket of ROW_BUCKETS rows, then multiples of 16.
COLUMNS = 256
ROW_BUCKETS = (1, 2, 4, 8, 16)

# The model types whose decoder layer `StaticStep` writes out, Llama 3 and YaRN rotary scaling
# included, each tested on a tiny random model: Llama's (Mistral's is the same; Qwen2's biases on
# q, k and v are in its projections; Qwen3 normalises each head's query and key). Gemma, Gemma2,
# Granite, SmolLM3, OLMo2 and Phi3 differ in ways the step does not write (scaled embeddings,
# multipliers, layers without rotary, other norms, fused weights).
STATIC_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
PROBE_TOKENS = 8  # the prompt length of the static step's check against the model's forward
# How far the checked step's logits may stand from the forward pass's, as a fraction of their
# range. Rounding alone, measured on a CPU: under 1e-6 in fp32; in bf16 0.007 (a random
# Qwen3-0.6B), 0.011 (SmolLM2-135M), 0.015 (the tiny test models). A layer the step does not
# write, in the tiny test models: 0.36 (SmolLM3's layers without rotary, rotated), 3.8
# (Granite's multipliers ignored). A GPU's bf16 kernels round otherwise, not yet measured: a
# check that fails there costs speed (the plain loop, with a warning), never tokens.
FP32_TOLERANCE, HALF_TOLERANCE = 1e-4, 5e-2
CHECKED = weakref.WeakKeyDictionary()  # model -> {(dtype, device): static_refusal's check}


def padded_causal_mask(attn: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The (B, 1, L, L) mask of left-padded rows attn (B, L): causal, no query sees a pad key, a
    pad query sees itself. Boolean for SDPA (True: attend), additive (0 or min) for eager.

    A pad query that saw no key could be NaN in CUDA's fused kernels (transformers issue 38690;
    docs/performance.md), and reach real tokens through its keys and values, as 0 x NaN is NaN."""
    L = attn.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=attn.device).tril()  # (L, L)
    itself = torch.eye(L, dtype=torch.bool, device=attn.device)  # (L, L)
    mask = causal & (attn.bool()[:, None, :] | itself)  # (B, L, L): query i, key j
    mask = mask[:, None]  # (B, 1, L, L)
    if implementation == "sdpa":
        return mask
    additive = torch.zeros(mask.shape, dtype=dtype, device=attn.device)
    return additive.masked_fill(~mask, torch.finfo(dtype).min)


def forward_padded(model, ids: torch.Tensor, attn: torch.Tensor, **kw):
    """model(...) over left-padded rows, positions counting real tokens, under
    `padded_causal_mask` where a row is padded and the attention takes a 4-D mask."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, L): left padding does not shift positions
    implementation = model.config._attn_implementation
    mask = attn
    if implementation in ("sdpa", "eager") and not bool(attn.all()):
        mask = padded_causal_mask(attn, implementation, model.dtype)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw)


@dataclass(frozen=True)
class Sampler:
    """How a decoder picks each token: the most likely (greedy), or `sample_next`'s draw."""
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


GREEDY = Sampler(greedy=True)


def next_token(logits: torch.Tensor, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens (B,) `sampler` picks from logits (B, V), and their log pi_rollout (B,)."""
    if sampler.greedy:
        return logits.argmax(-1), None
    return sample_next(logits, sampler.temperature, sampler.top_p)


def sample_next(logits: torch.Tensor, temperature: float,
                top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits (B, V) at `temperature`, within the top_p nucleus: the
    tokens (B,) and their log pi_rollout (B,), as in pi_old without the nucleus cut.

    Inverse-CDF sampling, one uniform number a row, with no host synchronisation: on a CPU,
    torch.multinomial over a 49k vocabulary costs as much as a decoding step's matrix products."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, V)
    probs = logp.exp()
    if top_p < 1.0:  # keep the most likely tokens until their mass reaches top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p[sorted_p.cumsum(-1) - sorted_p >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    cdf = probs.cumsum(-1)  # (B, V)
    # u in (0, total]: a draw of exactly 0 would pick token 0 even where its probability is 0
    u = torch.rand(len(cdf), 1, device=cdf.device) * cdf[:, -1:]
    u = u.clamp(min=torch.finfo(cdf.dtype).tiny)  # (B, 1)
    tokens = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=cdf.shape[-1] - 1)  # (B,)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def as_ids(eos_id: int | Collection[int]) -> list[int]:
    return [eos_id] if isinstance(eos_id, int) else list(eos_id)


def end_tokens(model, tok) -> int | list[int]:
    """The ids that end a reply: the tokenizer's eos, then those of the model's generation_config
    (Qwen3's lists <|im_end|> and <|endoftext|>); one id where they agree."""
    listed = model.generation_config.eos_token_id
    ids = list(dict.fromkeys([tok.eos_token_id] + ([] if listed is None else as_ids(listed))))
    return ids[0] if len(ids) == 1 else ids


def check_length(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")


def prefill(model, ids: torch.Tensor,
            attn: torch.Tensor) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """The KV cache and next token's logits (U, V) of the U distinct prompts, and `copy` (B,):
    each row's distinct prompt."""
    P = ids.shape[1]
    distinct, copy = torch.unique(torch.cat([ids, attn.to(ids.dtype)], dim=-1), dim=0,
                                  return_inverse=True)  # (U, 2P), (B,)
    cache = DynamicCache()
    out = forward_padded(model, distinct[:, :P], distinct[:, P:], cache=cache, use_cache=True,
                         logits_to_keep=1)
    if len(cache.layers) != model.config.num_hidden_layers:  # `cache=` went unread
        raise RuntimeError(f"the prefill filled {len(cache.layers)} cache layers of "
                           f"{model.config.num_hidden_layers}: a transformers whose models take "
                           "`cache=` is needed (requirements.txt)")
    return cache, out.logits[:, -1], copy


# ----------------------------------------------------------------------------
# The CPU's decoder: a growing cache, finished rows leave


@torch.no_grad()
def decode(model, ids: torch.Tensor, attn: torch.Tensor, max_new_tokens: int,
           eos_id: int | Collection[int], pad_id: int, sampler: Sampler = Sampler()):
    """`model.generate`'s loop without its general machinery: greedy, its tokens."""
    check_length(max_new_tokens)
    B, device = ids.shape[0], ids.device
    ends = torch.tensor(as_ids(eos_id), device=device)  # (E,)
    cache, logits, copy = prefill(model, ids, attn)
    for layer in cache.layers:
        layer.batch_select_indices(copy)
    logits = logits[copy]  # (L, V): one row per live row, all B at first
    position = attn.long().sum(-1, keepdim=True) - 1  # (L, 1): positions count real tokens only
    live = torch.arange(B, device=device)  # (L,) the rows in the batch, by their index in it
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (L,) those that wrote their eos
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = None if sampler.greedy else torch.zeros(B, max_new_tokens, device=device)
    for t in range(max_new_tokens):
        token, logp = next_token(logits, sampler)
        if logps is not None:
            logps[live, t] = logp
        token = token.masked_fill(done, pad_id)  # (L,) a finished row only pads
        tokens[live, t] = token
        done |= torch.isin(token, ends)
        if t == max_new_tokens - 1 or done.all():
            break
        # Finished rows leave once they are an eighth: copying the cache costs about a step
        if done.sum() * 8 >= len(live):
            keep = (~done).nonzero().squeeze(-1)  # (L',)
            for layer in cache.layers:
                layer.batch_select_indices(keep)
            live, done, token = live[keep], done[keep], token[keep]
            attn, position = attn[keep], position[keep]
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)  # (L, P + t + 1)
        position = position + 1
        logits = model(input_ids=token[:, None], attention_mask=attn, position_ids=position,
                       cache=cache, use_cache=True).logits[:, -1]
    return tokens[:, : t + 1], None if logps is None else logps[:, : t + 1]


# ----------------------------------------------------------------------------
# The GPU's decoder: a static cache, one step captured as a CUDA graph


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:  # x: (..., D)
    """A Llama or Qwen3 RMSNorm's output as transformers computes it (mean square in fp32, weight
    in x's dtype) in one call: on CUDA one fused kernel in place of five."""
    normed = torch.nn.functional.rms_norm(x.float(), x.shape[-1:],
                                          eps=norm.variance_epsilon)  # (..., D) fp32
    return norm.weight * normed.to(x.dtype)  # (..., D) in x's dtype


def static_refusal(model, columns: int | None = None) -> str | None:
    """Why `StaticStep` cannot decode `model` (a stage of `columns` tokens), or None."""
    family = model.config.model_type
    if family not in STATIC_FAMILIES:
        return f"the static step does not write {family} layers"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope in ("dynamic", "longrope"):  # transformers recomputes these tables on the host
        return f"rope_type {rope!r} cannot be captured in a CUDA graph"
    window = getattr(model.config, "sliding_window", None)
    if columns is not None and window is not None and columns > window:
        return f"{columns} columns outgrow the {window}-token sliding window"
    verdicts = CHECKED.setdefault(model, {})
    key = (model.dtype, model.device)
    if key not in verdicts:
        verdicts[key] = check_static_step(model)
        if verdicts[key] is not None:
            warnings.warn(f"{family} model: {verdicts[key]}; it decodes with the plain loop")
    return verdicts[key]


@torch.no_grad()
def check_static_step(model) -> str | None:
    """One `StaticStep` on two prompts, one left-padded, against the model's forward pass: None
    where the logits agree to rounding, else how far apart they stand."""
    P, device = PROBE_TOKENS, model.device
    ids = (torch.arange(2 * P, device=device).view(2, P) * 37 + 11) % model.config.vocab_size
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # (2, P): the second row left-padded
    cache, logits, copy = prefill(model, ids, attn)
    token = logits[copy].argmax(-1)  # (2,)
    try:  # a layer whose modules the step does not find
        step = StaticStep(model, 2, 2 * (P + 1))
        step.lay_out(2, P + 1)
        step.fill(cache, copy, attn.bool())
        step.token.copy_(token)
        step.position.copy_(attn.sum(-1, keepdim=True))  # (2, 1) the new token's position
        step.column.fill_(P)
        static = step(2, P + 1)  # (2, V)
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:
        return f"the static step fails on it ({type(e).__name__}: {e})"
    ids, attn = torch.cat([ids, token[:, None]], -1), torch.cat([attn, attn[:, -1:]], -1)
    plain = forward_padded(model, ids, attn, logits_to_keep=1).logits[:, -1].float()  # (2, V)
    spread = plain.amax(-1) - plain.amin(-1)  # (2,)
    gap = float(((static - plain).abs().amax(-1) / spread).max())
    tolerance = FP32_TOLERANCE if model.dtype == torch.float32 else HALF_TOLERANCE
    if not gap <= tolerance:  # NaN included
        return (f"the static step's logits stand {gap:.2g} of their range from the model's "
                f"forward pass (tolerance {tolerance:g})")
    return None


def decoder_plan(model) -> str:
    """The decoder a stage of `model` runs, for a run's plan line."""
    why = "no GPU" if model.device.type != "cuda" else static_refusal(model)
    if why is not None:
        return f"plain loop ({why})"
    window = getattr(model.config, "sliding_window", None)
    return ("static graph" if window is None else
            f"static graph (plain loop past its {window}-token sliding window)")


class StaticStep:
    """One decoding step of a Llama-style model over a static KV cache of R rows by S columns,
    run over a bucket of its first rows and columns. Every tensor it touches keeps its address
    from stage to stage, so each bucket is captured as a CUDA graph once. It calls the model's
    own modules, so an adapter merged into the weights (lora.merged_adapter) is in it too.

    Inputs, set before each step: `token` (R,) each row's last token, `position` (R, 1) its
    position, `column` (1,) the cache column it goes in. `valid` (R, S): the columns holding a
    row's tokens; the step marks its own, so no row is empty (NaN)."""

    def __init__(self, model, R: int, cells: int):
        inner, config = model.model, model.config
        # the modules, not the model: a step kept for a model (STEPS) must not keep it alive
        self.inner, self.layers, self.lm_head = inner, inner.layers, model.lm_head
        attn = self.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        device, size = model.device, cells * self.kv_heads * self.head_dim
        self.room = [torch.zeros(size, dtype=model.dtype, device=device)  # keys, values a layer
                     for _ in range(2 * len(self.layers))]
        self.all_valid = torch.zeros(cells, dtype=torch.bool, device=device)
        self.token = torch.zeros(R, dtype=torch.long, device=device)
        self.position = torch.zeros(R, 1, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.logits = torch.zeros(R, model.lm_head.weight.shape[0], device=device)  # (R, V) fp32
        self.graphs = {}  # (R, S, rows, columns) -> the CUDA graph of that layout's bucket
        self.pool = None  # the memory pool every graph of the step shares (one runs at a time)
        self.layouts = set()  # the (R, S) that stages ran in

    def lay_out(self, R: int, S: int) -> None:
        """Keys and values (R, Hkv, S, d) a layer and valid (R, S) as views of the same memory
        whatever the layout; each layout has graphs of its own (their strides differ)."""
        Hkv, d = self.kv_heads, self.head_dim
        kv = [room[: R * Hkv * S * d].view(R, Hkv, S, d) for room in self.room]
        self.keys, self.values = kv[0::2], kv[1::2]  # (R, Hkv, S, d) a layer
        self.valid = self.all_valid[: R * S].view(R, S)
        self.layout = (R, S)
        self.layouts.add(self.layout)

    def fill(self, cache: DynamicCache, copy: torch.Tensor, valid: torch.Tensor) -> None:
        """The prefill's keys and values (U, Hkv, P, d) copied to the rows (`copy` (B,)), each
        layer's let go once copied so that the two caches are never whole side by side."""
        B, P = valid.shape
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            keys[:B, :, :P], values[:B, :, :P] = layer.keys[copy], layer.values[copy]
            layer.keys = layer.values = None
        self.valid.zero_()  # what an earlier stage left in the cache is masked; it is finite
        self.valid[:B, :P] = valid

    def keep(self, rows: torch.Tensor, written: int) -> None:
        """The rows `rows` (L,) move to the front, with their first `written` columns."""
        L = len(rows)
        for keys, values in zip(self.keys, self.values):
            keys[:L, :, :written] = keys[rows, :, :written]  # (L, Hkv, written, d)
            values[:L, :, :written] = values[rows, :, :written]
        self.valid[:L], self.position[:L] = self.valid[rows], self.position[rows]

    def run(self, rows: int, columns: int, use_graph: bool) -> torch.Tensor:
        """The logits (rows, V) of a bucket: its CUDA graph replayed, or the step run eagerly."""
        if not use_graph:
            return self(rows, columns)
        key = self.layout + (rows, columns)
        if key not in self.graphs:
            self.graphs[key] = capture(self, rows, columns)
        self.graphs[key].replay()
        return self.logits[:rows]

    def __call__(self, rows: int, columns: int) -> torch.Tensor:
        inner = self.inner
        B, H, Hkv, d = rows, self.heads, self.kv_heads, self.head_dim
        valid = self.valid[:B, :columns]  # (B, S'): the bucket's columns, no more
        valid.index_fill_(1, self.column, True)
        x = inner.embed_tokens(self.token[:B, None])  # (B, 1, D)
        cos, sin = inner.rotary_emb(x, self.position[:B])  # (B, 1, d) each
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, 1, d)
        # 0 where a row's column holds a token, -inf elsewhere: added to the scores, it scales
        # and masks them in one kernel, the same numbers as masking after scaling
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=x.device)
        bias = bias.masked_fill_(~valid, -math.inf)[:, None, None, :]  # (B, 1, 1, S')
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            keys, values = keys[:B, :, :columns], values[:B, :, :columns]  # (B, Hkv, S', d)
            a, h = layer.self_attn, rms_norm(layer.input_layernorm, x)
            q = a.q_proj(h).view(B, 1, H, d)
            k = a.k_proj(h).view(B, 1, Hkv, d)
            v = a.v_proj(h).view(B, 1, Hkv, d).transpose(1, 2)  # (B, Hkv, 1, d)
            if hasattr(a, "q_norm"):  # Qwen3 normalises each head's query and key
                q, k = rms_norm(a.q_norm, q), rms_norm(a.k_norm, k)
            # Rotary embedding (Su et al. 2021, arXiv 2104.09864) in the half-split layout of
            # Llama and Qwen3, of the queries and keys together: one set of kernels, not two
            qk = torch.cat([q, k], dim=2).transpose(1, 2)  # (B, H + Hkv, 1, d)
            first, second = qk.chunk(2, dim=-1)
            qk = qk * cos + torch.cat([-second, first], dim=-1) * sin
            q, k = qk[:, :H], qk[:, H:]  # (B, H, 1, d), (B, Hkv, 1, d)
            keys.index_copy_(2, self.column, k)
            values.index_copy_(2, self.column, v)
            # Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245), one query a row:
            # H query heads in Hkv groups, each reading its key/value head, the cache not copied
            q = q.view(B, Hkv, H // Hkv, d)  # (B, Hkv, g, d)
            scores = torch.add(bias, q @ keys.transpose(-1, -2), alpha=self.scale)  # (B,Hkv,g,S')
            p = scores.softmax(-1).to(values.dtype)
            out = (p @ values).reshape(B, 1, H * d)  # (B, 1, H*d)
            x = x + a.o_proj(out)
            x = x + layer.mlp(rms_norm(layer.post_attention_layernorm, x))
        return self.logits[:B].copy_(self.lm_head(rms_norm(inner.norm, x))[:, 0])  # (B, V)


def rows_bucket(n: int) -> int:
    return next((b for b in ROW_BUCKETS if b >= n), -(-n // ROW_BUCKETS[-1]) * ROW_BUCKETS[-1])


def columns_bucket(n: int) -> int:
    return -(-n // COLUMNS) * COLUMNS


def signature(model) -> tuple:
    """What a captured step reads of the model: dtype, device, its tensors' addresses and each
    LoRA layer's `active` adapter. Where it changed, the graphs would be stale."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return (model.dtype, model.device, tuple(t.data_ptr() for t in tensors),
            tuple(getattr(m, "active", None) for m in model.modules()))


STEPS = weakref.WeakKeyDictionary()  # model -> (signature, its StaticStep), kept across stages


def static_step(model, rows: int, columns: int) -> StaticStep:
    """The model's StaticStep laid out for a stage: in the smallest earlier layout that holds it
    (its graphs serve), else its own; a new one where the stage outgrows the cache or the model's
    signature changed."""
    now, (kept, step) = signature(model), STEPS.pop(model, (None, None))
    R, S = rows_bucket(rows), columns_bucket(columns)
    room, cells = R, R * S
    if kept == now:
        room, cells = max(R, len(step.token)), max(R * S, len(step.all_valid))
    if kept != now or (room, cells) != (len(step.token), len(step.all_valid)):
        del step  # the old cache goes before the new one is made
        step = StaticStep(model, room, cells)
    held = [(r, s) for r, s in step.layouts if r >= R and s >= S]
    step.lay_out(*min(held, key=lambda rs: rs[0] * rs[1], default=(R, S)))
    STEPS[model] = (now, step)
    return step


SIDE_STREAMS = {}  # device -> the one stream its graphs are warmed up and captured on


def capture(step: StaticStep, rows: int, columns: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `step` over a bucket, in the step's one memory pool; the warm-up runs
    write only the current column. On the step's own GPU (another's stream would leave the graph
    empty), on one side stream per device: cuBLAS keeps a workspace for every stream it ran on."""
    device = step.token.device
    with torch.cuda.device(device):
        if device not in SIDE_STREAMS:
            SIDE_STREAMS[device] = torch.cuda.Stream()
        side = SIDE_STREAMS[device]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # kernels' first runs (cuBLAS handles, workspaces) off it
            for _ in range(2):
                step(rows, columns)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=step.pool, stream=side):
            step(rows, columns)
        step.pool = graph.pool() if step.pool is None else step.pool
    return graph


@torch.no_grad()
def graph_decode(model, ids: torch.Tensor, attn: torch.Tensor, max_new_tokens: int,
                 eos_id: int | Collection[int], pad_id: int, sampler: Sampler = Sampler(),
                 use_graph: bool = True):
    """`decode`'s contract, each step a CUDA graph's replay (use_graph=False: eager, for the
    CPU's tests). Finished rows write pad until a check, and leave for a smaller rows bucket."""
    check_length(max_new_tokens)
    (B, P), device = ids.shape, ids.device
    why = static_refusal(model, P + max_new_tokens)
    if why is not None:
        raise ValueError(f"graph_decode cannot decode this model: {why}; decode it with `decode`")
    ends = torch.tensor(as_ids(eos_id), device=device)  # (E,)
    cache, logits, copy = prefill(model, ids, attn)
    step = static_step(model, B, P + max_new_tokens)
    step.fill(cache, copy, attn.bool())
    del cache
    logits = logits[copy]  # (U, V) -> (B, V)
    step.position[:B] = attn.long().sum(-1, keepdim=True) - 1  # the last prompt token's
    live = torch.arange(B, device=device)  # (L,) the rows in the batch, by their index in it
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (L,) those that wrote their eos
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = None if sampler.greedy else torch.zeros(B, max_new_tokens, device=device)
    rows = rows_bucket(B)
    for t in range(max_new_tokens):
        token, logp = next_token(logits, sampler)
        if logps is not None:
            logps[live, t] = logp
        token = token.masked_fill(done, pad_id)  # (L,) a finished row only pads
        tokens[live, t] = token
        done |= torch.isin(token, ends)
        if t == max_new_tokens - 1:
            break
        if t % CHECK_EVERY == CHECK_EVERY - 1:  # the host waits for the device here only
            left = int((~done).sum())
            if left == 0:
                break
            # Finished rows leave for a rows bucket an eighth smaller: moving costs about a step
            if rows_bucket(left) <= rows * 7 // 8:
                keep = (~done).nonzero().squeeze(-1)  # (L',)
                step.keep(keep, P + t)
                live, done, token, rows = live[keep], done[keep], token[keep], rows_bucket(left)
        step.token[: len(live)] = token
        step.position[: len(live)].add_(1)
        step.column.fill_(P + t)  # the columns before it are the prompt's and the tokens'
        logits = step.run(rows, columns_bucket(P + t + 1), use_graph)[: len(live)]
    # Rows all done before a check wrote only pad since: cut after the last row's first end
    # token (the pad may be one too), as `decode` stops.
    T = t + 1
    if bool(done.all()):
        T = int(torch.isin(tokens, ends).long().argmax(-1).max()) + 1
    return tokens[:, :T], None if logps is None else logps[:, :T]
