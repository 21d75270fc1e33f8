"""Speed and memory of the rollout, the update and a training step (as nanoGPT has a bench.py).

    python -m lab.bench                 # the embedded model on a 2-core CPU: about 20 minutes
    python -m lab.bench --model Qwen/Qwen3-1.7B --device cuda --json bench.json
    python -m lab.bench --model random:qwen3-0.6b --device cuda  # its shape, random weights

Each figure is the median of --repeats runs (at least 3 on a GPU, whose first runs plan and
compile kernels) after a warm-up on a smaller input; compared runs alternate (A B C A B C ...), so
a machine that slows down slows all of them. Memory is each part's peak: the allocator's on CUDA,
the resident set on CPU. The parts are the functions below (generation, update_parts, step_parts,
sharing, throughput); docs/performance.md reads their figures.
"""
import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

import torch

from decode import decode
from grpo import policy_update
from lab.checkpoint import TrainState
from lab.files import PROJECT, enclosing_run, read_jsonl
from lab.machine import check_device, peak_memory_mb, pick_threads
from lab.settings import TASK_TOKENS
from lora import (LoRALinear, adapter_for, adapter_parameters, add_adapter, inject_lora,
                  merged_adapter)
from measure import gradient_signals
from model import cpu_has_bf16, load_policy
from rollout import Call, Rollout, chat_text, old_logprobs
from tasks import DEFAULT_LEVEL, load_task
from train import Config
from workflows import chat, run_workflow

GPU_REPEATS = 3  # the fewest timed runs of a part on a GPU
PARTS = ("step", "sharing", "throughput")  # the parts --skip may leave out
STEP_FLAGS = ["--steps", "1", "--eval_problems", "2", "--val_problems", "0"]  # the step part's


# ----------------------------------------------------------------------------
# The clocks


def sync(device: str) -> None:
    """A clock read before the GPU's queued kernels finish times only their launch."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(device: str, fn) -> tuple[float, float, object]:
    """Seconds and peak memory (MiB) of one call of fn, and what it returned."""
    sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the resident set's high-water mark starts again from now
        except OSError:
            pass  # the peak then covers the whole process so far
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, peak_memory_mb(device), result


def alternate(device: str, runs: dict, repeats: int, warmups: list) -> dict[str, dict]:
    """Each of `warmups` once, then `repeats` rounds of `runs` (name -> fn) in turn: per name the
    median seconds, every round's seconds, the largest peak and the last result."""
    for fn in warmups:
        fn()
    rounds = [{name: timed(device, fn) for name, fn in runs.items()} for _ in range(repeats)]
    seconds = {name: [r[name][0] for r in rounds] for name in runs}
    return {name: {"seconds": statistics.median(seconds[name]), "all": seconds[name],
                   "peak_mb": max(r[name][1] for r in rounds), "result": rounds[-1][name][2]}
            for name in runs}


# ----------------------------------------------------------------------------
# The parts, each returning its figures


def race(device: str, parts: dict, args: tuple, warm: tuple, repeats: int) -> tuple[dict, dict]:
    """`alternate` over `parts` (name -> function) called on `args`, warmed up on `warm`: each
    part's figures, and what it returned."""
    r = alternate(device, {name: partial(f, *args) for name, f in parts.items()}, repeats,
                  [partial(f, *warm) for f in parts.values()])
    return r, {name: r[name].pop("result") for name in r}


def ratio(a: dict, b: dict) -> float:
    """Median over rounds of a's time over b's in the same round (neighbours in time share
    the machine's state, so their ratio is steadier than a ratio of medians)."""
    return statistics.median(x / y for x, y in zip(a["all"], b["all"]))


def raw_generate(model, tok, chats: list, cfg: Config, greedy: bool = False) -> torch.Tensor:
    """transformers' generate on the base model (each LoRALinear swapped for the nn.Linear it
    wraps, then put back), as the rollout prompts and samples."""
    enc = tok([chat_text(tok, c) for c in chats], return_tensors="pt", padding=True,
              add_special_tokens=False).to(model.device)
    torch.manual_seed(cfg.seed)
    sampling = (dict(do_sample=False) if greedy
                else dict(do_sample=True, temperature=cfg.temperature, top_p=1.0, top_k=0))
    swapped = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, layer in swapped:
        model.set_submodule(name, layer.base)
    try:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=cfg.max_new_tokens, **sampling,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    finally:
        for name, layer in swapped:
            model.set_submodule(name, layer)
    return out[:, enc.input_ids.shape[1]:]  # (B, T)


