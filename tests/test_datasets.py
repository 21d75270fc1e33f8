"""Tests for the problem sets beyond arith: HumanEval offline, and the row -> Problem conversion of
DAPO-Math-17K and DeepCoder on small fixtures shaped like real rows; hub tasks fail fast offline."""
import json
import os
import subprocess
import sys
import time

# imported here once, so the time bounds below time the hub probe, not the import
import datasets  # noqa: F401
import pytest

from reward import score
from sandbox import run_code
from tasks import TASKS, dapo_problem, deepcoder_problem, humaneval_problems, load_task
from verifier import math_reward

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(name: str) -> list[dict]:
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- HumanEval

def test_humaneval_loads_offline_with_a_disjoint_split():
    train, val, test = (humaneval_problems(split, 1000) for split in ("train", "val", "test"))
    # every problem; a quarter and an eighth held out
    assert (len(train), len(val), len(test)) == (103, 21, 40)
    assert (not {p.id for p in train} & {p.id for p in test}
            and not {p.id for p in val} & {p.id for p in train + test})
    assert all(p.kind == "code" and p.test_format == "assert" and p.entry_point
               for p in train + val + test)
    assert load_task("humaneval", "test", 1000, 3, 0) == test  # the level is ignored


def test_humaneval_is_seeded_and_deterministic():
    a, b = load_task("humaneval", "train", 20, 1, 0), load_task("humaneval", "train", 20, 1, 0)
    assert a == b and len(a) == 20
    assert [p.id for p in a] != [p.id for p in load_task("humaneval", "train", 20, 1, 1)]
    # asking for more than a split holds returns all of it
    assert ({p.id for p in load_task("humaneval", "test", 48, 1, 0)}
            == {p.id for p in humaneval_problems("test", 99)})


def test_copies_of_a_hub_problem_share_a_split():
    """Hub problems are split by their normalised text: a copy that differs in case, spacing or
    punctuation lands beside the original, wherever that is."""
    from tasks import Problem, _pick
    pool = [Problem(f"p{i}", f"What is {i} plus {i + 1}?", str(2 * i + 1)) for i in range(40)]
    pool += [Problem(f"copy{i}", f"  what IS {i} plus {i + 1} ", str(2 * i + 1)) for i in range(40)]
    for split in ("train", "val", "test"):
        ids = {p.id for p in _pick(pool, split, 100, 0)}
        assert ids and all((f"p{i}" in ids) == (f"copy{i}" in ids) for i in range(40))


def test_humaneval_problem_fields():
    p = next(p for p in humaneval_problems("train", 1000) + humaneval_problems("test", 1000)
             if p.id == "HumanEval/0")
    assert (p.question.startswith("from typing import List")
            and "def has_close_elements" in p.question)
    assert (p.entry_point == "has_close_elements"
            and p.tests.rstrip().endswith("check(has_close_elements)"))
    assert p.setup == p.question and p.answer.startswith(p.question)


@pytest.mark.parametrize("index", [0, 7, 31])
def test_humaneval_canonical_solution_scores_one_and_stub_zero(index):
    p = humaneval_problems("test", 1000)[index]
    assert score(p, f"Solution:\n```python\n{p.answer}\n```", timeout=10) == 1.0
    assert score(p, f"```python\n{p.question}\n```", timeout=10) == 0.0  # the prompt alone: a stub
    assert score(p, "", timeout=10) == 0.0
    assert score(p, "```python\ndef nothing():\n    pass\n```", timeout=10) == 0.0


# ----------------------------------------------------------------------------- DAPO-Math-17K

def test_dapo_rows_convert():
    problems = [dapo_problem(r) for r in rows("dapo_rows.json")]
    assert [p.answer for p in problems] == ["54", "15", "400"]
    first = problems[0]
    assert first.id == "dapo-7c0f2a4e-1b6d-4f3e-9a51-3d2c8e6b1f01" and first.kind == "math"
    assert (first.question
            == "A rectangle has a perimeter of $30$ and a length of $9$. What is its area?")
    assert all("Answer:" not in p.question and "Remember" not in p.question for p in problems)
    assert math_reward("So the area is \\boxed{54}.", first.answer) == 1.0


def test_dapo_row_variants():
    row = rows("dapo_rows.json")[1]
    no_solution = dict(row, solution=None)  # the answer also sits in reward_model.ground_truth
    assert dapo_problem(no_solution).answer == "15"
    assert dapo_problem(dict(row, extra_info=None)).id.startswith("dapo-")
    assert dapo_problem(dict(row, prompt="")) is None
    plain = dict(row, prompt="What is 2 + 2?")  # no DAPO wrapper: kept as it is
    assert dapo_problem(plain).question == "What is 2 + 2?"


# ----------------------------------------------------------------------------- DeepCoder

