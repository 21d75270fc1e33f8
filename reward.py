"""The rewards of one step: each episode's final text scored by its verifier (verifier.py:
math by value, code in the sandbox), then, in one place (`credit_calls`), what every call of the
workflow is paid: by default the episode's outcome, broadcast to all its calls (Paper A, Zeng et
al. 2026, arXiv 2605.24202, Sec. 3).

    pytest tests/test_reward.py tests/test_sandbox.py tests/test_train.py
"""
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from sandbox import CODE_TIMEOUT
from tasks import Problem
from verifier import code_reward, math_reward
from workflows import SOLVERS, parse_verdict


# ----------------------------------------------------------------------------- scoring
def score(problem: Problem, text: str, strict: bool = False,
          timeout: float = CODE_TIMEOUT) -> float:
    """Reward of one final text, 1.0 or 0.0, by the problem's kind; never raises."""
    try:
        if problem.kind == "code":
            return code_reward(text, problem, timeout)
        return math_reward(text, problem.answer, strict)
    except Exception:
        return 0.0


def score_batch(problems: list[Problem], texts: list[str], strict: bool = False, workers: int = 2,
                timeout: float = CODE_TIMEOUT) -> list[float]:
    """score() of each (problem, text), at most `workers` programs at a time (threads)."""
    if len(problems) != len(texts):
        raise ValueError(f"{len(problems)} problems but {len(texts)} texts")
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(partial(score, strict=strict, timeout=timeout), problems, texts))


# ----------------------------------------------------------------------------- each call's reward
# A workflow's calls are rollout.Call records (read by field name here): role, episode, stage, text,
# truncated, and the two set below, own_score and reward.
CREDITS = ("final", "own")
TRUNCATED = ("penalize", "mask", "keep")


def credit_calls(calls: list, problems: list[Problem], rewards: list[float], credit: str,
                 truncated: str, strict: bool = False) -> None:
    """Decide every call's reward, in this one place. `rewards`: each episode's final outcome.

    final: the outcome is broadcast to every call of the episode (Paper A, Sec. 3; CoLLM).
    own: each call is paid for its own part (math only): a solver for its own answer, an evaluator
      for a verdict that agrees with the verifier; aggregator and orchestrator keep the outcome.
      A departure; docs/learning.md measures both.
    truncated "penalize": a call cut by the length limit earns 0, the reward of a wrong answer.
      DAPO (Yu et al. 2025, Sec. 3.4) instead penalizes the last tokens before the limit, or masks
      cut samples out of the loss ("mask" here, in the update). Unless "keep", a cut call's own
      answer is no answer either, and a cut final answer scores 0 (cut_finals).
    On math every solving call's own answer is scored into `own_score` (for measure.role_jobs)."""
    for c in calls:
        c.reward = rewards[c.episode]
    if problems[0].kind == "math":
        solvers = [c for c in calls if c.role in SOLVERS]
        for c, r in zip(solvers, score_batch([problems[c.episode] for c in solvers],
                                             [c.text for c in solvers], strict=strict)):
            c.own_score = 0.0 if c.truncated and truncated != "keep" else r
    if credit == "own":
        for c in calls:
            c.reward = c.own_score if c.own_score is not None else c.reward
        for c, right in verdicts(calls):
            c.reward = float(right)
    if truncated == "penalize":
        for c in calls:
            c.reward = 0.0 if c.truncated else c.reward


def cut_finals(calls: list, finals: list[str]) -> list[bool]:
    """Whether each episode's final answer is a call's text that the length limit cut."""
    cut = {(c.episode, c.text) for c in calls if c.truncated}
    return [(e, final) in cut for e, final in enumerate(finals)]


def read_by(calls: list) -> list[tuple]:
    """Each judging call (evaluator, aggregator, synthesizer) with the solutions it read: the
    scored calls of its episode one stage before it, in slot order."""
    made = {}
    for c in calls:
        if c.own_score is not None:
            made.setdefault((c.episode, c.stage), []).append(c)
    return [(c, made[c.episode, c.stage - 1]) for c in calls
            if c.role in ("evaluator", "aggregator", "synthesizer")
            and (c.episode, c.stage - 1) in made]


def verdicts(calls: list) -> list[tuple]:
    """Each evaluator call that read a scored solution, and whether the verifier agrees."""
    return [(c, parse_verdict(c.text)[0] == (read[0].own_score == 1.0))
            for c, read in read_by(calls) if c.role == "evaluator"]
