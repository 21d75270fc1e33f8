"""lab/bench.py end to end on the tiny model, and the memory figure a fresh process reports."""
import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from lab import bench


def test_bench_runs_and_its_rollout_writes_generates_greedy_tokens(tmp_path, capsys):
    out = tmp_path / "bench.json"
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
            and "peaks at" in table)


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
    (["--json", "/no/such/dir/b.json"], "/no/such/dir is missing or read-only"),
])
def test_bench_refuses_bad_flags_before_loading_a_model(flags, words, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "load_policy", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match=re.escape(words)):
        bench.main(["--model", "tiny", *flags])
    with pytest.raises(SystemExit, match="is a directory"):
        bench.main(["--model", "tiny", "--json", str(tmp_path)])


def test_bench_on_cuda_without_a_gpu_is_one_line(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    monkeypatch.setattr(bench, "load_policy", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match="--device cuda: "):
        bench.main(["--model", "tiny", "--device", "cuda"])
