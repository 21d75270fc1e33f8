"""Speed and memory of the rollout, the update and a training step (as nanoGPT has a bench.py).

    python -m lab.bench                 # the embedded model on a 2-core CPU: about 4.5 minutes
    python -m lab.bench --model Qwen/Qwen3-1.7B --device cuda --json bench.json
    python -m lab.bench --model random:qwen3-0.6b --device cuda  # its shape, random weights: no hub

Each timed figure is the median of --repeats runs after a warm-up, and runs that are compared
alternate (A B C A B C ...), so a machine that slows down slows all of them. Sections:

  generate   one workflow stage: --problems x 4 generator calls (16; the default step's first
             stage has 32). transformers' own `generate` on the base model (the LoRA layers
             taken out) against the rollout
             (Rollout.__call__, decode.py) with its adapter merged into the weights, as training
             runs it, and with the low-rank path on every token. A fresh adapter is an exact no-op,
             so under greedy decoding all three write the same tokens (checked once); the timed runs
             sample, each with its own sampler. rollout / raw is what the rollout's decode gains
             over `generate`, net of its own costs (merging, chat template, tokenizer, records).
  old logp   the no-grad pass that gives pi_old for the stage's completions; the
             update skips it for its first mini-batch (grpo.py)
  update     forward + backward of the policy loss, per completion token; beside it the
             diagnostics' pass over the same calls (measure.gradient_signals)
  step       one step of the default run (train.py in a fresh process), split as
             its metrics.jsonl logs it: rollout, old log-probs, update, evaluation
  sharing    one Voting rollout (2 episodes of one problem), then its update under
             one shared adapter and under one adapter per role type, alternating
  throughput what the machine allows and how near each part runs to it: the peak of a large matrix
             product in fp32 and, where the device has it natively, bf16; memory bandwidth from a
             large copy; then tokens/s of one generator stage by batch size and dtype (the
             rollout's decode, and transformers' generate beside it), and of the update's
             forward + backward, each with its arithmetic
             rate (2 x parameters FLOP per generated token, 4 x per trained position: the frozen
             weights get no gradient of their own) against the peak; on CUDA the CUDA graph's decode
             beside the CPU's loop ("loop"), and milliseconds a decoding step against reading the
             weights once

Memory is the peak over each part: the allocator's on CUDA, the process's resident
set on CPU (reset between parts through /proc/self/clear_refs where Linux allows). The parts
are lab/timings.py's; this file is the command, its checks and its table.
"""
import argparse
import json
import os
import sys
import tempfile

import torch

from lab.machine import check_device, pick_threads
from lab.files import enclosing_run
from lab.settings import TASK_TOKENS
from lab.timings import (generation, machine_limits, ratio, sharing, step_parts, throughput,
                         train_step, update_parts)
from lora import add_adapter, inject_lora
from model import load_policy, resolve_dtype
from tasks import DEFAULT_LEVEL, load_task
from train import Config
from workflows import chat


# ----------------------------------------------------------------------------
# The table


def throughput_lines(fig: dict) -> list[str]:
    lim, t = fig["limits"], fig["throughput"]
    peak = {d: lim[f"matmul_{d}_gflops"] for d in t["dtypes"]}
    # per token: a forward pass is 2 FLOP a parameter; backward adds 2 for the gradient of the
    # input (the frozen weights need none of their own; LoRA's few parameters are left out)
    gflop = {"generate": 2 * t["params"] / 1e9, "update": 4 * t["params"] / 1e9}
    lines = ["", "throughput against the machine: a 2048^3 matmul peaks at "
             + ", ".join(f"{peak[d]:.0f} GFLOP/s {d}" for d in t["dtypes"])
             + f"; copying 256 MiB runs at {lim['copy_gbs']:.1f} GB/s",
             f"  generate, one generator stage ({fig['new_tokens']} new tokens), tokens/s "
             f"(GFLOP/s at {gflop['generate']:.2f} GFLOP a token, % of the dtype's peak):"]
    # a step of B rows writes B tokens; its floor is reading every weight once at the copy's rate
    floor = {d: 1e3 * t["weight_bytes"][d] / (lim["copy_gbs"] * 1e9) for d in t["dtypes"]}
    lines.append("    ms a decoding step = 1000 x rows / tokens/s (prefill included); "
                 "reading the weights once takes "
                 + ", ".join(f"{floor[d]:.3f} ms in {d}" for d in t["dtypes"]))
    for B, row in t["generate"].items():
        for sampler in ("decode", "loop", "generate"):
            if f"{sampler} fp32" not in row:
                continue
            cells = [f"{d} {row[f'{sampler} {d}']:8.1f} "
                     f"({1e3 * int(B) / row[f'{sampler} {d}']:6.2f} ms, "
                     f"{row[f'{sampler} {d}'] * gflop['generate']:6.1f}, "
                     f"{100 * row[f'{sampler} {d}'] * gflop['generate'] / peak[d]:4.1f}%)"
                     for d in t["dtypes"]]
            lines.append(f"    batch {int(B):4d}, {sampler:8s}: " + " | ".join(cells))
    cells = [f"{d} {v:6.1f} ({v * gflop['update']:5.1f}, "
             f"{100 * v * gflop['update'] / peak[d]:4.1f}%)" for d, v in t["update"].items()]
    lines.append(f"  update, forward + backward over {t['update_positions']} positions "
                 "of 16 calls, positions/s: " + " | ".join(cells))
    return lines


