"""lab/bench.py end to end on the tiny model, and the memory figure a fresh process reports."""
import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from lab import bench, files


def test_bench_runs_and_its_rollout_writes_generates_greedy_tokens(tmp_path, capsys,
                                                                   monkeypatch):
    out = tmp_path / "bench.json"
    warmed = []  # per timed comparison: its runs, and the warm-ups run before them
    timed_alternately = bench.alternate

    def alternate(device, runs, repeats, warmups):
        warmed.append((sorted(runs), len(warmups)))
        return timed_alternately(device, runs, repeats, warmups)
    monkeypatch.setattr(bench, "alternate", alternate)
    bench.main(["--model", "tiny", "--repeats", "1", "--json", str(out)])
    fig = json.loads(out.read_text())
    g = fig["generate"]
    # raw generate, merged and low-rank rollouts: the same completions
    assert g["same_greedy_tokens"]
    assert all(g[name]["seconds"] > 0 and g[name]["tokens_per_s"] > 0
               for name in ("raw", "merged", "low_rank"))
    assert g["rollout_over_raw"] > 0 and 0 <= g["prompt_padding"] < 1
    assert fig["update"]["update"]["tokens_per_s"] > 0
    assert set(fig["step"]) == {"rollout", "old_logp", "update", "eval", "peak_mb"}
    assert fig["sharing"]["adapters"] == {"shared": 1, "isolated": 2}
    assert fig["limits"]["matmul_fp32_gflops"] > 0 and fig["limits"]["copy_gbs"] > 0
    t = fig["throughput"]
    assert set(t["generate"]) == {"16", "32", "64"} and all(v > 0 for row in t["generate"].values()
                                                            for v in row.values())
    assert set(t["generate"]["32"]) == {f"{s} {d}" for s in ("decode", "generate")
                                        for d in t["dtypes"]}
    assert set(t["update"]) == set(t["dtypes"]) and "fp32" in t["dtypes"]
    table = capsys.readouterr().out
    assert ("rollout, adapter merged" in table and "isolated / shared" in table
            and "peaks at" in table and "medians of 1 alternating runs after a warm-up" in table)
    # every comparison warms each of its runs up first (the throughput's update too)
    assert len(warmed) >= 8 and all(n >= len(runs) for runs, n in warmed), warmed


def test_bench_refuses_an_unknown_part_before_loading_a_model():
    with pytest.raises(SystemExit, match="--skip steps: choose from step, sharing, throughput"):
        bench.main(["--model", "no-such-model", "--skip", "steps"])


def test_a_process_started_from_a_big_one_reports_its_own_peak():
    """ru_maxrss carries a parent's peak over to the process it starts; machine.peak_memory_mb
    must not (lab/bench.py and lab/grid.py --reproduce start train.py)."""
    ballast = bytearray(1 << 30)
    ballast[:: 1 << 12] = b"x" * len(ballast[:: 1 << 12])  # touch every page: 1 GiB resident
    child = subprocess.run([sys.executable, "-c",
                            "from lab import machine; print(machine.peak_memory_mb('cpu'))"],
                           cwd=ROOT, capture_output=True, text=True, check=True)
    assert float(child.stdout.split()[-1]) < 1000, child.stdout
    del ballast


@pytest.mark.parametrize("flags, words", [
    (["--device", "tpu"], "--device tpu: not a device of this project"),
    (["--threads", "-1"], "--threads -1: from 0"),
    (["--threads", "1000"], "--threads 1000: from 0"),
    (["--problems", "1000"], "--problems from 1 to 256"),
    (["--batches", "0"], "every batch size must be at least 1"),
    (["--batches", "-2"], "every batch size must be at least 1"),
    (["--batches", "abc"], "--batches 'abc': give batch sizes"),
    (["--batches", "8,8"], "--batches 8,8: a batch size is given twice"),
    (["--skip", "throughput", "--batches", "8"], "--batches sizes the throughput part, which "
                                                 "--skip leaves out"),
    (["--json", "/no/such/dir/b.json"], "/no/such/dir is missing or read-only"),
])
def test_bench_refuses_bad_flags_before_loading_a_model(flags, words, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "load_policy", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match=re.escape(words)):
        bench.main(["--model", "tiny", *flags])
    with pytest.raises(SystemExit, match="is a directory"):
        bench.main(["--model", "tiny", "--json", str(tmp_path)])
    # a run's own file (its config.json, its log) is not replaced by the figures
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text(json.dumps(dict.fromkeys(files.READ, 1)))
    for name in ("config.json", "metrics.jsonl", "ckpt/b.json"):
        with pytest.raises(SystemExit, match="is inside the run in .*run; name a file outside"):
            bench.main(["--model", "tiny", "--json", str(tmp_path / "run" / name)])


def test_bench_on_cuda_without_a_gpu_is_one_line(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    monkeypatch.setattr(bench, "load_policy", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match="--device cuda: "):
        bench.main(["--model", "tiny", "--device", "cuda"])


def test_bench_on_a_gpu_takes_the_median_of_at_least_three_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench, "load_policy", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match="--repeats 2 on a GPU: at least 3"):
        bench.main(["--model", "tiny", "--device", "cuda", "--repeats", "2"])
    args = bench.make_parser().parse_args(["--device", "cuda", "--repeats", "3"])
    assert bench.check_args(args, 256) == (set(), [16, 32, 64])
    args = bench.make_parser().parse_args(["--device", "cpu", "--repeats", "1"])
    assert bench.check_args(args, 256) == (set(), [16, 32, 64])  # a CPU's timings may be one run


def test_the_throughput_table_against_the_machine_by_hand():
    """A model of 1e9 parameters: 2 GFLOP a generated token, 4 a trained position. 100 tokens/s
    at 32 rows is 320 ms a step and 200 GFLOP/s, 20 % of a 1000 GFLOP/s peak; 2 GB of weights at
    100 GB/s take 20 ms to read; 50 positions/s of the update is 200 GFLOP/s."""
    fig = {"limits": {"matmul_fp32_gflops": 1000.0, "copy_gbs": 100.0}, "new_tokens": 48,
           "throughput": {"dtypes": ["fp32"], "params": 1e9, "weight_bytes": {"fp32": 2e9},
                          "generate": {"32": {"decode fp32": 100.0}}, "update": {"fp32": 50.0},
                          "update_positions": 1000}}
    lines = bench.throughput_lines(fig)
    assert "peaks at 1000 GFLOP/s fp32; copying 256 MiB runs at 100.0 GB/s" in lines[1]
    assert "at 2.00 GFLOP a token" in lines[2]
    assert "reading the weights once takes 20.000 ms in fp32" in lines[3]
    assert lines[4] == "    batch   32, decode  : fp32    100.0 (320.00 ms,  200.0, 20.0%)"
    assert lines[5].endswith("positions/s: fp32   50.0 (200.0, 20.0%)")
