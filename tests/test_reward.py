"""Tests for verifier.py, reward.py and tasks.py: the math verifier on a table of hand-written cases, and the
arith task generator; measure.py's figures of a step's calls, by hand."""
import random
import re
import time
from functools import lru_cache

import pytest
# imported here once, so the time bounds below time the verifier, not the import
import sympy  # noqa: F401

from measure import role_jobs, step_metrics
from reward import credit_calls, cut_finals
from tasks import LEVELS, NAMES, OBJECTS, SPLITS, Problem, arith_problems, load_task
from verifier import extract_answer, math_equal, math_reward
from workflows import Outcome

HUGE = "blah 7 " * 30_000 + "\\boxed{42}"  # about 210k chars, answer at the very end

# ----------------------------------------------------------------------------- verifier

# (completion text, gold, strict, expected reward)
REWARD_CASES = [
    ("\\boxed{12}", "12", False, 1.0),
    ("\\boxed{12}", "12", True, 1.0),
    ("So the total is \\boxed{12}.", "12", True, 1.0),
    ("The answer is 12.", "12", False, 1.0),  # lenient: last number
    ("The answer is 12.", "12", True, 0.0),  # strict: no box, no answer
    ("First \\boxed{7}, wait, no: \\boxed{12}", "12", True, 1.0),  # the last box wins
    ("First \\boxed{12}, wait, no: \\boxed{7}", "12", True, 0.0),
    ("\\boxed{12} is wrong, the answer is 13", "12", False, 1.0),  # a box beats any later number
    ("\\boxed{\\frac{3}{4}}", "0.75", True, 1.0),  # nested braces
    ("\\boxed{\\dfrac{3}{4}}", "3/4", True, 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", True, 1.0),
    ("\\boxed{\\frac{1}{2}}", "-1/2", True, 0.0),
    ("\\boxed{1,000}", "1000", True, 1.0),
    ("\\boxed{3.50}", "3.5", True, 1.0),
    ("\\boxed{-3}", "-3.0", True, 1.0),
    ("\\boxed{+4}", "4", True, 1.0),
    ("\\boxed{$5$}", "5", True, 1.0),
    ("\\boxed {  5 }", "5", True, 1.0),  # spaces around the brace and inside
    ("\\boxed{}", "0", False, 0.0),  # an empty box is an answer, and a wrong one
    ("\\boxed{12", "12", True, 0.0),  # unclosed: no box at all
    ("\\boxed{12", "12", False, 1.0),  # ... so the lenient fallback reads the number
    ("\\boxed{7} and then \\boxed{12", "7", True, 1.0),  # the last box that closes
    ("", "12", False, 0.0),
    ("", "12", True, 0.0),
    ("\\boxed{12}", "13", False, 0.0),
    ("12", "13", False, 0.0),
    ("He has 1,000 apples", "1000", False, 1.0),
    ("so 7-2 = 5", "5", False, 1.0),
    ("it drops to -3.", "-3", False, 1.0),
    ("half of it, 1/2", "0.5", False, 1.0),
    ("The area is 12 cm^2.", "12", False, 1.0),  # lenient: an exponent is not the answer
    ("The area is 12 cm^2.", "2", False, 0.0),
    ("The area is 12 \\text{ cm}^{2}.", "2", False, 0.0),
    ("💥\x00\ufffd{}}}{{\\boxed{\u200b}", "0", False, 0.0),  # unicode garbage
    ("\\boxed{\u22123}", "-3", True, 1.0),  # unicode minus sign
    ("no numbers here", "0", False, 0.0),
    (HUGE, "42", True, 1.0),
    (HUGE[:-11], "7", False, 1.0),
]


@pytest.mark.parametrize("text, gold, strict, expected", REWARD_CASES)
def test_math_reward(text, gold, strict, expected):
    assert math_reward(text, gold, strict=strict) == expected


# (pred, gold, expected)
EQUAL_CASES = [
    ("12", "12", True),
    ("1/2", "2/4", True),
    ("3/4", "0.75", True),
    ("\\frac{3}{4}", "3/4", True),
    ("\\tfrac{6}{8}", "0.75", True),
    ("3.0", "3", True),
    ("3.", "3", True),
    ("1,000", "1000", True),
    ("1,000,000.50", "1000000.5", True),
    (" 5 ", "5", True),
    ("\\$5", "5", True),
    ("-0", "0", True),
    ("1/0", "0", False),  # no value: compared as strings
    ("1,00", "100", False),  # not a thousands comma
    ("12", "-12", False),
    ("0.333", "1/3", False),  # exact values: no rounding
    ("x", "x", True),  # not a number: normalised string equality
    ("\\text{yes}", "\\text{no}", False),
    (None, "12", False),
    ("", "", False),  # an empty answer never scores
    ("9" * 5000, "9" * 5000, True),  # too long for Fraction: falls back to string equality
]


@pytest.mark.parametrize("pred, gold, expected", EQUAL_CASES)
def test_math_equal(pred, gold, expected):
    assert math_equal(pred, gold) is expected


# The stronger verifier: values, LaTeX wrappers, units, and symbolic equality
# (pred, gold, expected).
VALUE_CASES = [
    ("12,345", "12345", True),
    ("1\\,000", "1000", True),  # LaTeX thin space as a thousands separator
    ("\\$1,000", "1000", True),
    ("0.50", "\\frac{1}{2}", True),
    ("\\dfrac{3}{4}", "0.75", True),
    ("\\frac12", "0.5", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("\\sqrt2", "\\sqrt{2}", True),
    ("\\sqrt[3]{8}", "2", True),
    ("\\sqrt{2}", "1.41", False),  # no rounding
    ("-\\frac{\\sqrt{3}}{2}", "-0.8660254037844386", True),
    ("50\\%", "50", True),
    ("50%", "50", True),
    ("50\\%", "0.5", False),  # MATH's convention: the percent sign is dropped, 50% is the number 50
    ("50\\%", "\\frac{1}{2}", False),
    ("0.5\\%", "0.5", True),
    ("5%", "50", False),
    ("90^\\circ", "90", True),
    ("90^{\\circ}", "90", True),
    ("45°", "45", True),
    ("\\text{7 apples}", "7", True),
    ("7 apples", "7", True),
    ("12 \\text{ cm}", "12", True),
    ("7 apples", "8", False),
    # units and words after a value (MATH, DAPO), dropped on either side; each form with a
    # wrong-value twin
    ("12 \\text{ cm}", "1", False),  # a unit never splits the number
    ("12 \\text{ cm}", "2", False),
    ("12 cm", "12", True),
    ("12 cm", "2", False),
    ("12cm", "12", True),  # a listed unit glued to the digits
    ("12cm", "1", False),
    ("3 cm^2", "3", True),  # a unit takes its exponent along...
    ("3 cm^2", "9", False),
    ("3^2", "3", False),  # ... a number keeps its own: 3^2 is 9
    ("3\\text{ cm}^{2}", "3", True),
    ("3\\text{ cm}^{2}", "9", False),
    ("3 \\mathrm{~cm}^{2}", "3", True),
    ("3 \\mathrm{~cm}^{2}", "32", False),
    ("3\\,\\mathrm{cm}", "3", True),
    ("3\\,\\mathrm{cm}", "4", False),
    ("5 \\text{ apples}", "5", True),
    ("5 \\text{ apples}", "6", False),
    ("5 \\mbox{ apples}", "5", True),
    ("5 \\mbox{ apples}", "4", False),
    ("24 \\text{ square units}", "24", True),
    ("24 \\text{ square units}", "42", False),
    ("24 square units", "24", True),
    ("24 square units", "2", False),
    ("24 \\text{ units}^2", "24", True),
    ("24 \\text{ units}^2", "576", False),
    ("24 sq. ft", "24", True),
    ("24 sq. ft", "4", False),
    ("8 inches", "8", True),
    ("8 inches", "9", False),
    ("90 degrees", "90", True),
    ("90 \\text{ degrees}", "80", False),
    ("90\\degree", "90", True),
    ("90\\degree", "9", False),
    ("30^\\circ \\text{C}", "30", True),
    ("30^\\circ \\text{C}", "3", False),
    ("\\$18.90", "18.9", True),
    ("\\$18.90", "1890", False),
    ("5 dollars", "5", True),
    ("5 dollars", "6", False),
    ("1,000 \\text{ dollars}", "1000", True),
    ("1,000 \\text{ dollars}", "1", False),  # thousands commas survive the unit
    ("50 percent", "50", True),
    ("50 percent", "0.5", False),
    ("50 cents", "50", True),
    ("50 cents", "0.5", False),  # units are dropped, never converted
    ("4\\sqrt{2}\\text{ cm}", "\\sqrt{32}", True),  # a unit after an expression
    ("4\\sqrt{2}\\text{ cm}", "4", False),
    ("18\\pi \\text{ square units}", "18\\pi", True),
    ("18\\pi \\text{ square units}", "18", False),
    ("\\frac{1}{2} \\text{ inch}", "0.5", True),
    ("\\frac{1}{2} \\text{ inch}", "2", False),
    ("3 \\times 10^8 \\text{ m/s}", "300000000", True),
    ("3 \\times 10^8 \\text{ m/s}", "3", False),
    ("x = 5 \\text{ cm}", "5", True),
    ("x = 5 \\text{ cm}", "x", False),
    ("5\\text{ m}", "5", True),  # a one-letter unit only in text mode...
    ("5 m", "5", False),  # ... bare, it is a product like 2x
    ("2x", "2", False),  # a variable is no unit
    ("2\\text{ x}", "2", False),
    ("2x \\text{ cm}", "2x", True),
    ("2x \\text{ cm}", "2", False),
    ("2 xy", "2", False),  # a short word that is no listed unit stays
    ("\\text{no solution}", "\\text{no}", False),  # words that follow no value stay
    ("[2, 5)", "[2,5)", True),  # intervals and matrices are left alone
    ("[2, 5)", "(2, 5)", False),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\3\\end{pmatrix}", False),
    ("$x = 5$", "5", True),
    ("\\left( 3 \\right)", "3", True),
    ("2x+2", "2(x+1)", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("x^2", "x^3", False),
    ("\\frac{1}{2}x", "\\frac{x}{2}", True),
    ("3\\pi", "\\pi \\cdot 3", True),
    ("\\pi", "3.14", False),
    ("2^{10}", "1024", True),
    ("2^{0.5}", "\\sqrt{2}", True),
    ("\\sqrt{-4}", "2i", True),
    ("12 - 3", "9", True),
    ("x", "y", False),
    ("\\text{yes}", "\\text{no}", False),
    ("no", "on", False),  # words are not products of letters
    ("(1,2)", "(1, 2)", True),  # tuples: normalised string equality only
    ("(1,2)", "(2,1)", False),
    ("\\frac{1}{0}", "0", False),
    ("0/0", "0", False),
    # a power tower is never evaluated: only identical strings match
    ("9^{9^{9}}", "9^{9^9}", False),
    ("9^{9^{9}}", "9^{9^{9}}", True),
    ("10^{100}", "1" + "0" * 100, False),  # too long for the symbolic step
    # only numbers, letters and operators reach sympy
    ("__import__('os').system('true')", "0", False),
    ("\\frac{\\frac{\\frac{1}{2}}{2}}{2}", "0.125", True),
    ("\\frac{{{{1}}}}{8}", "0.125", True),
    ("\\frac{1}{", "1", False),
    ("\\sqrt[3]{", "1", False),
    ("{" * 5000 + "1" + "}" * 5000, "1", False),
    ("(" * 30 + "1" + ")" * 30, "1", True),
    ("x" * 100_000, "x", False),
    ("1" + "+1" * 39, "40", True),
    ("", "0", False),
    # formats of DAPO-style answers
    ("1{,}000", "1000", True),  # LaTeX thousands separator
    ("1{,}000{,}000", "10^6", True),
    ("1,000,000", "10^6", True),  # a gold with thousands commas against an equal power
    ("2,000", "2 \\times 10^3", True),  # ... or product
    ("1,000,000", "10^5", False),
    ("1.5e3", "1500", True),  # scientific notation
    ("1.5E3", "1500", True),
    ("2e-3", "0.002", True),
    ("1.5e3", "150", False),
    ("1.5 \\times 10^{3}", "1500", True),
    (".5", "0.5", True),  # no leading zero
    ("-.5", "-\\frac{1}{2}", True),
    (".5", "5", False),
    ("\\{1, 2\\}", "\\{2, 1\\}", True),  # a set of answers in another order
    ("1, 2", "2, 1", True),
    ("\\{1, 2\\}", "2, 1", True),
    ("\\frac{1}{2}, 3", "3, 0.5", True),
    ("\\{3\\}", "3", True),
    ("1, 2", "1, 3", False),
    ("1, 2, 2", "1, 2", False),  # as many elements
    ("345, 12", "12,345", False),  # a number with a thousands comma is not a list
    ("\\{12, 345\\}", "12,345", False),
    ("1, 2", "(1, 2)", False),  # a tuple is ordered and not a set
    ("2(x+y)", "2x+2y", True),  # two symbols
    ("x^2", "\\frac{37}{41}x", False),  # equal at x = 37/41, not at the other test point
    ("(x-37)(x-66)(x-95)+x", "x", False),  # equal at 37, 66 and 95, not between
    ("2^{\\sqrt{2}}", "2^{\\frac{2}{\\sqrt{2}}}", True),  # a root in the exponent
    ("1," * 3000, "1", False),
]


@pytest.mark.parametrize("pred, gold, expected", VALUE_CASES)
def test_math_equal_by_value(pred, gold, expected):
    start = time.perf_counter()
    assert math_equal(pred, gold) is expected
    assert math_equal(gold, pred) is expected  # symmetric
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text, gold, expected", [
    ("\\boxed{}", "0", 0.0),
    ("\\boxed{1} \\boxed{2} \\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{\\text{5 apples}}", "5", 1.0),
    ("\\boxed{\\boxed{7}}", "7", 1.0),
    ("\\boxed{" + "{" * 3000 + "7" + "}" * 3000 + "}", "7", 0.0),
    ("$\\boxed{25\\%}$", "25", 1.0),
    ("\\boxed{12 \\text{ cm}^2}", "12", 1.0),
    ("\\boxed{12 \\text{ cm}^2}", "2", 0.0),
    ("\\boxed{2x \\text{ units}}", "2", 0.0),
])
def test_math_reward_adversarial(text, gold, expected):
    start = time.perf_counter()
    assert math_reward(text, gold, strict=True) == expected
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text, strict, expected", [
    ("\\boxed{\\frac{1}{2}}", False, "\\frac{1}{2}"),
    ("a \\boxed{1} b \\boxed{ 2 } c", True, "2"),
    ("\\boxed{{1}}", True, "{1}"),
    ("\\boxed{}", True, ""),
    ("The answer is 12.", True, None),
    ("The answer is 12.", False, "12"),
    ("-7 and then 3.25", False, "3.25"),
    ("costs 1,250 dollars", False, "1,250"),
    ("an area of 12 cm^2", False, "12"),
    ("x^{2} = 9", False, "9"),
    ("step-3", False, "-3"),
    ("nothing", False, None),
    ("\\boxed{12", True, None),
])
def test_extract_answer(text, strict, expected):
    assert extract_answer(text, strict=strict) == expected


