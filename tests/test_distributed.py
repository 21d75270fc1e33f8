"""Several processes, as torchrun runs them, on CPU with gloo: the 2-process update equals the
1-process update on the same calls, and a 2-process training run completes and resumes exactly.

Processes are started with torch.multiprocessing, with the environment variables torchrun
sets, and meet through a file store in a fresh directory (a port picked in advance could be taken
before the store binds it)."""
import json
import os
import sys
import tempfile

import pytest

from conftest import critic_config, train_state, update_config
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo import policy_update
from lab import machine, files
from lab import run as lab_run
from lab.machine import PROCESSES, rank_and_world
from lora import adapter_for, adapter_parameters, inject_lora, setup_adapters
from measure import gradient_signals
from model import tiny_model
from rollout import Rollout
from tasks import Problem
import train
from workflows import ROLES, run_workflow


def worker(rank: int, world: int, store: str, fn, args: tuple) -> None:
    """One process of the group. A process whose work is done leaves as lab.machine.run_main
    leaves under torchrun: without the interpreter's shutdown, where gloo's threads have aborted
    a finished process (SIGABRT, "terminate called without an active exception")."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(*args)
        if dist.is_initialized():  # (train.main tears its group down itself)
            # as train.py does: every process done with the group before any tears it down
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (an exception above propagates: torch.multiprocessing reports it)


def in_processes(world: int, fn, *args) -> None:
    """Run fn(*args) in `world` fresh processes that form one process group."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(world, f"{d}/store", fn, args), nprocs=world, join=True)


# ----------------------------------------------------------------------------
# The update


def updated_adapters(workflow: str, sharing: str, minibatch_size: int, out: str) -> None:
    """Roll out 4 tiny-model episodes (the same in every process), then one policy update per
    adapter; rank 0 saves the adapters' weights and the update's statistics to `out`."""
    torch.manual_seed(0)
    model, tok = tiny_model()
    tok.padding_side = "left"
    model.eval()
    inject_lora(model, r=4, alpha=8)
    names = setup_adapters(model, ROLES[workflow], sharing)
    for name in names:
        for p in adapter_parameters(model, name):
            torch.nn.init.normal_(p, std=0.05)
            p.requires_grad_(True)
            p.grad = torch.zeros_like(p)
    rollout = Rollout(model, tok, sharing, max_new_tokens=6, temperature=1.0)
    torch.manual_seed(1)
    run_workflow(workflow, ["What is 1 + 2?", "What is 3 + 4?"] * 2, rollout, n_agents=3)
    calls = rollout.calls
    # some calls without signal, so slots hold 0, 1 or more live calls
    for i, c in enumerate(calls):
        c.advantage = [1.0, -0.5, 0.0, 2.0, 0.0][i % 5]
    settings = update_config(minibatch_size=minibatch_size, grad_clip=0.5)
    start = {n: [p.detach().clone() for p in adapter_parameters(model, n)] for n in names}
    stats = {}
    for name in names:
        mine = [c for c in calls if adapter_for(c.role, sharing) == name]
        sgd = torch.optim.SGD(adapter_parameters(model, name), lr=0.5)
        stats.update(gradient_signals(model, name, mine, tok.pad_token_id, settings, PROCESSES))
        stats.update(policy_update(train_state(model, {name: sgd}),
                                   name, mine, tok.pad_token_id, settings, PROCESSES))
    if rank_and_world()[0] == 0:
        torch.save({"start": start,
                    "weights": {n: [p.detach().clone() for p in adapter_parameters(model, n)]
                                for n in names},
                    "stats": {k: v for k, v in stats.items() if "grad_norm" in k or "kappa" in k
                              or "update_norm" in k}}, out)


