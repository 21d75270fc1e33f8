#!/bin/bash
# The GPU checks of docs/performance.md, in one run of at most about $BUDGET seconds (default
# 480: eight minutes) on one GPU. After the decoders' tests with CUDA visible,
# the parts never measured on a GPU come first, so that a run cut short loses what is known
# already: one decoding step alone (eager, and a CUDA graph's replay) by rows and cache length,
# three steps of the GPU recipe on the embedded model with the diagnostics, the update profiled
# in bf16 and in fp32 (kernels launched, host and GPU time), the recipe without the diagnostics,
# lab/bench.py on Qwen3-0.6B's shape with random weights; then what was measured at an earlier
# commit: the default run, lab/bench.py's throughput (32, 128, 512 rows; the CUDA graph's decode,
# the CPU's loop and transformers' generate, fp32 and bf16), and a bf16 gradient through left
# padding under the old and the new attention mask. A part that would not finish in the time left is
# skipped and named in skipped.txt; one that overruns its share is asked to stop, and killed
# 10 s later. Every log lands in $LOGS (default: ./gpu); with TAR=FILE they are also packed
# into that one file after every part.
#   bash tests/gpu_check.sh
#   LOGS=/tmp/gpu TAR=$OUT/gpu.tgz bash tests/gpu_check.sh   # on a machine that returns few files
LOGS=${LOGS:-gpu}
BUDGET=${BUDGET:-480}
export PYTHONUNBUFFERED=1 PYTHONPATH=".:$PYTHONPATH"
PY=${PY:-python}
set -o pipefail
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
  || { echo "gpu_check: $PY finds no torch with a CUDA device here; run it where one is"; exit 1; }
mkdir -p "$LOGS"

# limit CAP: the seconds a part may take, CAP or what is left of the budget less the 10 s a
# stopped part has to end (at least 1: `timeout 0` would mean no limit at all)
limit() {
  local rest=$(( BUDGET - SECONDS - 10 ))
  rest=$(( rest < $1 ? rest : $1 ))
  echo $(( rest < 1 ? 1 : rest ))
}
# enough NEED NAME: whether NEED seconds are left for part NAME (else it is skipped, and said)
enough() {
  [ $(( BUDGET - SECONDS )) -ge "$1" ] && return 0
  echo "== $2: skipped, $(( BUDGET - SECONDS )) s of the budget left" | tee -a "$LOGS/skipped.txt"
  return 1
}
pack() { [ -z "$TAR" ] || tar czf "$TAR" -C "$LOGS" . ; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/device.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$LOGS/device.txt"
timeout -k 10 150 $PY -c "from model import load_policy; load_policy('smollm2', 'cuda')" \
  || { pack; exit 1; }   # the first load converts
pack

echo "== tests"
timeout -k 10 $(limit 120) $PY -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tee "$LOGS/tests.txt" | tail -3 \
  || { echo "the decoders' tests did not pass: the rest would measure a broken decode"; pack; exit 1; }
pack

echo "== one decoding step alone, eager and replayed as a CUDA graph, by rows and cache length"
for model in smollm2 random:qwen3-0.6b; do
enough 40 "step $model" || continue
timeout -k 10 $(limit 90) $PY - $model <<'PY' 2>&1 | grep -v "^$" | tee -a "$LOGS/step.txt"
import sys
import time

import torch

import decode
from decode import columns_bucket, prefill, rows_bucket, static_step
from model import load_policy
from rollout import chat_text, left_pad
from tasks import DEFAULT_LEVEL, load_task
from workflows import chat

name, device, sync = sys.argv[1], "cuda", torch.cuda.synchronize
pool = load_task("arith", "train", 64, DEFAULT_LEVEL, 0)
# Qwen3-0.6B's keys and values take 112 KiB a token in bf16: 512 rows of 600 columns, 35 GB
for dtype in ("bf16",) if name.startswith("random:") else ("bf16", "fp32"):
    model, tok = load_policy(name, device, dtype)
    for B in (32, 128, 512):
        chats = [chat("math", "generator", question=pool[i % len(pool)].question) for i in range(B)]
        rows = tok([chat_text(tok, c) for c in chats], add_special_tokens=False).input_ids
        ids, attn = (t.to(device) for t in left_pad(rows, tok.pad_token_id))
        P = ids.shape[1]
        with torch.no_grad():
            cache, logits, copy = prefill(model, ids, attn)
            step = static_step(model, B, P + 512)
            step.fill(cache, copy, attn.bool())
            del cache
            step.position[:B] = attn.long().sum(-1, keepdim=True)
            step.token[:B] = logits[copy].argmax(-1)
            for columns in (columns_bucket(P + 1), columns_bucket(P + 512)):
                step.column.fill_(columns - 1)  # the same column each time: a timing, not a decode
                timed, R = {}, rows_bucket(B)
                for label in ("eager", "replay"):
                    if label == "replay":
                        start = time.perf_counter()
                        step.run(R, columns, True)  # captured, then replayed once
                        sync()
                        timed["capture"] = time.perf_counter() - start
                    for _ in range(3):
                        step.run(R, columns, label == "replay")
                    sync()
                    start = time.perf_counter()
                    for _ in range(24):
                        step.run(R, columns, label == "replay")
                    sync()
                    timed[label] = (time.perf_counter() - start) / 24
                print(f"{name} {dtype}, {B} rows, {columns} columns (prompts {P}): " +
                      ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in timed.items()), flush=True)
        del step
        decode.STEPS.clear()
        torch.cuda.empty_cache()
    del model
