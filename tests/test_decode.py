"""decode.py: the mask that keeps pad queries out of NaN, the sampler's draws, rows ended by any
of several end tokens, and the GPU's static-cache step (run eagerly here) against the CPU's
decoder, transformers' generate and a scoring pass, on the model families it serves; the others
are refused by name and by its check against the model's forward pass."""
import itertools
import warnings

import pytest
import torch

import decode as decode_module
from decode import (GREEDY, Sampler, decode, end_tokens, forward_padded, graph_decode,
                    padded_causal_mask, rms_norm, sample_next)
from lora import inject_lora, lora_layers, merged_adapter, setup_adapters, use_adapter
from rollout import Call, chat_text, cut_at_eos, left_pad, sequence_logprobs


def prompts(tok, texts):
    return left_pad(tok([chat_text(tok, [{"role": "user", "content": t}]) for t in texts],
                        add_special_tokens=False).input_ids, tok.pad_token_id)


def test_the_mask_hides_pads_from_real_queries_and_shows_a_pad_query_itself():
    attn = torch.tensor([[0, 0, 1, 1]])  # two pads, then two tokens
    mask = padded_causal_mask(attn, "sdpa", torch.float32)[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0],   # a pad query: itself alone (padding would leave it nothing)
                    [0, 1, 0, 0],
                    [0, 0, 1, 0],   # the first token: itself, no pad
                    [0, 0, 1, 1]]
    additive = padded_causal_mask(attn, "eager", torch.bfloat16)[0, 0]
    assert additive.dtype == torch.bfloat16
    assert ((additive == 0) == torch.tensor(mask).bool()).all()
    assert (additive[torch.tensor(mask) == 0] == torch.finfo(torch.bfloat16).min).all()


def test_an_empty_query_row_turns_real_tokens_nan_through_the_next_layer():
    """The mechanism, by hand: attention whose empty rows give NaN (as CUDA's fused kernels do)
    over two layers of a left-padded row. With padding alone as the mask, the pad's NaN output
    becomes its value in the next layer and reaches the real token as 0 x NaN; with the pad
    query shown itself, every output is finite and the real tokens' are unchanged."""
    torch.manual_seed(0)
    attn = torch.tensor([[0, 1, 1]])
    causal = torch.ones(3, 3).tril().bool()
    padding_only = (causal & attn.bool()[:, None, :])[:, None]  # (1, 1, 3, 3): row 0 empty

    def two_layers(mask):
        x = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            scores = (x @ x.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
            x = scores.softmax(-1) @ x  # an empty row: softmax of all -inf is NaN
        return x[0, 0]

    old, new = two_layers(padding_only), two_layers(padded_causal_mask(attn, "sdpa", torch.float32))
    assert old[1:].isnan().all()  # the real tokens, lost
    assert new.isfinite().all()
    x = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(1))
    s = (x @ x.transpose(-1, -2))[..., 1:, 1:].masked_fill(~causal[1:, 1:], float("-inf"))
    first = s.softmax(-1) @ x[..., 1:, :]  # the real tokens alone, one layer
    s = (first @ first.transpose(-1, -2)).masked_fill(~causal[1:, 1:], float("-inf"))
    assert torch.allclose(new[1:], (s.softmax(-1) @ first)[0, 0], atol=1e-6)


