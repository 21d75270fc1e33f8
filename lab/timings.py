"""The parts that lab/bench.py times: the rollout's stage against transformers' `generate` (the
same tokens under greedy decoding, checked), the old-log-prob pass and the update, one default
training step in a fresh process, one Voting step under either sharing, and the throughput of
the decode and of the update by batch size and dtype against the machine's own peak. Each returns
its figures as a dict; lab/bench.py says how they are timed and prints them.

Exercised by: pytest tests/test_bench.py
"""
import json
import dataclasses
import os
import random
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import torch

from decode import decode
from grpo import policy_update
from lab.checkpoint import TrainState
from lab.machine import alternate, sync, timed
from lora import (LoRALinear, adapter_for, adapter_parameters, add_adapter, inject_lora,
                  merged_adapter)
from measure import gradient_signals
from model import cpu_has_bf16, load_policy
from rollout import Rollout, chat_text, old_logprobs
from train import Config
from workflows import chat, run_workflow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where train.py is


@contextmanager
def without_lora(model):
    """The plain base model: every LoRALinear replaced by the nn.Linear it wraps, then put back."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.base)
                swapped.append((parent, name, child))
    try:
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


def raw_generate(model, tok, chats, max_new_tokens: int, temperature: float, seed: int,
                 greedy: bool = False):
    """transformers' generate on the base model, with the rollout's exact input and sampling
    settings."""
    enc = tok([chat_text(tok, c) for c in chats], return_tensors="pt", padding=True,
              add_special_tokens=False).to(model.device)
    torch.manual_seed(seed)
    with torch.no_grad(), without_lora(model):
        sampling = (dict(do_sample=False) if greedy
                    else dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0))
        out = model.generate(**enc, max_new_tokens=max_new_tokens, **sampling,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return out[:, enc.input_ids.shape[1]:]  # (B, T)


def rollout_stage(model, tok, chats, max_new_tokens: int, temperature: float, seed: int,
                  merge: bool, greedy: bool = False, decoder=None):
    """The project's rollout of one generator stage under the (fresh) shared adapter."""
    rollout = Rollout(model, tok, "shared", max_new_tokens=max_new_tokens, temperature=temperature,
                      merge=merge, greedy=greedy, decoder=decoder)
    torch.manual_seed(seed)
    rollout("generator", ["generator"] * len(chats), list(range(len(chats))), chats)
    return rollout.calls


def same_tokens(raw: torch.Tensor, calls) -> bool:
    """Whether the rollout's completions are the raw generate's, cut at their first eos."""
    return all(raw[i, : len(c.completion_ids)].tolist() == c.completion_ids
               for i, c in enumerate(calls))


def generation(model, tok, device: str, chats, cfg: Config, repeats: int) -> dict:
    """One stage three ways (raw, merged, low-rank), alternating; their greedy tokens once; and
    merging alone."""
    T, temp = cfg.max_new_tokens, cfg.temperature
    greedy = raw_generate(model, tok, chats, T, temp, cfg.seed, greedy=True)
    same = all(same_tokens(greedy,
                           rollout_stage(model, tok, chats, T, temp, cfg.seed, merge, greedy=True))
               for merge in (True, False))
    runs = {"raw": lambda: raw_generate(model, tok, chats, T, temp, cfg.seed),
            "merged": lambda: rollout_stage(model, tok, chats, T, temp, cfg.seed, merge=True),
            "low_rank": lambda: rollout_stage(model, tok, chats, T, temp, cfg.seed, merge=False)}
    warmups = [lambda: raw_generate(model, tok, chats[:2], 4, temp, cfg.seed),
               lambda: rollout_stage(model, tok, chats[:2], 4, temp, cfg.seed, merge=True),
               lambda: rollout_stage(model, tok, chats[:2], 4, temp, cfg.seed, merge=False)]
    r = alternate(device, runs, repeats, warmups)
    results = {name: r[name].pop("result") for name in r}
    calls = results["merged"]
    merge_seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        with merged_adapter(model, "shared"):
            sync(device)
        sync(device)
        merge_seconds.append(time.perf_counter() - start)
    for name, result in results.items():  # every row runs every decode step, finished or not
        steps = result.shape[1] if name == "raw" else max(len(c.completion_ids) for c in result)
        r[name]["tokens_per_s"] = len(chats) * steps / r[name]["seconds"]
    return {**r, "same_greedy_tokens": same, "calls": calls,
            "rollout_over_raw": ratio(r["merged"], r["raw"]),
            "low_rank_over_raw": ratio(r["low_rank"], r["raw"]),
            "merge_extra_mb": r["merged"]["peak_mb"] - r["low_rank"]["peak_mb"],
            "merge_seconds": statistics.median(merge_seconds),
            "prompt_padding": prompt_padding(calls)}