PY
done
pack

# The recipe with the diagnostics (per-slot and half-batch backward passes) every step, the
# default, and (after the update's profile) with none: what they cost on the GPU.
recipe() {
  echo "== three steps of the GPU recipe, --diag_every $1"
  enough 80 "the recipe, --diag_every $1" || return
  timeout -k 10 $(limit 150) $PY train.py --workflow voting --sharing isolated --problems_per_step 32 --group_size 8 \
    --max_new_tokens 256 --level 3 --steps 3 --eval_problems 32 --micro_batch_tokens 16384 \
    --diag_every $1 --out /tmp/gpu-recipe$1 --overwrite > "$LOGS/recipe$1.txt" 2>&1
  echo "exit $?" | tee -a "$LOGS/recipe$1.txt"
  grep -E "^step [0-9]+/|not applied" "$LOGS/recipe$1.txt" | tail -4
  cp /tmp/gpu-recipe$1/metrics.jsonl "$LOGS/recipe$1-metrics.jsonl" 2>/dev/null
  pack
}
recipe 1

echo "== the update's profile, bf16 against fp32: kernels launched, host and GPU time"
if enough 60 "the update's profile"; then
timeout -k 10 $(limit 150) $PY - smollm2 <<'PY' 2>&1 | grep -v -e "^$" -e "^USDT" | tee "$LOGS/update-profile.txt"
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from grpo import policy_update
from lora import add_adapter, adapter_parameters, inject_lora
from model import load_policy
from rollout import Call
from train import Config