@pytest.mark.parametrize("text", [
    HUGE,
    "\\boxed{" * 30_000,  # many unclosed boxes: quadratic if each were scanned to the end
    "{" * 100_000 + "}" * 99_999,
    "1," * 100_000,
    "9" * 100_000,  # Python refuses int() on more than 4300 digits
    "1e999999999",  # Fraction would build a huge integer
    "-" * 100_000 + "1",
])
def test_adversarial_inputs_are_fast(text):
    start = time.perf_counter()
    for strict in (False, True):
        assert math_reward(text, "1", strict=strict) in (0.0, 1.0)
    assert time.perf_counter() - start < 1.0


def test_random_garbage_never_raises():
    rng = random.Random(0)
    alphabet = (list("0123456789.,/-+ ${}\\boxedfrac")
                + ["\\boxed{", "\\frac{", "\\dfrac", "\u2212", "é", "😀"])
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(30)))
        gold = "".join(rng.choice(alphabet) for _ in range(rng.randrange(6)))
        for strict in (False, True):
            assert math_reward(text, gold, strict=strict) in (0.0, 1.0)
        math_equal(text, gold)


# ----------------------------------------------------------------------------- arith task


def test_same_arguments_same_problems():
    assert (arith_problems("train", 50, level=3, seed=1)
            == arith_problems("train", 50, level=3, seed=1))


