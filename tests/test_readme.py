"""Every command in the README and its deep pages (docs/*.md) works verbatim after the two set-up
commands: each is parsed here, and those that work offline run on the tiny model with tiny
budgets, the README's first, in page order; the prepared GPU script's (tests/gpu_check.sh) pass
the checks a launch makes before its model loads, and its own Python runs on the CPU."""
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


def gpu_check_commands(logs: str) -> list[list[str]]:
    """The argv (after $PY) of each train.py and lab.bench command of tests/gpu_check.sh, the
    prepared GPU measurement of docs/performance.md, its logs in `logs`; its recipe runs with
    --diag_every 1 and 0."""
    with open(f"{ROOT}/tests/gpu_check.sh") as f:
        text = f.read().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if "$PY train.py" not in line and "$PY -m lab.bench" not in line:
            continue
        words = shlex.split(line[line.index("$PY") + 3:])
        ends = [i for i, w in enumerate(words) if re.fullmatch(r"\d?>.*|\|", w)]
        words = words[:ends[0]] if ends else words  # up to a redirection or a pipe
        for diag_every in ("1", "0"):
            argv = [w.replace("$1", diag_every).replace("$LOGS", logs) for w in words]
            if argv not in commands:
                commands.append(argv)
    return commands


def test_the_prepared_gpu_check_s_commands_pass_a_launch_s_checks(tmp_path, monkeypatch):
    """The script runs only where a GPU is lent: a flag it passes that train.py or lab.bench
    would refuse shows here, before the model loads (a GPU faked as present)."""
    import torch
    from lab.run import load_problems
    from lab.settings import check_settings, typed_flags
    from train import Config
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    commands = gpu_check_commands(str(tmp_path))
    scripts = [c[0] for c in commands]
    assert scripts.count("train.py") == 3 and scripts.count("-m") == 2, commands
    for argv in commands:
        if argv[0] == "train.py":
            cfg = check_settings(train.parse_config(argv[1:]), typed_flags(argv[1:]))
            load_problems(cfg, world=1)
        else:
            assert argv[1] == "lab.bench", argv
            bench.check_args(bench.make_parser().parse_args(argv[2:]), Config().train_problems)


def gpu_check_snippet(log: str) -> str:
    """The Python that tests/gpu_check.sh feeds to `$PY -` for the part that writes `log`."""
    with open(f"{ROOT}/tests/gpu_check.sh") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if "<<'PY'" in line and log in line)
    end = lines.index("PY", start)
    return "\n".join(lines[start + 1:end]) + "\n"


@pytest.mark.parametrize("log, device_line", [
    ("step.txt", 'name, device, sync = sys.argv[1], "cuda", torch.cuda.synchronize'),
    ("update-profile.txt", 'name, device = sys.argv[1], "cuda"'),
])
def test_the_prepared_gpu_check_s_python_runs_on_the_cpu(log, device_line, monkeypatch, capsys):
    """The script's own Python (a decoding step timed eager and replayed; the update profiled),
    run here on the tiny model with its device set to the CPU and CUDA's calls stood in for (the
    "graph" replays the eager step): a change to decode.py, grpo.py or rollout.py that the script
    does not follow fails here, not in a GPU session's minutes."""
    import types
    import torch
    import decode
    source = gpu_check_snippet(log)
    assert device_line in source
    source = source.replace(device_line, device_line.replace('"cuda"', '"cpu"'))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(decode, "capture", lambda step, rows, columns: types.SimpleNamespace(
        replay=lambda: step(rows, columns)))
    monkeypatch.setattr(sys, "argv", ["-", "tiny"])
    exec(compile(source, f"gpu_check.sh ({log})", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    for dtype in ("bf16", "fp32"):
        assert f"tiny {dtype}, " in printed, printed
