"""The environment: problem sets and verifiable rewards.

An RL environment for LLM workflows is two things: a set of problems with
gold answers, and a verifier that turns a model's final text into a reward
(1 right, 0 wrong) without any learned judge.

Problems. The embedded `arith` task generates arithmetic problems in code, so
it works offline and its difficulty can be set (levels 1..5, from one-digit
addition to two-step word problems). Train and test are disjoint by
construction: a question belongs to the test split iff a stable hash of its
text says so, whatever the seed or size asked for.

Verifier. Like Paper A (Zeng et al. 2026, arXiv 2605.24202) the math
verifier reads the content of the *last* \\boxed{...} in the text and
compares it with the gold answer. Paper A compares by normalised string and
symbolic equality; this file compares by exact value with
`fractions.Fraction` ("3.50" == "7/2" == "\\frac{7}{2}") and falls back
to normalised string equality. Symbolic equality via sympy arrives later.
Departure: by default the verifier is lenient, and when there is no complete
\\boxed{} it takes the last number in the text, because a tiny model often
states the right answer without the box. `strict=True` switches that off.

    pytest tests/test_reward.py
"""
import hashlib
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from operator import add, mul, sub
from typing import Callable

# Chosen so the embedded model's single-agent base accuracy sits between 20 % and 70 %.
DEFAULT_LEVEL = 2


@dataclass(frozen=True)
class Problem:
    id: str  # unique and stable, e.g. "arith-L2-train-00017"
    question: str  # the text shown to the agents; the workflow adds format instructions
    answer: str  # the gold answer, e.g. "12", "-3" or "3/4"
    kind: str = "math"  # which verifier scores it


# ----------------------------------------------------------------------------- arith task
# Every answer is a non-negative integer: subtraction always has a >= b, so a
# tiny model is never asked for a sign it has not learned to write.

ADD = ("What is {a} + {b}?", "Compute {a} + {b}.", "Calculate {a} + {b}.", "What is {a} plus {b}?",
       "What is the sum of {a} and {b}?", "Add {a} and {b}.", "Find the sum of {a} and {b}.", "{a} + {b} = ?")
SUB = ("What is {a} - {b}?", "Compute {a} - {b}.", "What is {a} minus {b}?", "Subtract {b} from {a}.",
       "What is {b} less than {a}?", "Take {b} away from {a}. What is left?")
MUL = ("What is {a} × {b}?", "Compute {a} * {b}.", "What is {a} times {b}?", "Multiply {a} by {b}.",
       "What is the product of {a} and {b}?")
ADD3 = ("What is {a} + {b} + {c}?", "Compute {a} + {b} + {c}.", "Add {a}, {b} and {c}.",
        "What is the sum of {a}, {b} and {c}?")
STORY_ADD = ("{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?",
             "There are {a} {obj} in a box. {name} puts {b} more in the box. How many {obj} are in the box now?",
             "{name} had {a} {obj}. Then {name} found {b} more. How many {obj} does {name} have now?")
STORY_SUB = ("{name} has {a} {obj} and gives {b} to a friend. How many {obj} does {name} have left?",
             "There are {a} {obj} in a box. {name} takes {b} out. How many {obj} are left in the box?",
             "{name} had {a} {obj} and lost {b} of them. How many {obj} does {name} have now?")
STORY_MUL = ("{name} has {a} bags with {b} {obj} in each bag. How many {obj} does {name} have?",
             "There are {a} boxes and each box holds {b} {obj}. How many {obj} are there in all?")
GAIN_LOSE = ("{name} has {a} {obj}. {name} buys {b} more and then gives {c} to a friend. "
             "How many {obj} does {name} have now?",
             "There are {a} {obj} in a box. {name} puts in {b} more and then takes out {c}. "
             "How many {obj} are in the box now?")
LOSE_GAIN = ("{name} has {a} {obj} and gives {b} to a friend. Later {name} buys {c} more. "
             "How many {obj} does {name} have now?",
             "There are {a} {obj} in a box. {name} takes out {b} and then puts in {c}. "
             "How many {obj} are in the box now?")
GROUPS_PLUS = ("{name} has {a} bags with {b} {obj} in each bag and {c} more {obj} on the table. "
               "How many {obj} does {name} have in total?",
               "{name} buys {a} packs of {b} {obj} and already had {c} {obj}. How many {obj} does {name} have now?")
GROUPS_MINUS = ("{name} buys {a} packs of {b} {obj} and gives {c} to a friend. How many {obj} does {name} have left?",
                "There are {a} boxes with {b} {obj} in each box. {name} takes {c} out. How many {obj} are left?")
NAMES = ("Sam", "Mia", "Leo", "Ana", "Tom", "Zoe", "Ben", "Ivy")
OBJECTS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "shells")  # 7 vs 8 names: coprime