def report(fig: dict, device_name: str) -> str:
    g, u = fig["generate"], fig["update"]
    lines = [f"bench on {device_name}, model {fig['model']}, {fig['threads']} thread(s); "
             f"medians of {fig['repeats']} alternating runs", "",
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
              f"({fig['update_tokens']} completion tokens)",
              f"  old log-prob pass   {u['old_logp']['seconds']:6.2f} s  "
              f"{u['old_logp']['tokens_per_s']:7.1f} tokens/s",
              f"  forward + backward  {u['update']['seconds']:6.2f} s  "
              f"{u['update']['tokens_per_s']:7.1f} tokens/s",
              f"  diagnostics' pass   {u['diagnostics']['seconds']:6.2f} s  "
              f"{u['diagnostics']['tokens_per_s']:7.1f} tokens/s  (measure.py, every "
              "--diag_every steps)"]
    s = fig.get("step")
    lines += [] if s is None else ["",
              f"one default training step (train.py {' '.join(fig['step_flags'])}):",
              f"  rollout {s['rollout']:.1f} s | old log-probs {s['old_logp']:.1f} s | update "
              f"{s['update']:.1f} s | eval of {fig['step_eval_problems']} problems "
              f"{s['eval']:.1f} s | peak {s['peak_mb']:.0f} MiB"]
    v = fig.get("sharing")
    if v is not None:
        lines += ["", f"Voting, {v['calls']} calls: rollout {v['rollout_seconds']:.1f} s "
                  "(the same stages under either sharing), then the update:",
                  f"  {'':10s}{'seconds':>9s}{'peak MiB':>10s}{'adapters':>10s}"]
        for name in ("shared", "isolated"):
            lines.append(f"  {name:10s}{v[name]['seconds']:9.2f}{v[name]['peak_mb']:10.0f}"
                         f"{v['adapters'][name]:10d}")
        lines.append(f"  isolated / shared update time {v['update_ratio']:.2f}; each adapter holds "
                     f"{v['adapter_state_mb']:.1f} MiB (weights, gradient, AdamW's two moments)")
    if "throughput" in fig:
        lines += throughput_lines(fig)
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.bench", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", default="smollm2", help="smollm2 (embedded), tiny, random:qwen3-0.6b "
                   "(-1.7b, -4b: random weights), or a HF id/path")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--repeats", type=int, default=4, help="timed runs of each alternating part")
    p.add_argument("--problems", type=int, default=4,
                   help="problems of the stage (x 4 episodes each)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads; 0 = chosen as train.py does")
    p.add_argument("--dtype", default="auto", help="base weights of the first parts: "
                   "auto, fp32 or bf16 (as train.py's --dtype; the throughput part measures both)")
    p.add_argument("--batches", default="16,32,64", help="batch sizes of the throughput part")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: step, sharing, "
                   "throughput")
    p.add_argument("--json", default="", help="also write every figure to this file")
    return p