def ratio(a: dict, b: dict) -> float:
    """Median over rounds of a's time over b's in the same round (neighbours in time share
    the machine's state, so their ratio is steadier than a ratio of medians)."""
    return statistics.median(x / y for x, y in zip(a["all"], b["all"]))


def prompt_padding(calls) -> float:
    """Share of the stage's prompt positions that are left padding."""
    P = max(len(c.prompt_ids) for c in calls)
    return 1 - sum(len(c.prompt_ids) for c in calls) / (P * len(calls))


def one_adapter(model, name: str, optimizer) -> TrainState:
    """The training state one adapter's update reads: its optimizer and a fresh random state."""
    return TrainState(model, {}, {name: optimizer}, {}, random.Random(0), {name: {}})


def update_parts(model, tok, device: str, calls, cfg: Config, repeats: int) -> dict:
    """The old-log-prob pass, one update over `calls` (one mini-batch, on-policy) and the
    diagnostics' pass over the same calls (measure.gradient_signals)."""
    for i, c in enumerate(calls):
        c.advantage = 1.0 if i % 2 else -1.0
    params = adapter_parameters(model, "shared")
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.zeros_like(p)
    frozen = torch.optim.SGD(params, lr=0.0)  # measure the work, keep the adapter a no-op
    # one mini-batch of every call, each alone in its group
    settings = dataclasses.replace(cfg, one_step=False, minibatch_size=len(calls), group_size=1)

    def parts(calls):  # each part over `calls`, a thunk for alternate
        return {"old_logp": lambda: old_logprobs(model, calls, "shared", tok.pad_token_id,
                                                 cfg.temperature, cfg.micro_batch_tokens),
                "update": lambda: policy_update(one_adapter(model, "shared", frozen), "shared",
                                                calls, tok.pad_token_id, settings),
                "diagnostics": lambda: gradient_signals(model, "shared", calls, tok.pad_token_id,
                                                        settings)}
    r = alternate(device, parts(calls), repeats, list(parts(calls[:2]).values()))
    tokens = sum(len(c.completion_ids) for c in calls)
    for name in r:
        r[name].pop("result")
        r[name]["tokens_per_s"] = tokens / r[name]["seconds"]
    return r


def sharing(model, tok, device: str, questions: list[str], cfg: Config, repeats: int) -> dict:
    """Voting's rollout, then its update under one shared adapter and under one adapter per role
    type, on the same calls. Fresh adapters are no-ops, so isolated adapters would have written
    the same tokens; the update's work is the same calls with the same advantages."""
    for name in ("generator", "aggregator"):
        add_adapter(model, name)
    rollout = Rollout(model, tok, "shared", max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.temperature)
    torch.manual_seed(cfg.seed)
    seconds, rollout_mb, _ = timed(device, lambda: run_workflow("voting", questions, rollout,
                                                                "math", n_agents=cfg.n_agents))
    calls = rollout.calls
    for i, c in enumerate(calls):
        c.advantage = 1.0 if i % 2 else -1.0
    optimizers = {}
    for name in ("shared", "generator", "aggregator"):  # lr 0: the work of a step, no movement
        params = adapter_parameters(model, name)
        for p in params:
            p.requires_grad_(True)
            p.grad = torch.zeros_like(p)
        optimizers[name] = torch.optim.AdamW(params, lr=0.0)
    settings = dataclasses.replace(cfg, one_step=False, group_size=1)  # mini-batch steps

    def update(mode: str, calls: list):
        def run():
            for name in sorted({adapter_for(c.role, mode) for c in calls}):
                mine = [c for c in calls if adapter_for(c.role, mode) == name]
                # the gradient signals, then the update, as train.py's default
                gradient_signals(model, name, mine, tok.pad_token_id, settings)
                policy_update(one_adapter(model, name, optimizers[name]), name, mine,
                              tok.pad_token_id, settings)
        return run
    few = [c for c in calls if c.episode == 0]
    r = alternate(device,
                  {"shared": update("shared", calls), "isolated": update("isolated", calls)},
                  repeats, [update("shared", few), update("isolated", few)])
    for name in r:
        r[name].pop("result")
    per_adapter = sum(p.numel() for p in adapter_parameters(model, "shared")) * 4 * 4 / 2**20
    return {**r, "rollout_seconds": seconds, "rollout_peak_mb": rollout_mb, "calls": len(calls),
            "update_ratio": ratio(r["isolated"], r["shared"]),
            "adapter_state_mb": per_adapter,  # fp32 weights, gradient, AdamW's two moments
            "adapters": {"shared": 1, "isolated": len({c.role for c in calls})}}