def test_the_padded_mask_leaves_real_tokens_logits_as_they_were(tiny):
    model, tok = tiny
    ids, attn = prompts(tok, ["What is 1 + 2?", "x", "Name three colours, then stop."])
    with torch.no_grad():
        ours = forward_padded(model, ids, attn).logits
        theirs = model(input_ids=ids, attention_mask=attn,
                       position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    real = attn.bool()
    assert torch.allclose(ours[real], theirs[real], atol=1e-5)
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            eager = forward_padded(model, ids, attn).logits
    finally:
        model.config._attn_implementation = "sdpa"
    assert torch.allclose(eager[real], theirs[real], atol=1e-5)


def test_the_static_step_writes_generates_greedy_tokens(tiny):
    """The GPU's decoder, its step run eagerly: transformers' generate's greedy tokens on
    left-padded prompts, some asked twice, rows ending at different steps, and it stops where
    `decode` stops although it asks whether all rows are done only every few tokens."""
    model, tok = tiny
    ids, attn = prompts(tok, ["What is 1 + 2?", "Name three colours, then stop.", "What is 1 + 2?",
                              "x", "What is 12 * 13? Think step by step."])
    free, _ = decode(model, ids, attn, 24, tok.eos_token_id, tok.pad_token_id, GREEDY)
    # the random model never says eos: tokens it writes stand in for it
    for stop in (free[0, 5].item(), free[3, 10].item()):
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=24, do_sample=False,
                             eos_token_id=stop, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
        static, logp = graph_decode(model, ids, attn, 24, stop, tok.pad_token_id, GREEDY,
                                    use_graph=False)
        dynamic, _ = decode(model, ids, attn, 24, stop, tok.pad_token_id, GREEDY)
        assert logp is None
        assert static.tolist() == out.tolist() == dynamic.tolist()


def test_a_second_end_token_stops_a_row(tiny):
    """Given two end tokens (Qwen3 ends a reply with <|im_end|> or <|endoftext|>), a row ends at
    whichever it writes first, pad after: both decoders write generate's tokens for the same
    list, and a row that wrote only the second is done (the batch stops before its budget)."""
    model, tok = tiny
    ids, attn = prompts(tok, ["What is 1 + 2?", "x", "Name three colours, then stop."])
    free, _ = decode(model, ids, attn, 24, -1, tok.pad_token_id, GREEDY)
    # the random model never says eos: a token that each row writes stands in for the second
    second = next(t for t in free[0, 2:].tolist() if all(t in row for row in free.tolist()))
    ends = [tok.eos_token_id, second]
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=24, do_sample=False,
                         eos_token_id=ends, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    dynamic, _ = decode(model, ids, attn, 24, ends, tok.pad_token_id, GREEDY)
    static, _ = graph_decode(model, ids, attn, 24, ends, tok.pad_token_id, GREEDY,
                             use_graph=False)
    assert dynamic.tolist() == static.tolist() == out.tolist()
    assert dynamic.shape[1] < 24 and (dynamic == second).any(-1).all()
    for row in dynamic.tolist():
        j = row.index(second)
        assert set(row[j + 1:]) <= {tok.pad_token_id}
    assert end_tokens(model, tok) == tok.eos_token_id  # the tiny model names no other
    model.generation_config.eos_token_id = [tok.eos_token_id, second]
    assert end_tokens(model, tok) == [tok.eos_token_id, second]


def test_the_static_step_records_the_log_probs_a_scoring_pass_gives(tiny):
    """Sampled through the static step under a merged adapter: each recorded log-prob equals a
    forward pass's over prompt and completion (fp32), token by token."""
    model, tok = tiny
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator"], "shared")
    for layer in lora_layers(model):  # a non-zero adapter, so that merging changes the weights
        torch.nn.init.normal_(layer.lora_B["shared"], std=0.05)
    ids, attn = prompts(tok, ["What is 1 + 2?", "What is 1 + 2?", "Name three colours."])
    torch.manual_seed(0)
    with merged_adapter(model, "shared"):
        new, logp = graph_decode(model, ids, attn, 16, tok.eos_token_id, tok.pad_token_id,
                                 Sampler(0.7), use_graph=False)
    calls = [Call(i, "generator", "generator0", 0, ids[i][attn[i].bool()].tolist(), new[i].tolist(),
                  "", "") for i in range(len(ids))]
    with torch.no_grad(), use_adapter(model, "shared"):
        scored, mask, _ = sequence_logprobs(model, calls, tok.pad_token_id, 0.7)
    assert logp.shape == new.shape == (3, 16)
    assert torch.allclose(logp, scored, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graph needs a GPU")
def test_graphs_of_successive_stages_replay_what_the_eager_step_computes(tiny):
    """As a run uses them: sampled under a merged adapter (fp32), then a stage of another shape
    captured after the first graph was dropped, in bf16: graphed and eager write the same tokens
    (a replay runs the kernels the eager step launches) and record the same log-probs."""
    model, tok = tiny
    model = model.cuda()
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator"], "shared")
    for layer in lora_layers(model):
        torch.nn.init.normal_(layer.lora_B["shared"], std=0.05)
    ids, attn = (t.cuda() for t in prompts(tok, ["What is 1 + 2?", "What is 1 + 2?", "x"]))
    runs = []
    for use_graph in (False, True):
        torch.manual_seed(0)
        with merged_adapter(model, "shared"):
            runs.append(graph_decode(model, ids, attn, 16, -1, tok.pad_token_id, Sampler(0.7, 0.9),
                                     use_graph=use_graph))
    (eager, eager_logp), (graphed, graphed_logp) = runs
    assert graphed.tolist() == eager.tolist() and torch.equal(graphed_logp, eager_logp)
    model = model.to(torch.bfloat16)
    ids, attn = (t.cuda() for t in prompts(tok, ["Name three colours, then stop.", "y"] * 3))
    eager, _ = graph_decode(model, ids, attn, 24, -1, tok.pad_token_id, GREEDY,
                            use_graph=False)
    graphed, _ = graph_decode(model, ids, attn, 24, -1, tok.pad_token_id, GREEDY)
    assert graphed.tolist() == eager.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graph needs a GPU")
def test_the_graph_decoder_waits_for_the_gpu_every_few_tokens_not_every_token(tiny):
    """The host waits for the GPU (a synchronising call, as torch's sync debug mode reports each)
    as often for 16 tokens as for 48, but for the question "which rows are done?" asked every
    CHECK_EVERY tokens: a wait added to the token loop would add 32. The step's check and its
    graph's capture (which wait) come first, once for both."""
    model, tok = tiny
    model = model.cuda()
    ids, attn = (t.cuda() for t in prompts(tok, ["What is 1 + 2?", "x", "Name three colours."]))
    graph_decode(model, ids, attn, 48, -1, tok.pad_token_id, Sampler(top_p=0.9))

    def waits(tokens: int) -> int:
        torch.manual_seed(0)
        with pytest.warns(UserWarning) as seen:
            torch.cuda.set_sync_debug_mode("warn")
            try:
                graph_decode(model, ids, attn, tokens, -1, tok.pad_token_id, Sampler(top_p=0.9))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchronizing" in str(w.message) for w in seen)

    short, long = waits(16), waits(48)
    assert short > 0 and long - short == (48 - 16) // decode_module.CHECK_EVERY, (short, long)


FIVE = ["What is 1 + 2?", "Name three colours, then stop.", "What is 1 + 2?", "x",
        "What is 12 * 13? Think step by step."]


def small_buckets(monkeypatch) -> list[tuple[int, int]]:
    """Length buckets of 4 columns and a check every other token, so that a short stage of the
    tiny model crosses them; the (rows, columns) bucket of every step the static path runs."""
    monkeypatch.setattr(decode_module, "COLUMNS", 4)
    monkeypatch.setattr(decode_module, "CHECK_EVERY", 2)
    seen, run = [], decode_module.StaticStep.run

    def recorded(step, rows, columns, use_graph):
        seen.append((rows, columns))
        return run(step, rows, columns, use_graph)
    monkeypatch.setattr(decode_module.StaticStep, "run", recorded)
    return seen


def adapted(model, names):
    """The model with LoRA adapters `names` that change its outputs."""
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, names, "isolated")
    torch.manual_seed(0)
    for layer in lora_layers(model):
        for name in names:
            torch.nn.init.normal_(layer.lora_B[name], std=0.05)
    return model


def test_finished_rows_leave_and_the_length_buckets_grow_with_decode_s_tokens(tiny, monkeypatch):
    """Greedy, rows ending at different steps: the static path starts in the rows bucket of 8,
    moves to smaller ones as rows finish and to longer length buckets as they write, never
    attending over more than a bucket past the written columns, and writes `decode`'s tokens."""
    model, tok = tiny
    ids, attn = prompts(tok, FIVE)
    P = ids.shape[1]
    free, _ = decode(model, ids, attn, 24, -1, tok.pad_token_id, GREEDY)
    ends = [free[0, 2].item(), free[4, 9].item(), free[1, 19].item()]  # stand-ins for eos
    seen = small_buckets(monkeypatch)
    static, _ = graph_decode(model, ids, attn, 24, ends, tok.pad_token_id, GREEDY, use_graph=False)
    dynamic, _ = decode(model, ids, attn, 24, ends, tok.pad_token_id, GREEDY)
    assert static.tolist() == dynamic.tolist()
    rows, columns = zip(*seen)
    assert rows[0] == 8 and len(set(rows)) >= 3 and list(rows) == sorted(rows, reverse=True)
    assert len(set(columns)) >= 4 and list(columns) == sorted(columns)
    assert all(0 <= c - (P + t + 1) < 4 for t, c in enumerate(columns))


def test_sampled_through_the_buckets_each_log_prob_is_the_scoring_pass_s(tiny, monkeypatch):
    """Sampled under a merged adapter, rows leaving and length buckets crossed: every recorded
    log-prob equals a forward pass's over prompt and completion. With no row ending, the draws
    are the same ones, and the buckets change no token against one whole cache."""
    model, tok = tiny
    adapted(model, ["generator"])
    ids, attn = prompts(tok, FIVE)
    torch.manual_seed(0)
    whole = graph_decode(model, ids, attn, 16, -1, tok.pad_token_id, Sampler(0.7), use_graph=False)
    ends = [whole[0][0, 3].item(), whole[0][4, 6].item()]  # stand-ins for eos
    seen = small_buckets(monkeypatch)
    torch.manual_seed(1)
    with merged_adapter(model, "generator"):
        new, logp = graph_decode(model, ids, attn, 16, ends, tok.pad_token_id, Sampler(0.7),
                                 use_graph=False)
    assert len({rows for rows, _ in seen}) >= 2  # rows left the batch
    calls = [Call(i, "generator", "generator0", 0, ids[i][attn[i].bool()].tolist(),
                  cut_at_eos(new[i].tolist(), ends), "", "") for i in range(len(ids))]
    with torch.no_grad(), use_adapter(model, "generator"):
        scored, mask, _ = sequence_logprobs(model, calls, tok.pad_token_id, 0.7)
    assert mask.sum(-1).min() < 16  # some rows ended
    assert torch.allclose(logp[:, : mask.shape[1]][mask.bool()], scored[mask.bool()], atol=1e-4)
    torch.manual_seed(0)
    bucketed = graph_decode(model, ids, attn, 16, -1, tok.pad_token_id, Sampler(0.7),
                            use_graph=False)
    assert bucketed[0].tolist() == whole[0].tolist() and torch.equal(bucketed[1], whole[1])


def test_later_stages_run_in_the_kept_cache_under_another_merged_adapter(tiny, monkeypatch):
    """The static step, its cache and (on a GPU) its graphs are kept from stage to stage: a
    later stage with fewer rows and columns, under another adapter merged in place, runs in the
    same memory and layout and writes the low-rank path's tokens; one of fewer, longer rows lays
    the same memory out anew (the cache holds the most rows x columns a stage needed, not the
    most rows times the most columns); one with more rows grows it, and a model whose weights
    moved (another dtype) gets a new one."""
    model, tok = tiny
    adapted(model, ["generator", "evaluator"])
    small_buckets(monkeypatch)
    ids, attn = prompts(tok, FIVE)
    with merged_adapter(model, "generator"):
        graph_decode(model, ids, attn, 12, -1, tok.pad_token_id, GREEDY, use_graph=False)
    step = decode_module.STEPS[model][1]
    address, first = step.keys[0].data_ptr(), step.layout
    assert first == (8, decode_module.columns_bucket(ids.shape[1] + 12))
    ids, attn = prompts(tok, ["y", "Name three colours."])
    long = decode_module.columns_bucket(ids.shape[1] + 3 * first[1])
    for new_tokens, layout in ((12, first), (3 * first[1], (2, long))):
        with merged_adapter(model, "evaluator"):
            merged, _ = graph_decode(model, ids, attn, new_tokens, -1, tok.pad_token_id, GREEDY,
                                     use_graph=False)
        assert decode_module.STEPS[model][1] is step and step.keys[0].data_ptr() == address
        assert step.layout == layout and len(step.all_valid) == first[0] * first[1]
        with use_adapter(model, "evaluator"):
            low_rank, _ = decode(model, ids, attn, new_tokens, -1, tok.pad_token_id, GREEDY)
        assert merged.tolist() == low_rank.tolist()
    ids, attn = prompts(tok, FIVE * 2)
    with merged_adapter(model, "evaluator"):
        graph_decode(model, ids, attn, 4, -1, tok.pad_token_id, GREEDY, use_graph=False)
    grown = decode_module.STEPS[model][1]
    assert grown is not step and len(grown.token) == 16 and grown.keys[0].dtype == torch.float32
    model.to(torch.bfloat16)
    graph_decode(model, ids, attn, 4, -1, tok.pad_token_id, GREEDY, use_graph=False)
    assert decode_module.STEPS[model][1].keys[0].dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graph needs a GPU")
def test_graphs_captured_in_one_stage_serve_the_next_under_another_adapter(tiny, monkeypatch):
    """Under small buckets, a stage captures a graph per bucket it visits; a second stage of the
    same shape under another merged adapter captures none, and its replays write what the eager
    step writes under that adapter."""
    model, tok = tiny
    model = adapted(model.cuda(), ["generator", "evaluator"])
    seen = small_buckets(monkeypatch)
    ids, attn = (t.cuda() for t in prompts(tok, FIVE))
    with merged_adapter(model, "generator"):
        graph_decode(model, ids, attn, 16, -1, tok.pad_token_id, GREEDY)
    step = decode_module.STEPS[model][1]
    captured = dict(step.graphs)
    assert len(captured) == len(set(seen)) >= 4
    with merged_adapter(model, "evaluator"):
        graphed, _ = graph_decode(model, ids, attn, 16, -1, tok.pad_token_id, GREEDY)
        eager, _ = graph_decode(model, ids, attn, 16, -1, tok.pad_token_id, GREEDY,
                                use_graph=False)
    assert decode_module.STEPS[model][1] is step and step.graphs == captured
    assert graphed.tolist() == eager.tolist()


def test_a_rotary_table_that_changes_with_the_length_is_refused_by_the_static_step(tiny,
                                                                                    monkeypatch):
    """"dynamic" and "longrope" rotary embeddings recompute their table when a sequence outgrows
    it, a branch on the host that a CUDA graph cannot hold: refused by name."""
    model, tok = tiny
    monkeypatch.setattr(model.model.rotary_emb, "rope_type", "dynamic")
    ids, attn = prompts(tok, ["What is 1 + 2?"])
    with pytest.raises(ValueError, match="rope_type 'dynamic' cannot be captured"):
        graph_decode(model, ids, attn, 4, -1, tok.pad_token_id, use_graph=False)
    # the rollout decodes it with `decode` on a GPU too
    assert decode_module.static_refusal(model).startswith("rope_type 'dynamic'")


# Tiny random models of Hugging Face families (config class, settings beyond TINY_SHAPE): the
# static step writes out the first five; the rest differ in ways it does not write.
TINY_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.4)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "qwen3-yarn": ("Qwen3Config", dict(max_position_embeddings=2048, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=512))),
    "qwen2": ("Qwen2Config", {}),  # biases on q, k and v, drawn below
    "mistral": ("MistralConfig", {}),
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2)),  # every 2nd layer unrotated
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=1 / 128, logits_scaling=8.0)),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "phi3": ("Phi3Config", {}),
}
STATIC = ("llama", "llama3-rope", "qwen3-yarn", "qwen2", "mistral")
# left-padded rows of token ids, one asked twice (one shared prefill)
FAMILY_ROWS = [[5, 9, 33, 47, 8], [17, 3], [5, 9, 33, 47, 8], [60, 61, 62, 70, 90, 100, 4]]


