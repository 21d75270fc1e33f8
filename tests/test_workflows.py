"""Workflows against a scripted fake model: stage order, batching, prompts, contracts, finals."""
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import pytest

from conftest import ROOT
from tasks import LEVELS, OPS, fact, facts
from workflows import (PROMPTS, DEFAULT_STRATEGY, MAX_FEED_CHARS, ROLES, WORKFLOWS,
                       Chat, boxed_contents, clip, parse_choice, parse_strategies,
                       parse_verdict, role_of, run_workflow, slots, stage)

Script = Callable[[str, str, int, int], str]  # (role, slot, episode, call number) -> completion


@dataclass
class Call:
    role: str
    slots: list[str]
    episodes: list[int]
    chats: list[Chat]


def default_script(role: str, slot: str, episode: int, call: int) -> str:
    return {"evaluator": r"Fine. \boxed{Correct}",
            "aggregator": r"\boxed{1}",
            "orchestrator": "1. Add.\n2. Count.\n3. Draw."}.get(
                role, f"{slot} on episode {episode} (call {call}) \\boxed{{{episode}}}")


class FakeModel:
    """A `generate` callback that records every call and answers from a script."""

    def __init__(self, script: Script = default_script):
        self.script = script
        self.calls: list[Call] = []

    def __call__(self, role: str, slots: list[str], episodes: list[int],
                 chats: list[Chat]) -> list[str]:
        assert slots and len(slots) == len(episodes) == len(chats)
        assert all([m["role"] for m in c] == ["system", "user"] for c in chats)
        self.calls.append(Call(role, list(slots), list(episodes), chats))
        return [self.script(role, s, e, len(self.calls) - 1) for s, e in zip(slots, episodes)]

    @property
    def stages(self) -> list[str]:
        return [c.role for c in self.calls]


def user(chat: Chat) -> str:
    return chat[-1]["content"]


QUESTIONS = [f"What is {i} + {i}?" for i in range(5)]


# ---------------------------------------------------------------- names

def test_slots_roles_and_role_of() -> None:
    assert slots("single") == ["generator"]
    assert slots("eval_opt") == ["generator", "evaluator"]
    assert slots("voting") == ["generator0", "generator1", "generator2", "aggregator"]
    assert slots("orch_workers", 2) == ["orchestrator", "worker0", "worker1", "synthesizer"]
    for name in WORKFLOWS:
        assert sorted({role_of(s) for s in slots(name)}) == sorted(ROLES[name])
    assert role_of("generator1") == "generator" and role_of("worker0") == "worker"
    assert role_of("evaluator") == "evaluator"
    with pytest.raises(ValueError):
        role_of("critic0")


def test_unknown_names_raise_one_line() -> None:
    for bad in (lambda: run_workflow("debate", QUESTIONS, FakeModel()), lambda: slots("debate")):
        with pytest.raises(ValueError) as err:
            bad()
        assert "\n" not in str(err.value) and "voting" in str(err.value)
    with pytest.raises(ValueError, match="math"):
        run_workflow("single", QUESTIONS, FakeModel(), kind="poetry")


def test_no_questions_no_calls() -> None:
    model = FakeModel()
    for name in WORKFLOWS:
        assert run_workflow(name, [], model) == []
    assert model.calls == []


def test_stage_checks_the_number_of_completions() -> None:
    with pytest.raises(RuntimeError):
        stage(lambda role, s, e, c: ["only one"], "generator", [("g", 0, []), ("g", 1, [])])


# ---------------------------------------------------------------- single

def test_single() -> None:
    model = FakeModel()
    outcomes = run_workflow("single", QUESTIONS[:2], model)
    assert model.stages == ["generator"]
    assert model.calls[0].slots == ["generator"] * 2 and model.calls[0].episodes == [0, 1]
    assert [user(c) for c in model.calls[0].chats] == [f"Problem: {q}" for q in QUESTIONS[:2]]
    assert r"\boxed{}" in model.calls[0].chats[0][0]["content"]
    assert [o.final for o in outcomes] == [rf"generator on episode {e} (call 0) \boxed{{{e}}}"
                                           for e in range(2)]