def check_args(args: argparse.Namespace, pool_size: int) -> tuple[set[str], list[int]]:
    """Every flag, before a model loads or a part runs: the parts to skip and the batch sizes."""
    if args.repeats < 1 or not 1 <= args.problems <= pool_size:
        raise SystemExit(f"bench: --repeats must be at least 1 and --problems from 1 to "
                         f"{pool_size} (the training pool), got {args.repeats} and {args.problems}")
    cores = len(os.sched_getaffinity(0))
    if not 0 <= args.threads <= cores:
        raise SystemExit(f"bench: --threads {args.threads}: from 0 (chosen as train.py does) to "
                         f"{cores}, the cores this process may use")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    parts = {"step", "sharing", "throughput"}
    if skip - parts:
        raise SystemExit(f"bench: --skip {','.join(sorted(skip - parts))}: "
                         "choose from step, sharing, throughput")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"bench: --batches {args.batches!r}: "
                         "give batch sizes as 16,32,64") from None
    if any(b < 1 for b in batches):
        raise SystemExit(f"bench: --batches {args.batches}: every batch size must be at least 1")
    if len(set(batches)) < len(batches):
        raise SystemExit(f"bench: --batches {args.batches}: a batch size is given twice")
    if "throughput" in skip and args.batches != make_parser().get_default("batches"):
        raise SystemExit("bench: --batches sizes the throughput part, which --skip leaves out: "
                         "drop one")
    check_device(args.device)
    folder = os.path.dirname(os.path.abspath(args.json))
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(folder)
                      or not os.access(folder, os.W_OK)):
        why = ("is a directory" if os.path.isdir(args.json)
               else f"cannot be written: {folder} is missing or read-only")
        raise SystemExit(f"bench: --json {args.json} {why}; name a file in a writable directory")
    if args.json and (home := enclosing_run(args.json)):  # it would replace a run's own file
        raise SystemExit(f"bench: --json {args.json} is inside the run in {home}; "
                         "name a file outside it")
    return skip, batches


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    skip, batches = check_args(args, Config().train_problems)
    device = (("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto"
              else args.device)
    args.device = device
    threads = pick_threads(args.threads, own_load=0.0)
    torch.set_num_threads(threads)
    # the stage it times is math's
    cfg = Config(model=args.model, max_new_tokens=TASK_TOKENS["math"])
    resolve_dtype(args.dtype, device, args.model)  # a bad --dtype stops before any model loads
    model, tok = load_policy(args.model, device, args.dtype)
    inject_lora(model, cfg.lora_r, cfg.lora_alpha)
    add_adapter(model, "shared")  # fresh: an exact no-op, so every variant writes the same tokens
    pool = load_task(cfg.task, "train", cfg.train_problems, DEFAULT_LEVEL, cfg.seed)
    chats = [chat("math", "generator", question=pool[i].question)
             for i in range(args.problems) for _ in range(cfg.group_size)]
    fig = {"model": args.model, "device": device, "dtype": args.dtype, "threads": threads,
           "repeats": args.repeats, "rows": len(chats), "new_tokens": cfg.max_new_tokens}
    print(f"bench: generate ({3 * (args.repeats + 1)} stages) ...", file=sys.stderr)
    g = generation(model, tok, device, chats, cfg, args.repeats)
    calls = g.pop("calls")
    fig["prompt_tokens"] = max(len(c.prompt_ids) for c in calls)
    fig["update_tokens"] = sum(len(c.completion_ids) for c in calls[::2])
    fig["generate"] = g
    print("bench: old log-probs and update ...", file=sys.stderr)
    fig["update"] = update_parts(model, tok, device, calls[::2], cfg, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        if "step" not in skip:
            print("bench: one default training step ...", file=sys.stderr)
            fig["step_eval_problems"] = 2
            fig["step_flags"] = ["--steps", "1", "--eval_problems", "2"]
            fig["step"] = step_parts(train_step(args, threads, os.path.join(tmp, "step"),
                                                ["--eval_problems", "2", "--dtype", args.dtype]))
    if "sharing" not in skip:
        print("bench: Voting, shared vs isolated ...", file=sys.stderr)
        fig["sharing"] = sharing(model, tok, device, [pool[0].question] * 2, cfg, args.repeats)
    if "throughput" not in skip:
        print("bench: throughput against the machine's limits ...", file=sys.stderr)
        fig["limits"] = machine_limits(device, args.repeats)
        fig["throughput"] = throughput(args, device, [p.question for p in pool[:max(batches)]],
                                       cfg, batches)
    name = (torch.cuda.get_device_name() if device.startswith("cuda")
            else f"CPU ({os.cpu_count()} cores)")
    print(report(fig, name))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=2)
    return fig


if __name__ == "__main__":
    main()