def family_model(family: str, **settings):
    """A tiny random model of `family` (FAMILIES), in eval mode; skipped where this transformers
    lacks its config class."""
    import transformers
    name, own = FAMILIES[family]
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_class(**TINY_SHAPE | own | settings)).eval()
    for name, bias in model.named_parameters():  # zero at initialisation: make them count
        if name.endswith("bias"):
            torch.nn.init.normal_(bias, std=0.4)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_takes_the_static_step_only_where_it_writes_decode_s_tokens(family):
    """Each family's greedy tokens through the static step (run eagerly) are `decode`'s; a family
    the step does not write out is refused by name, so that the rollout decodes it with the plain
    loop, and graph_decode, called anyway, says so instead of writing other tokens."""
    model = family_model(family)
    ids, attn = left_pad(FAMILY_ROWS, 0)
    dynamic, _ = decode(model, ids, attn, 12, -1, 0, GREEDY)
    why = decode_module.static_refusal(model, ids.shape[1] + 12)
    if family in STATIC:
        assert why is None
        static, _ = graph_decode(model, ids, attn, 12, -1, 0, GREEDY, use_graph=False)
        assert static.tolist() == dynamic.tolist()
        assert all(len(set(row)) > 2 for row in static.tolist())  # not one token over and over
    else:
        assert why == f"the static step does not write {model.config.model_type} layers"
        with pytest.raises(ValueError, match="decode it with `decode`"):
            graph_decode(model, ids, attn, 12, -1, 0, GREEDY, use_graph=False)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in STATIC])