# ---------------------------------------------------------------- voting

def test_voting_batches_one_call_per_stage() -> None:
    model = FakeModel()
    outcomes = run_workflow("voting", QUESTIONS, model)
    assert model.stages == ["generator", "aggregator"]
    gen, agg = model.calls
    assert len(gen.chats) == 15
    assert gen.slots == ["generator0", "generator1", "generator2"] * 5
    assert gen.episodes == [e for e in range(5) for _ in range(3)]
    # Same-role agents see exactly the same prompt: that is what makes their gradients coherent.
    for e in range(5):
        assert gen.chats[3 * e] == gen.chats[3 * e + 1] == gen.chats[3 * e + 2]
        assert QUESTIONS[e] in user(gen.chats[3 * e])
    assert agg.slots == ["aggregator"] * 5 and agg.episodes == list(range(5))
    for e, chat in enumerate(agg.chats):
        assert QUESTIONS[e] in user(chat)
        for k in range(3):
            assert f"Candidate {k + 1}:\ngenerator{k} on episode {e} (call 0)" in user(chat)
    assert all(o.final.startswith("generator0 on") for o in outcomes)
    assert outcomes[0].info == {"choice": 1, "rule": "boxed", "fallback": False}


def test_voting_choice_rules() -> None:
    picks = [r"\boxed{2}", r"Candidate 3 looks right. \boxed{7}", "no idea",
             r"\boxed{3} or \boxed{9}"]
    model = FakeModel(
        lambda role, slot, e, call: picks[e] if role == "aggregator" else f"{slot}/{e}")
    outcomes = run_workflow("voting", QUESTIONS[:4], model)
    assert [(o.info["choice"], o.info["rule"]) for o in outcomes] == [
        (2, "boxed"), (3, "first_digit"), (1, "default"), (3, "boxed")]
    assert [o.final for o in outcomes] == [
        "generator1/0", "generator2/1", "generator0/2", "generator2/3"]
    assert [o.info["fallback"] for o in outcomes] == [False, True, True, False]


@pytest.mark.parametrize("text, n, expected", [
    (r"\boxed{2}", 3, (2, "boxed")),
    (r"\boxed{ 3 }", 3, (3, "boxed")),
    (r"I pick \boxed{1}. Final: \boxed{7}", 3, (1, "boxed")),   # last *valid* boxed
    (r"\boxed{7}", 3, (1, "default")),                           # out of range, no other digit
    (r"\boxed{7}, since 0 and 2 agree", 3, (2, "first_digit")),  # first digit in 1..n
    (r"\boxed{x=2}", 3, (2, "first_digit")),
    ("", 3, (1, "default")),
    (r"\boxed{5}", 5, (5, "boxed")),
])
def test_parse_choice(text: str, n: int, expected: tuple[int, str]) -> None:
    assert parse_choice(text, n) == expected


def test_long_candidates_are_clipped_head_and_tail() -> None:
    long = "start " + "x" * 5000 + r" \boxed{8}"
    model = FakeModel(lambda role, slot, e, call: long if role == "generator" else r"\boxed{1}")
    outcomes = run_workflow("voting", QUESTIONS[:1], model)
    prompt = user(model.calls[1].chats[0])
    assert len(prompt) < 3 * MAX_FEED_CHARS + 500
    assert prompt.count("start ") == 3 and prompt.count(r"\boxed{8}") == 3
    assert outcomes[0].final == long  # the reward scores the full text
    assert clip("short") == "short" and len(clip(long)) <= MAX_FEED_CHARS + 10


# ---------------------------------------------------------------- eval_opt

def verdict_by_episode(role: str, slot: str, episode: int, call: int) -> str:
    if role == "evaluator":
        return r"Good. \boxed{Correct}" if episode == 0 else r"Step 2 is wrong. \boxed{Incorrect}"
    return f"solution {episode} from call {call}"