def test_deepcoder_rows_convert():
    stdio, call, empty = (deepcoder_problem(r) for r in rows("deepcoder_rows.json"))
    assert empty is None
    assert stdio.kind == call.kind == "code" and stdio.id.startswith("deepcoder-")
    assert stdio.test_format == "stdio" and stdio.entry_point == ""
    assert json.loads(stdio.tests)[0] == {"input": "4\n1 2 3 4\n", "output": "6\n2\n"}
    assert ("standard input" in stdio.question
            and stdio.question.startswith("Solve the following coding problem"))
    assert call.test_format == "call" and call.entry_point == "run_lengths"
    assert json.loads(call.tests)[1] == {"input": [""], "output": [[]]}
    assert "`run_lengths`" in call.question


@pytest.mark.parametrize("index", [0, 1])
def test_deepcoder_reference_solutions_score_one(index):
    row = rows("deepcoder_rows.json")[index]
    p = deepcoder_problem(row)
    assert p.answer == row["solutions"][0]
    assert score(p, f"Here you go.\n```python\n{p.answer}```\nDone.", timeout=10) == 1.0
    broken = p.answer.replace("% 2", "% 3").replace("+= 1", "+= 2")
    assert run_code(broken, p, timeout=10).reason.startswith("wrong")


def test_deepcoder_mixed_and_odd_tests():
    row = rows("deepcoder_rows.json")[0]
    tests = json.loads(row["tests"]) + [{"type": "function_call", "fn_name": "f", "input": [1],
                                         "output": [1]}]
    p = deepcoder_problem(dict(row, tests=tests))  # already decoded; the other format is dropped
    assert p.test_format == "stdio" and len(json.loads(p.tests)) == 3
    assert deepcoder_problem(dict(row, tests=json.dumps([{"type": "unknown"}]))) is None
    scalar = [{"type": "function_call", "fn_name": "twice", "input": 4, "output": [8]}]
    p = deepcoder_problem(dict(row, tests=json.dumps(scalar)))
    assert json.loads(p.tests) == [{"input": [4], "output": [8]}]
    assert run_code("def twice(x):\n    return 2 * x\n", p, timeout=10).passed


# ----------------------------------------------------------------------------- hub tasks offline

@pytest.mark.parametrize("task", ["dapo_math", "deepcoder"])
def test_hub_tasks_fail_fast_offline(task, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        load_task(task, "train", 8, 1, 0)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "\n" not in message and "arith" in message and "humaneval" in message


def test_unreachable_hub_fails_fast_without_the_offline_flag():
    """In a fresh process with no network route to the hub, the probe gives up within seconds."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tasks import load_task\n"
            "try:\n    load_task('dapo_math', 'train', 8, 1, 0)\n"
            "except ValueError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_ENDPOINT"] = "https://hub.invalid"  # a reserved name that never resolves
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, ROOT], env=env, capture_output=True,
                         text=True, timeout=60)
    assert time.monotonic() - start < 15
    assert out.stdout.count("\n") == 1 and "humaneval" in out.stdout, out


def test_task_names():
    assert {"arith", "humaneval", "dapo_math", "deepcoder"} <= set(TASKS)


def test_hub_rows_flow_into_problems(monkeypatch):
    """The loading path with the hub replaced by the fixture rows: conversion, filtering and
    splits."""
    import datasets

    import tasks
    monkeypatch.setattr(tasks, "_hub_reachable", lambda: True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", lambda repo, config, split: rows(
        {"open-r1/DAPO-Math-17k-Processed": "dapo_rows.json",
         "agentica-org/DeepCoder-Preview-Dataset": "deepcoder_rows.json"}[repo]))
    tasks._hub_pool.cache_clear()
    try:
        for task, size in (("dapo_math", 3), ("deepcoder", 2)):
            train, val, test = (load_task(task, split, 100, 1, 0)
                                for split in ("train", "val", "test"))
            assert len(train) + len(val) + len(test) == size
            assert (not {p.id for p in train} & {p.id for p in test}
                    and not {p.id for p in val} & {p.id for p in train})
    finally:
        tasks._hub_pool.cache_clear()


def test_malformed_rows_are_skipped(monkeypatch):
    import datasets

    import tasks
    good = rows("deepcoder_rows.json")[:2]
    bad = [{"problem": None, "tests": "[{}]"}, {"problem": "x", "tests": "not json"}, {"tests": 3}]
    monkeypatch.setattr(tasks, "_hub_reachable", lambda: True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    tasks._hub_pool.cache_clear()
    try:
        monkeypatch.setattr(datasets, "load_dataset", lambda repo, config, split: bad + good)
        assert len(tasks._hub_pool("deepcoder")) == 2
        tasks._hub_pool.cache_clear()
        monkeypatch.setattr(datasets, "load_dataset", lambda repo, config, split: bad)
        with pytest.raises(ValueError, match="no usable rows"):
            load_task("deepcoder", "train", 4, 1, 0)
    finally:
        tasks._hub_pool.cache_clear()