def test_the_self_check_alone_refuses_each_family_the_step_does_not_write(family, monkeypatch):
    """With the family list out of the way, the static step's check against the model's forward
    pass still refuses each: SmolLM3 and Granite, which it would decode wrong without an error,
    by their logits; Gemma, Gemma2, OLMo2 and Phi3 by the error the step raises. The refusal is
    said once, as a warning, and graph_decode declines the model."""
    model = family_model(family)
    monkeypatch.setattr(decode_module, "STATIC_FAMILIES", tuple(FAMILIES))
    with pytest.warns(UserWarning, match="it decodes with the plain loop"):
        why = decode_module.static_refusal(model)
    wrong = "step's logits stand" if family in ("smollm3", "granite") else "step fails on it"
    assert why.startswith(f"the static {wrong}"), why
    ids, attn = left_pad(FAMILY_ROWS, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the verdict is remembered: no second warning, no check
        with pytest.raises(ValueError, match="decode it with `decode`"):
            graph_decode(model, ids, attn, 12, -1, 0, GREEDY, use_graph=False)


def test_a_stage_longer_than_the_sliding_window_is_left_to_the_plain_loop():
    """Mistral attends over a sliding window, the static step over the whole cache: the same
    while a stage's columns fit the window, refused once they outgrow it."""
    model = family_model("mistral", sliding_window=16)
    ids, attn = left_pad(FAMILY_ROWS, 0)  # 7 columns
    assert decode_module.static_refusal(model, 7 + 9) is None
    static, _ = graph_decode(model, ids, attn, 9, -1, 0, GREEDY, use_graph=False)
    assert static.tolist() == decode(model, ids, attn, 9, -1, 0, GREEDY)[0].tolist()
    assert "outgrow the 16-token sliding window" in decode_module.static_refusal(model, 7 + 10)
    with pytest.raises(ValueError, match="outgrow the 16-token sliding window"):
        graph_decode(model, ids, attn, 10, -1, 0, GREEDY, use_graph=False)


def test_the_plan_line_names_the_decoder(tiny):
    model, _ = tiny
    assert decode_module.decoder_plan(model) == "plain loop (no GPU)"
    if torch.cuda.is_available():
        assert decode_module.decoder_plan(model.cuda()) == "static graph"
        gemma = family_model("gemma").cuda()
        assert decode_module.decoder_plan(gemma) == ("plain loop (the static step does not "
                                                     "write gemma layers)")


def test_the_sampler_draws_from_the_softmax_and_its_nucleus():
    """sample_next's inverse-CDF draws: frequencies within 4 standard errors of the softmax at
    the temperature, the recorded log-probs are log_softmax's, and top_p keeps only the nucleus."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(20000, 1)
    torch.manual_seed(0)
    tokens, logp = sample_next(logits, temperature=0.7)
    expected = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    se = (expected * (1 - expected) / len(tokens)).sqrt()
    assert ((freq - expected).abs() <= 4 * se + 1e-9).all(), (freq, expected)
    expected_logp = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logp, expected_logp)
    # p = .64 .24 .09 .03 ...: the nucleus keeps 0 and 1
    tokens, _ = sample_next(logits, temperature=1.0, top_p=0.8)
    assert set(tokens.tolist()) == {0, 1}
    kept = torch.softmax(logits[0, :2], -1)[0]
    assert abs((tokens == 0).float().mean() - kept) < 4 * (kept * (1 - kept) / len(tokens)).sqrt()




def test_a_draw_of_zero_picks_no_token_of_zero_probability(monkeypatch):
    """torch.rand can return exactly 0: the draw must still land on a token the distribution
    (or its nucleus) gives a probability, never on token 0 where its probability is 0."""
    monkeypatch.setattr(torch, "rand", lambda *shape, device=None: torch.zeros(*shape))
    tokens, logp = sample_next(torch.tensor([[-float("inf"), 0.0, 1.0]]), temperature=1.0)
    assert tokens.tolist() == [1] and logp.isfinite().all()
    tokens, _ = sample_next(torch.tensor([[0.0, 5.0, 5.0]]), temperature=1.0, top_p=0.5)
    assert tokens.tolist() == [1]  # token 0 is outside the nucleus (tokens 1 and 2)


def test_the_decoders_refuse_a_budget_of_no_token(tiny):
    model, tok = tiny
    ids, attn = left_pad([[5, 6, 7]], tok.pad_token_id)
    for run in (decode, graph_decode):
        with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
            run(model, ids, attn, 0, tok.eos_token_id, tok.pad_token_id)


def test_a_model_that_ignores_the_cache_argument_stops_the_decoders(tiny, monkeypatch):
    """A transformers whose models read `past_key_values` only would leave the prefill's cache
    empty, and each later step would see its last token alone: the decoders say so instead."""
    model, tok = tiny
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, cache=None, **kw: forward(*a, **kw))
    ids, attn = left_pad([[5, 6, 7]], tok.pad_token_id)
    unread = "a transformers whose models take `cache=`"
    with pytest.raises(RuntimeError, match=unread):
        decode(model, ids, attn, 4, tok.eos_token_id, tok.pad_token_id)
    with pytest.raises(RuntimeError, match=unread):
        graph_decode(model, ids, attn, 4, tok.eos_token_id, tok.pad_token_id, use_graph=False)


def test_rms_norm_is_the_modules_own_arithmetic_bit_for_bit():
    """The decoding step's norm gives what transformers' Llama and Qwen3 RMSNorm modules give, in
    fp32 and bf16: the weight multiplied after the cast down (multiplied before, in fp32, other
    bits come out)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    torch.manual_seed(0)
    for Norm, dtype in itertools.product((LlamaRMSNorm, Qwen3RMSNorm),
                                         (torch.float32, torch.bfloat16)):
        norm = Norm(96, eps=1e-5)  # not rms_norm's own default, nor the models' 1e-6
        torch.nn.init.normal_(norm.weight, 1.0, 0.2)
        norm.to(dtype)
        x = (3 * torch.randn(8, 1, 96)).to(dtype)
        assert torch.equal(rms_norm(norm, x), norm(x))
    normed = torch.nn.functional.rms_norm(x.float(), (96,), eps=1e-5)
    assert not torch.equal((norm.weight.float() * normed).to(x.dtype), norm(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's fused kernel needs a GPU")
def test_rms_norm_on_cuda_equals_the_modules_to_fp32_rounding():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    torch.manual_seed(0)
    norm = Qwen3RMSNorm(96, eps=1e-5).cuda()
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    x = 3 * torch.randn(8, 1, 96, device="cuda")
    assert torch.allclose(rms_norm(norm, x), norm(x), rtol=1e-5, atol=1e-6)


def test_the_static_step_reads_each_norm_s_own_weight_and_epsilon(tiny):
    """The tiny model (a Qwen3: its step also normalises each head's query and key) with norms
    whose weights are not 1 and whose epsilon is not the default: greedy, `decode`'s and
    generate's tokens, which differ between steps; sampled, the log-probs a scoring pass gives."""
    model, tok = tiny
    torch.manual_seed(0)
    for norm in [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]:
        torch.nn.init.normal_(norm.weight, 1.0, 0.3)
        norm.variance_epsilon = 1e-3
    ids, attn = prompts(tok, ["What is 1 + 2?", "x", "Name three colours, then stop."])
    static, _ = graph_decode(model, ids, attn, 12, -1, tok.pad_token_id, GREEDY,
                             use_graph=False)
    dynamic, _ = decode(model, ids, attn, 12, -1, tok.pad_token_id, GREEDY)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    assert static.tolist() == dynamic.tolist() == out.tolist()
    assert all(len(set(row)) > 2 for row in static.tolist())  # not one token over and over
    torch.manual_seed(1)
    new, logp = graph_decode(model, ids, attn, 12, tok.eos_token_id, tok.pad_token_id,
                             Sampler(0.7), use_graph=False)
    calls = [Call(i, "generator", "generator0", 0, ids[i][attn[i].bool()].tolist(), new[i].tolist(),
                  "", "") for i in range(len(ids))]
    with torch.no_grad():
        scored, _, _ = sequence_logprobs(model, calls, tok.pad_token_id, 0.7)
    assert logp.shape == scored.shape and torch.allclose(logp, scored, atol=1e-4)