def test_eval_opt_stops_each_episode_on_its_own() -> None:
    model = FakeModel(verdict_by_episode)
    a, b = run_workflow("eval_opt", ["Question A", "Question B"], model, max_rounds=3)
    assert model.stages == ["generator", "evaluator", "generator", "evaluator", "generator"]
    assert [c.episodes for c in model.calls] == [[0, 1], [0, 1], [1], [1], [1]]
    assert model.calls[1].slots == ["evaluator"] * 2 and model.calls[2].slots == ["generator"]
    assert a.final == "solution 0 from call 0"
    assert a.info == {"rounds": 1, "stopped": True, "fallback": False, "rule": "boxed"}
    assert b.final == "solution 1 from call 4"
    assert b.info == {"rounds": 3, "stopped": False, "fallback": False, "rule": "boxed"}


def test_eval_opt_prompts_carry_solution_and_critique() -> None:
    model = FakeModel(verdict_by_episode)
    run_workflow("eval_opt", ["Question A", "Question B"], model, max_rounds=2)
    assert model.stages == ["generator", "evaluator", "generator"]  # no verdict after the last turn
    evaluate, refine = user(model.calls[1].chats[1]), user(model.calls[2].chats[0])
    assert "Question B" in evaluate and "solution 1 from call 0" in evaluate
    assert "Question B" in refine and "solution 1 from call 0" in refine
    # the critique without its verdict: a bare \boxed{Incorrect} in the refine prompt is what a
    # small model copies instead of writing a solution
    assert "Step 2 is wrong." in refine and r"\boxed{Incorrect}" not in refine
    model = FakeModel(
        lambda role, slot, e, call: r"\boxed{Incorrect}" if role == "evaluator" else "s")
    run_workflow("eval_opt", ["Q"], model, max_rounds=2)
    assert "(no reason given)" in user(model.calls[2].chats[0])


def test_eval_opt_round_limits() -> None:
    model = FakeModel(verdict_by_episode)
    run_workflow("eval_opt", ["Question B"], model, max_rounds=1)
    assert model.stages == ["generator"]
    model = FakeModel(
        lambda role, slot, e, call: r"\boxed{Incorrect}" if role == "evaluator" else "s")
    (outcome,) = run_workflow("eval_opt", ["Q"], model, max_rounds=4)
    assert model.stages == ["generator", "evaluator"] * 3 + ["generator"]
    assert outcome.info["rounds"] == 4 and not outcome.info["stopped"]


