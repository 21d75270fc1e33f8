"""train.py end to end on the tiny model: every workflow x sharing, resume, learning."""
import dataclasses
import glob
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, directory_state, make_read_only, train_state
import diagnose
import grpo
from grpo import policy_update, reference_of
from lab import machine, probe, files, settings
from lab import run as lab_run
from lab.checkpoint import TrainState
from lora import adapter_parameters, freeze_copy, inject_lora, setup_adapters, use_adapter
from model import load_policy, tiny_model
from measure import step_metrics
from reward import credit_calls, score_batch
from rollout import Call
from tasks import Problem, load_task
import train
from warmup import contract_replies
from workflows import ROLES, adherence, slots

# One thread: the test model is tiny, and on a busy 2-core machine two threads
# waiting on each other turn seconds into minutes.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SMALL = ["--model", "tiny", "--steps", "1", "--problems_per_step", "2", "--group_size", "2",
         "--eval_problems", "2", "--val_problems", "2", "--max_new_tokens", "8", "--lora_r", "4"]


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


ALGOS = {"grpo": ["--algo", "grpo"],
         "central": ["--algo", "maac", "--critic", "central"],
         "decentral": ["--algo", "maac", "--critic", "decentral"]}


@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("sharing", ["shared", "isolated"])
@pytest.mark.parametrize("workflow", ["single", "eval_opt", "voting", "orch_workers"])
def test_smoke_every_workflow_sharing_and_algorithm(workflow, sharing, algo, tmp_path):
    out = str(tmp_path / "run")
    res = subprocess.run([sys.executable, "train.py", *SMALL, *ALGOS[algo], "--workflow", workflow,
                          "--sharing", sharing, "--out", out],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "before" in res.stdout and "after" in res.stdout
    assert json.load(open(f"{out}/config.json"))["workflow"] == workflow
    first, last = read_jsonl(f"{out}/metrics.jsonl")
    # the evaluation before training, and the warm-up's own numbers
    step0 = without_machine_stats([first])[0]
    assert {"step", *(f"eval/{k}" for k in ("accuracy", "accuracy_se", "first_answer", "boxed",
                                            "len", "truncated"))} \
        <= set(step0) and all(k == "step" or k.startswith(("eval/", "val/", "sft/")) for k in step0)
    assert last["step"] == 1 and 0 <= last["reward/mean"] <= 1 and "eval/accuracy" in last
    for role in ROLES[workflow]:
        assert f"role/{role}/reward" in last and f"role/{role}/len" in last
    # generator0..2, worker0..2: one role's slots
    several = [s for s in slots(workflow) if s[-1].isdigit()]
    assert {k.split("/")[1] for k in last if k.startswith("slot/")} == set(several)
    assert all(f"slot/{slot}/len" in last for slot in several)
    episode = read_jsonl(f"{out}/samples.jsonl")[0]
    assert episode["calls"] and {"role", "slot", "prompt", "output"} <= set(episode["calls"][0])
    assert {"final", "reward", "answer"} <= set(episode)
    adapters = ["shared"] if sharing == "shared" else ROLES[workflow]
    if algo == "central":
        adapters = adapters + ["critic"]
        assert "critic/value_loss" in last
    if algo == "decentral":
        adapters = adapters + [f"critic-{s}" for s in slots(workflow)]
        assert "critic/value_loss" in last
    assert sorted(os.listdir(f"{out}/ckpt")) == sorted(adapters + ["state.pt"])
    for a in adapters:  # a PEFT LoRA directory each; a critic's also holds its value head
        files = ["adapter_config.json", "adapter_model.safetensors"]
        assert sorted(os.listdir(f"{out}/ckpt/{a}")) == files + (["value_head.safetensors"]
                                                                 if "critic" in a else [])


def test_bad_input_is_a_one_line_error(tmp_path):
    for flags, words in [(["--workflow", "chain"], "chain"), (["--task", "nope"], "nope")]:
        res = subprocess.run([sys.executable, "train.py", *SMALL, *flags, "--out", str(tmp_path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
        assert res.returncode != 0 and words in res.stderr
        assert "Traceback" not in res.stderr


def small_config(out: str, **kw) -> train.Config:
    # the paper's mini-batch steps
    base = dict(model="tiny", workflow="voting", sharing="isolated", steps=4, problems_per_step=2,
                group_size=3, eval_problems=3, val_problems=0, max_new_tokens=6, lora_r=4,
                minibatch_size=4,
                one_step=False, eval_every=2, save_every=2, sft_warmup=0, diag_every=1, out=out)
    return train.Config(**{**base, **kw})


def without_machine_stats(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in rows]


TOY = [Problem(f"toy-{i}", f"Question {i}: reply with the number 7.", "7") for i in range(16)]


def killed_in_step_3(cfg: train.Config, monkeypatch, dies_at_call: int = 5) -> None:
    """Run `cfg` and kill it in its third step, after the checkpoint of step 2 (eval_every 2);
    with dies_at_call=3, in its second step."""
    real_rollout, calls = train.run_episodes, []

    def dies_in_step_3(*args, **kw):
        calls.append(1)
        if len(calls) == dies_at_call:  # evaluation, step 1, step 2 and its evaluation; step 3 dies
            raise KeyboardInterrupt
        return real_rollout(*args, **kw)
    monkeypatch.setattr(train, "run_episodes", dies_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        train.main(cfg)
    monkeypatch.setattr(train, "run_episodes", real_rollout)


@pytest.mark.parametrize("algo", [dict(algo="grpo", damping=0.5),
                                  dict(algo="maac", critic="central", sharing="shared",
                                       workflow="eval_opt", critic_lr=1e-2, seed=1)])
def test_interrupted_then_resumed_run_matches_uninterrupted(algo, tmp_path, monkeypatch):
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)  # rewards vary, so adapters move
    toy = dict(max_new_tokens=16, truncated="keep", temperature=1.0, lr=1e-2, **algo)
    train.main(small_config(str(tmp_path / "straight"), **toy))

    out = str(tmp_path / "resumed")
    killed_in_step_3(small_config(out, **toy), monkeypatch)
    train.main(train.Config(out=out, resume=True))

    straight = without_machine_stats(read_jsonl(str(tmp_path / "straight/metrics.jsonl")))
    resumed = without_machine_stats(read_jsonl(out + "/metrics.jsonl"))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert any(r.get("role/generator/grad_norm", 0) > 0 for r in straight)  # something was learned
    if algo["algo"] == "maac":  # the critic moved too, and its head came back from the checkpoint
        assert any(abs(r.get("role/generator/value", 0)) > 0 for r in straight)
    assert resumed == straight
    assert read_jsonl(str(tmp_path / "straight/samples.jsonl")) == \
        read_jsonl(out + "/samples.jsonl")


def test_resume_rejects_a_contradicting_flag(tmp_path):
    out = str(tmp_path / "run")
    train.main(small_config(out, steps=1))
    with pytest.raises(SystemExit, match=re.escape("--seed 5 differs from the run's config (0)")):
        train.main(train.Config(out=out, resume=True, seed=5))
    # a setting the run has none of is said to be none, not "()"
    with pytest.raises(SystemExit, match=re.escape("--start_from elsewhere differs from the run's "
                                                   "config (none)")):
        train.main(train.Config(out=out, resume=True, start_from="elsewhere"))
    # typed, even when it is the default: this voting/isolated run is not eval_opt/shared
    argv = ["--out", out, "--resume", "--workflow", "eval_opt", "--sharing=shared"]
    assert settings.typed_flags(argv) == {"out", "resume", "workflow", "sharing"}
    with pytest.raises(SystemExit, match="--workflow eval_opt differs from the run's config"):
        train.main(train.parse_config(argv), typed=settings.typed_flags(argv))
    argv = ["--out", out, "--resume", "--workflow", "voting", "--no-one_step", "--threads", "1"]
    assert settings.typed_flags(argv) == {"out", "resume", "workflow", "one_step", "threads"}
    # agrees with the run: resumes
    train.main(train.parse_config(argv), typed=settings.typed_flags(argv))


def test_an_abbreviated_flag_is_refused_so_that_resume_sees_every_flag(tmp_path, capsys):
    """--work would be --workflow to argparse but "work" to the --resume check, which let it
    pass."""
    for flag in (["--work", "voting"], ["--ste", "3"], ["--ste=3"]):
        with pytest.raises(SystemExit) as stop:
            train.parse_config(["--model", "tiny", "--out", str(tmp_path), "--resume", *flag])
        assert stop.value.code == 2 \
            and f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err
    # full names, in either form
    assert train.parse_config(["--steps=3", "--no-one_step"]).steps == 3


def test_grpo_learns_a_toy_task(tmp_path, monkeypatch):
    """Reward rises from chance to >= 0.9: fails if the loss sign or the advantages are wrong.

    The toy task always has the answer 7; the random tiny model says a number whose last
    digit group is 7 a few percent of the time.
    """
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)
    cfg = train.Config(model="tiny", workflow="single", steps=25, problems_per_step=4, group_size=8,
                       max_new_tokens=16, truncated="keep", temperature=1.0, lr=1e-2,
                       warmup_steps=0, lora_r=8, minibatch_size=64, eval_problems=4, save_every=100,
                       out=str(tmp_path))
    train.main(cfg)
    rewards = [m["reward/mean"] for m in read_jsonl(f"{tmp_path}/metrics.jsonl")[1:]]
    assert sum(rewards[:3]) / 3 < 0.2, rewards
    assert sum(rewards[-5:]) / 5 >= 0.9, rewards


def test_a_step_writes_no_twin_and_nothing_constant():
    """Eval-Opt's slots are its roles, and Voting's aggregator has one slot: their slot/ keys would
    repeat role/ keys. Under --one_step every ratio is 1, and with one critic step every value is
    the rollout's: their statistics cannot move."""
    role = {"role/generator/len": 5.0, "role/generator/ratio_mean": 1.0,
            "role/generator/pg_loss": 0.5}
    # a critic's value clip: --critic_steps, not --one_step, decides whether its values move
    critic = {"critic/clip_frac": 0.25}
    eval_opt = {**role, **critic, "slot/generator/len": 5.0}
    assert train.without_repeats(eval_opt, train.Config(workflow="eval_opt", critic_steps=2)) == \
        {"role/generator/len": 5.0, "role/generator/pg_loss": 0.5, **critic}
    assert train.without_repeats(eval_opt, train.Config(workflow="eval_opt")) == \
        {"role/generator/len": 5.0, "role/generator/pg_loss": 0.5}
    generators = {f"slot/generator{i}/len": 5.0 for i in range(2)}
    voting = {**role, **generators, "slot/aggregator/len": 5.0}
    assert train.without_repeats(voting, train.Config(workflow="voting", n_agents=2, one_step=False)) == \
        {**role, **generators}
    alone = {**role, "slot/generator0/len": 5.0}  # one generator: its slot is the role
    assert train.without_repeats(alone, train.Config(workflow="voting", n_agents=1, one_step=False)) == role


def test_learning_rate_schedule_by_hand():
    assert train.lr_factor(0, warmup=1, total=12) == pytest.approx(0.5)
    assert train.lr_factor(1, warmup=1, total=12) == pytest.approx(1.0)
    assert train.lr_factor(12, warmup=1, total=12) == pytest.approx(0.1)
    assert train.lr_factor(0, warmup=0, total=4) == pytest.approx(1.0)
    assert train.lr_factor(2, warmup=0, total=4) == pytest.approx(0.1 + 0.9 * 0.5)
    assert train.lr_factor(2, warmup=0, total=4, floor=0.0) == pytest.approx(0.5)
    # --lr_floor 1
    assert [train.lr_factor(s, warmup=0, total=4, floor=1.0) for s in range(6)] == [1.0] * 6


def test_isolated_roles_take_optimizer_steps_in_proportion_to_their_calls(tmp_path):
    """Voting, B=2, G=4: 24 generator calls and 8 aggregator calls in mini-batches of 8 (every
    mini-batch steps, live or not, as the paper's trainer does)."""
    out = str(tmp_path / "run")
    train.main(small_config(out, steps=1, problems_per_step=2, group_size=4, minibatch_size=8,
                            eval_problems=1, skip_empty=False))
    state = torch.load(f"{out}/ckpt/state.pt", weights_only=False)
    steps = {name: int(opt["state"][0]["step"]) for name, opt in state["optimizers"].items()}
    assert steps == {"generator": 3, "aggregator": 1}


def readme_python_block(containing: str) -> str:
    """The python block of the README or of a page in docs/ that contains `containing`."""
    text = ""
    for page in [os.path.join(ROOT, "README.md"),
                 *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(page) as f:
            text += f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    return next(b for b in blocks if containing in b)


@pytest.mark.parametrize("sharing", ["shared", "isolated"])
def test_readme_snippet_loads_every_trained_adapter_in_peft(sharing, tmp_path, monkeypatch):
    """The PEFT snippet of docs/runs.md, run as written on a trained run's adapters, gives our
    logits."""
    # a test dependency: fail here, not inside the snippet, if it is missing
    import peft  # noqa: F401
    # a base model that transformers can load by path, as PEFT needs
    base_dir = str(tmp_path / "base")
    model, tok = tiny_model()
    model.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    # rewards that vary inside every group, so that every adapter moves
    monkeypatch.setattr(train, "score_batch",
                        lambda problems, texts, **kw: [len(t) % 2 for t in texts])
    out = str(tmp_path / "run")
    # fp32: as the snippet loads it; seed 1: every adapter moves
    train.main(small_config(out, model=base_dir, workflow="voting", sharing=sharing, steps=1,
                            seed=1, max_new_tokens=16, truncated="keep", temperature=1.0, lr=1e-2,
                            dtype="fp32"))
    cfg, ours, _, names = probe.trained_model(f"{out}/ckpt")
    ours.to("cpu")  # where the snippet's PEFT model is, on a machine with a GPU too
    ids = torch.randint(0, len(tok), (2, 12), generator=torch.Generator().manual_seed(1))
    snippet = readme_python_block("PeftModel.from_pretrained")
    for name in names:
        namespace = {}
        exec(snippet.replace("runs/default/ckpt/shared", f"{out}/ckpt/{name}"), namespace)
        with torch.no_grad(), use_adapter(ours, name):
            expected = ours(ids).logits
            assert torch.allclose(namespace["model"](input_ids=ids).logits, expected, atol=1e-4)
        with torch.no_grad(), use_adapter(ours, None):  # the trained adapter is not a no-op
            assert not torch.allclose(ours(ids).logits, expected, atol=1e-3)


# ----------------------------------------------------------------------------
# A new user's first hour: help, progress, bad numbers, run directories, checkpoints


def test_help_shows_a_first_weeks_flags_and_every_readme_flag_and_help_all_every_flag(
        capsys, monkeypatch):
    """--help fits about one screen of an 80-column terminal: the flags a student changes first,
    among them every flag of the README's train.py commands; --help-all shows all of them."""
    from test_readme import readme_commands
    monkeypatch.setenv("COLUMNS", "80")
    texts = {}
    for word in ("--help", "--help-all"):
        with pytest.raises(SystemExit) as stop:
            train.parse_config(["--model", "tiny", word])
        assert stop.value.code == 0
        texts[word] = capsys.readouterr().out
    shown = {word: set(re.findall(r"^  --(\w+)", text, re.MULTILINE)) - {"help"}
             for word, text in texts.items()}
    assert shown["--help"] == settings.TUTORIAL and len(shown["--help"]) <= 27, shown["--help"]
    assert texts["--help"].count("\n") <= 80, texts["--help"]
    assert shown["--help-all"] == {f.name for f in dataclasses.fields(train.Config)}
    readme = {w[2:].split("=")[0].removeprefix("no-") for script, *args in readme_commands()
              if script == "train.py"
              for w in args if w.startswith("--") and w != "--help"}
    assert readme and readme <= shown["--help"], readme - shown["--help"]


def test_help_is_grouped_and_shows_defaults_whole(capsys):
    with pytest.raises(SystemExit):
        train.parse_config(["--help-all"])
    text = capsys.readouterr().out
    for title in settings.SECTIONS.values():
        assert f"\n{title}:\n" in text, title
    role_kl = text[text.index("\n  --role_kl"):text.index("\n  --critic ")]
    assert "(default: none)" in role_kl
    for target in train.Config().lora_targets.split(","):
        assert target in text  # never cut in two by the line wrapping
    max_new = text[text.index("\n  --max_new_tokens"):text.index("\n  --temperature")]
    assert "48" in max_new and "320" in max_new


def test_own_credit_pays_each_call_for_its_own_part():
    """--credit own: a solver is paid for its own answer, an evaluator for a verdict that agrees
    with the verifier, an aggregator keeps its episode's reward; by default every call keeps the
    broadcast reward."""
    def call(episode, role, slot, turn, text):
        return Call(episode, role, slot, turn, [], [], "", text)
    problem = Problem("p", "What is 2 + 3?", "5")
    eval_opt = [call(0, "generator", "generator", 0, "\\boxed{4}"),  # wrong first answer ...
                call(0, "evaluator", "evaluator", 1, "\\boxed{Incorrect}"),  # ... rightly refused
                call(0, "generator", "generator", 2, "\\boxed{5}"),  # ... and refined: final right
                call(1, "generator", "generator", 0, "\\boxed{4}"),
                call(1, "evaluator", "evaluator", 1, "\\boxed{Correct}")]  # a wrong answer passed
    voting = [call(0, "generator", f"generator{i}", 0, f"\\boxed{{{a}}}")
              for i, a in enumerate((5, 4, 5))]
    voting.append(call(0, "aggregator", "aggregator", 1, "\\boxed{2}"))  # picked the wrong one
    for calls, outcomes, own in ((eval_opt, [1.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0]),
                                 (voting, [0.0], [1.0, 0.0, 1.0, 0.0])):
        credit_calls(calls, [problem] * 2, outcomes, "final", "keep")
        # the broadcast
        assert [c.reward for c in calls] == [outcomes[c.episode] for c in calls] != own
        credit_calls(calls, [problem] * 2, outcomes, "own", "keep")
        assert [c.reward for c in calls] == own


@pytest.mark.parametrize("flags,words", [(["--steps", "-1"], "--steps -1: must be in [0, inf)"),
                                         (["--group_size", "1"],
                                          "--group_size 1: must be >= 2 with --algo grpo"),
                                         (["--group_size", "0", "--algo", "maac"],
                                          "--group_size 0: must be in [1, inf)"),
                                         (["--save_every", "0"], "--save_every 0"),
                                         (["--lr", "-1"], "--lr -1.0: must be in (0, inf)"),
                                         (["--lr", "0"], "--lr 0.0: must be in (0, inf)"),
                                         (["--top_p", "1.5"], "--top_p 1.5: must be in (0, 1]"),
                                         (["--eval_problems", "0"],
                                          "--eval_problems 0: must be in [1, inf)"),
                                         (["--problems_per_step", "300"],
                                          "training pool holds 256"),
                                         (["--damping", "2"], "--damping 2.0"),
                                         (["--credit", "own", "--task", "humaneval"],
                                          "--credit own: task humaneval")])
def test_bad_numbers_stop_before_any_model_work(flags, words, tmp_path, monkeypatch):
    def no_model(*args):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(train, "load_policy", no_model)
    with pytest.raises(SystemExit, match=re.escape(words)):
        train.main(train.parse_config(["--model", "tiny", *flags, "--out", str(tmp_path / "run")]))
    assert not os.path.exists(tmp_path / "run")


def test_intervals_by_hand():
    assert settings.in_bounds(0, "[0, inf)") and not settings.in_bounds(0, "(0, inf)")
    assert settings.in_bounds(1, "(0, 1]") and not settings.in_bounds(1, "[0, 1)")
    assert not settings.in_bounds(-1e-9, "[0, 1]") and settings.in_bounds(1e300, "(0, inf)")
    settings.check_numbers(train.Config())  # the defaults are valid


def test_a_list_flag_names_each_item_once_before_the_model_loads():
    with pytest.raises(SystemExit, match="^--role_kl: aggregator is given twice$"):
        train.check_algorithm_settings(train.Config(workflow="voting",
                                                    role_kl="aggregator=0.1,aggregator=0.5"))
    for targets in ("q_proj,,v_proj", "", "q_proj, q_proj"):
        with pytest.raises(SystemExit, match="give distinct layer names separated by commas"):
            settings.check_settings(train.Config(lora_targets=targets), None)
    assert settings.lora_targets(train.Config(lora_targets="q_proj, v_proj")) == ("q_proj",
                                                                                 "v_proj")


def test_a_run_directory_is_never_overwritten_implicitly(tmp_path):
    out = str(tmp_path / "run")
    train.main(small_config(out, steps=1))
    before = read_jsonl(f"{out}/metrics.jsonl")
    with pytest.raises(SystemExit, match="already holds a run: add --resume"):
        train.main(small_config(out, steps=1))
    # a failed launch leaves the run alone
    with pytest.raises(SystemExit, match="could not be loaded"):
        train.main(small_config(out, steps=1, model="no-such-dir/no-model", overwrite=True))
    with pytest.raises(SystemExit, match="no such directory"):
        train.main(small_config(out, steps=1, model=str(tmp_path / "nothing"), overwrite=True))
    # the tiny model's key and value projections are 64 x 32: no update of theirs has rank 33
    with pytest.raises(SystemExit, match="--lora_r 33: more than 32, the smaller side of the"):
        train.main(small_config(out, steps=1, lora_r=33, overwrite=True))
    # a run's directory is no model's (its config.json holds train.py's settings)
    with pytest.raises(SystemExit, match="not a model's directory"):
        train.main(small_config(str(tmp_path / "other"), steps=1, model=out))
    assert read_jsonl(f"{out}/metrics.jsonl") == before
    assert json.load(open(f"{out}/config.json"))["model"] == "tiny"
    (tmp_path / "run" / "notes.txt").write_text("mine")
    train.main(small_config(out, steps=2, overwrite=True))
    assert [r["step"] for r in read_jsonl(f"{out}/metrics.jsonl")] == [0, 1, 2]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"  # only the run's own files went
    # diagnose.py's report and plots go with the run, a picture of one's own stays
    for name in ("photo.png", "accuracy.png", "report.md"):
        (tmp_path / "run" / name).write_text("mine")
    train.main(small_config(out, steps=1, overwrite=True))
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.suffix in (".png", ".md")) \
        == ["photo.png"]
    # a folder with a run's names but no run is refused; so is one with another tool's config
    plain = tmp_path / "plain"
    (plain / "tb").mkdir(parents=True)
    (plain / "tb" / "notes.txt").write_text("mine")
    for config in (None, '{"architectures": ["LlamaForCausalLM"]}'):
        if config:
            (plain / "config.json").write_text(config)
        with pytest.raises(SystemExit, match="holds .*tb but no run .* nothing there is deleted"):
            train.main(small_config(str(plain), steps=1, overwrite=True))
        assert (plain / "tb" / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit, match="is a file"):
        train.main(small_config(str(tmp_path / "run" / "notes.txt")))
    with pytest.raises(SystemExit, match="cannot create a directory in"):
        train.main(small_config(str(tmp_path / "run" / "notes.txt" / "deeper")))
    with pytest.raises(SystemExit, match="^--out is empty: name the run's directory$"):
        train.main(small_config(""))


def test_a_read_only_run_is_a_one_line_error_that_touches_nothing(tmp_path, monkeypatch):
    """A run kept or copied read-only, its files or its directory: every launch on it stops before
    it deletes or writes anything, naming what cannot be written."""
    out = str(tmp_path / "run")
    train.main(small_config(out, steps=1))
    before = directory_state(out)
    make_read_only(out, monkeypatch)
    os.chmod(out, 0o755)  # the directory writable, the run's files not
    launches = (train.Config(out=out, resume=True), small_config(out, steps=1, overwrite=True))
    for cfg in launches:
        with pytest.raises(SystemExit,
                           match=re.escape(f"--out {out}: {out}/.lock is read-only; make the run")):
            train.main(cfg)
    os.chmod(out, 0o555)
    for cfg in launches:
        with pytest.raises(SystemExit, match=re.escape(f"--out {out}: cannot write in it")):
            train.main(cfg)
    assert directory_state(out) == before


def test_default_checkpoint_every_step_and_resume_from_anywhere(tmp_path, monkeypatch):
    """A kill loses at most one step; the run resumes from a moved directory, however spelled."""
    assert train.Config().save_every == 1
    out = str(tmp_path / "run")
    killed_in_step_3(small_config(out, save_every=1), monkeypatch)
    assert torch.load(f"{out}/ckpt/state.pt", weights_only=False)["step"] == 2
    moved = str(tmp_path / "elsewhere" / "run")
    os.makedirs(os.path.dirname(moved))
    shutil.move(out, moved)
    monkeypatch.chdir(tmp_path)
    result = train.main(train.Config(out="./elsewhere/run/", resume=True))
    rows = read_jsonl(f"{moved}/metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert result["after"] == rows[-1]["eval/accuracy"]
    again = train.main(train.Config(out=moved, resume=True))  # a finished run: nothing to do
    assert again["after"] == rows[-1]["eval/accuracy"]


def test_the_evaluated_steps_are_every_eval_every_th_and_the_last_however_long_the_run():
    """Against the list written out (step 0, each multiple of --eval_every, the last step), for
    every run of up to 30 steps; a run of a billion steps is planned without listing them."""
    for steps, every in itertools.product(range(31), range(9)):
        cfg = train.Config(steps=steps, eval_every=every)
        listed = [0] + [s for s in range(1, steps + 1) if (every and s % every == 0) or s == steps]
        assert [s for s in range(steps + 1) if lab_run.is_eval_step(cfg, s)] == listed
        assert [lab_run.evals_after(cfg, s) for s in range(steps + 1)] == \
            [sum(e > s for e in listed) for s in range(steps + 1)]
        if len(listed) <= 7:
            assert lab_run.eval_steps_text(cfg) == ", ".join(map(str, listed))
    long = train.Config(steps=10 ** 9, eval_every=5)
    started = time.time()
    assert lab_run.eval_steps_text(long) == "0, 5, 10, 15, ..., 999999990, 999999995, 1000000000"
    assert lab_run.evals_after(long, 0) == 2 * 10 ** 8 and time.time() - started < 1


def test_a_redirected_log_shows_progress(tmp_path):
    """No terminal (nohup, CI, a batch system): plain lines for every stage, update and estimate."""
    out = str(tmp_path / "run")
    res = subprocess.run([sys.executable, "train.py", *SMALL, "--workflow", "eval_opt",
                          "--eval_problems", "3", "--device", "cpu", "--out", out], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith(
        "eval_opt with one shared adapter, grpo, model tiny on cpu (1 thread)")
    assert "1 steps of 2 problems x 2 episodes" in lines[0] and "at steps 0, 1;" in lines[0]
    assert any(re.fullmatch(r"eval problems 1-3/3 \| stage 1 generator x3: \d+s", l) for l in lines)
    assert any(re.fullmatch(r"step 1 rollout \| stage 1 generator x4: \d+s", l) for l in lines)
    assert any(re.fullmatch(r"step 1 update \| shared: \d+ of \d+ calls with signal, \d+s", l)
               for l in lines)
    assert any(re.match(r"step 0/1 \| eval/accuracy [\d.]+ \| \d+s \| "
                        r"the whole run: about \d+ min", l) for l in lines)


def test_threads_are_the_free_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    for load, own, running, threads in [(0.1, 0.0, 1, 2), (1.2, 0.0, 2, 1), (3.0, 2.0, 2, 1),
                                        (2.1, 2.0, 3, 2), (5.0, 0.5, 9, 1),
                                        (1.9, 0.0, 1, 2)]:  # the last: a program just ended
        monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
        monkeypatch.setattr(machine, "running_threads", lambda: running)
        assert machine.pick_threads(0, own_load=own) == threads, (load, own, running)
    assert machine.pick_threads(3, own_load=0.0) == 3  # --threads wins
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert machine.pick_threads(0, own_load=0.0) == 1  # the cores this process may use
    assert machine.running_threads() >= 1



def test_resume_recovers_from_a_crash_inside_a_checkpoint_save_and_a_torn_log(tmp_path, monkeypatch,
                                                                              capsys):
    """Killed between the two renames of a save: ckpt.old (step 1) and ckpt.tmp (step 2, whole)
    are on disk, ckpt is not; and the log's last line was cut in half."""
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)
    toy = dict(max_new_tokens=16, truncated="keep", temperature=1.0, lr=1e-2, save_every=1)
    train.main(small_config(str(tmp_path / "straight"), **toy))
    out, older = str(tmp_path / "run"), str(tmp_path / "older")
    killed_in_step_3(small_config(out, **toy), monkeypatch)  # its ckpt: step 2
    killed_in_step_3(small_config(older, **toy), monkeypatch, dies_at_call=3)  # its ckpt: step 1
    os.replace(f"{out}/ckpt", f"{out}/ckpt.tmp")
    shutil.copytree(f"{older}/ckpt", f"{out}/ckpt.old")
    with open(f"{out}/metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')
    capsys.readouterr()
    train.main(train.Config(out=out, resume=True))
    assert f"resuming {out} at step 2" in capsys.readouterr().out  # the newest whole checkpoint
    straight = without_machine_stats(read_jsonl(str(tmp_path / "straight/metrics.jsonl")))
    assert without_machine_stats(read_jsonl(f"{out}/metrics.jsonl")) == straight
    assert sorted(os.listdir(out)) == [".lock", "ckpt", "config.json", "metrics.jsonl",
                                       "samples.jsonl", "tb"]


def test_a_torn_save_never_replaces_a_good_checkpoint_and_a_save_is_on_disk_before_its_renames(
        tmp_path, monkeypatch, capsys):
    """A power loss after the rename that makes ckpt.tmp whole (state.pt), before an adapter's data
    reached the disk: ckpt.tmp holds a torn file beside a good ckpt, and --resume takes the good
    one. Every file of a save is fsynced before state.pt names it whole, and the swap before
    ckpt.old goes."""
    out = str(tmp_path / "run")
    killed_in_step_3(small_config(out), monkeypatch)  # its ckpt: step 2
    shutil.copytree(f"{out}/ckpt", f"{out}/ckpt.tmp")
    with open(f"{out}/ckpt.tmp/generator/adapter_model.safetensors", "r+b") as f:
        f.truncate(100)
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(os.readlink(f"/proc/self/fd/{fd}"))  # the file or directory it flushes
        real_fsync(fd)

    def replace(src, dst):
        events.append((src, dst))
        real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    capsys.readouterr()
    train.main(train.Config(out=out, resume=True))
    assert f"resuming {out} at step 2" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(f"{out}/metrics.jsonl")] == [0, 1, 2, 3, 4]
    tmp = f"{out}/ckpt.tmp"
    # the first save after the resume
    whole = events.index((f"{tmp}/state.part", f"{tmp}/state.pt"))
    saved = [os.path.join(root, n) for root, _, files in os.walk(f"{out}/ckpt")
             for n in files + ["."]]
    synced = {os.path.normpath(p.replace(tmp, f"{out}/ckpt").replace("state.part", "state.pt"))
              for p in events[:whole] if isinstance(p, str)}
    assert {os.path.normpath(p) for p in saved} <= synced
    swap = events.index((tmp, f"{out}/ckpt"))
    assert tmp in events[whole:swap] and out in events[swap:]


def test_resume_says_what_to_do_with_a_run_that_has_no_checkpoint_or_a_damaged_one(tmp_path,
                                                                                   monkeypatch):
    out = str(tmp_path / "run")
    killed_in_step_3(small_config(out), monkeypatch, dies_at_call=1)  # in the step-0 evaluation
    with monkeypatch.context() as m, pytest.raises(
            SystemExit, match="stopped before its first one.*without --resume, with --overwrite"):
        m.setattr(train, "load_policy", lambda *a: pytest.fail("the model loaded first"))
        train.main(train.Config(out=out, resume=True))
    killed_in_step_3(small_config(out, overwrite=True), monkeypatch, dies_at_call=2)  # in step 1
    # from the checkpoint after the step-0 evaluation
    train.main(train.Config(out=out, resume=True))
    assert [r["step"] for r in read_jsonl(f"{out}/metrics.jsonl")] == [0, 1, 2, 3, 4]
    train.main(small_config(out, steps=1, overwrite=True))
    os.rename(f"{out}/metrics.jsonl", f"{out}/metrics.moved")
    with pytest.raises(SystemExit, match="metrics.jsonl is missing"):
        train.main(train.Config(out=out, resume=True))
    os.rename(f"{out}/metrics.moved", f"{out}/metrics.jsonl")
    with open(f"{out}/ckpt/state.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(SystemExit, match="cannot be read"):
        train.main(train.Config(out=out, resume=True))
    os.rename(f"{out}/ckpt", f"{out}/ckpt.tmp")  # only a torn save left: a checkpoint, unreadable
    with pytest.raises(SystemExit, match="no checkpoint in .* reads back whole"):
        train.main(train.Config(out=out, resume=True))
    os.rename(f"{out}/ckpt.tmp", f"{out}/ckpt")
    good = json.load(open(f"{out}/config.json"))
    with open(f"{out}/config.json", "w") as f:
        f.write('{"workflow": "vot')
    with pytest.raises(SystemExit, match="config.json cannot be read"):
        train.main(train.Config(out=out, resume=True))
    # refused: a lost field (it would take the default: a Voting run resumed as Eval-Opt), a type
    for damaged, words in [({k: v for k, v in good.items() if k != "workflow"}, "lacks workflow$"),
                           ({**good, "steps": "ten"}, r"steps is 'ten' \(a str, not int\)$"),
                           ({**good, "lr": None}, r"lr is None \(a NoneType, not float\)$"),
                           ([good], "is not a config of this project")]:
        with open(f"{out}/config.json", "w") as f:
            json.dump(damaged, f)
        with pytest.raises(SystemExit, match=words):
            train.main(train.Config(out=out, resume=True))


@pytest.mark.parametrize("sharing", ["shared", "isolated"])
def test_sft_warmup_lowers_its_loss_and_teaches_the_aggregator_its_contract(sharing):
    """The random tiny model never writes \\boxed{k}; after 30 warm-up steps it does, sampled at
    temperature 0.7 on new candidates. (The tiny model cannot learn to stop: its end-of-text
    token is also padding, whose embedding row is zero, so the loss keeps that token's ~6 nats.)"""
    cfg = train.Config(model="tiny", workflow="voting", sharing=sharing, problems_per_step=2,
                       group_size=2, max_new_tokens=8, lora_r=4, sft_warmup=30, sft_lr=1e-2)
    model, tok = load_policy("tiny")
    inject_lora(model, cfg.lora_r, cfg.lora_alpha)
    names = setup_adapters(model, ROLES["voting"], sharing)
    pool = load_task("arith", "train", 4, 2, 0)
    torch.manual_seed(0)
    metrics = train.warm_up(model, tok, cfg, pool, names)
    assert metrics["sft/loss/last"] < 0.2 * metrics["sft/loss/first"], metrics
    rollout, outcomes, rewards = train.run_episodes(model, tok, cfg, pool, greedy=False)
    after = step_metrics(rollout.calls, rewards, outcomes, cfg.n_agents)
    assert (metrics["sft/adherence/aggregator"] <= 0.25
            and after["role/aggregator/adherence"] >= 0.75), (
        metrics, [c.text for c in rollout.calls if c.role == "aggregator"])


def test_contract_replies_are_verifier_labelled_and_keep_the_contracts():
    """Aggregator: a correct candidate (a random one when none is); evaluator: the verifier's
    verdict; generators: their own solutions that the verifier accepts. Every reply keeps its
    role's contract."""
    problem = Problem("p", "What is 2 + 3?", "5")
    calls = [Call(0, "generator", f"generator{i}", 0, [1], [1], "", text)
             for i, text in enumerate(["so \\boxed{4}", "it is 5", "\\boxed{6}"])]
    calls += [Call(0, "aggregator", "aggregator", 1, [1], [1], "", "I pick three"),
              Call(1, "generator", "generator", 0, [1], [1], "", "\\boxed{5}"),
              Call(1, "evaluator", "evaluator", 1, [1], [1], "", "looks fine")]
    cfg = train.Config(workflow="voting")
    replies = contract_replies(calls, [problem, problem], score_batch, cfg.n_agents,
                               random.Random(0), ["aggregator", "evaluator", "generator"])
    texts = {(c.episode, c.slot): c.text for c in replies}
    assert texts[0, "aggregator"] == "\\boxed{2}"  # candidate 2 says 5, by the last number
    assert texts[1, "evaluator"] == "\\boxed{Correct}"
    assert (texts[0, "generator1"], texts[1, "generator"]) == ("it is 5", "\\boxed{5}")
    assert (0, "generator0") not in texts and (0, "generator2") not in texts
    for c in replies:
        assert adherence(c.role, c.text) in (True, None)
    wrong = [dataclasses.replace(c, text="\\boxed{7}") if c.role == "generator" else c
             for c in calls]
    replies = contract_replies(wrong, [problem, problem], score_batch, cfg.n_agents,
                               random.Random(0), ["evaluator"])
    assert [c.text for c in replies] == ["\\boxed{Incorrect}"]


def test_warm_up_verdicts_are_balanced_and_unfinished_solutions_are_not_taught():
    """Three Eval-Opt episodes, one right answer: the evaluator is taught Correct as often as
    Incorrect (the verifier's labels alone would teach a constant), and a right answer cut by the
    length limit is no example of a finished one."""
    problem = Problem("p", "What is 2 + 3?", "5")
    calls = [Call(e, "generator", "generator", 0, [1], [1], "", text, truncated=cut)
             for e, (text, cut) in enumerate([("\\boxed{5}", False), ("\\boxed{4}", False),
                                              ("so 5 and", True)])]
    calls += [Call(e, "evaluator", "evaluator", 1, [1], [1], "", "hm") for e in range(3)]
    replies = contract_replies(calls, [problem] * 3, score_batch, 3, random.Random(0),
                               ["evaluator", "generator"])
    verdicts = sorted(c.text for c in replies if c.role == "evaluator")
    # 2 Correct, one of them a copy
    assert verdicts == ["\\boxed{Correct}"] * 2 + ["\\boxed{Incorrect}"] * 2
    assert [(c.episode, c.text) for c in replies if c.role == "generator"] == [(0, "\\boxed{5}")]
    # a refine (stage 2) of a right answer is taught to keep it; a refine that made it right, itself
    calls += [Call(0, "generator", "generator", 2, [1], [1], "", "\\boxed{Incorrect}"),
              Call(1, "generator", "generator", 2, [1], [1], "", "\\boxed{5}")]
    replies = contract_replies(calls, [problem] * 3, score_batch, 3, random.Random(0),
                               ["generator"])
    assert sorted((c.episode, c.stage, c.text) for c in replies) == [
        (0, 0, "\\boxed{5}"), (0, 2, "\\boxed{5}"), (1, 2, "\\boxed{5}")]


def test_after_a_warm_up_the_kl_anchor_is_the_warmed_up_adapter(tmp_path):
    """With a warm-up and a KL term, RL starts exactly at its reference (KL 0 on the first
    mini-batch; the base model, the reference without a warm-up, is far from it), the
    reference does not move with the adapter nor change the sampling, and it travels in
    the checkpoint."""
    cfg = train.Config(model="tiny", workflow="voting", sharing="shared", problems_per_step=2,
                       group_size=2, max_new_tokens=6, lora_r=4, sft_warmup=5, sft_lr=1e-2,
                       role_kl="aggregator=1.0")
    model, tok = load_policy("tiny")
    inject_lora(model, cfg.lora_r, cfg.lora_alpha)
    names = setup_adapters(model, ROLES["voting"], "shared")
    pool = load_task("arith", "train", 4, 2, 0)
    torch.manual_seed(0)
    train.warm_up(model, tok, cfg, pool, names)
    assert reference_of(cfg, "shared") == "shared-ref"
    sampling = torch.get_rng_state()
    freeze_copy(model, "shared", "shared-ref")
    assert torch.equal(torch.get_rng_state(), sampling)  # the same episodes as without the anchor
    reference = [p.detach().clone() for p in adapter_parameters(model, "shared-ref")]
    assert not any(p.requires_grad for p in adapter_parameters(model, "shared-ref"))
    rollout, _, _ = train.run_episodes(model, tok, cfg, pool, greedy=False)
    agg = [dataclasses.replace(c, advantage=(-1.0) ** i) for i, c in enumerate(rollout.calls)
           if c.role == "aggregator"]
    kl = {}
    # without a warm-up the anchor is the base model
    for label, s in [("base", dataclasses.replace(cfg, sft_warmup=0)), ("warmed-up", cfg)]:
        optimizer = torch.optim.AdamW(adapter_parameters(model, "shared"), lr=1e-2)
        state = [p.detach().clone() for p in adapter_parameters(model, "shared")]
        stats = policy_update(train_state(model, {"shared": optimizer}),
                              "shared", agg, tok.pad_token_id, s)
        kl[label] = stats["role/aggregator/kl_ref"][0]
        with torch.no_grad():  # back to the warmed-up adapter for the other reference
            for p, p0 in zip(adapter_parameters(model, "shared"), state):
                p.copy_(p0)
    assert kl["warmed-up"] == pytest.approx(0.0, abs=1e-6) and kl["base"] > 1e-3, kl
    assert all(torch.equal(p, p0)
               for p, p0 in zip(adapter_parameters(model, "shared-ref"), reference))

    out = str(tmp_path / "run")  # a run saves the reference and resumes with it
    train.main(dataclasses.replace(small_config(out, sharing="shared", steps=1), sft_warmup=2,
                                   sft_lr=1e-2, role_kl="aggregator=1.0"))
    assert sorted(os.listdir(f"{out}/ckpt")) == ["shared", "shared-ref", "state.pt"]


def test_a_resumed_run_keeps_its_warmed_up_kl_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)  # rewards vary, so adapters move
    toy = dict(max_new_tokens=16, truncated="keep", temperature=1.0, lr=1e-2, sharing="shared",
               sft_warmup=2, sft_lr=1e-2, role_kl="aggregator=0.5",
               seed=3)  # a seed whose first steps see rewards
    train.main(small_config(str(tmp_path / "straight"), **toy))
    out = str(tmp_path / "resumed")
    # the warm-up rolls out first
    killed_in_step_3(small_config(out, **toy), monkeypatch, dies_at_call=6)
    train.main(train.Config(out=out, resume=True))
    straight = without_machine_stats(read_jsonl(str(tmp_path / "straight/metrics.jsonl")))
    resumed = without_machine_stats(read_jsonl(out + "/metrics.jsonl"))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    # the anchor is at work
    assert any(r.get("role/aggregator/kl_ref", 0) > 0 for r in straight[3:])
    assert resumed == straight


def test_sft_roles_must_be_roles(tmp_path):
    res = subprocess.run([sys.executable, "train.py", *SMALL, "--sft_warmup", "1", "--sft_roles",
                          "judge", "--out", str(tmp_path / "run")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode != 0 and "--sft_roles: 'judge' is not a role" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_run_started_from_another_runs_step_0_matches_one_that_warmed_up_itself(tmp_path,
                                                                                  monkeypatch):
    """--start_from: a run that takes its warm-up and step-0 evaluation from a --steps 0 run, and
    differs from it in an RL setting (--balance), logs what the same run does on its own."""
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)  # rewards vary, so adapters move
    toy = dict(max_new_tokens=16, truncated="keep", temperature=1.0, lr=1e-2, sharing="shared",
               sft_warmup=2, sft_lr=1e-2, role_kl="aggregator=0.5",
               seed=3)  # a seed whose first steps see rewards
    train.main(small_config(str(tmp_path / "straight"), balance="role", **toy))
    start = str(tmp_path / "start")
    train.main(small_config(start, steps=0, **toy))
    assert [r["step"] for r in read_jsonl(f"{start}/metrics.jsonl")] == [0]
    out = str(tmp_path / "branch")
    train.main(small_config(out, balance="role", start_from=start, **toy))
    straight = without_machine_stats(read_jsonl(str(tmp_path / "straight/metrics.jsonl")))
    branch = without_machine_stats(read_jsonl(out + "/metrics.jsonl"))
    assert [r["step"] for r in branch] == [0, 1, 2, 3, 4]
    # the anchor is at work
    assert any(r.get("role/aggregator/kl_ref", 0) > 0 for r in straight[1:])
    assert branch == straight
    assert read_jsonl(str(tmp_path / "straight/samples.jsonl")) == \
        read_jsonl(out + "/samples.jsonl")


def test_an_isolated_run_started_from_a_shared_start_gives_every_role_the_shared_adapter(tmp_path):
    start, out = str(tmp_path / "start"), str(tmp_path / "isolated")
    warm = dict(steps=0, sharing="shared", sft_warmup=2, sft_lr=1e-2, role_kl="aggregator=0.5")
    train.main(small_config(start, **warm))
    train.main(small_config(out, **{**warm, "sharing": "isolated"}, start_from=start))
    shared = load_file(f"{start}/ckpt/shared/adapter_model.safetensors")
    assert sorted(os.listdir(f"{out}/ckpt")) == ["aggregator", "aggregator-ref", "generator",
                                                 "generator-ref", "state.pt"]
    for name in ("aggregator", "aggregator-ref", "generator", "generator-ref"):
        mine = load_file(f"{out}/ckpt/{name}/adapter_model.safetensors")
        assert mine.keys() == shared.keys() and all(torch.equal(mine[k], shared[k]) for k in shared)
    # the warm-up moved it
    assert any(t.abs().sum() > 0 for k, t in shared.items() if "lora_B" in k)
    saved = [torch.load(f"{d}/ckpt/state.pt", weights_only=False) for d in (start, out)]
    # the same episodes next
    assert torch.equal(saved[0]["torch_rngs"][0], saved[1]["torch_rngs"][0])
    assert read_jsonl(f"{out}/metrics.jsonl") == read_jsonl(f"{start}/metrics.jsonl")


def test_an_actor_critic_run_goes_on_from_a_grpo_start_with_fresh_critics(tmp_path):
    """The algorithm and its critics are RL settings: an actor-critic run takes a GRPO run's warm-up
    and step 0, its policy adapters as the start left them, and critics that begin where a run of
    its own would begin them. The critics' initial weights draw no random number the warm-up
    draws, so the run logs what the actor-critic run of its seed logs."""
    start, out, own = (str(tmp_path / d) for d in ("start", "central", "own"))
    warm = dict(sft_warmup=2, sft_lr=1e-2, seed=3)
    train.main(small_config(start, steps=0, **warm))
    train.main(small_config(out, steps=1, algo="maac", critic="central", start_from=start, **warm))
    train.main(small_config(own, steps=1, algo="maac", critic="central", **warm))
    rows = read_jsonl(f"{out}/metrics.jsonl")
    assert rows[0] == read_jsonl(f"{start}/metrics.jsonl")[0] and rows[-1]["step"] == 1
    assert without_machine_stats(rows) == without_machine_stats(read_jsonl(f"{own}/metrics.jsonl"))
    # critics trained
    assert {"critic/value_loss", "role/aggregator/value", "role/generator/value"} <= rows[-1].keys()
    critics = [d for d in os.listdir(f"{out}/ckpt") if d.startswith("critic")]
    assert critics and not any(d.startswith("critic") for d in os.listdir(f"{start}/ckpt"))


def test_start_from_reads_max_new_tokens_0_as_the_task_s_own_limit(tmp_path):
    """--max_new_tokens 0 (the task's own) matches a start that saved the limit it resolved to."""
    start = str(tmp_path / "start")
    train.main(small_config(start, steps=0, max_new_tokens=0, eval_problems=1))
    assert json.load(open(f"{start}/config.json"))["max_new_tokens"] == 48
    train.main(small_config(str(tmp_path / "b"), steps=1, max_new_tokens=0, eval_problems=1,
                            start_from=start))
    with pytest.raises(SystemExit, match="--max_new_tokens 32 differs from the start's"):
        train.main(small_config(str(tmp_path / "c"), max_new_tokens=32, start_from=start))


def test_start_from_takes_only_a_step_0_run_that_differs_in_rl_settings(tmp_path):
    start = str(tmp_path / "start")
    train.main(small_config(start, steps=0, sharing="isolated"))
    for kw, words in [(dict(seed=1), "--seed 1 differs from the start's"),
                      (dict(sft_warmup=1), "--sft_warmup 1 differs"),
                      (dict(truncated="keep"), "--truncated keep differs"),  # scores step 0
                      (dict(grad_clip=0.1), "--grad_clip 0.1 differs"),  # clips the warm-up
                      (dict(sharing="shared"), "cannot become one shared adapter"),
                      (dict(start_from=str(tmp_path / "nothing")),
                       "no run with a checkpoint there")]:
        with pytest.raises(SystemExit, match=words):
            train.main(small_config(str(tmp_path / "run"), **{"start_from": start, **kw}))
    assert not os.path.exists(tmp_path / "run")  # stopped before anything was made
    before = directory_state(start)
    os.symlink(start, tmp_path / "link")  # the start itself, spelled otherwise
    with pytest.raises(SystemExit, match="is this run's own --out"):
        train.main(small_config(str(tmp_path / "link"), start_from=start, overwrite=True))
    assert directory_state(start) == before  # --overwrite deleted nothing
    further = str(tmp_path / "further")
    train.main(small_config(further, steps=1, sharing="isolated"))
    with pytest.raises(SystemExit, match="its checkpoint is at step 1, not 0"):
        train.main(small_config(str(tmp_path / "run"), start_from=further))


# ----------------------------------------------------------------------------
# The best checkpoint: a peak kept through a cliff


def scripted_evaluations(monkeypatch, test: list[float], val: list[float] | None = None) -> None:
    """Evaluations that return these accuracies in turn (one per evaluation: step 0, 1, ...), on
    the validation split too where the run has one (`val`, else the test's); None stops the run
    there, as a kill would."""
    scores = iter(zip(test, val or test))

    def evaluations(model, tok, cfg, held_out):
        acc, val_acc = next(scores)
        if acc is None:
            raise KeyboardInterrupt
        return ({"eval/accuracy": acc, "eval/accuracy_se": 0.0}
                | ({"val/accuracy": val_acc} if cfg.val_problems else {}))
    monkeypatch.setattr(train, "evaluations", evaluations)


def adapters_saved_each_step(out: str, monkeypatch) -> dict[int, dict[str, bytes]]:
    """step -> the adapter files of the newest checkpoint as saved at that step (filled in as the
    run saves)."""
    saved, real = {}, TrainState.save

    def save(state, out, step, best=None):
        real(state, out, step, best)
        if best is None:
            saved[step] = adapter_files(f"{out}/ckpt")
    monkeypatch.setattr(TrainState, "save", save)
    return saved


def adapter_files(ckpt: str) -> dict[str, bytes]:
    return {p: open(p, "rb").read() for p in glob.glob(f"{ckpt}/*/adapter_model.safetensors")}


def with_dir(files: dict[str, bytes], ckpt: str) -> dict[str, bytes]:
    return {os.path.join(ckpt, os.path.relpath(p, os.path.dirname(os.path.dirname(p)))): b
            for p, b in files.items()}


TOY_RUN = dict(max_new_tokens=16, truncated="keep", temperature=1.0, lr=1e-2, eval_every=1,
               sft_warmup=0)


@pytest.mark.parametrize("val", [False, True])
def test_a_run_through_a_cliff_keeps_its_peaks_adapters(val, tmp_path, monkeypatch):
    """Accuracy rises then falls: out/best holds the adapters of the peak's step, byte for byte,
    beside the newest checkpoint, chosen on val; a run without a val split keeps no best (never
    chosen on test), and its plan says so."""
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)  # rewards vary, so adapters move
    test, peak = [0.2, 0.5, 0.9, 0.4, 0.1], 2
    if val:  # test peaks at step 2, val at step 3: val decides
        scripted_evaluations(monkeypatch, test, val=[0.1, 0.3, 0.5, 0.7, 0.2])
        peak = 3
    else:
        scripted_evaluations(monkeypatch, test)
    out = str(tmp_path / "run")
    saved = adapters_saved_each_step(out, monkeypatch)
    # seed 1: rewards vary in the steps after the peak too, so the adapters move on from it
    train.main(small_config(out, save_every=1, val_problems=2 * val, seed=1, **TOY_RUN))
    if not val:
        assert not os.path.exists(f"{out}/best")
        assert "no best/: no validation split" in lab_run.plan(train.Config(val_problems=0), "cpu")
        return
    best = json.load(open(f"{out}/best/best.json"))
    assert (best["step"], best["metric"], best["score"]) == (peak, "val/accuracy", 0.7)
    assert best["evaluation"]["eval/accuracy"] == test[peak]
    assert adapter_files(f"{out}/best") == with_dir(saved[peak], f"{out}/best")
    assert adapter_files(f"{out}/ckpt") == saved[4] != saved[peak]  # the newest checkpoint moved on
    assert torch.load(f"{out}/best/state.pt", weights_only=False)["step"] == peak


def test_a_resumed_run_keeps_its_best_even_from_a_damaged_save(tmp_path, monkeypatch):
    """Killed in step 3 (checkpoint of step 2, best of step 1): --resume keeps the same best, and
    the uninterrupted run's; a torn best.tmp beside it changes nothing; a damaged best stops the
    resume in one line and is kept as it is; moved aside, the next evaluation keeps a new one."""
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)
    config = dict(save_every=2, val_problems=2, **TOY_RUN)
    scripted_evaluations(monkeypatch, [0.2, 0.9, 0.5, 0.4, 0.3])
    train.main(small_config(str(tmp_path / "straight"), **config))
    straight = directory_state(str(tmp_path / "straight/best"))
    runs_ = {name: str(tmp_path / name) for name in ("resumed", "torn", "damaged")}
    for out in runs_.values():
        scripted_evaluations(monkeypatch, [0.2, 0.9, 0.5, None])
        with pytest.raises(KeyboardInterrupt):
            train.main(small_config(out, **config))
        assert directory_state(f"{out}/best") == straight
    # a save cut before its data reached the disk
    shutil.copytree(f"{runs_['torn']}/best", f"{runs_['torn']}/best.tmp")
    with open(glob.glob(f"{runs_['torn']}/best.tmp/*/adapter_model.safetensors")[0], "r+b") as f:
        f.truncate(100)
    with open(glob.glob(f"{runs_['damaged']}/best/*/adapter_model.safetensors")[0], "r+b") as f:
        f.truncate(100)
    damaged = directory_state(f"{runs_['damaged']}/best")
    with pytest.raises(SystemExit, match=r"the best checkpoint cannot be read \(.*/best/\w+/"
                       r"adapter_model.safetensors cannot be read"):
        train.main(train.Config(out=runs_["damaged"], resume=True))
    assert directory_state(f"{runs_['damaged']}/best") == damaged
    os.rename(f"{runs_['damaged']}/best", f"{runs_['damaged']}/best.damaged")
    for name, out in runs_.items():
        scripted_evaluations(monkeypatch, [0.4, 0.3])  # steps 3 and 4
        train.main(train.Config(out=out, resume=True))
        assert [r["step"] for r in read_jsonl(f"{out}/metrics.jsonl")] == [0, 1, 2, 3, 4]
        if name == "damaged":
            assert json.load(open(f"{out}/best/best.json"))["step"] == 3
        else:
            assert directory_state(f"{out}/best") == straight \
                and not os.path.exists(f"{out}/best.tmp")


def test_start_from_and_watch_take_a_runs_best_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)
    scripted_evaluations(monkeypatch, [0.2, 0.9, 0.5])
    source = str(tmp_path / "source")
    train.main(small_config(source, steps=2, save_every=1, val_problems=2, **TOY_RUN))
    best = json.load(open(f"{source}/best/best.json"))
    assert best["step"] == 1
    out = str(tmp_path / "branch")  # RL from the peak, with another learning rate
    train.main(small_config(out, steps=0, start_from=f"{source}/best", val_problems=2,
                            **{**TOY_RUN, "lr": 1e-3}))
    assert read_jsonl(f"{out}/metrics.jsonl") == [{"step": 0, **best["evaluation"]}]
    assert adapter_files(f"{out}/ckpt") == with_dir(adapter_files(f"{source}/best"), f"{out}/ckpt")
    with pytest.raises(SystemExit, match="not 0 .*or start from its best checkpoint"):
        train.main(small_config(str(tmp_path / "other"), start_from=source, val_problems=2,
                                **TOY_RUN))
    capsys.readouterr()
    diagnose.main(["--watch", f"{source}/best", "What is 1 + 1?"])
    assert f"from {source}/best (step 1, val/accuracy 0.900)" in capsys.readouterr().out


# ----------------------------------------------------------------------------
# Reliability: a device that is not there, one launch per run directory, steps that cannot be
# applied, lengths that do not fit the model, signals


def test_device_cuda_without_a_gpu_is_a_one_line_error_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without one
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit, match=r"^--device cuda: .+; use --device cpu \(or auto\)$"):
        train.main(small_config(out, device="cuda"))
    assert not os.path.exists(out)


@pytest.mark.parametrize("device,words", [("tpu", "--device tpu: not a device of this project"),
                                          ("cuda:2", "--device cuda:2: this machine has 1 GPU(s)")])
def test_a_device_that_is_not_here_is_a_one_line_error_before_anything_loads(device, words,
                                                                             tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit, match=re.escape(words)):
        train.main(small_config(out, device=device))
    assert not os.path.exists(out)


def test_a_run_directory_is_held_by_one_launch_at_a_time(tmp_path):
    """While another process holds the run (kill -9 releases it), every launch on it stops at
    once, naming that process, and touches nothing: a new run, --overwrite, --resume."""
    out = str(tmp_path / "run")
    train.main(small_config(out, steps=1))
    hold = ("import sys; from lab import files; files.lock_run(sys.argv[1]); "
            "print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold, out], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline() == "held\n"
        before = directory_state(out)
        for cfg in (small_config(out, steps=1), small_config(out, steps=2, overwrite=True),
                    train.Config(out=out, resume=True)):
            with pytest.raises(SystemExit, match=re.escape(f"--out {out} is in use by another "
                                                           f"run (pid {holder.pid});")):
                train.main(cfg)
        assert directory_state(out) == before
    finally:
        holder.kill()  # SIGKILL: no clean-up runs, the kernel drops the lock
        holder.wait()
    train.main(small_config(out, steps=2, overwrite=True))
    assert [r["step"] for r in read_jsonl(f"{out}/metrics.jsonl")] == [0, 1, 2]


def test_non_finite_steps_are_not_applied_and_three_in_a_row_stop_the_run(tmp_path, monkeypatch,
                                                                          capsys):
    """Every mini-batch's loss is NaN: nothing is applied, each step says so, the third stops the
    run with the checkpoint from before the trouble, and --resume --lr goes on from there."""
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)
    real = grpo.aggregate
    monkeypatch.setattr(grpo, "aggregate", lambda *args, **kw: real(*args, **kw) * float("nan"))
    out = str(tmp_path / "run")
    stop = re.escape(f"step 3: 3 steps in a row with a non-finite loss or gradient (those "
                     f"mini-batches were not applied); the last good checkpoint is step 0 in "
                     f"{out}/ckpt; to go on from it with a lower learning rate: "
                     f"python train.py --resume --out {out} --lr <lower>")
    with pytest.raises(SystemExit, match=stop):
        # the KL term: every call has a loss
        train.main(small_config(out, kl_coef=0.1, save_every=1))
    assert re.search(r"step 1 update \| generator: 18 of 18 calls with signal, \d+s, "
                     r"5 mini-batch\(es\) not applied: loss or gradient not finite",
                     capsys.readouterr().out)
    rows = read_jsonl(f"{out}/metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["adapter/generator/skipped_nonfinite"] == 5
               and r["adapter/aggregator/skipped_nonfinite"] == 2
               for r in rows[1:])
    assert torch.load(f"{out}/ckpt/state.pt", weights_only=False)["step"] == 0
    monkeypatch.setattr(grpo, "aggregate", real)
    train.main(train.Config(out=out, resume=True, lr=1e-4))
    rows = read_jsonl(f"{out}/metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    # each step logs the rate it trained at: the schedule from step 0 on, scaled to the new peak
    assert [r["lr"] for r in rows[1:]] == pytest.approx(
        [1e-4 * train.lr_factor(s, warmup=1, total=4) for s in range(4)])
    assert not any(v for r in rows for k, v in r.items() if k.endswith("skipped_nonfinite"))
    assert json.load(open(f"{out}/config.json"))["lr"] == 1e-4


def test_lengths_that_do_not_fit_the_model_stop_before_it_generates(tmp_path, monkeypatch):
    def no_generation(*args, **kw):
        raise AssertionError("the model generated")
    monkeypatch.setattr(train, "Rollout", no_generation)
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit, match=r"^--critic_max_tokens 4096: more than the 2048 "
                                         r"positions of model tiny; lower it to at most 2048$"):
        train.main(small_config(out, algo="maac", critic_max_tokens=4096))
    too_long = (r"^--max_new_tokens 2000: the longest prompt of voting on arith takes \d+ tokens, "
                r"and model tiny reads 2048; lower --max_new_tokens to at most \d+$")
    with pytest.raises(SystemExit, match=too_long) as stop:
        train.main(small_config(out, max_new_tokens=2000))
    assert not os.path.exists(f"{out}/config.json")
    prompt, most = (int(x) for x in re.search(r"takes (\d+) .* at most (\d+)",
                                              str(stop.value)).groups())
    assert prompt + most == 2048
    model, tok = load_policy("tiny")  # the largest length it names fits
    train.check_context(model, tok, small_config(out, max_new_tokens=most),
                         load_task("arith", "test", 3, 2, 0))


def test_sigterm_in_a_step_finishes_it_and_the_run_resumes_as_if_never_stopped(tmp_path,
                                                                               monkeypatch, capsys):
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)  # rewards vary, so adapters move
    # step 3 is saved all the same
    toy = dict(max_new_tokens=16, truncated="keep", temperature=1.0, lr=1e-2, save_every=2)
    train.main(small_config(str(tmp_path / "straight"), **toy))
    monkeypatch.setattr(machine, "requested", [])
    real_rollout, calls = train.run_episodes, []

    def signalled_in_step_3(*args, **kw):
        calls.append(1)
        if len(calls) == 5:  # evaluation, step 1, step 2 and its evaluation; step 3
            machine.ask_to_stop(signal.SIGTERM)
        return real_rollout(*args, **kw)
    monkeypatch.setattr(train, "run_episodes", signalled_in_step_3)
    out = str(tmp_path / "resumed")
    with pytest.raises(SystemExit) as stop:
        train.main(small_config(out, **toy))
    assert stop.value.code == 143 == 128 + signal.SIGTERM
    assert (f"stopped by SIGTERM after step 3, the checkpoint of step 3 kept; to go on: "
            f"python train.py --resume --out {out}") in capsys.readouterr().err
    assert torch.load(f"{out}/ckpt/state.pt", weights_only=False)["step"] == 3
    monkeypatch.setattr(train, "run_episodes", real_rollout)
    monkeypatch.setattr(machine, "requested", [])
    train.main(train.Config(out=out, resume=True))
    straight = without_machine_stats(read_jsonl(str(tmp_path / "straight/metrics.jsonl")))
    assert without_machine_stats(read_jsonl(out + "/metrics.jsonl")) == straight
    assert read_jsonl(str(tmp_path / "straight/samples.jsonl")) == \
        read_jsonl(out + "/samples.jsonl")


