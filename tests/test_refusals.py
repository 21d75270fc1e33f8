"""Nothing lost, nothing silent: inputs that would lose a run, or run with a setting that does
nothing, are refused in one line before anything is written; damaged run files are named."""
import errno
import glob
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from functools import partial

import pytest
import torch
from tensorboard.compat.tensorflow_stub.io.gfile import LocalFileSystem

from conftest import ROOT, directory_state
from lab import files, settings
from lab import run as lab_run
from critic import critic_key
from lora import adapter_for, inject_lora
from model import tiny_model
from tasks import Problem, facts, humaneval_problems
import train
from workflows import run_workflow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TOY = [Problem(f"toy-{i}", f"Question {i}: reply with the number 7.", "7") for i in range(16)]
TINY = dict(model="tiny", workflow="voting", sharing="shared", steps=1, problems_per_step=2,
            group_size=2, eval_problems=2, val_problems=2, max_new_tokens=6, lora_r=4, sft_warmup=0)


def run(out, **kw) -> dict:
    return train.main(train.Config(**{**TINY, **kw, "out": str(out)}))


def refused(argv: list[str], words: str, cwd: str = ROOT) -> None:
    """train.py with `argv` exits non-zero with `words` in one line and no traceback."""
    res = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], cwd=cwd,
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode != 0 and words in res.stderr, res.stderr[-1500:]
    assert "Traceback" not in res.stderr


# ----------------------------------------------------------------------------- data never lost

@pytest.mark.parametrize("inside", ["ckpt", "best", "ckpt/shared", "deeper/new"])
def test_a_run_inside_another_runs_directory_is_refused(inside, tmp_path):
    run(tmp_path / "a")
    before = directory_state(tmp_path / "a")
    with pytest.raises(SystemExit, match="is inside the run in"):
        run(tmp_path / "a" / inside)
    assert directory_state(tmp_path / "a") == before
    # --start_from a/best --out a/best
    with pytest.raises(SystemExit, match="is inside the run in"):
        run(tmp_path / "a" / "best", start_from=str(tmp_path / "a" / "best"))
    assert directory_state(tmp_path / "a") == before


def test_a_run_around_another_run_or_a_directory_that_cannot_be_made_is_refused(tmp_path):
    """A run made around a grid's cell (two levels down, or four below runs/) would keep that
    cell from resuming (it would be inside a run): refused, as is an --out whose name is too long
    to make."""
    run(tmp_path / "grid" / "cell" / "seed0")
    before = directory_state(tmp_path / "grid")
    with pytest.raises(SystemExit, match="holds the run in .*seed0 below it; choose a directory"):
        run(tmp_path / "grid")
    assert directory_state(tmp_path / "grid") == before
    with pytest.raises(SystemExit, match=r"cannot be made \(File name too long\)"):
        run(tmp_path / ("x" * 300))
    # a demo grid's cell, four levels below runs/
    run(tmp_path / "runs" / "demo-d" / "d" / "seed0" / "cell")
    with pytest.raises(SystemExit, match="holds the run in .*seed0/cell below it"):
        run(tmp_path / "runs")


def test_the_project_s_own_directory_is_no_run_s(tmp_path, monkeypatch):
    """--out . in a clone would put a run around every later runs/NAME (checked on a stand-in for
    the project, so that a failure leaves no lock in the real one)."""
    assert os.path.samefile(files.PROJECT, ROOT)
    monkeypatch.setattr(files, "PROJECT", str(tmp_path))
    assert files.take_lock(str(tmp_path)) == (f"--out {tmp_path} is the project's own directory; "
                                             "choose one for the run (runs/NAME)")