def rollout_stage(model, tok, chats: list, cfg: Config, merge: bool = True, greedy: bool = False,
                  decoder=None) -> list[Call]:
    """The project's rollout of one generator stage under the (fresh) shared adapter."""
    rollout = Rollout(model, tok, "shared", max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.temperature, merge=merge, greedy=greedy, decoder=decoder)
    torch.manual_seed(cfg.seed)
    rollout("generator", ["generator"] * len(chats), list(range(len(chats))), chats)
    return rollout.calls


def generation(model, tok, device: str, chats: list, cfg: Config, repeats: int) -> dict:
    """One stage three ways (raw, merged, low-rank) and merging alone. A fresh adapter is a no-op:
    greedy decoding writes the same tokens in all three (checked once); the timed runs sample."""
    greedy = raw_generate(model, tok, chats, cfg, greedy=True)
    same = all(  # each rollout's completions are the raw generate's, cut at their first eos
        greedy[i, :len(c.completion_ids)].tolist() == c.completion_ids for merge in (True, False)
        for i, c in enumerate(rollout_stage(model, tok, chats, cfg, merge, greedy=True)))
    ways = {"raw": partial(raw_generate, model, tok),
            "merged": partial(rollout_stage, model, tok, merge=True),
            "low_rank": partial(rollout_stage, model, tok, merge=False)}
    short = dataclasses.replace(cfg, max_new_tokens=4)  # the warm-up: the same code, 4 tokens
    r, results = race(device, ways, (chats, cfg), (chats[:2], short), repeats)
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
    P = max(len(c.prompt_ids) for c in calls)
    return {**r, "same_greedy_tokens": same, "calls": calls,
            "rollout_over_raw": ratio(r["merged"], r["raw"]),
            "low_rank_over_raw": ratio(r["low_rank"], r["raw"]),
            "merge_extra_mb": r["merged"]["peak_mb"] - r["low_rank"]["peak_mb"],
            "merge_seconds": statistics.median(merge_seconds),
            # the share of the stage's prompt positions that are left padding
            "prompt_padding": 1 - sum(len(c.prompt_ids) for c in calls) / (P * len(calls))}


def still_adapter(model, name: str, calls: list[Call], adamw: bool = False):
    """An optimizer of lr 0 over the adapter `name` (the work of a step, the adapter a no-op
    still), and advantages of alternating sign on `calls`, so that every call has a signal."""
    for i, c in enumerate(calls):
        c.advantage = 1.0 if i % 2 else -1.0
    params = adapter_parameters(model, name)
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.zeros_like(p)
    return torch.optim.AdamW(params, lr=0.0) if adamw else torch.optim.SGD(params, lr=0.0)


def one_adapter(model, name: str, optimizer) -> TrainState:
    """The training state that one adapter's update reads."""
    return TrainState(model, {}, {name: optimizer}, {}, random.Random(0), {name: {}})


def shared_update(model, optimizer, pad: int, settings: Config, calls: list[Call]) -> dict:
    return policy_update(one_adapter(model, "shared", optimizer), "shared", calls, pad, settings)


def update_parts(model, tok, device: str, calls: list[Call], cfg: Config, repeats: int) -> dict:
    """The old-log-prob pass, one on-policy mini-batch's update and the diagnostics' pass."""
    frozen = still_adapter(model, "shared", calls)
    settings = dataclasses.replace(cfg, one_step=False, minibatch_size=len(calls), group_size=1)
    pad = tok.pad_token_id
    parts = {"old_logp": lambda cs: old_logprobs(model, cs, "shared", pad, cfg.temperature,
                                                 cfg.micro_batch_tokens),
             "update": partial(shared_update, model, frozen, pad, settings),
             "diagnostics": lambda cs: gradient_signals(model, "shared", cs, pad, settings)}
    r, _ = race(device, parts, (calls,), (calls[:2],), repeats)
    for name in r:
        r[name]["tokens_per_s"] = sum(len(c.completion_ids) for c in calls) / r[name]["seconds"]
    return r