def test_seeds_change_the_problems():
    a, b = (arith_problems("train", 50, level=2, seed=0),
            arith_problems("train", 50, level=2, seed=1))
    assert [p.question for p in a] != [p.question for p in b]


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_splits_are_disjoint(level):
    train = {p.question for seed in (0, 1)
             for p in arith_problems("train", 300, level=level, seed=seed)}
    test = {p.question for seed in (0, 1)
            for p in arith_problems("test", 100, level=level, seed=seed)}
    assert train and test and not train & test
    # and not just these samples: every question the level holds
    every = {split: _every_question(level, split).keys() for split in SPLITS}
    assert (not every["train"] & every["test"]
            and not every["val"] & (every["train"] | every["test"]))


SUBTRACTION = re.compile(r" - | minus |Subtract|less than|away|gives|takes|lost")


def level2_fact(question: str) -> tuple:
    """The arithmetic fact a level-2 question asks for, read from its words: (op, operands),
    operands unordered for an addition."""
    a, b = map(int, re.findall(r"\d+", question))
    if SUBTRACTION.search(question):
        # b before a
        named_last = question.startswith(("Subtract", "Take")) or "less than" in question
        return ("-", (b, a) if named_last else (a, b))
    return ("+", tuple(sorted((a, b))))


def test_no_test_fact_is_trained_on():
    """"What is 3 + 5?" held out means "Add 5 and 3." and "Sam has 3 apples and gets 5 more" are
    too: the splits are disjoint by fact, not only by wording."""
    facts = {split: {level2_fact(q) for q in _every_question(2, split)} for split in SPLITS}
    assert (not facts["test"] & facts["train"]
            and not facts["val"] & (facts["train"] | facts["test"]))
    # a quarter and an eighth of 110 facts
    assert len(facts["test"]) >= 25 and len(facts["val"]) >= 12
    # a held-out sample covers as many facts as it can
    assert (len({level2_fact(p.question) for p in arith_problems("test", 96, level=2)})
            == len(facts["test"]))