D, DD = range(10), range(10, 100)  # one-digit and two-digit operands
ADD_1D = [(a, b) for a in D for b in D]
SUB_1D = [(a, b) for a in D for b in range(a + 1)]
STORY_ADD_1D = [(a, b) for a in range(2, 10) for b in range(1, 10)]  # a >= 2 so "{a} apples" is plural
STORY_SUB_1D = [(a, b) for a in range(2, 10) for b in range(1, a + 1)]
ADD_2D1D = [(a, b) for a in DD for b in range(1, 10)]
ADD_3X1D = [(a, b, c) for a in range(1, 10) for b in range(1, 10) for c in range(1, 10)]
ADD_2D2D = [(a, b) for a in DD for b in DD]
SUB_2D2D = [(a, b) for a in DD for b in DD if b <= a]
MUL_1D = [(a, b) for a in range(1, 10) for b in range(1, 10)]
MUL_STORY = [(a, b) for a in range(2, 10) for b in range(2, 10)]
GAIN_LOSE_N = [(a, b, c) for a in range(2, 10) for b in range(1, 10) for c in range(1, 10) if c <= a + b]
LOSE_GAIN_N = [(a, b, c) for a in range(2, 10) for b in range(1, a + 1) for c in range(1, 10)]
GROUPS_PLUS_N = [(a, b, c) for a in range(2, 6) for b in range(2, 10) for c in range(2, 10)]
GROUPS_MINUS_N = [(a, b, c) for a in range(2, 6) for b in range(2, 10) for c in range(1, 10) if c <= a * b]

# A level is a few kinds of problem drawn with equal odds; a kind is one or
# more (templates, operand tuples, answer function) parts.
Part = tuple[tuple[str, ...], list[tuple[int, ...]], Callable[..., int]]
LEVELS: dict[int, dict[str, list[Part]]] = {
    1: {"add": [(ADD, ADD_1D, add)]},
    2: {"add": [(ADD, ADD_1D, add)], "sub": [(SUB, SUB_1D, sub)],
        "story": [(STORY_ADD, STORY_ADD_1D, add), (STORY_SUB, STORY_SUB_1D, sub)]},
    3: {"add-2d1d": [(ADD, ADD_2D1D, add)], "add-3x1d": [(ADD3, ADD_3X1D, lambda a, b, c: a + b + c)],
        "story": [(STORY_ADD, ADD_2D1D, add)]},
    4: {"add-2d2d": [(ADD[:4], ADD_2D2D, add)], "sub-2d2d": [(SUB[:4], SUB_2D2D, sub)],
        "mul": [(MUL, MUL_1D, mul), (STORY_MUL, MUL_STORY, mul)]},
    5: {"gain-lose": [(GAIN_LOSE, GAIN_LOSE_N, lambda a, b, c: a + b - c)],
        "lose-gain": [(LOSE_GAIN, LOSE_GAIN_N, lambda a, b, c: a - b + c)],
        "groups-plus": [(GROUPS_PLUS, GROUPS_PLUS_N, lambda a, b, c: a * b + c)],
        "groups-minus": [(GROUPS_MINUS, GROUPS_MINUS_N, lambda a, b, c: a * b - c)]},
}


