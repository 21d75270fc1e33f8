"""Hand-rolled LoRA with named adapters on one frozen base model.

LoRA (Hu et al. 2021, arXiv 2106.09685) freezes a pretrained weight W and
learns a low-rank update:  y = W x + (alpha / r) * B A x,  A: (r, in), B: (out, r).
A starts Kaiming-uniform and B at zero, so a fresh adapter is an exact no-op.

Policy sharing (Paper A, Zeng et al. 2026, arXiv 2605.24202, Sec. 3):
  shared   (SP): one adapter, "shared", that every role of the workflow uses;
  isolated (IP): one adapter per *role type*; generator0/1/2 all use "generator".
All adapters live in the same LoRALinear modules. With none active the model is the base model,
the KL term's reference, unless a supervised warm-up came first (then `freeze_copy`, as
InstructGPT anchors RL to its SFT model).

Departures from loralib: no mixins; several adapters per layer, one active for the whole model;
generation runs with the adapter merged into the weights in place (`merged_adapter`: the paper's
"no additional inference latency", Sec. 4.1); saved in Hugging Face PEFT's LoRA format.

Exercised by: pytest tests/test_lora.py
"""
import json
import math
import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
from safetensors.torch import load_file, save

# Every linear layer of attention and MLP in Llama/Qwen-style models.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus any number of named low-rank adapters."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base = base
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.lora_A = nn.ParameterDict()  # name -> (r, in)
        self.lora_B = nn.ParameterDict()  # name -> (out, r)
        self.active: str | None = None
        self.kept: torch.Tensor | None = None  # the base weight while an adapter is merged in

    def add(self, name: str, init: bool = True) -> None:
        """A fresh adapter; init=False leaves A at zero for a state to be copied in (and draws
        no random numbers)."""
        # Adapters are fp32 over a bf16 base too: AdamW on bf16 weights loses LoRA's small updates
        out_features, in_features = self.base.weight.shape
        device = self.base.weight.device
        A = torch.zeros(self.r, in_features, device=device)
        if init:
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # the init nn.Linear uses
        self.lora_A[name] = nn.Parameter(A)
        self.lora_B[name] = nn.Parameter(torch.zeros(out_features, self.r, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        y = self.base(x)  # (..., out)
        if self.active is None:
            return y
        A, B = self.lora_A[self.active], self.lora_B[self.active]
        update = (x.to(A.dtype) @ A.t()) @ B.t()  # (..., r) -> (..., out)
        return y + (update * self.scaling).to(y.dtype)

    def merged_weight(self, name: str) -> torch.Tensor:
        """W + (alpha / r) B A in the base's dtype: (out, in)."""
        W = self.base.weight  # fp32 adapters: the sum is formed in fp32, then rounded once
        merged = torch.addmm(W.float(), self.lora_B[name], self.lora_A[name], alpha=self.scaling)
        return merged.to(W.dtype)

    @torch.no_grad()
    def merge(self, name: str) -> None:
        """Write W + (alpha / r) B A into the base weight in place (so a CUDA graph reading it
        serves every adapter, decode.py), keeping W to put back."""
        merged = self.merged_weight(name)  # (out, in)
        self.kept = self.base.weight.detach().clone()
        self.base.weight.copy_(merged)

    @torch.no_grad()
    def unmerge(self) -> None:  # from the copy, bit for bit: in bf16, W + D - D drifts
        if self.kept is not None:
            self.base.weight.copy_(self.kept)
            self.kept = None


def inject_lora(model: nn.Module, r: int = 64, alpha: float = 32.0,
                targets: tuple[str, ...] = DEFAULT_TARGETS) -> list[LoRALinear]:
    """Freeze the model and wrap every nn.Linear whose name ends in a target."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child_name in targets:
                layer = LoRALinear(child, r, alpha)
                setattr(parent, child_name, layer)
                wrapped.append(layer)
    found = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, LoRALinear)}
    if missing := [t for t in targets if t not in found]:
        raise ValueError(f"no linear layer named {', '.join(missing)} in the model")
    return wrapped


def narrowest(model: nn.Module, targets: tuple[str, ...] = DEFAULT_TARGETS) -> int | None:
    """The highest rank B A can have: the narrowest target layer's smaller side (None: none)."""
    sides = [min(m.in_features, m.out_features) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    return min(sides, default=None)


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def add_adapter(model: nn.Module, name: str, init: bool = True) -> None:
    for layer in lora_layers(model):
        layer.add(name, init)


def adapter_names(model: nn.Module) -> list[str]:
    return list(lora_layers(model)[0].lora_A.keys())


def set_adapter(model: nn.Module, name: str | None) -> None:
    """Make `name` the active adapter everywhere; None runs the base model."""
    if name is not None and name not in adapter_names(model):
        raise KeyError(f"unknown adapter {name!r}; have {adapter_names(model)}")
    for layer in lora_layers(model):
        layer.active = name


@contextmanager
def use_adapter(model: nn.Module, name: str | None) -> Iterator[None]:
    """Run a block under one adapter (or none), restoring the previous one after."""
    previous = lora_layers(model)[0].active
    set_adapter(model, name)
    try:
        yield
    finally:
        set_adapter(model, previous)


@contextmanager
def merged_adapter(model: nn.Module, name: str | None) -> Iterator[None]:
    """Run a block (no gradients) under adapter `name` folded into the base weights in place
    (`LoRALinear.merge`): use_adapter(model, name)'s function up to float rounding, at the base
    model's cost per token. One extra copy of the base weights is kept while the block runs and
    written back, bit for bit, after it."""
    if name is not None and name not in adapter_names(model):
        raise KeyError(f"unknown adapter {name!r}; have {adapter_names(model)}")
    layers = [] if name is None else lora_layers(model)  # None: the base model, nothing to merge
    if any(layer.kept is not None for layer in layers):
        raise RuntimeError("an adapter is merged into the weights already")
    try:
        with torch.no_grad(), use_adapter(model, None):  # the low-rank path is in the weights now
            for layer in layers:
                layer.merge(name)
            yield
    finally:
        for layer in layers:
            layer.unmerge()


PEFT_PREFIX = "base_model.model."  # PeftModel wraps the model as base_model.model


def adapter_tensors(model: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """Adapter `name`'s A and B of every layer under PEFT's key names, e.g.
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: (r, in)."""
    tensors = {}
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = module.lora_A[name]
            tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = module.lora_B[name]
    return tensors


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    return list(adapter_tensors(model, name).values())


def freeze_copy(model: nn.Module, source: str, name: str) -> None:
    """Adapter `name`: a copy of adapter `source` that no optimizer moves (a reference policy)."""
    load_adapter_state(model, name, adapter_state(model, source))
    for param in adapter_parameters(model, name):
        param.requires_grad_(False)


def adapter_for(role: str, sharing: str) -> str:
    """Which adapter a role runs under: SP -> "shared", IP -> the role type itself."""
    if sharing not in ("shared", "isolated"):
        raise ValueError(f"unknown sharing {sharing!r}; choose shared or isolated")
    return "shared" if sharing == "shared" else role


def setup_adapters(model: nn.Module, roles: list[str], sharing: str) -> list[str]:
    """Add the adapters the workflow's roles need; return their names."""
    names = sorted({adapter_for(role, sharing) for role in roles})
    for name in names:
        add_adapter(model, name)
    return names


# ----------------------------------------------------------------------------
# Saving and loading in Hugging Face PEFT's LoRA format (one directory per adapter), which
# peft.PeftModel.from_pretrained and serving engines load: the same W x + (alpha / r) B A x.

def adapter_state(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """One adapter's tensors under PEFT's key names, copied to the CPU."""
    tensors = adapter_tensors(model, name)
    return {key: param.detach().cpu().clone() for key, param in tensors.items()}


def load_adapter_state(model: nn.Module, name: str, state: dict[str, torch.Tensor]) -> None:
    """Copy a state from adapter_state into adapter `name`, created if missing (drawing no
    random numbers: loading an adapter leaves the sampling as it was)."""
    if name not in adapter_names(model):
        add_adapter(model, name, init=False)
    with torch.no_grad():
        for key, param in adapter_tensors(model, name).items():
            if key not in state or state[key].shape != param.shape:
                raise ValueError(f"adapter {name!r}: no tensor {key} of shape "
                                 f"{tuple(param.shape)}")
            param.copy_(state[key])


def adapter_files(model: nn.Module) -> dict[str, bytes]:
    """Each adapter's <name>/adapter_config.json and <name>/adapter_model.safetensors: path ->
    bytes (a checkpoint writes them itself). Every adapter has the same rank, alpha, targets."""
    layers = {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}
    first = next(iter(layers.values()))
    config = json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM",
                         "base_model_name_or_path": getattr(model, "name_or_path", ""),
                         "r": first.r, "lora_alpha": first.alpha, "lora_dropout": 0.0,
                         "bias": "none",
                         "target_modules": sorted({path.rsplit(".", 1)[-1] for path in layers}),
                         "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True},
                        indent=2).encode()
    return {os.path.join(name, file): data for name in adapter_names(model)
            for file, data in (("adapter_config.json", config),
                               ("adapter_model.safetensors", save(adapter_state(model, name))))}


def save_adapters(model: nn.Module, directory: str) -> None:
    for path, data in adapter_files(model).items():
        os.makedirs(os.path.join(directory, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(directory, path), "wb") as f:
            f.write(data)


def load_adapters(model: nn.Module, directory: str, names: list[str]) -> None:
    """Load the adapters `names` from DIR/<name>/, as save_adapters wrote them."""
    for name in names:
        path = os.path.join(directory, name, "adapter_model.safetensors")
        load_adapter_state(model, name, load_file(path))