def signed_terms(op: str, nums: tuple[int, ...]) -> tuple:
    """The computation a formula asks for, as a multiset of signed terms, a product's factors
    unordered: written here from the formula's text, not from tasks.fact."""
    values = dict(zip("abc", nums))
    terms = re.findall(r"([+-]?)([a-c](?:\*[a-c])?)", op)
    return tuple(sorted((sign or "+", tuple(sorted(values[v] for v in term.split("*"))))
                        for sign, term in terms))


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_one_computation_lands_in_one_split(level):
    """Level 5: a+b-c of (6, 7, 8) and a-b+c of (6, 8, 7) are one computation, 6 + 7 - 8; its
    every form and wording lands in one split."""
    split_of = {q: split for split in SPLITS for q in _every_question(level, split)}
    where = {}
    for templates, operands, op in (part for parts in LEVELS[level].values() for part in parts):
        for i, nums in enumerate(operands):
            names = dict(name=NAMES[i % len(NAMES)], obj=OBJECTS[i % len(OBJECTS)])
            question = templates[0].format(**dict(zip("abc", nums)), **names)
            where.setdefault(signed_terms(op, nums), set()).add(split_of[question])
    assert all(len(splits) == 1 for splits in where.values())
    if level == 5:  # the two forms meet: 6 + 7 - 8 is asked both ways
        assert signed_terms("a+b-c", (6, 7, 8)) == signed_terms("a-b+c", (6, 8, 7))


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_ids_and_questions_are_unique(level):
    problems = arith_problems("train", 300, level=level)
    assert len({p.id for p in problems}) == len({p.question for p in problems}) == 300
    assert all(p.id.startswith(f"arith-L{level}-train-") and p.kind == "math" for p in problems)