name, device = sys.argv[1], "cuda"
cuda = device == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
g = torch.Generator().manual_seed(0)
for dtype in ("bf16", "fp32"):
    model, tok = load_policy(name, device, dtype)
    inject_lora(model, 16, 32)
    add_adapter(model, "shared")
    vocab = model.config.vocab_size
    calls = [Call(i, "generator", "generator0", 0,
                  torch.randint(3, vocab, (20 + 13 * i,), generator=g).tolist(),
                  torch.randint(3, vocab, (30,), generator=g).tolist(), "", "",
                  advantage=1.0 if i % 2 else -1.0) for i in range(16)]
    params = adapter_parameters(model, "shared")
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.zeros_like(p)
    positions = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    frozen = torch.optim.SGD(params, lr=0.0)  # the work of an update, the adapter unchanged
    for tokens in (1024, 16384):
        s = Config(temperature=1.0, one_step=False, minibatch_size=16, micro_batch_tokens=tokens)
        def run():
            policy_update(model, "shared", calls, frozen, random.Random(0), tok.pad_token_id, s)
            sync()
        run()
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        with profile(activities=activities) as prof:
            run()
        events = prof.key_averages()
        on_gpu = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")
                  and not getattr(e, "is_user_annotation", False)  # a span, not a kernel
                  and not e.key.startswith(("Memcpy", "Memset"))]
        kernels = sum(e.count for e in on_gpu)
        ops = sorted((e for e in events if e.key.startswith("aten::")),
                     key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
        print(f"{name} {dtype}, --micro_batch_tokens {tokens}, {positions} positions: update "
              f"{1e3 * sorted(seconds)[1]:.1f} ms (median of 3), {kernels} CUDA kernels; "
              "most host time: " + ", ".join(f"{e.key[6:]} x{e.count} "
                                           f"{e.self_cpu_time_total / 1e3:.1f} ms" for e in ops))
        if cuda:
            gpu_ms = {e.key: getattr(e, "self_device_time_total", 0) / 1e3 for e in on_gpu}
            top = sorted(on_gpu, key=lambda e: gpu_ms[e.key], reverse=True)[:5]
            print(f"  GPU busy {sum(gpu_ms.values()):.1f} ms; most GPU time: "
                  + ", ".join(f"{e.key[:40]} x{e.count} {gpu_ms[e.key]:.1f} ms" for e in top))
    del model
PY
fi
pack

recipe 0

echo "== bench, Qwen3-0.6B's shape with random weights"
if enough 60 "bench on random:qwen3-0.6b"; then
  timeout -k 10 $(limit 150) $PY -m lab.bench --model random:qwen3-0.6b --device cuda --skip step,sharing \
    --batches 32,512 --repeats 3 --json "$LOGS/bench-qwen3.json" 2>&1 | tee "$LOGS/bench-qwen3.txt" \
    | grep -v "^bench:"
fi
pack

echo "== the default run"
if enough 70 "the default run"; then
  start=$EPOCHREALTIME
  timeout -k 10 $(limit 120) $PY train.py --out /tmp/gpu-default --overwrite > "$LOGS/default.txt" 2>&1
  echo "exit $?, wall $(awk "BEGIN {print $EPOCHREALTIME - $start}") s (loading included)" | tee -a "$LOGS/default.txt"
  grep -E "^step|not applied|peak" "$LOGS/default.txt" | tail -8
  cp /tmp/gpu-default/metrics.jsonl "$LOGS/default-metrics.jsonl" 2>/dev/null
fi
pack

echo "== bench"
if enough 100 "bench"; then
  timeout -k 10 $(limit 200) $PY -m lab.bench --device cuda --skip step,sharing --batches 32,128,512 --repeats 3 \
    --json "$LOGS/bench.json" 2>&1 | tee "$LOGS/bench.txt" | grep -v "^bench:"
fi
pack

echo "== bf16 gradient through left padding, the old mask against the new"
if enough 30 "the bf16 gradient"; then
timeout -k 10 $(limit 120) $PY - <<'PY' 2>&1 | tee "$LOGS/nan.txt"
import torch
import decode
from lora import add_adapter, adapter_parameters, inject_lora, use_adapter
from model import load_policy
from rollout import Call, sequence_logprobs

def padding_only(model, ids, attn, **kw):  # the mask before: padding and causality, as transformers makes it
    return model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0), **kw)

model, tok = load_policy("smollm2", "cuda")
inject_lora(model, 16, 32)
add_adapter(model, "shared")
g = torch.Generator().manual_seed(0)
calls = [Call(i, "generator", "generator0", 0, torch.randint(100, 40000, (20 + 13 * i,), generator=g).tolist(),
              torch.randint(100, 40000, (30,), generator=g).tolist(), "", "") for i in range(16)]
params = adapter_parameters(model, "shared")
for name, forward in (("padding only", padding_only), ("padded_causal_mask", decode.forward_padded)):
    import rollout
    rollout.forward_padded = forward
    for p in params:
        p.requires_grad_(True)
        p.grad = None
    with use_adapter(model, "shared"):
        logp, mask, _ = sequence_logprobs(model, calls, tok.pad_token_id)
        (logp * mask).sum().backward()
    bad = sum(int((~p.grad.isfinite()).sum()) for p in params)
    print(f"{name}: log-probs finite {bool(logp[mask.bool()].isfinite().all())}, "
          f"non-finite gradient entries {bad} of {sum(p.numel() for p in params)}")
PY
fi
pack
echo "gpu_check: done in $SECONDS s"