def train_step(args, threads: int, out: str, flags: list[str]) -> dict:
    """One training step of train.py in a fresh process; its metrics.jsonl row of step 1."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--steps", "1", "--model", args.model,
           "--device", args.device, "--threads", str(threads), "--out", out, "--overwrite", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"bench: {' '.join(cmd[1:])} failed: {said}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f][-1]


def step_parts(row: dict) -> dict:
    update = row["time/update"] - row["time/old_logp"]
    return {"rollout": row["time/rollout"], "old_logp": row["time/old_logp"], "update": update,
            "eval": row.get("time/eval", 0.0), "peak_mb": row["mem/peak_mb"]}


def bench_dtypes(device: str) -> list[str]:
    """The dtypes the throughput compares: bf16 only where the device computes in it natively
    (elsewhere torch emulates it: a 2048^3 product took minutes on a 2-core CPU)."""
    return ["fp32", "bf16"] if device.startswith("cuda") or cpu_has_bf16() else ["fp32"]


def machine_limits(device: str, repeats: int) -> dict:
    """Peak GFLOP/s of a 2048 x 2048 matrix product in each of bench_dtypes, and GB/s of copying
    256 MiB (read once, written once)."""
    out = {}
    for name in bench_dtypes(device):
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        a, b = (torch.randn(2048, 2048, device=device).to(dtype) for _ in range(2))
        r = alternate(device, {name: lambda: a @ b}, repeats, [lambda: a @ b])
        out[f"matmul_{name}_gflops"] = 2 * 2048 ** 3 / r[name]["seconds"] / 1e9
    src = torch.empty(2 ** 26, device=device)  # 256 MiB of fp32
    dst = torch.empty_like(src)
    r = alternate(device, {"copy": lambda: dst.copy_(src)}, repeats, [lambda: dst.copy_(src)])
    out["copy_gbs"] = 2 * src.numel() * 4 / r["copy"]["seconds"] / 1e9
    return out


def throughput(args, device: str, questions: list[str], cfg: Config, batches: list[int]) -> dict:
    """Tokens/s of one generator stage by batch size and dtype, and of the update's forward and
    backward, alternating the dtypes (bench_dtypes)."""
    dtypes = bench_dtypes(device)
    models = {}
    for d in dtypes:
        model, tok = load_policy(args.model, device, d)
        inject_lora(model, cfg.lora_r, cfg.lora_alpha)
        add_adapter(model, "shared")
        models[d] = model
    n_params = sum(p.numel() for n, p in models["fp32"].named_parameters() if "lora_" not in n)
    weight_bytes = {d: sum(p.numel() * p.element_size() for n, p in models[d].named_parameters()
                           if "lora_" not in n) for d in dtypes}
    T, fig = cfg.max_new_tokens, {"params": n_params, "dtypes": dtypes, "generate": {},
                                  "weight_bytes": weight_bytes}
    for B in batches:
        chats = [chat("math", "generator", question=questions[i % len(questions)])
                 for i in range(B)]
        runs, warmups = {}, []
        for d in dtypes:  # the rollout's decode, and transformers' generate as it was before
            runs[f"decode {d}"] = lambda m=models[d]: rollout_stage(m, tok, chats, T,
                                                                    cfg.temperature, cfg.seed, True)
            if device.startswith("cuda"):  # the CUDA graph's, and the CPU's loop beside it
                runs[f"loop {d}"] = lambda m=models[d]: rollout_stage(m, tok, chats, T,
                                                                      cfg.temperature, cfg.seed,
                                                                      True, decoder=decode)
            runs[f"generate {d}"] = lambda m=models[d]: raw_generate(m, tok, chats, T,
                                                                     cfg.temperature, cfg.seed)
            warmups.append(lambda m=models[d]: rollout_stage(m, tok, chats[:2], 4, 1.0, 0, True))
        r = alternate(device, runs, args.repeats, warmups)
        fig["generate"][B] = {name: B * T / r[name]["seconds"] for name in runs}
    calls = rollout_stage(models["fp32"], tok, chats[:16], T, cfg.temperature, cfg.seed, merge=True)
    for i, c in enumerate(calls):
        c.advantage = 1.0 if i % 2 else -1.0
    # every position's forward
    trained = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    settings = dataclasses.replace(cfg, one_step=False, minibatch_size=len(calls))
    runs = {}
    for d in dtypes:
        params = adapter_parameters(models[d], "shared")
        for p in params:
            p.requires_grad_(True)
            p.grad = torch.zeros_like(p)
        frozen = torch.optim.SGD(params, lr=0.0)
        runs[d] = (lambda m=models[d], o=frozen:
                   policy_update(one_adapter(m, "shared", o), "shared", calls, tok.pad_token_id,
                                 settings))
    r = alternate(device, runs, args.repeats, [])
    fig["update"] = {d: trained / r[d]["seconds"] for d in dtypes}
    fig["update_positions"] = trained
    return fig