@pytest.mark.parametrize("workflow, sharing, minibatch_size", [
    ("voting", "isolated", 5),   # several mini-batches, the later ones off-policy
    ("voting", "shared", 32),    # one mini-batch, roles sharing the adapter
    ("eval_opt", "shared", 3),   # early stopping: slots and stages of unequal size
])
def test_two_process_update_equals_the_one_process_update(tmp_path, workflow, sharing,
                                                          minibatch_size):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    updated_adapters(workflow, sharing, minibatch_size, one)
    in_processes(2, updated_adapters, workflow, sharing, minibatch_size, two)
    a, b = torch.load(one), torch.load(two)
    moved = 0.0
    for name, weights in a["weights"].items():
        for x, y, x0 in zip(weights, b["weights"][name], a["start"][name]):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), name
            moved = max(moved, (x - x0).abs().max().item())
    assert moved > 1e-3
    assert (a["stats"].keys() == b["stats"].keys()
            and any("kappa" in k for k in a["stats"]) == (workflow == "voting"))
    for k, v in a["stats"].items():
        assert v == pytest.approx(b["stats"][k], rel=1e-4), k


# ----------------------------------------------------------------------------
# A training run

TOY = [Problem(f"toy-{i}", f"Question {i}: reply with the number 7.", "7") for i in range(16)]


def odd_length_wins(problems, texts, **settings) -> list[float]:
    return [float(len(t) % 2) for t in texts]


def run(out: str, resume: bool = False, dies_at_call: int = 0, **kw) -> None:
    """train.main on the toy task (rewards that vary); dies_at_call: raise in that rollout."""
    lab_run.load_task = lambda *args: TOY
    train.score_batch = odd_length_wins
    if dies_at_call:
        real, seen = train.run_episodes, []

        def dies(*args, **kwargs):
            seen.append(1)
            if len(seen) == dies_at_call:
                raise RuntimeError("killed")
            return real(*args, **kwargs)
        train.run_episodes = dies
    cfg = dict(model="tiny", workflow="voting", sharing="isolated", steps=4, problems_per_step=3,
               group_size=2, eval_problems=3, val_problems=0, max_new_tokens=6, temperature=1.0,
               lr=1e-2, lora_r=4,
               eval_every=2, save_every=2, sft_warmup=0, truncated="keep",
               out=out)
    train.main(train.Config(**cfg, **kw) if not resume else train.Config(out=out, resume=True))


def rows(out: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))}
            for r in files.read_jsonl(f"{out}/metrics.jsonl")]


def test_two_process_run_logs_like_one_and_resumes_exactly(tmp_path):
    single, straight, resumed = (str(tmp_path / n) for n in ("single", "straight", "resumed"))
    in_processes(1, run, single)
    in_processes(2, run, straight)
    with pytest.raises(Exception):  # both processes die in step 3, after the checkpoint of step 2
        in_processes(2, run, resumed, False, 5)
    assert [r["step"] for r in rows(resumed)] == [0, 1, 2]
    in_processes(2, run, resumed, True)
    assert rows(resumed) == rows(straight)
    with open(f"{straight}/samples.jsonl") as f, open(f"{resumed}/samples.jsonl") as g:
        assert f.read() == g.read()
    keys = [set().union(*rows(out)) for out in (straight, single)]
    assert keys[0] == keys[1]  # the same metrics as one process logs
    last = rows(straight)[-1]
    # everyone's episodes: 3 problems x 2 x 3 slots
    assert last["role/generator/calls"] == 3 * 3 * 2
    assert any(r.get("adapter/generator/grad_norm", 0) > 0 for r in rows(straight))
    with open(f"{straight}/config.json") as f:
        assert json.load(f)["problems_per_step"] == 3
    with pytest.raises(Exception):  # a 2-process checkpoint does not resume in one process
        in_processes(1, run, straight, True)


def stop_and_lock(out: str) -> None:
    """A signal that reached rank 1 alone stops both processes; a run directory that another
    process holds stops both. Each process writes what it saw to out.<rank>."""
    import signal
    rank = rank_and_world()[0]
    machine.requested[:] = [signal.SIGTERM] if rank == 1 else []
    seen = [machine.stop_requested()]
    try:
        files.lock_run(out)
    except SystemExit as e:
        seen.append(str(e))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)


