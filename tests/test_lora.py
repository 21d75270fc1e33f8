"""LoRA: no-op start, gradient routing under shared and isolated sharing, merging, save/load."""
import json
import os

import pytest
import torch

from lora import (LoRALinear, adapter_for, adapter_parameters, inject_lora, lora_layers,
                  load_adapters, merged_adapter, save_adapters, set_adapter, setup_adapters,
                  use_adapter)
from model import tiny_model


def batch(vocab: int, B: int = 2, T: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(1))


def randomize(model, name: str, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model, name):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_fresh_adapter_is_bit_identical(tiny):
    model, tok = tiny
    ids = batch(len(tok))
    before = model(ids).logits
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator"], "shared")
    set_adapter(model, "shared")
    assert torch.equal(model(ids).logits, before)


def test_targets_every_attention_and_mlp_linear(tiny):
    model, _ = tiny
    layers = inject_lora(model, r=4, alpha=8)
    assert len(layers) == 2 * 7  # 2 blocks x (q, k, v, o, gate, up, down)
    assert all(l.scaling == 2.0 for l in layers)


def test_only_adapter_parameters_get_gradients(tiny):
    model, tok = tiny
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator"], "shared")
    randomize(model, "shared")  # B != 0, so A gets a gradient too
    for p in adapter_parameters(model, "shared"):
        p.requires_grad_(True)
    with use_adapter(model, "shared"):
        model(batch(len(tok))).logits.sum().backward()
    adapter = {id(p) for p in adapter_parameters(model, "shared")}
    for name, p in model.named_parameters():
        if id(p) in adapter:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name


def role_grads(model, tok, sharing: str, roles: list[str], loss_role: str) -> dict[str, float]:
    """Gradient norm of every adapter after a loss on `loss_role`'s tokens only."""
    names = setup_adapters(model, roles, sharing)
    for n in names:
        randomize(model, n, seed=len(n))
        for p in adapter_parameters(model, n):
            p.requires_grad_(True)
            p.grad = None
    with use_adapter(model, adapter_for(loss_role, sharing)):
        model(batch(len(tok))).logits.square().mean().backward()
    return {n: sum(float(p.grad.norm()) if p.grad is not None else 0.0
                   for p in adapter_parameters(model, n)) for n in names}


def test_isolated_loss_reaches_only_its_role(tiny):
    model, tok = tiny
    inject_lora(model, r=4, alpha=8)
    roles = ["orchestrator", "worker", "synthesizer"]
    norms = role_grads(model, tok, "isolated", roles, "worker")
    assert sorted(norms) == sorted(roles)
    assert norms["worker"] > 0
    assert norms["orchestrator"] == 0 and norms["synthesizer"] == 0


def test_shared_every_role_reaches_the_one_adapter(tiny):
    for role in ("generator", "aggregator"):
        model, tok = tiny_model()
        inject_lora(model, r=4, alpha=8)
        norms = role_grads(model, tok, "shared", ["generator", "aggregator"], role)
        assert list(norms) == ["shared"] and norms["shared"] > 0


def test_isolated_costs_adapters_not_models(tiny):
    model, _ = tiny
    base = sum(p.numel() for p in model.parameters())
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["orchestrator", "worker", "synthesizer"], "isolated")
    one = sum(p.numel() for p in adapter_parameters(model, "worker"))
    assert sum(p.numel() for p in model.parameters()) == base + 3 * one
    assert one < base / 10


def test_adapters_off_equals_base(tiny):
    model, tok = tiny
    ids = batch(len(tok))
    before = model(ids).logits
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator"], "isolated")
    randomize(model, "generator")
    with use_adapter(model, "generator"):
        assert not torch.allclose(model(ids).logits, before)
    with use_adapter(model, None):
        assert torch.equal(model(ids).logits, before)