def test_ids_do_not_depend_on_seed():
    ids = {p.question: p.id for p in arith_problems("test", 100, level=2, seed=0)}
    shared = [p for p in arith_problems("test", 100, level=2, seed=5) if p.question in ids]
    assert shared and all(ids[p.question] == p.id for p in shared)


def _size(level: int, split: str) -> int:
    """How many questions a level holds, read from the error that asking for too many raises."""
    with pytest.raises(ValueError, match=r"has \d+") as err:
        arith_problems(split, 10**6, level=level)
    return int(re.search(r"has (\d+)", str(err.value)).group(1))


@lru_cache(maxsize=None)
def _every_question(level: int, split: str) -> dict[str, str]:
    everything = arith_problems(split, _size(level, split), level=level)
    questions = {p.question: p.answer for p in everything}
    assert len(questions) == len(everything)
    return questions


def test_level_size_is_enforced():
    size = _size(1, "test")
    assert 100 < size < 800
    assert len({p.question for p in arith_problems("test", size, level=1)}) == size


# plain-expression questions, e.g. "What is 37 - 16?", "Compute 4 * 6.", "8 + 9 = ?"
EXPRESSION = re.compile(
    r"(?:What is|Compute|Calculate) (\d+(?: [-+*×] \d+)+)[?.]|(\d+ \+ \d+) = \?")


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_answers_of_plain_expressions(level):
    checked = 0
    for split in ("train", "test"):
        for p in arith_problems(split, 100, level=level):
            m = EXPRESSION.fullmatch(p.question)
            if m:
                assert str(eval((m.group(1) or m.group(2)).replace("×", "*"))) == p.answer, p
                checked += 1
            assert int(p.answer) >= 0
    assert checked > 0 or level == 5  # level 5 is all word problems