def role_updates(model, pad: int, calls: list[Call], optimizers: dict, mode: str, cfg: Config):
    """Each adapter's diagnostics' pass and update over its calls under sharing `mode`."""
    for name in sorted({adapter_for(c.role, mode) for c in calls}):
        mine = [c for c in calls if adapter_for(c.role, mode) == name]
        gradient_signals(model, name, mine, pad, cfg)
        policy_update(one_adapter(model, name, optimizers[name]), name, mine, pad, cfg)


def sharing(model, tok, device: str, questions: list[str], cfg: Config, repeats: int) -> dict:
    """Voting's rollout, then its update under one shared adapter and one per role type (fresh
    adapters are no-ops: isolated ones would have written the same calls)."""
    for name in ("generator", "aggregator"):
        add_adapter(model, name)
    rollout = Rollout(model, tok, "shared", max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.temperature)
    torch.manual_seed(cfg.seed)
    seconds, rollout_mb, _ = timed(device, lambda: run_workflow("voting", questions, rollout,
                                                                "math", n_agents=cfg.n_agents))
    calls = rollout.calls
    optimizers = {name: still_adapter(model, name, calls, adamw=True)
                  for name in ("shared", "generator", "aggregator")}
    settings = dataclasses.replace(cfg, one_step=False, group_size=1)  # mini-batch steps
    modes = {m: partial(role_updates, model, tok.pad_token_id, optimizers=optimizers, mode=m,
                        cfg=settings) for m in ("shared", "isolated")}
    r, _ = race(device, modes, (calls,), ([c for c in calls if c.episode == 0],), repeats)
    per_adapter = sum(p.numel() for p in adapter_parameters(model, "shared")) * 4 * 4 / 2**20
    return {**r, "rollout_seconds": seconds, "rollout_peak_mb": rollout_mb, "calls": len(calls),
            "update_ratio": ratio(r["isolated"], r["shared"]),
            "adapter_state_mb": per_adapter,  # fp32 weights, gradient, AdamW's two moments
            "adapters": {"shared": 1, "isolated": len({c.role for c in calls})}}