def test_save_load_round_trip(tiny, tmp_path):
    model, tok = tiny
    ids = batch(len(tok))
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator", "evaluator"], "isolated")
    randomize(model, "generator", 1)
    randomize(model, "evaluator", 2)
    save_adapters(model, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["evaluator", "generator"]
    assert sorted(os.listdir(tmp_path / "generator")) == ["adapter_config.json",
                                                          "adapter_model.safetensors"]
    fresh, _ = tiny_model()
    inject_lora(fresh, r=4, alpha=8)
    load_adapters(fresh, str(tmp_path), ["generator", "evaluator"])
    for name in ("generator", "evaluator"):
        with use_adapter(model, name), use_adapter(fresh, name):
            assert torch.equal(model(ids).logits, fresh(ids).logits)


def test_a_saved_adapter_of_another_rank_is_refused(tiny, tmp_path):
    model, _ = tiny
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator"], "shared")
    save_adapters(model, str(tmp_path))
    other, _ = tiny_model()
    inject_lora(other, r=2, alpha=8)
    with pytest.raises(ValueError, match="shape"):
        load_adapters(other, str(tmp_path), ["shared"])


@pytest.mark.parametrize("sharing", ["shared", "isolated"])
def test_peft_loads_each_saved_adapter_with_the_same_logits(tiny, tmp_path, sharing):
    """Hugging Face PEFT reads the saved directories as its own LoRA adapters."""
    import peft  # a test dependency only: the project never imports it
    model, tok = tiny
    ids = batch(len(tok))
    inject_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    names = setup_adapters(model, ["generator", "evaluator"], sharing)
    for i, name in enumerate(names):
        randomize(model, name, i + 1)
    save_adapters(model, str(tmp_path))
    for name in names:
        config = json.load(open(tmp_path / name / "adapter_config.json"))
        assert config["r"] == 4 and config["lora_alpha"] == 8
        assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
        base, _ = tiny_model()  # the same random weights as `model`'s base
        theirs = peft.PeftModel.from_pretrained(base.eval(), str(tmp_path / name))
        with use_adapter(model, name), torch.no_grad():
            ours = model(ids).logits
            assert torch.allclose(theirs(input_ids=ids).logits, ours, atol=1e-4)
        with theirs.disable_adapter(), torch.no_grad():  # and the adapter does change the logits
            assert not torch.allclose(theirs(input_ids=ids).logits, ours, atol=1e-2)


def test_use_adapter_restores_previous_and_rejects_unknown(tiny):
    model, _ = tiny
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator", "aggregator"], "isolated")
    set_adapter(model, "generator")
    with use_adapter(model, "aggregator"):
        assert all(l.active == "aggregator" for l in lora_layers(model))
    assert all(l.active == "generator" for l in lora_layers(model))
    try:
        set_adapter(model, "critic")
    except KeyError as e:
        assert "critic" in str(e)
    else:
        raise AssertionError("unknown adapter accepted")


def test_lora_linear_matches_formula():
    base = torch.nn.Linear(5, 3)
    layer = LoRALinear(base, r=2, alpha=6)
    layer.add("a")
    with torch.no_grad():
        layer.lora_B["a"].fill_(0.5)
    layer.active = "a"
    x = torch.randn(4, 5)
    expected = base(x) + 3.0 * (x @ layer.lora_A["a"].t() @ layer.lora_B["a"].t())
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_merged_adapter_is_the_low_rank_path_and_puts_the_base_back(tiny):
    model, tok = tiny
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator"], "shared")
    randomize(model, "shared")
    ids = batch(len(tok))
    with use_adapter(model, "shared"):
        low_rank = model(ids).logits
    weights = [l.base.weight for l in lora_layers(model)]
    copies = [w.clone() for w in weights]
    with merged_adapter(model, "shared"):
        merged = model(ids).logits
        assert all(l.active is None for l in lora_layers(model))  # no second low-rank path
    assert (merged - low_rank).abs().max() < 1e-5 * low_rank.abs().max()
    assert (merged - model(ids).logits).abs().max() > 1e-2  # the adapter did change the output
    with pytest.raises(RuntimeError), merged_adapter(model, "shared"):
        raise RuntimeError("a stage that fails half-way")
    for layer, w, c in zip(lora_layers(model), weights, copies):
        assert layer.base.weight is w and torch.equal(w, c)  # the same tensors, bit for bit
    with pytest.raises(KeyError):
        with merged_adapter(model, "nope"):
            pass


def test_merges_of_different_adapters_write_into_the_same_weight_tensors(tiny):
    """Merging writes in place: every weight keeps its address whichever adapter is merged (a
    CUDA graph that reads it serves them all), each merge is its adapter's low-rank path, the
    base comes back bit for bit after each, and a merge inside a merge is refused, the outer one
    left as it was."""
    model, tok = tiny
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator", "evaluator"], "isolated")
    randomize(model, "generator", seed=0)
    randomize(model, "evaluator", seed=1)
    ids = batch(len(tok))
    weights = [l.base.weight for l in lora_layers(model)]
    addresses, base = [w.data_ptr() for w in weights], [w.clone() for w in weights]
    outputs = []
    for name in ("generator", "evaluator", "generator"):
        with use_adapter(model, name):
            low_rank = model(ids).logits
        with merged_adapter(model, name):
            outputs.append(model(ids).logits)
            assert [l.base.weight.data_ptr() for l in lora_layers(model)] == addresses
        assert (outputs[-1] - low_rank).abs().max() < 1e-5 * low_rank.abs().max()
        assert all(l.base.weight is w for l, w in zip(lora_layers(model), weights))
        assert all(torch.equal(w, b) for w, b in zip(weights, base))
    assert (outputs[0] - outputs[1]).abs().max() > 1e-2 and torch.equal(outputs[0], outputs[2])
    with merged_adapter(model, "generator"):
        with pytest.raises(RuntimeError, match="merged into the weights already"):
            with merged_adapter(model, "evaluator"):
                pass
        assert torch.equal(model(ids).logits, outputs[0])
    assert all(torch.equal(w, b) for w, b in zip(weights, base))


def test_merged_bf16_base_differs_by_no_more_than_bf16_rounding(tiny):
    """A bf16 base with fp32 adapters: the merged weights are rounded to bf16 once, which moves
    the logits by about as much as bf16 arithmetic does anyway. Restoring by subtraction would
    not give the base back: in bf16, (W + D) - D != W."""
    model, tok = tiny
    model.to(torch.bfloat16).float()  # weights that bf16 holds exactly, for the fp32 reference
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ["generator"], "shared")
    randomize(model, "shared")
    ids = batch(len(tok))
    with use_adapter(model, "shared"):
        exact = model(ids).logits  # fp32 arithmetic: the reference
    adapter_effect = (exact - model(ids).logits).abs().max()
    adapters = [p.detach().clone() for p in adapter_parameters(model, "shared")]
    model.to(torch.bfloat16)
    for p, kept in zip(adapter_parameters(model, "shared"), adapters):
        p.data = kept  # fp32 adapters over the bf16 base, as load_policy + inject_lora build them
    base = [l.base.weight.clone() for l in lora_layers(model)]
    with use_adapter(model, "shared"):
        low_rank = model(ids).logits.float()
    with merged_adapter(model, "shared"):
        merged = model(ids).logits.float()
    bf16_noise = (low_rank - exact).abs().max()
    assert bf16_noise > 0
    assert (merged - exact).abs().max() < 2 * bf16_noise < adapter_effect / 5
    assert all(torch.equal(l.base.weight, w) for l, w in zip(lora_layers(model), base))
    layer = lora_layers(model)[0]
    W = layer.base.weight
    D = (layer.merged_weight("shared").float() - W.float()).to(torch.bfloat16)
    assert not torch.equal((W + D) - D, W)


def test_a_second_injection_wraps_nothing_and_finds_every_target(tiny):
    """inject_lora on a model that holds its LoRA layers already: no layer wrapped twice, and no
    target reported missing."""
    model, _ = tiny
    first = inject_lora(model, r=4, alpha=8)
    assert first and inject_lora(model, r=4, alpha=8) == []
