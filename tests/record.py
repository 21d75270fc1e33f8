"""Fixed-seed recordings of tiny-model runs: what a restructuring must leave unchanged.

    python tests/record.py --out /tmp/rec                 # run every case, write recording.json
    python tests/record.py --out /tmp/rec --check tests/fixtures/recording.json

A case is one train.py run (or two: a resumed run, a start from another run) on the tiny random
model, one thread, a fixed seed, with problems whose answer is always 7 (so that its random replies
earn rewards that vary). Its recording is every metrics row less the clock and memory keys,
and the sha256 of its samples.jsonl and of every saved adapter and critic head. --check compares
a new recording with a stored one: the keys both hold must agree exactly, a key the old run wrote
may be gone, a new key is a difference. Floating-point results depend on the machine's CPU and
torch build: compare recordings made on one machine.
"""
import argparse
import glob
import hashlib
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = ["--model", "tiny", "--steps", "2", "--problems_per_step", "3", "--group_size", "4",
       "--max_new_tokens", "24", "--truncated", "keep", "--temperature", "1.0", "--lr", "1e-2",
       "--lora_r", "4", "--eval_problems", "4", "--val_problems", "0", "--sft_warmup", "2",
       "--threads", "1"]
CASES: dict[str, list[str]] = {
    **{f"{w}-{s}": ["--workflow", w, "--sharing", s]
       for w in ("single", "eval_opt", "voting", "orch_workers") for s in ("shared", "isolated")},
    "maac-central": ["--workflow", "orch_workers", "--algo", "maac", "--critic", "central"],
    "maac-decentral": ["--workflow", "orch_workers", "--algo", "maac", "--critic", "decentral"],
    "maac-decentral-role": ["--workflow", "voting", "--algo", "maac", "--critic", "decentral",
                            "--critic_per", "role", "--sharing", "isolated"],
    "credit-own": ["--workflow", "voting", "--credit", "own"],
    "truncated-mask": ["--truncated", "mask"],
    "truncated-penalize": ["--truncated", "penalize", "--max_new_tokens", "24"],
    "gspo": ["--workflow", "voting", "--ratio", "sequence", "--no-one_step",
             "--minibatch_size", "4"],
    "minibatches": ["--workflow", "voting", "--sharing", "isolated", "--no-one_step",
                    "--minibatch_size", "4"],
    "kl-anchor": ["--workflow", "voting", "--kl_coef", "0.1", "--role_kl", "aggregator=0.5"],
    "mitigations": ["--workflow", "voting", "--sharing", "isolated", "--balance", "multiplicity",
                    "--damping", "0.5", "--no-one_step", "--minibatch_size", "4"],
    "tis": ["--tis_cap", "2.0", "--no-one_step", "--minibatch_size", "4"],
    "token-mean": ["--workflow", "voting", "--loss_agg", "token-mean", "--adv_group", "role"],
    "eval-every-val": ["--eval_every", "1", "--val_problems", "4", "--diag_every", "2"],
}
# two-run cases: the first run, then the second in the same directory or from the first
RESUMED = ["--workflow", "voting", "--steps", "3"]
STARTED = ["--workflow", "voting", "--steps", "0"]
VOLATILE = ("time/", "mem/")  # the clock's and the machine's, not the algorithm's