def step_parts(args: argparse.Namespace, threads: int) -> dict:
    """One training step of train.py in a fresh process, split as its metrics.jsonl logs it."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.join(PROJECT, "train.py"), *STEP_FLAGS, "--model",
               args.model, "--device", args.device, "--dtype", args.dtype, "--threads",
               str(threads), "--out", os.path.join(tmp, "step"), "--overwrite"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise SystemExit(f"bench: {' '.join(cmd[1:])} failed: {said}")
        row = read_jsonl(os.path.join(tmp, "step", "metrics.jsonl"))[-1]
    return {"rollout": row["time/rollout"], "old_logp": row["time/old_logp"],
            "update": row["time/update"] - row["time/old_logp"],
            "eval": row.get("time/eval", 0.0), "peak_mb": row["mem/peak_mb"]}


def bench_dtypes(device: str) -> list[str]:
    """The dtypes the throughput compares: bf16 only where the device computes in it natively
    (elsewhere torch emulates it: a 2048^3 product took minutes on a 2-core CPU)."""
    return ["fp32", "bf16"] if device.startswith("cuda") or cpu_has_bf16() else ["fp32"]


def machine_limits(device: str, repeats: int) -> dict:
    """GFLOP/s of a 2048^3 matrix product in each of bench_dtypes; GB/s of copying 256 MiB."""
    out = {}
    for name in bench_dtypes(device):
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        a, b = (torch.randn(2048, 2048, device=device).to(dtype) for _ in range(2))
        r, _ = race(device, {name: torch.matmul}, (a, b), (a, b), repeats)
        out[f"matmul_{name}_gflops"] = 2 * 2048 ** 3 / r[name]["seconds"] / 1e9
    src = torch.empty(2 ** 26, device=device)  # 256 MiB of fp32
    r, _ = race(device, {"copy": torch.empty_like(src).copy_}, (src,), (src,), repeats)
    out["copy_gbs"] = 2 * src.numel() * 4 / r["copy"]["seconds"] / 1e9
    return out


def throughput(args: argparse.Namespace, questions: list[str], cfg: Config,
               batches: list[int]) -> dict:
    """Tokens/s of one generator stage by batch size and dtype; positions/s of the update."""
    device, dtypes, models = args.device, bench_dtypes(args.device), {}
    short = dataclasses.replace(cfg, max_new_tokens=4)
    for d in dtypes:
        models[d], tok = load_policy(args.model, device, d)
        inject_lora(models[d], cfg.lora_r, cfg.lora_alpha)
        add_adapter(models[d], "shared")
    weights = {d: [p for n, p in models[d].named_parameters() if "lora_" not in n] for d in dtypes}
    fig = {"params": sum(p.numel() for p in weights["fp32"]), "dtypes": dtypes, "generate": {},
           "weight_bytes": {d: sum(p.numel() * p.element_size() for p in weights[d])
                            for d in dtypes}}
    ways = {"decode": lambda m, c, s: rollout_stage(m, tok, c, s),
            "loop": lambda m, c, s: rollout_stage(m, tok, c, s, decoder=decode),  # CUDA only
            "generate": lambda m, c, s: raw_generate(m, tok, c, s)}
    if not device.startswith("cuda"):  # the CPU's rollout is the loop
        del ways["loop"]
    for B in batches:
        chats = [chat("math", "generator", question=questions[i % len(questions)])
                 for i in range(B)]
        runs = {f"{w} {d}": partial(f, models[d]) for w, f in ways.items() for d in dtypes}
        r, _ = race(device, runs, (chats, cfg), (chats[:2], short), args.repeats)
        fig["generate"][B] = {name: B * cfg.max_new_tokens / r[name]["seconds"] for name in runs}
    calls = rollout_stage(models["fp32"], tok, chats[:16], cfg)
    trained = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)  # every position
    settings = dataclasses.replace(cfg, one_step=False, minibatch_size=len(calls))
    update = {d: partial(shared_update, models[d], still_adapter(models[d], "shared", calls),
                         tok.pad_token_id, settings) for d in dtypes}
    r, _ = race(device, update, (calls,), (calls[:2],), args.repeats)
    fig["update"] = {d: trained / r[d]["seconds"] for d in dtypes}
    fig["update_positions"] = trained
    return fig


# ----------------------------------------------------------------------------
# The table


def throughput_lines(fig: dict) -> list[str]:
    lim, t = fig["limits"], fig["throughput"]
    peak = {d: lim[f"matmul_{d}_gflops"] for d in t["dtypes"]}
    # per token: a forward pass is 2 FLOP a parameter; backward adds 2 for the gradient of the
    # input (the frozen weights need none of their own; LoRA's few parameters are left out)
    gflop = {"generate": 2 * t["params"] / 1e9, "update": 4 * t["params"] / 1e9}
    # a step of B rows writes B tokens; its floor is reading every weight once at the copy's rate
    floor = {d: 1e3 * t["weight_bytes"][d] / (lim["copy_gbs"] * 1e9) for d in t["dtypes"]}
    lines = ["", "throughput against the machine: a 2048^3 matmul peaks at "
             + ", ".join(f"{peak[d]:.0f} GFLOP/s {d}" for d in t["dtypes"])
             + f"; copying 256 MiB runs at {lim['copy_gbs']:.1f} GB/s",
             f"  generate, one generator stage ({fig['new_tokens']} new tokens), tokens/s "
             f"(GFLOP/s at {gflop['generate']:.2f} GFLOP a token, % of the dtype's peak):",
             "    ms a decoding step = 1000 x rows / tokens/s (prefill included); "
             "reading the weights once takes "
             + ", ".join(f"{floor[d]:.3f} ms in {d}" for d in t["dtypes"])]
    for B, row in t["generate"].items():
        for sampler in (s for s in ("decode", "loop", "generate") if f"{s} fp32" in row):
            rates = {d: row[f"{sampler} {d}"] for d in t["dtypes"]}
            cells = [f"{d} {v:8.1f} ({1e3 * int(B) / v:6.2f} ms, {v * gflop['generate']:6.1f}, "
                     f"{100 * v * gflop['generate'] / peak[d]:4.1f}%)" for d, v in rates.items()]
            lines.append(f"    batch {int(B):4d}, {sampler:8s}: " + " | ".join(cells))
    cells = [f"{d} {v:6.1f} ({v * gflop['update']:5.1f}, "
             f"{100 * v * gflop['update'] / peak[d]:4.1f}%)" for d, v in t["update"].items()]
    lines.append(f"  update, forward + backward over {t['update_positions']} positions "
                 "of 16 calls, positions/s: " + " | ".join(cells))
    return lines


def report(fig: dict, device_name: str) -> str:
    g, u = fig["generate"], fig["update"]
    lines = [f"bench on {device_name}, model {fig['model']}, {fig['threads']} thread(s); "
             f"medians of {fig['repeats']} alternating runs after a warm-up", "",
             f"generate one stage: {fig['rows']} calls x {fig['new_tokens']} new tokens (prompts"
             f" {fig['prompt_tokens']} tokens, {100 * g['prompt_padding']:.0f}% of them padding)",
             f"  {'':28s}{'seconds':>9s}{'tokens/s':>10s}{'vs raw':>8s}{'peak MiB':>10s}"
             "   (vs raw: median of the rounds' ratios)"]
    for name, label in [("raw", "transformers generate (raw)"),
                        ("merged", "rollout, adapter merged"),
                        ("low_rank", "rollout, low-rank path")]:
        r = g[name]
        lines.append(f"  {label:28s}{r['seconds']:9.2f}{r['tokens_per_s']:10.1f}"
                     f"{ratio(r, g['raw']):8.3f}{r['peak_mb']:10.0f}")
    lines.append(f"  merging and restoring the weights: {g['merge_seconds']:.2f} s per stage")
    lines.append(f"  same greedy tokens in all three: {g['same_greedy_tokens']}; runs (s): "
                 + "; ".join(f"{n} {', '.join(f'{x:.2f}' for x in g[n]['all'])}"
                             for n in ("raw", "merged", "low_rank")))
    lines += ["", "update over every second call of the stage "
              f"({fig['update_tokens']} completion tokens)"]
    for name, label in [("old_logp", "old log-prob pass "), ("update", "forward + backward"),
                        ("diagnostics", "diagnostics' pass ")]:
        lines.append(f"  {label}  {u[name]['seconds']:6.2f} s  "
                     f"{u[name]['tokens_per_s']:7.1f} tokens/s")
    lines[-1] += "  (measure.py, every --diag_every steps)"
    if (s := fig.get("step")) is not None:
        lines += ["", f"one default training step, timed once (train.py "
                  f"{' '.join(fig['step_flags'])}):",
                  f"  rollout {s['rollout']:.1f} s | old log-probs {s['old_logp']:.1f} s | update "
                  f"{s['update']:.1f} s | eval of {fig['step_eval_problems']} test problems "
                  f"{s['eval']:.1f} s | peak {s['peak_mb']:.0f} MiB"]
    if (v := fig.get("sharing")) is not None:
        lines += ["", f"Voting, {v['calls']} calls: rollout {v['rollout_seconds']:.1f} s "
                  "(the same stages under either sharing), then the update:",
                  f"  {'':10s}{'seconds':>9s}{'peak MiB':>10s}{'adapters':>10s}"]
        lines += [f"  {name:10s}{v[name]['seconds']:9.2f}{v[name]['peak_mb']:10.0f}"
                  f"{v['adapters'][name]:10d}" for name in ("shared", "isolated")]
        lines.append(f"  isolated / shared update time {v['update_ratio']:.2f}; each adapter "
                     f"holds {v['adapter_state_mb']:.1f} MiB (weights, gradient, AdamW's "
                     "two moments)")
    if "throughput" in fig:
        lines += throughput_lines(fig)
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# The command


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.bench", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", default="smollm2", help="smollm2 (embedded), tiny, "
                   "random:qwen3-0.6b (-1.7b, -4b: random weights), or a HF id/path")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--repeats", type=int, default=4,
                   help=f"timed runs of each alternating part (at least {GPU_REPEATS} on a GPU)")
    p.add_argument("--problems", type=int, default=4,
                   help="problems of the stage (x 4 episodes each)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads; 0 = chosen as train.py does")
    p.add_argument("--dtype", default="auto", help="base weights of the first parts: "
                   "auto, fp32 or bf16 (as train.py's --dtype; the throughput part measures both)")
    p.add_argument("--batches", default="16,32,64", help="batch sizes of the throughput part")
    p.add_argument("--skip", default="",
                   help=f"comma-separated parts to leave out: {', '.join(PARTS)}")
    p.add_argument("--json", default="", help="also write every figure to this file")
    return p


def check_args(args: argparse.Namespace, pool_size: int) -> tuple[set[str], list[int]]:
    """Every flag, before a model loads: the parts to skip and the batch sizes."""
    if args.repeats < 1 or not 1 <= args.problems <= pool_size:
        raise SystemExit(f"bench: --repeats must be at least 1 and --problems from 1 to "
                         f"{pool_size} (the training pool), got {args.repeats} and "
                         f"{args.problems}")
    cores = len(os.sched_getaffinity(0))
    if not 0 <= args.threads <= cores:
        raise SystemExit(f"bench: --threads {args.threads}: from 0 (chosen as train.py does) to "
                         f"{cores}, the cores this process may use")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(PARTS):
        raise SystemExit(f"bench: --skip {','.join(sorted(skip - set(PARTS)))}: "
                         f"choose from {', '.join(PARTS)}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"bench: --batches {args.batches!r}: "
                         "give batch sizes as 16,32,64") from None
    why = ("every batch size must be at least 1" if min(batches) < 1 else
           "a batch size is given twice" if len(set(batches)) < len(batches) else "")
    if why:
        raise SystemExit(f"bench: --batches {args.batches}: {why}")
    if "throughput" in skip and args.batches != make_parser().get_default("batches"):
        raise SystemExit("bench: --batches sizes the throughput part, which --skip leaves out: "
                         "drop one")
    if check_device(args.device) and args.repeats < GPU_REPEATS:
        raise SystemExit(f"bench: --repeats {args.repeats} on a GPU: at least {GPU_REPEATS} (its "
                         "first runs pay for planning kernels; a median needs three)")
    folder = os.path.dirname(os.path.abspath(args.json))
    why = ("is a directory" if os.path.isdir(args.json) else
           "" if os.path.isdir(folder) and os.access(folder, os.W_OK) else
           f"cannot be written: {folder} is missing or read-only")
    if args.json and why:
        raise SystemExit(f"bench: --json {args.json} {why}; name a file in a writable directory")
    if args.json and (home := enclosing_run(args.json)):  # it would replace a run's own file
        raise SystemExit(f"bench: --json {args.json} is inside the run in {home}; "
                         "name a file outside it")
    return skip, batches


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    skip, batches = check_args(args, Config().train_problems)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device, threads = args.device, pick_threads(args.threads, own_load=0.0)
    torch.set_num_threads(threads)
    cfg = Config(model=args.model, max_new_tokens=TASK_TOKENS["math"])  # it times math's stage
    model, tok = load_policy(args.model, device, args.dtype)
    inject_lora(model, cfg.lora_r, cfg.lora_alpha)
    add_adapter(model, "shared")  # fresh: an exact no-op, so every variant writes the same tokens
    pool = load_task(cfg.task, "train", cfg.train_problems, DEFAULT_LEVEL, cfg.seed)
    chats = [chat("math", "generator", question=pool[i].question)
             for i in range(args.problems) for _ in range(cfg.group_size)]
    fig = {"model": args.model, "device": device, "dtype": args.dtype, "threads": threads,
           "repeats": args.repeats, "rows": len(chats), "new_tokens": cfg.max_new_tokens}
    print(f"bench: generate ({3 * (args.repeats + 1)} stages) ...", file=sys.stderr)
    fig["generate"] = generation(model, tok, device, chats, cfg, args.repeats)
    calls = fig["generate"].pop("calls")
    fig["prompt_tokens"] = max(len(c.prompt_ids) for c in calls)
    fig["update_tokens"] = sum(len(c.completion_ids) for c in calls[::2])
    print("bench: old log-probs and update ...", file=sys.stderr)
    fig["update"] = update_parts(model, tok, device, calls[::2], cfg, args.repeats)
    if "step" not in skip:
        print("bench: one default training step ...", file=sys.stderr)
        fig["step_eval_problems"], fig["step_flags"] = 2, STEP_FLAGS
        fig["step"] = step_parts(args, threads)
    if "sharing" not in skip:
        print("bench: Voting, shared vs isolated ...", file=sys.stderr)
        fig["sharing"] = sharing(model, tok, device, [pool[0].question] * 2, cfg, args.repeats)
    if "throughput" not in skip:
        print("bench: throughput against the machine's limits ...", file=sys.stderr)
        fig["limits"] = machine_limits(device, args.repeats)
        fig["throughput"] = throughput(args, [p.question for p in pool[:max(batches)]], cfg,
                                       batches)
    name = (torch.cuda.get_device_name() if device.startswith("cuda")
            else f"CPU ({os.cpu_count()} cores)")
    print(report(fig, name))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=2)
    return fig


if __name__ == "__main__":
    main()