def question_split(question: str) -> str:
    """'test' for about one question in five, decided by the text alone (stable across runs and machines)."""
    digest = hashlib.sha256(question.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % 5 == 0 else "train"


def _fill(parts: list[Part]) -> list[tuple[str, int]]:
    """Every (question, answer) of one kind. Names and objects cycle with the index, so each operand tuple gets one."""
    out = []
    for templates, operands, answer in parts:
        for template in templates:
            for i, nums in enumerate(operands):
                fields = dict(zip("abc", nums), name=NAMES[i % len(NAMES)], obj=OBJECTS[i % len(OBJECTS)])
                out.append((template.format(**fields), answer(*nums)))
    return out


@lru_cache(maxsize=None)
def _pools(level: int) -> dict[str, list[list[tuple[str, int]]]]:
    """The questions of one level by split, one list per kind, in a fixed order (built once, then cached)."""
    pools: dict[str, list[list[tuple[str, int]]]] = {"train": [], "test": []}
    for parts in LEVELS[level].values():
        for kinds in pools.values():
            kinds.append([])
        for question, answer in _fill(parts):
            pools[question_split(question)][-1].append((question, answer))
    return pools


def arith_problems(split: str, n: int, level: int = DEFAULT_LEVEL, seed: int = 0) -> list[Problem]:
    """n distinct arithmetic problems of one level; same arguments, same list."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if level not in LEVELS:
        raise ValueError(f"arith level must be one of {sorted(LEVELS)}, got {level!r}")
    pools = _pools(level)[split]
    total = sum(len(p) for p in pools)
    if not 0 <= n <= total:
        raise ValueError(f"arith level {level} has {total} {split} questions; asked for {n}")
    rng = random.Random(f"{seed}-{level}-{split}")
    # 1) pick a kind for each slot with equal odds, so a kind with 20k questions
    #    (two-digit sums) does not drown one with 200 (one-digit products)
    left = [len(p) for p in pools]
    kinds = []
    for _ in range(n):
        k = rng.choice([k for k, c in enumerate(left) if c > 0])
        left[k] -= 1
        kinds.append(k)
    # 2) draw that many distinct questions from each kind (rng.sample never repeats)
    picks = [iter(rng.sample(range(len(p)), len(p) - c)) for p, c in zip(pools, left)]
    offsets = [sum(len(p) for p in pools[:k]) for k in range(len(pools))]
    problems = []
    for k in kinds:
        i = next(picks[k])
        question, answer = pools[k][i]
        # the id is the question's place in the split, so it does not depend on seed or n
        problems.append(Problem(f"arith-L{level}-{split}-{offsets[k] + i:05d}", question, str(answer)))
    return problems


TASKS: dict[str, Callable[..., list[Problem]]] = {"arith": arith_problems}


def load_task(name: str, split: str, n: int, level: int, seed: int) -> list[Problem]:
    """Problems of a named task; the one entry point the trainer uses."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](split, n, level=level, seed=seed)


# ----------------------------------------------------------------------------- math verifier
# No regex below can match the same text in two ways (the usual cause of
# catastrophic backtracking), so a 100k-char completion takes milliseconds.
BOXED = re.compile(r"\\boxed\s*\{")
BRACE = re.compile(r"[{}]")
# a number not glued to the end of another one: 12, -3, 2.5, 1,000, 3/4
NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?")
FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
PLAIN = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")
MAX_DIGITS = 200  # longer "numbers" are compared as strings: Fraction on them is slow or raises


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} whose braces close; None if there is none."""
    starts = [m.end() - 1 for m in BOXED.finditer(text)]  # positions of the opening '{'
    if not starts:
        return None
    # one pass with a stack pairs every brace; scanning forward from each
    # \boxed instead would be quadratic on a text full of unclosed boxes
    stack, close = [], {}
    for m in BRACE.finditer(text, starts[0]):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            close[stack.pop()] = m.start()
    for s in reversed(starts):
        if s in close:
            return text[s + 1:close[s]].strip()
    return None


def extract_answer(text: str, strict: bool = False) -> str | None:
    """The final answer in a completion: last \\boxed{} content, else (lenient only) the last number."""
    boxed = _last_boxed(text)
    if boxed is not None or strict:
        return boxed
    last = None
    for last in NUMBER.finditer(text):
        pass
    return last.group() if last else None


def _normalise(s: str) -> str:
    """Drop what does not change the value: spaces, $, a trailing '.', a leading '+'."""
    s = s.replace("\u2212", "-").replace("\\$", "").replace("$", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = "".join(s.split()).rstrip(".")
    return s[1:] if s.startswith("+") else s


def _plain_value(s: str) -> Fraction | None:
    """Value of an unsigned integer or decimal, thousands commas allowed; None otherwise."""
    if len(s) > MAX_DIGITS or not PLAIN.fullmatch(s):
        return None
    return Fraction(s.replace(",", ""))  # exact: Fraction("3.50") == Fraction(7, 2)


def _value(s: str) -> Fraction | None:
    """Exact value of a normalised answer: 12, -3.5, 1,000, 3/4, -\\frac{1}{2}; None if not a plain number."""
    sign = -1 if s.startswith("-") else 1
    s = s[1:] if s[:1] in ("+", "-") else s
    frac = FRAC.fullmatch(s)
    if frac:
        num, den = _value(frac.group(1)), _value(frac.group(2))
    elif s.count("/") == 1:
        num, den = (_value(part) for part in s.split("/"))
    else:
        v = _plain_value(s)
        return None if v is None else sign * v
    if num is None or den is None or den == 0:
        return None
    return sign * num / den


def math_equal(pred: str | None, gold: str) -> bool:
    """True when pred and gold are the same number (or, if either is not a number, the same normalised string)."""
    if pred is None:
        return False
    p, g = _normalise(pred), _normalise(gold)
    if not p:
        return False
    pv, gv = _value(p), _value(g)
    if pv is not None and gv is not None:
        return pv == gv
    return p == g


def math_reward(text: str, gold: str, strict: bool = False) -> float:
    """1.0 if the completion's final answer equals gold, else 0.0."""
    return 1.0 if math_equal(extract_answer(text, strict), gold) else 0.0