def test_a_sigterm_stops_a_training_process_with_its_checkpoint_and_the_resume_command(tmp_path):
    out = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "train.py", *SMALL, "--steps", "500", "--out", out],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    while not os.path.exists(f"{out}/ckpt/state.pt"):  # after the step-0 evaluation
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, err[-2000:]
    assert f"; to go on: python train.py --resume --out {out}\n" in err and "Traceback" not in err
    saved = torch.load(f"{out}/ckpt/state.pt", weights_only=False)["step"]
    assert [r["step"] for r in read_jsonl(f"{out}/metrics.jsonl")] == list(range(saved + 1)) \
        and saved < 500


def tensorboard_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event TensorBoard reads back from a run, (step, value) in its order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tb"), size_guidance={"scalars": 0}).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def tensorboard_texts(run_dir: str) -> dict[str, list[tuple[int, str]]]:
    """Every text (the TEXT tab) TensorBoard's server reads back from a run, (step, text) in its
    order."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tb"), size_guidance={"tensors": 0}).Reload()
    return {tag.removesuffix("/text_summary"): [(e.step, e.tensor_proto.string_val[0].decode())
                                               for e in events.Tensors(tag)]
            for tag in events.Tags()["tensors"]
            if events.SummaryMetadata(tag).plugin_data.plugin_name == "text"}


def test_tensorboard_holds_every_number_of_metrics_jsonl_and_every_logged_episode(tmp_path):
    out = str(tmp_path / "run")
    train.main(small_config(out, steps=3, workflow="eval_opt", log_samples=2))
    scalars = tensorboard_scalars(out)
    for row in read_jsonl(f"{out}/metrics.jsonl"):
        for key, value in row.items():
            if key != "step":
                assert dict(scalars[key])[row["step"]] == pytest.approx(value, rel=1e-6), \
                    (key, row["step"])
    assert "role/generator/len" in scalars and "role/evaluator/len" in scalars
    # one block per samples.jsonl episode, under episodes/<its place in the step>
    texts = tensorboard_texts(out)
    episodes = read_jsonl(f"{out}/samples.jsonl")
    assert sorted(texts) == ["episodes/0", "episodes/1"] and len(episodes) == 6
    for k, episode in enumerate(episodes):
        step, text = texts[f"episodes/{k % 2}"][k // 2]
        assert step == episode["step"] and text == files.transcript(episode)
        assert f"**{episode['problem']}**" in text and f"    {episode['question']}" in text
        for i, call in enumerate(episode["calls"], 1):
            assert f"**{i}. {call['slot']}** ({call['role']}, stage {call['stage']})" in text
            assert f"advantage **{call['advantage']:+.3f}**" in text \
                and files.code_block(call["output"], 600) in text
    # 900 characters
    long = {**episodes[0], "calls": [{**episodes[0]["calls"][0], "output": "```x\n" + "7" * 895}]}
    # a fence, indented
    assert "\n    ```x\n    " + "7" * 595 + " [... 300 more characters]\n" in files.transcript(long)


def test_tensorboard_after_a_resume_keeps_one_value_per_step(tmp_path):
    """A resumed run writes again the steps after its checkpoint; purge_step drops the old ones."""
    out = str(tmp_path)
    episode = {"problem": "p", "episode": 0, "question": "q", "answer": "7", "final": "7",
               "calls": []}
    for step in range(4):
        files.tensorboard_row(out, {"step": step, "reward/mean": float(step)},
                             [{**episode, "reward": step}])
    files.close_tensorboard()
    # TensorBoard reads a run's event files in name order, and a name starts with the second it
    # was opened in (then a counter, which sorts "10" before "9"): a resume opens a later second.
    time.sleep(1.1)
    for step in (2, 3):  # resumed from the checkpoint of step 1
        files.tensorboard_row(out, {"step": step, "reward/mean": 10.0 + step},
                             [{**episode, "reward": 10 + step}])
    files.close_tensorboard()
    assert tensorboard_scalars(out)["reward/mean"] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    texts = tensorboard_texts(out)["episodes/0"]
    assert [step for step, _ in texts] == [0, 1, 2, 3] and "reward **13**" in texts[-1][1]


@pytest.mark.parametrize("truncated, zero_frac", [("keep", 0.0), ("mask", 1.0), ("penalize", 1.0)])
def test_truncated_calls_are_treated_as_the_flag_says(tmp_path, monkeypatch, truncated, zero_frac):
    """The tiny model never ends a 4-token completion, so every call is cut; the verifier scores
    each group's episodes 0 and 1. keep: they earn that, and every call has an advantage; mask and
    penalize: a cut final answer is no answer, so every episode earns 0 and no group has a
    contrast (mask would also drop every cut call's gradient). Either way no update moves."""
    monkeypatch.setattr(train, "score_batch",
                        lambda problems, texts, **kw: [float(i % 2) for i in range(len(texts))])
    train.main(small_config(str(tmp_path), workflow="single", steps=1, group_size=2,
                            max_new_tokens=4, eval_problems=1, val_problems=0, truncated=truncated))
    row = read_jsonl(f"{tmp_path}/metrics.jsonl")[1]
    assert row["contract/truncated"] == 1.0 \
        and row["reward/mean"] == (0.5 if truncated == "keep" else 0.0)
    assert row["adv/zero_frac"] == zero_frac
    assert (row["adapter/generator/update_norm"] == 0) == (zero_frac == 1.0)


def test_voting_is_evaluated_on_candidates_that_can_differ(tmp_path, monkeypatch):
    """Greedy generators given one prompt write one answer three times, so a greedy Voting
    evaluation measures one generator; --eval_sampling auto samples Voting (and only Voting)."""
    model, tok = load_policy("tiny")
    inject_lora(model, 4, 8.0, ("q_proj", "v_proj"))
    setup_adapters(model, ROLES["voting"], "shared")
    seen = []
    def recording(*args, greedy, **kw):
        rollout, outcomes, rewards = rollout_step(*args, greedy=greedy, **kw)
        seen.append((greedy, rollout.calls))
        return rollout, outcomes, rewards
    rollout_step = train.run_episodes
    monkeypatch.setattr(train, "run_episodes", recording)
    problems = load_task("arith", "test", 4, 2, 0)
    for sampling, greedy in (("auto", False), ("greedy", True)):
        cfg = train.Config(model="tiny", workflow="voting", max_new_tokens=6,
                           eval_sampling=sampling, eval_samples=2)
        m = train.evaluate(model, tok, cfg, problems)
        assert seen[-1][0] == greedy and 0 <= m["eval/accuracy_se"] <= 0.5
        answers = defaultdict(set)
        for c in seen[-1][1]:
            if c.role == "generator":
                answers[c.episode].add(c.text)
        assert len(answers) == 4 * (1 if greedy else 2)  # sampled: each problem twice
        assert all(len(a) == 1 for a in answers.values()) == greedy
    cfg = dataclasses.replace(cfg, workflow="eval_opt", eval_sampling="auto")
    setup_adapters(model, ROLES["eval_opt"], "shared")
    train.evaluate(model, tok, cfg, problems)
    assert seen[-1][0] is True  # the other workflows stay greedy
    voting = train.Config(model="tiny", workflow="voting", eval_samples=2)
    assert "sampled evaluation on 96 held-out problems x 2 samples" in lab_run.plan(voting, "cpu")
    assert "greedy evaluation on 96 held-out problems (--eval_samples 2 unused: greedy answers " \
        "once) at" in lab_run.plan(cfg, "cpu")
    assert "greedy evaluation on 96 held-out problems at" in lab_run.plan(
        dataclasses.replace(cfg, eval_samples=1), "cpu")


def test_an_evaluation_s_accuracy_and_standard_error_by_hand(monkeypatch):
    """Sampled twice a problem, a problem scores the mean of its two episodes, and the standard
    error is that of the mean over problems: episodes 1 0 | 1 1 | 0 0 | 1 0 score 0.5, 1, 0, 0.5,
    accuracy 0.5, se = sqrt((0 + 0.25 + 0.25 + 0) / 3 / 4) = 0.2041."""
    model, tok = load_policy("tiny")
    inject_lora(model, 4, 8.0, ("q_proj", "v_proj"))
    setup_adapters(model, ROLES["voting"], "shared")
    real = train.run_episodes
    def fixed_rewards(*args, **kw):
        rollout, outcomes, rewards = real(*args, **kw)
        assert len(rewards) == 8  # one batch: each problem's two episodes side by side
        return rollout, outcomes, [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    monkeypatch.setattr(train, "run_episodes", fixed_rewards)
    cfg = train.Config(model="tiny", workflow="voting", max_new_tokens=4, eval_samples=2)
    m = train.evaluate(model, tok, cfg, load_task("arith", "test", 4, 2, 0))
    assert m["eval/accuracy"] == 0.5
    assert m["eval/accuracy_se"] == pytest.approx(0.2041, abs=1e-4)


def test_a_process_without_held_out_problems_joins_the_one_gather_of_an_evaluation(monkeypatch):
    """Under torchrun with fewer held-out problems than processes, a process's block is empty:
    it still takes part in the evaluation's single gather, and every process reads the others'
    lists by the keys any process wrote (a gather per key of its own would hang the others)."""
    model, tok = load_policy("tiny")
    inject_lora(model, 4, 8.0, ("q_proj", "v_proj"))
    setup_adapters(model, ROLES["single"], "shared")
    gathers = []
    def gather(items):  # this process (rank 0, nothing) and rank 1's one right answer
        gathers.append(items)
        return items + [{"reward": [1.0], "len": [3], "first_answer": [1.0]}]
    monkeypatch.setattr(train, "block", lambda n: range(0))
    monkeypatch.setattr(train, "gather_lists", gather)
    cfg = train.Config(model="tiny", workflow="single", max_new_tokens=4)
    m = train.evaluate(model, tok, cfg, load_task("arith", "test", 1, 2, 0))
    assert len(gathers) == 1 and m["eval/accuracy"] == 1.0 and m["eval/len"] == 3


def test_the_time_left_before_any_step_counts_every_episode_of_an_evaluation():
    """Before its first step a run guesses a step from its evaluation, whose episodes are the
    test and val problems, each sample of them: 112 s over 64 + 48 problems is 1 s an episode,
    a step of 32 episodes 48 s with its update, and 10 steps and 5 evaluations are left."""
    cfg = train.Config(steps=10, eval_every=2, eval_problems=64, val_problems=48)
    assert lab_run.estimate_minutes(cfg, 112.0, [], 0) == pytest.approx((10 * 48 + 5 * 112) / 60)
    sampled = dataclasses.replace(cfg, workflow="voting", eval_samples=2)  # 224 episodes
    assert lab_run.estimate_minutes(sampled, 224.0, [], 0) == pytest.approx((480 + 5 * 224) / 60)


def test_the_orchestrators_warm_up_plans_vary_from_episode_to_episode():
    """Each episode gets n distinct strategies of its own, numbered: a worker shown one cannot know
    the others' (the central critic's extra information in Paper B in miniature)."""
    problem = Problem("p", "What is 2 + 3?", "5")
    calls = [Call(e, "orchestrator", "orchestrator", 0, [1], [1], "", "") for e in range(8)]
    replies = contract_replies(calls, [problem] * 8, score_batch, 3, random.Random(0),
                               ["orchestrator"])
    plans = [c.text for c in replies]
    assert len(plans) == 8 and len(set(plans)) > 4
    for plan in plans:
        strategies = [line.split(". ", 1)[1] for line in plan.splitlines()]
        assert adherence("orchestrator", plan) and len(set(strategies)) == 3


def test_an_evaluation_fills_a_gpu_and_rolls_out_32_at_once_on_a_cpu(tiny, monkeypatch):
    """machine.eval_batch by hand: 16 GiB free, half of it for keys and values of 128 KiB a token,
    1,024 tokens an episode (128 MiB): 64 episodes at once; never fewer than a training step's 256,
    never more than the 50 there are. On a GPU (faked) the README recipe's Qwen3-0.6B shape takes
    112 KiB a token in bf16, and Voting's widest stage is its 3 generators' rows, each room for a
    prompt, two quoted replies and its own of 1,024 tokens."""
    assert machine.eval_batch(2**34, 2**17, 2**10, 32, 500) == 64
    assert machine.eval_batch(2**34, 2**17, 2**10, 256, 500) == 256
    assert machine.eval_batch(2**34, 2**17, 2**10, 32, 50) == 50
    model, tok = tiny
    problems = load_task("arith", "test", 20, 2, 0)
    cfg = train.Config(model="tiny", workflow="voting", max_new_tokens=1024,
                       problems_per_step=32, group_size=8)
    assert train.eval_batch_here(model, tok, cfg, problems, 500) == train.EVAL_BATCH == 32
    from model import random_config
    gpu = type("GPU", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16,
                           "config": random_config("qwen3-0.6b", tok)})()
    seen = []
    monkeypatch.setattr(machine, "eval_batch", lambda *a: seen.append(a) or 7)
    for free in (2**30, 2**40):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, f=free: (f, 2 * f))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2**20)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
        assert train.eval_batch_here(gpu, tok, cfg, problems, 500) == 7
    (free, kv, tokens, least, episodes), (more, *_) = seen
    assert (free, more) == (2**30 + 2**20, 2**40 + 2**20)  # torch's cache counts as free
    assert (kv, least, episodes) == (112 * 1024, 256, 500)
    prompt = (tokens - 3 * 3 * 1024) / 3  # 3 rows of a prompt and 3 x 1,024 tokens
    longest = max(len(tok(p.question).input_ids) for p in problems)
    assert prompt == int(prompt) and longest < prompt < 2000