def worded_answer(question: str) -> int:
    """The answer of an arithmetic question read from its words alone, not from the tables that
    made it: a plain question by its operation's word, a story number by number, each changing
    the count by what the words before it do (gives, takes, lost: fewer; bags with, packs of,
    boxes with, each box holds: that many times over; otherwise more)."""
    nums = [int(n) for n in re.findall(r"\d+", question)]
    if m := EXPRESSION.fullmatch(question):
        return eval((m.group(1) or m.group(2)).replace("×", "*"))
    if "How many" not in question:
        if question.startswith(("Subtract", "Take")) or " less than " in question:
            return nums[1] - nums[0]
        if " minus " in question:
            return nums[0] - nums[1]
        if re.search(r"times|Multiply|product", question):
            return nums[0] * nums[1]
        return sum(nums)  # plus, the sum of, Add
    marks = list(re.finditer(r"\d+", question))
    count = nums[0]
    for before, n in zip(marks, marks[1:]):
        words = question[before.end():n.start()]
        if re.search(r"\b(gives|takes|lost)\b", words):
            count -= int(n.group())
        elif re.search(r"(bags with|packs of|boxes with|each box holds) $", words):
            count *= int(n.group())
        else:
            count += int(n.group())
    return count


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_every_answer_is_what_its_words_ask(level):
    """Every question of every split, plain or a story, against the answer its words give."""
    for split in SPLITS:
        for question, answer in _every_question(level, split).items():
            assert str(worded_answer(question)) == answer, question


@pytest.mark.parametrize("level, question, answer", [
    (2, "There are 6 marbles in a box. Sam takes 3 out. How many marbles are left in the box?",
     "3"),
    (2, "Subtract 5 from 9.", "4"),
    (3, "Ben had 72 books. Then Ben found 1 more. How many books does Ben have now?", "73"),
    (4, "What is the product of 7 and 8?", "56"),
    (5, "Mia has 5 shells. Mia buys 9 more and then gives 3 to a friend. "
        "How many shells does Mia have now?", "11"),
    (5, "There are 9 marbles in a box. Ivy takes out 5 and then puts in 9. "
        "How many marbles are in the box now?", "13"),
    (5, "Leo has 3 bags with 7 pencils in each bag and 4 more pencils on the table. "
        "How many pencils does Leo have in total?", "25"),
])
def test_known_word_problems(level, question, answer):
    everything = {q: a for split in SPLITS for q, a in _every_question(level, split).items()}
    assert everything[question] == answer


def test_bad_arguments():
    with pytest.raises(ValueError, match="arith"):
        load_task("nope", "train", 5, 1, 0)
    with pytest.raises(ValueError):
        arith_problems("validation", 5)
    with pytest.raises(ValueError):
        arith_problems("train", 5, level=9)


