"""Hand-rolled LoRA with named adapters on one frozen base model.

LoRA (Hu et al. 2021, arXiv 2106.09685) freezes a pretrained weight W and
learns a low-rank update:  y = W x + (alpha / r) * B A x,  A: (r, in), B: (out, r).
A starts Kaiming-uniform and B at zero, so a fresh adapter is an exact no-op.

Policy sharing (Paper A, Zeng et al. 2026, arXiv 2605.24202, Sec. 3):
  shared   (SP): one adapter, "shared", that every role of the workflow uses;
  isolated (IP): one adapter per *role type*; generator0/1/2 all use "generator".
Every adapter lives inside the same LoRALinear modules, so isolated sharing
costs a few adapters more than shared, never a second copy of the base model.
With no adapter active the model is exactly the base model, which is the
reference policy for the optional KL term.

Departures from loralib: no mixin classes and no merging; several adapters per
layer with one active at a time, switched for the whole model at once.

Exercised by: pytest tests/test_lora.py
"""
import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

# Every linear layer of attention and MLP in Llama/Qwen-style models.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus any number of named low-rank adapters."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base = base
        self.r, self.scaling = r, alpha / r
        self.lora_A = nn.ParameterDict()  # name -> (r, in)
        self.lora_B = nn.ParameterDict()  # name -> (out, r)
        self.active: str | None = None

    def add(self, name: str) -> None:
        # Adapters stay fp32 even over a bf16 base: AdamW on bf16 weights loses
        # the small updates that LoRA is made of.
        out_features, in_features = self.base.weight.shape
        device = self.base.weight.device
        A = torch.empty(self.r, in_features, device=device)
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


def inject_lora(model: nn.Module, r: int = 64, alpha: float = 32.0,
                targets: tuple[str, ...] = DEFAULT_TARGETS) -> list[LoRALinear]:
    """Freeze the model and wrap every nn.Linear whose name ends in a target."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child_name in targets:
                layer = LoRALinear(child, r, alpha)
                setattr(parent, child_name, layer)
                wrapped.append(layer)
    if not wrapped:
        raise ValueError(f"no linear layer named one of {targets} in the model")
    return wrapped


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def add_adapter(model: nn.Module, name: str) -> None:
    """Add a fresh (no-op) adapter called `name` to every LoRA layer."""
    for layer in lora_layers(model):
        layer.add(name)


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


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The trainable tensors of one adapter (A and B of every layer)."""
    params = []
    for layer in lora_layers(model):
        params += [layer.lora_A[name], layer.lora_B[name]]
    return params


def adapter_for(role: str, sharing: str) -> str:
    """Which adapter a role runs under: SP -> "shared", IP -> the role type itself."""
    if sharing == "shared":
        return "shared"
    if sharing == "isolated":
        return role
    raise ValueError(f"unknown sharing {sharing!r}; choose shared or isolated")


def setup_adapters(model: nn.Module, roles: list[str], sharing: str) -> list[str]:
    """Add one adapter per name that the workflow's roles need; return the names."""
    names = sorted({adapter_for(role, sharing) for role in roles})
    for name in names:
        add_adapter(model, name)
    return names


def adapter_state(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """A flat state dict of one adapter, keyed by the wrapped layer's module path."""
    state = {}
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            state[f"{path}.A"] = module.lora_A[name].detach().cpu().clone()
            state[f"{path}.B"] = module.lora_B[name].detach().cpu().clone()
    return state


def load_adapter_state(model: nn.Module, name: str, state: dict[str, torch.Tensor]) -> None:
    """Copy a state from adapter_state into adapter `name` (created if missing)."""
    if name not in adapter_names(model):
        add_adapter(model, name)
    with torch.no_grad():
        for path, module in model.named_modules():
            if isinstance(module, LoRALinear):
                module.lora_A[name].copy_(state[f"{path}.A"])
                module.lora_B[name].copy_(state[f"{path}.B"])


def save_adapters(model: nn.Module, directory: str) -> None:
    """One safetensors file per adapter: DIR/<name>.safetensors."""
    for name in adapter_names(model):
        save_file(adapter_state(model, name), f"{directory}/{name}.safetensors")


def load_adapters(model: nn.Module, directory: str, names: list[str]) -> None:
    for name in names:
        load_adapter_state(model, name, load_file(f"{directory}/{name}.safetensors"))