def train(out: str, flags: list[str], stop_in: str = "") -> None:
    """One train.py run; with `stop_in`, SIGTERM as soon as it logs a line that starts so (the run
    stops after that step, as Ctrl-C would stop it)."""
    cmd = [sys.executable, __file__, "--child", *TOY, *flags, "--out", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, stopped = [], False
    for line in proc.stdout:
        lines.append(line)
        if stop_in and line.startswith(stop_in) and not stopped:
            proc.send_signal(signal.SIGTERM)
            stopped = True
    if proc.wait() not in ((0, 128 + signal.SIGTERM) if stopped else (0,)):
        raise SystemExit(f"{' '.join(cmd[1:])} failed:\n{''.join(lines)[-2000:]}")


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def recording(run_dir: str) -> dict:
    """A run's metrics less the volatile keys, and the hashes of its samples and saved weights."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)}
                for line in f]
    files = sorted(glob.glob(os.path.join(run_dir, "ckpt", "**", "*.safetensors"), recursive=True))
    return {"metrics": rows, "samples": sha256(os.path.join(run_dir, "samples.jsonl")),
            "weights": {os.path.relpath(p, run_dir): sha256(p) for p in files}}


def record(out: str, only: list[str]) -> dict:
    got = {}
    for name, flags in CASES.items():
        if not only or name in only:
            train(os.path.join(out, name), flags)
            got[name] = recording(os.path.join(out, name))
            print(name, flush=True)
    if not only or "resumed" in only:  # stopped after step 1, resumed to step 2
        run = os.path.join(out, "resumed")
        train(run, RESUMED, stop_in="step 1 rollout")
        train(run, [*RESUMED, "--resume"])
        got["resumed"] = recording(run)
        print("resumed", flush=True)
    if not only or "started" in only:  # RL from another run's step 0
        start, run = os.path.join(out, "start"), os.path.join(out, "started")
        train(start, STARTED)
        train(run, ["--workflow", "voting", "--sharing", "isolated", "--start_from", start])
        got["started"] = recording(run)
        print("started", flush=True)
    return got


def differences(old: dict, new: dict) -> list[str]:
    """Where a new recording departs from an old one; keys the old rows had may be gone."""
    found = []
    for name in old.keys() | new.keys():
        if name not in old or name not in new:
            found.append(f"{name}: only in the {'new' if name in new else 'old'} recording")
            continue
        a, b = old[name], new[name]
        if len(a["metrics"]) != len(b["metrics"]):
            found.append(f"{name}: {len(a['metrics'])} metrics rows, now {len(b['metrics'])}")
        for i, (row_a, row_b) in enumerate(zip(a["metrics"], b["metrics"])):
            for k in sorted(row_b):
                if k not in row_a:
                    found.append(f"{name} row {i}: new key {k}")
                elif row_a[k] != row_b[k]:
                    found.append(f"{name} row {i}: {k} {row_a[k]!r} -> {row_b[k]!r}")
        for part in ("samples", "weights"):
            if a[part] != b[part]:
                found.append(f"{name}: {part} differ")
    return found


def stored(path: str) -> dict:
    """The recording that --check names, its shape checked: read before any case trains."""
    if os.path.isdir(path):
        raise ValueError("is a directory, not a recording.json")
    if not os.path.isfile(path):
        raise ValueError("no such file")
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"cannot be read as JSON ({e})") from None
    if not isinstance(old, dict):
        raise ValueError("is not a recording: an object of case name -> recording")
    for name, case in old.items():
        if not (isinstance(case, dict) and isinstance(case.get("metrics"), list)
                and all(isinstance(row, dict) for row in case["metrics"])
                and isinstance(case.get("samples"), str) and isinstance(case.get("weights"), dict)):
            raise ValueError(f"case {name!r} is not a recording (metrics rows, samples, weights)")
    return old


def unusable(out: str) -> str:
    """Why --out cannot take the runs ("" if it can): it must be new or an empty directory."""
    there = os.path.abspath(out)
    while not os.path.exists(there):  # out or the nearest directory above it that exists
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        return f"{there} is a file, not a directory"
    return "it is not empty" if os.path.exists(out) and os.listdir(out) else ""


def child(argv: list[str]) -> None:
    """train.py's command line on problems whose answer is always 7: the tiny model's random replies
    are right often enough that rewards vary and every update path moves the adapters."""
    sys.path.insert(0, ROOT)
    from lab import machine, run, settings
    import train
    from tasks import Problem
    problems = [Problem(f"seven-{i}", f"Question {i}: reply with the number 7.", "7")
                for i in range(16)]
    run.load_task = lambda *args: problems
    machine.catch_stop_signals()
    machine.run_main(lambda: train.main(train.parse_config(argv), typed=settings.typed_flags(argv)))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", required=True, help="a directory for the runs and recording.json")
    parser.add_argument("--check", default="", help="a stored recording.json to compare with")
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    only = [n.strip() for n in args.only.split(",")] if args.only.strip() else []
    if "" in only:
        parser.error(f"--only {args.only}: an empty case name between commas")
    unknown = set(only) - set(CASES) - {"resumed", "started"}
    if unknown:
        parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    try:
        old = stored(args.check) if args.check else {}
    except ValueError as e:
        parser.error(f"--check {args.check}: {e}")
    if not args.out:
        parser.error("--out is empty: name a directory for the runs")
    if why := unusable(args.out):
        parser.error(f"--out {args.out}: {why}")
    args.out = os.path.abspath(args.out)  # the runs' own working directory is the project's
    got = record(args.out, only)
    with open(os.path.join(args.out, "recording.json"), "w") as f:
        json.dump(got, f, indent=1, sort_keys=True)
    if args.check:
        old = {k: v for k, v in old.items() if not only or k in only}
        found = differences(old, got)
        print("\n".join(found[:50]) if found else f"identical: {len(got)} cases")
        sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