def test_eval_opt_missing_verdict_refines_and_is_flagged() -> None:
    replies = ["I think it is fine.", "Looks correct to me."]
    model = FakeModel(
        lambda role, slot, e, call: replies[call // 2] if role == "evaluator" else "s")
    (outcome,) = run_workflow("eval_opt", ["Q"], model, max_rounds=3)
    # "fine" is no verdict -> refine; then the word "correct" stops the episode.
    assert model.stages == ["generator", "evaluator", "generator", "evaluator"]
    assert outcome.info == {"rounds": 2, "stopped": True, "fallback": True, "rule": "word"}


@pytest.mark.parametrize("text, expected", [
    (r"\boxed{Correct}", (True, "boxed")),
    (r"\boxed{incorrect}", (False, "boxed")),
    (r"\boxed{\text{CORRECT}}", (True, "boxed")),
    (r"First \boxed{Incorrect}, on reflection \boxed{Correct}", (True, "boxed")),
    (r"The answer \boxed{5} is correct, not \boxed{Incorrect}", (False, "boxed")),
    (r"It gives \boxed{5}, which is incorrect.", (False, "word")),
    ("Incorrect at first glance, but correct.", (True, "word")),
    ("This was done incorrectly.", (False, "default")),
    ("The answer 7 is not correct.", (False, "word")),
    (r"\boxed{Not correct}", (False, "boxed")),
    ("", (False, "default")),
])
def test_parse_verdict(text: str, expected: tuple[bool, str]) -> None:
    assert parse_verdict(text) == expected


# ---------------------------------------------------------------- orch_workers

def test_orch_workers_stages_prompts_and_final() -> None:
    model = FakeModel()
    outcomes = run_workflow("orch_workers", QUESTIONS[:2], model)
    assert model.stages == ["orchestrator", "worker", "synthesizer"]
    orch, work, synth = model.calls
    assert orch.slots == ["orchestrator"] * 2 and orch.episodes == [0, 1]
    assert "3" in orch.chats[0][0]["content"] and QUESTIONS[0] in user(orch.chats[0])
    assert work.slots == ["worker0", "worker1", "worker2"] * 2
    assert work.episodes == [0, 0, 0, 1, 1, 1]
    assert [user(c).split("Strategy: ")[1] for c in work.chats] == ["Add.", "Count.", "Draw."] * 2
    assert all(QUESTIONS[e] in user(c) for e, c in zip(work.episodes, work.chats))
    assert synth.slots == ["synthesizer"] * 2 and synth.episodes == [0, 1]
    for e, chat in enumerate(synth.chats):
        assert QUESTIONS[e] in user(chat)
        for k in range(3):
            assert f"Solution {k + 1}:\nworker{k} on episode {e} (call 1)" in user(chat)
    assert [o.final for o in outcomes] == [rf"synthesizer on episode {e} (call 2) \boxed{{{e}}}"
                                           for e in range(2)]
    assert outcomes[0].info == {"strategies": 3, "fallback": False, "rule": "numbered"}


@pytest.mark.parametrize("plan, parsed", [
    ("I would just compute it: 2 + 2 = 4.", 0),
    ("1. Add the numbers.\n2) Count on fingers.", 2),
    ("1. a\n2. b\n3. c\n4. d", 3),
])
def test_orch_workers_fills_missing_strategies(plan: str, parsed: int) -> None:
    model = FakeModel(lambda role, slot, e, call: plan if role == "orchestrator" else "w")
    (outcome,) = run_workflow("orch_workers", ["Q"], model)
    strategies = [user(c).split("Strategy: ")[1] for c in model.calls[1].chats]
    assert len(strategies) == 3 and strategies.count(DEFAULT_STRATEGY) == 3 - parsed
    assert outcome.info == {"strategies": parsed, "fallback": parsed < 3,
                            "rule": "numbered" if parsed == 3 else "default"}


@pytest.mark.parametrize("text, expected", [
    ("1. Factor.\n2) Substitute.\nStrategy 3: Guess and check.",
     ["Factor.", "Substitute.", "Guess and check."]),
    ("Plan:\n- 1. Draw it\n**Strategy 2:** Use symmetry.", ["Draw it", "Use symmetry."]),
    ("1.5 is close to the answer\n2. Estimate", ["Estimate"]),
    ("No list here.", []),
])
def test_parse_strategies(text: str, expected: list[str]) -> None:
    assert parse_strategies(text, 3) == expected


def test_boxed_contents_handles_nesting() -> None:
    text = r"a \boxed{\frac{1}{2}} b \boxed{3} c \boxed{open"
    assert boxed_contents(text) == [r"\frac{1}{2}", "3"]


EXPRESSION = re.compile(r"(\d+)\s*([-+*×])\s*(\d+)(?:\s*([-+])\s*(\d+))?")


def test_no_prompt_shows_a_held_out_fact():
    """A format example such as "4 + 5 = 9" must not be a fact of any level's test or val split:
    the prompt is read by every call, evaluation's included."""
    held_out = {key for level in LEVELS for split in ("val", "test") for key in facts(level, split)}
    texts = [text for templates in PROMPTS.values() for text in templates.values()]
    shown = set()
    for text in texts:
        for a, op, b, op2, c in EXPRESSION.findall(text):
            formula = "a" + op.replace("×", "*") + "b" + (op2 + "c" if op2 else "")
            nums = tuple(int(x) for x in (a, b, c) if x)
            shown.add(fact(formula, nums) if formula in OPS else formula)
    assert shown, "the math prompts show a worked example"
    assert not shown & held_out, shown & held_out


def test_the_demo_names_its_workflows_for_an_unknown_one():
    """`python workflows.py NAME` prints a workflow's prompts on a canned model; any other NAME,
    or a second argument, is a usage line, not a traceback."""
    for args in (["chain"], ["voting", "extra"]):
        res = subprocess.run([sys.executable, os.path.join(ROOT, "workflows.py"), *args],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and "Traceback" not in res.stderr
        assert res.stderr.strip() == ("usage: python workflows.py [single | eval_opt | voting | "
                                      "orch_workers] (default: voting)")