def test_processes_agree_to_stop_and_that_a_held_run_directory_is_held(tmp_path):
    out = str(tmp_path / "run")
    files.lock_run(out)  # this process holds it
    try:
        in_processes(2, stop_and_lock, out)
    finally:
        files.unlock_run()
    for rank in (0, 1):
        with open(f"{out}.{rank}") as f:
            assert json.load(f) == [15, f"--out {out} is in use by another run "
                                        f"(pid {os.getpid()}); wait for it to end or stop it"]


# ----------------------------------------------------------------------------
# The critics, and torchrun itself


def updated_critics(out: str) -> None:
    """Values, GAE advantages and one critic update of 4 Eval-Opt episodes (central critic);
    rank 0 saves the values, advantages and the critic's weights."""
    from critic import critic_advantages, setup_critics, update_critics
    torch.manual_seed(0)
    model, tok = tiny_model()
    tok.padding_side = "left"
    model.eval()
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ROLES["eval_opt"], "shared")
    heads = setup_critics(model, ["critic"])
    params = adapter_parameters(model, "critic") + list(heads["critic"].parameters())
    for p in params:
        torch.nn.init.normal_(p, std=0.1)  # values that are not all 0
        p.requires_grad_(True)
        p.grad = torch.zeros_like(p)
    rollout = Rollout(model, tok, "shared", max_new_tokens=6, temperature=1.0)
    torch.manual_seed(1)
    run_workflow("eval_opt", ["What is 1 + 2?", "What is 3 + 4?"] * 2, rollout, n_agents=3)
    for c in rollout.calls:
        c.reward = float(c.episode % 2)
    s = critic_config(critic="central", critic_steps=3, norm_adv=True)  # several mini-batches
    batch = critic_advantages(model, tok, heads, rollout.calls, s, PROCESSES)
    sgd = {"critic": torch.optim.SGD(params, lr=0.5)}
    update_critics(train_state(model, sgd, heads), batch, tok.pad_token_id, s, PROCESSES)
    if rank_and_world()[0] == 0:
        torch.save({"values": batch.values, "adv": [c.advantage for c in rollout.calls],
                    "weights": [p.detach().clone() for p in params]}, out)


def test_two_process_critics_equal_one_process_critics(tmp_path):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    updated_critics(one)
    in_processes(2, updated_critics, two)
    a, b = torch.load(one), torch.load(two)
    assert torch.allclose(a["values"], b["values"], atol=1e-6) and a["values"].abs().max() > 0
    assert a["adv"] == pytest.approx(b["adv"], abs=1e-5)
    for x, y in zip(a["weights"], b["weights"]):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)


def test_torchrun_runs_train_py_with_two_processes(tmp_path):
    """docs/torchrun.md's command, on the tiny model: GRPO on Voting, and the central critic on
    Eval-Opt."""
    import subprocess
    from conftest import ROOT
    for flags in (["--workflow", "voting", "--sharing", "isolated"],
                  ["--workflow", "eval_opt", "--algo", "maac", "--critic", "central"]):
        out = str(tmp_path / flags[1])
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "train.py", "--model", "tiny", "--steps", "2", "--problems_per_step", "3",
             "--group_size", "2", "--eval_problems", "3", "--max_new_tokens", "6", "--lora_r", "4",
             "--out", out, *flags],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.count("held-out accuracy of") == 1  # rank 0 alone logs
        metrics = files.read_jsonl(f"{out}/metrics.jsonl")
        assert [r["step"] for r in metrics] == [0, 1, 2]
        assert metrics[-1]["role/generator/calls"] >= 3 * 2  # both processes' episodes
    done = subprocess.run(  # a process without a problem is refused, in one line per process
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "train.py", "--model", "tiny", "--problems_per_step", "1", "--out", str(tmp_path / "one")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "--problems_per_step 1: fewer problems than the 2 processes" in done.stderr