def test_a_directory_beside_a_run_or_below_a_non_run_is_free(tmp_path):
    run(tmp_path / "a")
    before = directory_state(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")  # another tool's config: no run without a log
    run(tmp_path / "b" / "run")
    run(tmp_path / "a2")
    for new in ("b/run", "a2"):  # both ran to their last step, and the run beside them is as it was
        rows = [json.loads(line) for line in open(tmp_path / new / "metrics.jsonl")]
        assert rows[-1]["step"] == TINY["steps"], new
    assert directory_state(tmp_path / "a") == before
    assert (tmp_path / "b" / "config.json").read_text() == "{}"


def test_step_0s_best_is_saved_before_the_checkpoint(tmp_path, monkeypatch):
    """Killed between the two saves of step 0, the run must not resume without step 0's best: the
    best comes first, so such a run has no checkpoint and starts over."""
    from lab.checkpoint import TrainState
    order, real = [], TrainState.save

    def recorded(state, out, step, best=None):
        order.append("best" if best else "ckpt")
        return real(state, out, step, best)
    monkeypatch.setattr(TrainState, "save", recorded)
    run(tmp_path / "a", steps=0)
    assert order == ["best", "ckpt"]


def test_overwrite_removes_what_diagnose_made_of_the_old_run(tmp_path):
    out = tmp_path / "a"
    run(out)
    for name in ("report.md", "probe.json", "reward.png"):
        (out / name).write_text("old")
    (out / "notes.txt").write_text("mine")
    run(out, overwrite=True)
    assert not {"report.md", "probe.json", "reward.png"} & set(os.listdir(out))
    assert (out / "notes.txt").read_text() == "mine"  # not the run's: kept


# ----------------------------------------------------------------------------- nothing silent

def test_a_misspelt_lora_target_is_refused():
    model, _ = tiny_model()
    with pytest.raises(ValueError, match="v_prj"):
        inject_lora(model, 4, 8, ("q_proj", "v_prj"))
    model, _ = tiny_model()
    assert len(inject_lora(model, 4, 8, ("q_proj", "v_proj"))) == 4  # 2 layers x 2 targets


@pytest.mark.parametrize("kw, words", [
    (dict(threads=1000), "--threads 1000: this process may use"),
    (dict(resume=True, overwrite=True), "give one"),
    (dict(critic="decentral"), "--critic sets the critics of --algo maac"),
    (dict(lam=0.5), "--lam sets the critics of --algo maac"),
    (dict(algo="maac", critic="central", critic_per="role"),
     "--critic_per groups the critics of --critic decentral; a central critic is one: drop it"),
    (dict(sft_lr=0.01), "--sft_lr sets the warm-up, which --sft_warmup 0 leaves out"),
    (dict(task="humaneval", level=1), "--level is the arith task's difficulty: drop it"),
    (dict(code_timeout=3.0), "--code_timeout sets how a code task's programs run: drop it"),
    (dict(workflow="single", n_agents=2), "--n_agents counts the generators of voting"),
    (dict(max_rounds=3), "--max_rounds counts eval_opt's generator turns"),
    (dict(minibatch_size=8), "--minibatch_size sizes the optimizer steps of --no-one_step and of "
                             "the warm-up; this run has neither"),
    (dict(steps=3, warmup_steps=4), "--warmup_steps 4: not fewer than the run's --steps 3"),
    (dict(steps=3, warmup_steps=3), "--warmup_steps 3: not fewer than the run's --steps 3"),
    (dict(eps_high=0.4), "--eps_high clips the ratio of --no-one_step's later mini-batches"),
    (dict(sft_warmup=1, sft_roles="generator,,generator"), "give distinct role names"),
    (dict(ratio="sequence"), "--ratio chooses the ratio of --no-one_step's later mini-batches"),
    (dict(seed=2 ** 64), "--seed 18446744073709551616: must be in"),
    (dict(seed=-1), "--seed -1: must be in"),
    (dict(lora_alpha=1e300), "--lora_alpha 1e+300: must be in"),
    (dict(task="humaneval", strict_answer=True), "--strict_answer scores a math answer only in"),
    (dict(task="humaneval", code_timeout=1e10), "--code_timeout 10000000000.0: must be in"),
    (dict(task="humaneval", code_timeout=0.001), "--code_timeout 0.001: must be in [0.5, 86400]"),
])
def test_contradictions_and_impossible_numbers_are_refused_before_any_file(kw, words, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(train, "load_policy", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match=re.escape(words)):
        run(tmp_path / "a", **kw)
    assert not os.path.exists(tmp_path / "a")


def test_a_flag_is_idle_only_where_it_changes_nothing():
    """--ratio acts under --one_step once --tis_cap weighs tokens apart; the clip and the
    mini-batch size act under --no-one_step."""
    idle = settings.idle_settings
    assert "ratio" in idle(train.Config()) and "ratio" not in idle(train.Config(tis_cap=2.0))
    free = idle(train.Config(one_step=False))
    assert not {"ratio", "eps_low", "eps_high", "minibatch_size"} & set(free)


def test_a_typed_critic_flag_without_maac_is_refused_even_at_its_default(tmp_path):
    argv = ["--model", "tiny", "--critic", "central", "--out", str(tmp_path / "a")]
    with pytest.raises(SystemExit, match="--critic sets the critics"):
        train.main(train.parse_config(argv), typed=settings.typed_flags(argv))


# ----------------------------------------------------------------------------- damaged files, named

@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> str:
    """A two-step run stopped after its first step (as by Ctrl-C), copied by each test that damages
    it: its best checkpoint is step 0's."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    answers = iter([0, signal.SIGTERM])  # before step 1: go on; after it: stop
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lab_run, "stop_requested", lambda: next(answers))
        with pytest.raises(SystemExit):
            run(out, steps=2)
    return str(out)


def damaged(finished: str, tmp_path, path: str, content) -> str:
    out = str(tmp_path / "run")
    shutil.copytree(finished, out)
    target = os.path.join(out, path)
    if os.path.isdir(target):
        shutil.rmtree(target)
    elif os.path.exists(target):
        os.remove(target)
    if content == "dir":
        os.makedirs(target)
    elif content is not None:
        with open(target, "w") as f:
            f.write(content if isinstance(content, str) else json.dumps(content))
    return out


@pytest.mark.parametrize("path, content, words", [
    ("best/best.json", {}, "best.json is not a best checkpoint's"),
    ("best/best.json", [], "best.json is not a best checkpoint's"),
    ("best/best.json", {"step": 1}, "best.json is not a best checkpoint's"),
    ("best/best.json", {"evaluation": 5}, "best.json is not a best checkpoint's"),
    ("best/shared/adapter_model.safetensors", "torn", "its run cannot be read"),
    ("best/shared", None, "its checkpoint lacks the adapter(s) shared"),
])
def test_a_damaged_start_is_refused_before_a_file_is_written(path, content, words, finished,
                                                             tmp_path):
    start = damaged(finished, tmp_path, path, content)
    with pytest.raises(SystemExit, match=re.escape(words)):
        run(tmp_path / "b", start_from=os.path.join(start, "best"))
    assert not os.path.exists(tmp_path / "b" / "config.json")


def test_start_from_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit, match="not a directory"):
        run(tmp_path / "b", start_from=str(tmp_path / "f"))
    assert not os.path.exists(tmp_path / "b" / "config.json")


@pytest.mark.parametrize("path, content, words", [
    ("metrics.jsonl", '{"reward": 1}\n{"step": 1}\n', "line 1: not a row of this log"),
    ("metrics.jsonl", '[1, 2]\n{"step": 1}\n', "line 1: not a row of this log"),
    ("metrics.jsonl", '{"step": "0"}\n{"step": 1}\n', "line 1: not a row of this log"),
    # the checkpoint is step 1's: its row torn, or one row twice
    ("metrics.jsonl", '{"step": 0, "eval/accuracy": 0.5}\n{"step": 1, "rew',
     "does not hold steps 0 to 1 once each, as the checkpoint of step 1 does (step 1's row"),
    ("metrics.jsonl", '{"step": 0, "eval/accuracy": 0.5}\n{"step": 0, "eval/accuracy": 0.5}\n',
     "(step 1's row is missing or out of place"),
    ("metrics.jsonl", '{"step": 0, "eval/accuracy": 0.5}\n{"step": 1}\n{"step": 1}\n',
     "(step 1's row is there twice"),
    ("config.json", None, "--resume: no run in"),
    (".lock", "dir", "is a directory, not a lock file"),
])
def test_a_resume_over_wrong_shaped_files_names_them(path, content, words, finished, tmp_path):
    """Refused before the log is cut back to the checkpoint: it stays as it was."""
    out = damaged(finished, tmp_path, path, content)
    log = open(os.path.join(out, "metrics.jsonl"), "rb").read()
    with pytest.raises(SystemExit, match=re.escape(words)):
        run(out, resume=True, steps=2)
    assert open(os.path.join(out, "metrics.jsonl"), "rb").read() == log


def test_a_checkpoint_whose_state_is_not_what_a_save_writes_is_refused_in_one_line(finished,
                                                                                  tmp_path):
    """state.pt that loads but holds the wrong things: not a dict, a dict that lacks the
    optimizers, one whose optimizers lack the run's adapter; and a start whose state has a step
    only. Each is named, not a KeyError."""
    state = torch.load(os.path.join(finished, "ckpt", "state.pt"), weights_only=False)
    for i, wrong in enumerate([[1, 2], {k: v for k, v in state.items() if k != "optimizers"},
                               {**state, "optimizers": {}}]):
        out = damaged(finished, tmp_path / str(i), "ckpt/state.pt", None)
        torch.save(wrong, os.path.join(out, "ckpt", "state.pt"))
        with pytest.raises(SystemExit, match=re.escape("the checkpoint in ") + ".*" +
                           re.escape("cannot be read")):
            run(out, resume=True, steps=2)
    start = damaged(finished, tmp_path / "start", "best/state.pt", None)
    torch.save({"step": 0}, os.path.join(start, "best", "state.pt"))
    with pytest.raises(SystemExit, match="its state.pt is not a checkpoint's"):
        run(tmp_path / "b", start_from=os.path.join(start, "best"))
    assert not os.path.exists(tmp_path / "b" / "config.json")


def test_a_resume_with_an_unknown_workflow_in_its_config_names_it(finished, tmp_path):
    out = damaged(finished, tmp_path, "config.json", None)
    with open(os.path.join(finished, "config.json")) as f:
        config = {**json.load(f), "workflow": "chain"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(SystemExit, match="--workflow 'chain': must be one of"):
        train.main(train.Config(out=out, resume=True))


def test_a_run_holding_an_idle_setting_still_resumes(finished, tmp_path):
    """Only a new run's settings are refused for doing nothing: a run whose config holds one (as
    one started before that check may) resumes and finishes."""
    out = damaged(finished, tmp_path, "config.json", None)
    with open(os.path.join(finished, "config.json")) as f:
        # Voting has no rounds and no evaluator
        config = {**json.load(f), "max_rounds": 5, "sft_roles": "generator,evaluator"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    train.main(train.Config(out=out, resume=True))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2]


def test_a_run_started_on_a_gpu_resumes_on_the_cpu(finished, tmp_path):
    """--device says where a run goes on, not what it is: a run saved with --device cuda, refused
    on a machine without CUDA, resumes there with --device cpu."""
    out = damaged(finished, tmp_path, "config.json", None)
    with open(os.path.join(finished, "config.json")) as f:
        config = {**json.load(f), "device": "cuda"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: "):
            train.main(train.Config(out=out, resume=True))
    train.main(train.parse_config(["--out", out, "--resume", "--device", "cpu"]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2]


def test_a_new_learning_rate_for_a_finished_run_is_refused(finished, tmp_path):
    """A finished run has no step left for it, and its config.json keeps the rate it trained
    with."""
    out = str(tmp_path / "run")
    shutil.copytree(finished, out)
    train.main(train.Config(out=out, resume=True))  # steps 2 of 2
    before = directory_state(out)
    with pytest.raises(SystemExit, match=r"is finished \(step 2 of 2\): a new --lr would train "):
        train.main(train.parse_config(["--out", out, "--resume", "--lr", "0.9"]))
    assert directory_state(out) == before


@pytest.mark.parametrize("path, content, words", [
    ("best/best.json", {}, "best/best.json cannot be read or is not what keep_best writes"),
    ("best/best.json", [], "best/best.json cannot be read or is not what keep_best writes"),
    ("best/best.json", "{not json", "best/best.json cannot be read or is not what keep_best"),
    ("best/best.json", {"step": 0, "metric": "eval/accuracy", "score": "high",
                        "evaluation": {"eval/accuracy": 0.5}}, "best/best.json cannot be read"),
    ("best", "not a checkpoint", "best is not a checkpoint's directory"),
])
def test_a_resume_refuses_a_damaged_best_and_keeps_it(path, content, words, finished, tmp_path):
    """A best checkpoint that does not read back stops the resume in one line naming it, before a
    log is cut: it may be all that is left of the run's peak, so nothing is deleted. Moved aside,
    the resume goes on and the next evaluation keeps a new best."""
    out = damaged(finished, tmp_path, path, content)
    before = directory_state(out)
    with pytest.raises(SystemExit, match=re.escape(words) + ".*move .*best aside"):
        run(out, resume=True, steps=2)
    assert directory_state(out) == before
    os.rename(os.path.join(out, "best"), os.path.join(out, "best.damaged"))
    run(out, resume=True, steps=2)
    with open(os.path.join(out, "best", "best.json")) as f:
        assert json.load(f)["step"] == 2  # the next evaluation kept one


def test_a_checkpoint_of_another_run_is_refused_before_a_log_is_cut(finished, tmp_path):
    """A state.pt copied in from another run (here a --steps 0 run of another seed) is refused in
    one line, the run left as it was, not taken with the logs cut back to its step. A checkpoint
    saved before runs had an id is taken, as it always was; a run started from another on purpose
    (--start_from) has its own id and resumes."""
    other = tmp_path / "other"
    run(other, steps=0, seed=5)
    out = damaged(finished, tmp_path, "ckpt/state.pt", None)
    shutil.copy(other / "ckpt" / "state.pt", os.path.join(out, "ckpt", "state.pt"))
    before = directory_state(out)
    with pytest.raises(SystemExit, match=r"the checkpoint in .*ckpt is another run's \(run id "):
        run(out, resume=True, steps=2)
    assert directory_state(out) == before
    old = damaged(finished, tmp_path / "old", "ckpt/state.pt", None)  # saved without an id
    state = torch.load(os.path.join(finished, "ckpt", "state.pt"), weights_only=True)
    torch.save({k: v for k, v in state.items() if k != files.RUN_ID},
               os.path.join(old, "ckpt", "state.pt"))
    run(old, resume=True, steps=2)
    assert [json.loads(line)["step"] for line in open(os.path.join(old, "metrics.jsonl"))] == \
        [0, 1, 2]
    branch = tmp_path / "branch"
    run(branch, steps=1, seed=5, start_from=str(other))
    ids = [files.config_run_id(str(d)) for d in (other, branch)]
    assert ids[0] != ids[1] and torch.load(branch / "ckpt" / "state.pt", weights_only=True)[
        files.RUN_ID] == ids[1]
    train.main(train.Config(out=str(branch), resume=True))  # finished: its checkpoint is taken


TINY_ARGV = ["--model", "tiny", "--workflow", "voting", "--sharing", "shared",
             "--problems_per_step", "2", "--group_size", "2", "--eval_problems", "2",
             "--val_problems", "2", "--max_new_tokens", "6", "--lora_r", "4", "--sft_warmup", "0"]


@pytest.mark.parametrize("nbytes, steps, words", [
    (1000, 1, "config.json cannot be written"),  # the first file a run writes
    (20000, 1, "best.tmp/shared/adapter_model.safetensors cannot be written"),  # its first save
    (40000, 12, " cannot be written"),  # a log or tb/ grows past it after a few checkpoints
])
def test_a_full_disk_stops_train_py_in_one_line_and_leaves_no_temporary_file(nbytes, steps, words,
                                                                             tmp_path):
    """A file that cannot grow past `nbytes` (RLIMIT_FSIZE: the kernel refuses the write, as a
    full disk does, whoever writes: torch.save, safetensors, TensorBoard, a log): train.py stops
    with one line naming the file and the error, no traceback and no temporary file, and where
    it saved a checkpoint it resumes from it and finishes once the files may grow."""
    out = tmp_path / "run"
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--out", str(out)]
    limit = (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
    res = subprocess.run(argv + TINY_ARGV + ["--steps", str(steps)], capture_output=True,
                         text=True, timeout=300, env=ENV,
                         preexec_fn=partial(resource.setrlimit, resource.RLIMIT_FSIZE, limit))
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and words in last and "(File too large)" in last, res.stderr[-1500:]
    assert "Traceback" not in res.stderr
    assert not [p for p in out.rglob("*") if p.name.endswith((".tmp", ".part"))]
    assert (out / "ckpt").exists() == (steps > 1)
    if steps > 1:
        done = subprocess.run(argv + ["--resume"], capture_output=True, text=True, timeout=300,
                              env=ENV)
        assert done.returncode == 0, done.stderr[-1500:]
        with open(out / "metrics.jsonl") as f:
            assert [json.loads(line)["step"] for line in f] == list(range(steps + 1))


@pytest.mark.parametrize("where", ["tb", "ckpt"])
def test_no_space_left_keeps_the_newest_checkpoint_resumable(where, finished, tmp_path,
                                                             monkeypatch, capfd):
    """No space left on the device (ENOSPC) as TensorBoard's thread writes its events, or as the
    newest checkpoint is written: the run stops in one line naming it, without a traceback (the
    thread's included) or a temporary directory, the checkpoint before it whole; it then
    resumes from that checkpoint and finishes."""
    out = str(tmp_path / "run")
    shutil.copytree(finished, out)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "tb":  # where TensorBoard's writer puts its bytes on the disk
        monkeypatch.setattr(LocalFileSystem, "_write", lambda *args: raise_(full))
    else:
        monkeypatch.setattr(os, "write", partial(write_unless, "/ckpt.tmp/", full, os.write))
    with pytest.raises(SystemExit, match=re.escape(f"{out}/{where}") + ".* cannot be written "
                       r"\(No space left on device\); the run stops here"):
        run(out, resume=True, steps=2)
    monkeypatch.undo()
    assert "Traceback" not in capfd.readouterr().err
    assert not glob.glob(f"{out}/**/*.tmp", recursive=True)
    assert torch.load(os.path.join(out, "ckpt", "state.pt"), weights_only=True)["step"] == 1
    run(out, resume=True, steps=2)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2]


def raise_(error: Exception):
    raise error


def write_unless(part: str, error: OSError, write, fd: int, data) -> int:
    """os.write, which fails with `error` for a file whose path holds `part`."""
    if part in os.readlink(f"/proc/self/fd/{fd}"):
        raise error
    return write(fd, data)


def test_the_command_line_refuses_in_one_line(tmp_path):
    refused(["--model", "tiny", "--threads", "1000", "--out", str(tmp_path / "a")],
            "--threads 1000")
    refused(["--model", "tiny", "--seed", str(2 ** 64), "--out", str(tmp_path / "a")], "--seed")
    assert not os.path.exists(tmp_path / "a")


# ----------------------------------------------------------------------------- the other tools

def test_diagnose_names_a_foreign_config_and_refuses_a_bad_seed(finished, tmp_path, capsys):
    import diagnose
    out = damaged(finished, tmp_path, "config.json", None)
    with open(os.path.join(finished, "config.json")) as f:
        config = {**json.load(f), "colour": "blue"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    for argv in (["--watch", out, "What is 2 + 3?"], ["--probe", os.path.join(out, "ckpt")]):
        with pytest.raises(SystemExit, match="config.json is not a config of this project"):
            diagnose.main(argv)
    with pytest.raises(SystemExit) as stop:
        diagnose.main(["--watch", finished, "2 + 3?", "--sample", "--seed", str(2 ** 64)])
    assert (stop.value.code == 2
            and "--seed 18446744073709551616: must be in" in capsys.readouterr().err)


def test_every_tool_refuses_an_abbreviated_flag():
    from lab import bench, course
    import diagnose
    from lab import grid
    for parse, argv in ((bench.make_parser().parse_args, ["--rep", "1"]),
                        (diagnose.make_parser().parse_args, ["--wat", "a", "b"]),
                        (course.make_parser().parse_args, ["make", "1", "--ou", "x"])):
        with pytest.raises(SystemExit) as stop:
            parse(argv)
        assert stop.value.code == 2
    args, train_flags = grid.parse_args(["--demo", "default", "--lr", "1e-3"])  # train.py's flag
    assert args.seeds == [0, 1, 2] and train_flags == ["--lr", "1e-3"]


@pytest.mark.parametrize("argv, words", [
    (["--seeds", "0,0"], "distinct seeds"),
    (["--seeds", "-1"], "distinct seeds"),
    (["--seeds", "4294967296"], "distinct seeds"),
    (["--seed", "1"], "each cell's seed is one of --seeds"),   # every cell would run seed 1
    (["--seed=1"], "each cell's seed is one of --seeds")])
def test_grid_refuses_seeds_that_would_repeat_a_cell(argv, words, capsys):
    from lab import grid
    with pytest.raises(SystemExit) as stop:
        grid.parse_args(["--demo", "default", *argv])
    assert stop.value.code == 2 and words in capsys.readouterr().err


def test_record_keeps_a_relative_out_where_it_was_given_and_refuses_an_abbreviation(
        tmp_path, monkeypatch, capsys):
    """The cases run with the project as their working directory: --out rec, given elsewhere, is
    still the caller's rec."""
    import record
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(record, "record", lambda out, only: seen.append(out) or {})
    monkeypatch.setattr(sys, "argv", ["record.py", "--out", "rec", "--only", "single-shared"])
    (tmp_path / "rec").mkdir()
    record.main()
    assert seen == [str(tmp_path / "rec")] and (tmp_path / "rec" / "recording.json").exists()
    monkeypatch.setattr(sys, "argv", ["record.py", "--ou", "rec2"])
    with pytest.raises(SystemExit) as stop:
        record.main()
    assert stop.value.code == 2 and "--out" in capsys.readouterr().err


@pytest.mark.parametrize("check, out, words", [
    ('{"a": ', "runs", "--check bad.json: cannot be read as JSON"),
    ("[]", "runs", "--check bad.json: is not a recording"),
    ('{"single-shared": {}}', "runs", "case 'single-shared' is not a recording"),
    ("dir", "runs", "--check bad.json: is a directory"),
    (None, "afile", "afile is a file, not a directory"),
    (None, "afile/sub", "afile is a file, not a directory"),
    (None, "", "--out is empty"),
])
def test_record_refuses_a_bad_check_or_out_before_training(check, out, words, tmp_path,
                                                           monkeypatch, capsys):
    import record
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(record, "record", lambda *a: pytest.fail("a case was trained"))
    (tmp_path / "afile").write_text("x")
    if check == "dir":
        (tmp_path / "bad.json").mkdir()
    elif check is not None:
        (tmp_path / "bad.json").write_text(check)
    argv = ["--out", out, "--only", "single-shared"] + (["--check", "bad.json"] if check else [])
    monkeypatch.setattr(sys, "argv", ["record.py", *argv])
    with pytest.raises(SystemExit) as stop:
        record.main()
    assert stop.value.code == 2 and words in capsys.readouterr().err


# ----------------------------------------------------------------------------- files and links

def test_a_link_in_the_run_directory_is_never_written_through(tmp_path):
    """A symbolic link where the run writes (its .lock, config.json's temporary file) is refused
    or replaced, never followed: the file it names keeps its bytes, even when the launch is then
    refused for another reason."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(target, out / ".lock")
    with pytest.raises(SystemExit, match=r"its \.lock is a symbolic link"):
        run(out, lora_targets="nosuch")
    os.remove(out / ".lock")
    os.symlink(target, out / "config.json.tmp")  # a new run writes config.json through it
    run(out)
    assert target.read_text() == "keep me\n"
    assert not os.path.islink(out / "config.json.tmp") and os.path.isfile(out / "config.json")
    os.remove(out / "metrics.jsonl")  # a log replaced by a link is refused as it is appended to
    os.symlink(target, out / "metrics.jsonl")
    with pytest.raises(SystemExit, match="metrics.jsonl is a symbolic link"):
        files.append_jsonl(str(out / "metrics.jsonl"), [{"step": 9}])
    assert target.read_text() == "keep me\n"


class RunsCode:
    """A pickled object that would run a command when unpickled."""
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("how", ["resume", "start_from"])
def test_a_checkpoint_that_would_run_code_is_refused_unread(how, tmp_path):
    """A state.pt that holds a pickled object besides tensors and plain data (a run someone hands
    over) is refused in one line by --resume and --start_from; the object never runs."""
    start, proof = tmp_path / "start", tmp_path / "it-ran"
    run(start, steps=0 if how == "start_from" else 1)
    state = torch.load(start / "ckpt" / "state.pt", weights_only=True)
    state["py_rng"] = RunsCode(str(proof))
    torch.save(state, start / "ckpt" / "state.pt")
    words = ("cannot be read" if how == "resume" else "its run cannot be read")
    with pytest.raises(SystemExit, match=words):
        if how == "resume":
            train.main(train.Config(out=str(start), resume=True))
        else:
            run(tmp_path / "b", start_from=str(start))
    assert not proof.exists()


def test_a_split_smaller_than_asked_is_refused_where_typed_and_said_where_not(tmp_path,
                                                                            monkeypatch):
    """A task whose test or val split holds fewer problems than asked (HumanEval's 164 in all):
    a typed --eval_problems is refused in one line; a default becomes what the split holds, and
    the run's config.json and plan say that number, not the default."""
    monkeypatch.setattr(lab_run, "load_task", lambda task, split, n, *a: TOY[:min(n, 5)])
    with pytest.raises(SystemExit, match=re.escape("--eval_problems 8: task arith's split holds "
                                                   "5 problems; give at most 5")):
        train.main(train.Config(**{**TINY, "val_problems": 0, "eval_problems": 8,
                                   "out": str(tmp_path / "typed")}), typed={"eval_problems"})
    assert not os.path.exists(tmp_path / "typed")
    out = tmp_path / "default"
    train.main(train.Config(**{**TINY, "eval_problems": 96, "val_problems": 48, "out": str(out)}),
               typed=set())
    saved = json.load(open(out / "config.json"))
    assert (saved["eval_problems"], saved["val_problems"], saved["train_problems"]) == (5, 5, 5)


@pytest.mark.parametrize("inside", ["lab", "docs/runs", "tests"])
def test_a_run_inside_the_projects_own_folders_is_refused(inside):
    """An --out in lab/, docs/ or tests/ would put a run (and an --overwrite) among the project's
    own files: refused before anything is made."""
    out = os.path.join(ROOT, inside, "a-run")
    with pytest.raises(SystemExit, match=f"is inside the project's {inside.split('/')[0]}/"):
        run(out)
    assert not os.path.exists(out)


def test_a_damaged_samples_log_stops_a_resume_before_either_log_is_cut(finished, tmp_path):
    """A step's row past the checkpoint (its save was cut) and a damaged line in samples.jsonl:
    the resume is refused in one line, metrics.jsonl left as it was (not cut back first)."""
    out = damaged(finished, tmp_path, "samples.jsonl", '{"step": 1}\nnot json\n{"step": 1}\n')
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 2, "reward/mean": 0.5}\n')
    log = open(os.path.join(out, "metrics.jsonl"), "rb").read()
    with pytest.raises(SystemExit, match="samples.jsonl, line 2: not JSON"):
        run(out, resume=True, steps=2)
    assert open(os.path.join(out, "metrics.jsonl"), "rb").read() == log


@pytest.mark.parametrize("call, words", [
    (partial(adapter_for, "generator", "per_role"), "unknown sharing 'per_role'"),
    (partial(critic_key, "generator_0", "generator", "decentral", "agent"),
     "unknown critic grouping 'agent'"),
    (partial(run_workflow, "voting", ["1+1?"], None, "math", n_agents=0), "need n_agents >= 1"),
    (partial(run_workflow, "eval_opt", ["1+1?"], None, "math", max_rounds=0), "max_rounds >= 1"),
    (partial(humaneval_problems, "validation", 5), "split must be one of train, val, test"),
    (partial(facts, 1, "tst"), "split must be one of train, val, test"),
])
def test_a_library_caller_s_unknown_setting_is_refused_not_read_as_another(call, words):
    """Called from a script rather than train.py, no setting falls through to a default branch:
    an unknown sharing would train isolated adapters, an unknown grouping one critic per role, an
    unknown split return no problems."""
    with pytest.raises(ValueError, match=re.escape(words)):
        call()