def test_load_task_matches_generator():
    assert load_task("arith", "test", 20, 4, 3) == arith_problems("test", 20, level=4, seed=3)


# -------------------------------------------------------------- each call's reward, each role's job

def _call(episode, role, slot, turn, text, truncated=False):
    from rollout import Call
    return Call(episode, role, slot, turn, [1], [1], "", text, truncated=truncated)


def _voting_episodes():
    """Two voting episodes on "2 + 3": candidates 5, 6, 5 then 6, 6, 5; the aggregator picks
    candidate 2 (wrong) in the first and candidate 3 (right) in the second."""
    problems = [Problem("p", "What is 2 + 3?", "5")] * 2
    calls = [_call(0, "generator", f"generator{i}", 0, f"\\boxed{{{a}}}")
             for i, a in enumerate((5, 6, 5))]
    calls += [_call(1, "generator", f"generator{i}", 0, f"\\boxed{{{a}}}")
              for i, a in enumerate((6, 6, 5))]
    calls += [_call(0, "aggregator", "aggregator", 1, "\\boxed{2}"),
              _call(1, "aggregator", "aggregator", 1, "\\boxed{3}")]
    return problems, calls


def test_refines_and_the_synthesizer_s_skill_by_hand():
    """Eval-Opt, three episodes on "2 + 3", every first answer judged Incorrect and refined:
    4 -> 5 fixed, 5 -> 5 kept, 4 -> 6 still wrong: fixed 1/3, broken 0. Orch-Workers: workers
    answer 5 and 4, the synthesizer 5: its skill 1 - (1 + 0) / 2 = 0.5."""
    problems = [Problem("p", "What is 2 + 3?", "5")] * 3
    calls = [_call(e, "generator", "generator", 0, f"\\boxed{{{a}}}")
             for e, a in enumerate((4, 5, 4))]
    calls += [_call(e, "evaluator", "evaluator", 1, "\\boxed{Incorrect}") for e in range(3)]
    calls += [_call(e, "generator", "generator", 2, f"\\boxed{{{a}}}")
              for e, a in enumerate((5, 5, 6))]
    credit_calls(calls, problems, [1.0, 1.0, 0.0], "final", "keep")
    jobs = role_jobs(calls)
    assert (jobs["refine/fixed"], jobs["refine/broken"]) == pytest.approx((1 / 3, 0.0))
    calls = [_call(0, "orchestrator", "orchestrator", 0, "1. add\n2. count\n3. check"),
             _call(0, "worker", "worker0", 1, "\\boxed{5}"),
             _call(0, "worker", "worker1", 1, "\\boxed{4}"),
             _call(0, "synthesizer", "synthesizer", 2, "\\boxed{5}")]
    credit_calls(calls, problems[:1], [1.0], "final", "keep")
    assert role_jobs(calls)["role/synthesizer/skill"] == pytest.approx(0.5)


def test_credit_broadcasts_the_outcome_or_pays_each_call_its_own():
    problems, calls = _voting_episodes()
    credit_calls(calls, problems, [0.0, 1.0], "final", "keep")
    assert [c.reward for c in calls] == [0.0] * 3 + [1.0] * 3 + [0.0, 1.0]
    assert [c.own_score for c in calls] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, None, None]
    credit_calls(calls, problems, [0.0, 1.0], "own", "keep")
    # the aggregator keeps the outcome
    assert [c.reward for c in calls] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0]


def test_a_truncated_call_earns_nothing_under_penalize_only():
    problems, calls = _voting_episodes()
    calls[5].truncated = calls[7].truncated = True
    credit_calls(calls, problems, [0.0, 1.0], "final", "penalize")
    assert [c.reward for c in calls] == [0.0] * 3 + [1.0, 1.0, 0.0, 0.0, 0.0]
    assert calls[5].own_score == 0.0  # a cut answer is no answer, though its number is right
    for kept in ("keep", "mask"):  # mask acts in the update, on the advantage
        credit_calls(calls, problems, [0.0, 1.0], "final", kept)
        assert [c.reward for c in calls] == [0.0] * 3 + [1.0] * 3 + [0.0, 1.0]
        assert calls[5].own_score == (1.0 if kept == "keep" else 0.0)


def test_an_episode_whose_final_answer_was_cut_is_found():
    problems, calls = _voting_episodes()
    calls[5].truncated = True  # episode 1's third candidate, the one its aggregator picked
    assert cut_finals(calls, ["\\boxed{6}", "\\boxed{5}"]) == [False, True]
    calls[5].truncated, calls[3].truncated = False, True  # a cut candidate that was not picked
    assert cut_finals(calls, ["\\boxed{6}", "\\boxed{5}"]) == [False, False]


def test_step_metrics_by_hand():
    """The two Voting episodes above with completions of 3 5 2 | 4 4 4 generator tokens
    (generator1's first cut by the limit) and 2 | 6 aggregator tokens, 30 in all; the second
    aggregator writes prose, and its answer was decided by a fallback rule."""
    problems, calls = _voting_episodes()
    for c, n in zip(calls, [3, 5, 2, 4, 4, 4, 2, 6]):
        c.completion_ids = [1] * n
    calls[1].truncated = True
    calls[7].text = "candidate 3"
    credit_calls(calls, problems, [0.0, 1.0], "final", "keep")
    outcomes = [Outcome("\\boxed{6}", {"fallback": False, "rule": "boxed"}),
                Outcome("\\boxed{5}", {"fallback": True, "rule": "first_digit"})]
    m = step_metrics(calls, [0.0, 1.0], outcomes, 3)
    assert (m["reward/mean"], m["contract/fallback_rate"], m["contract/truncated"]) == \
        pytest.approx((0.5, 0.5, 1 / 8))
    assert (m["role/generator/calls"], m["role/aggregator/calls"], m["slot/generator0/calls"]) \
        == (6, 2, 2)
    # tokens a call, and the share of the step's 30 tokens
    assert m["role/generator/len"] == pytest.approx(22 / 6)
    assert m["role/aggregator/len"] == pytest.approx(4.0)
    assert m["slot/generator0/len"] == pytest.approx((3 + 4) / 2)
    assert m["role/generator/token_share"] == pytest.approx(22 / 30)
    assert m["slot/generator1/token_share"] == pytest.approx(9 / 30)
    # the episode's outcome broadcast; the generators' own answers 5 6 5 | 6 6 5 against 5
    assert m["role/generator/reward"] == pytest.approx(0.5)
    assert m["role/generator/solved"] == pytest.approx(3 / 6)
    assert (m["slot/generator1/solved"], m["slot/generator2/solved"]) == (0.0, 1.0)
    assert m["contract/rule/boxed"] == m["contract/rule/first_digit"] == 0.5
    # one of the aggregator's two replies keeps its contract; generators have none
    assert m["role/aggregator/adherence"] == 0.5 and "role/generator/adherence" not in m


def test_role_jobs_by_hand():
    problems, calls = _voting_episodes()
    credit_calls(calls, problems, [0.0, 1.0], "final", "keep")
    # episode 0: picked 0 against a mean of 2/3; episode 1: picked 1 against 1/3
    assert role_jobs(calls) == pytest.approx(
        {"role/aggregator/skill": ((0 - 2 / 3) + (1 - 1 / 3)) / 2})
    # Eval-Opt: three episodes on "2 + 3", answers 5 (right), 4 and 6 (wrong); verdicts Correct,
    # Correct, Incorrect; the third is refined to 5
    problems = [Problem("p", "What is 2 + 3?", "5")] * 3
    calls = [_call(e, "generator", "generator", 0, f"\\boxed{{{a}}}")
             for e, a in enumerate((5, 4, 6))]
    calls += [_call(e, "evaluator", "evaluator", 1, f"\\boxed{{{v}}}")
              for e, v in enumerate(("Correct", "Correct", "Incorrect"))]
    calls += [_call(2, "generator", "generator", 2, "\\boxed{5}")]
    credit_calls(calls, problems, [1.0, 0.0, 1.0], "final", "keep")
    assert role_jobs(calls) == pytest.approx({
        "role/evaluator/verdict_acc": 2 / 3,   # right on 5 and on 6, wrong on 4
        "role/evaluator/verdict_base": 2 / 3,  # always Incorrect is right on 4 and 6: no better
        "refine/fixed": 1.0, "refine/broken": 0.0})
