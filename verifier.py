r"""The verifiers: is a final text's answer the gold one? 1 (right) or 0 (wrong), without any
learned judge. reward.py turns these verdicts into every call's reward.

Math. Like Paper A (Zeng et al. 2026, arXiv 2605.24202) the *last* \boxed{...} is compared with the
gold answer by value: exactly (`Fraction`) for plain numbers ("3.50" == "\frac{7}{2}", "1{,}000" ==
"1000", ".5" == "0.5", "1.5e3" == "1500"); else with sympy ("\frac{\sqrt{2}}{2}" == "1/\sqrt{2}",
"2(x+1)" == "2x+2", "1,000,000" == "10^6"), which sees only short strings of numbers, single
letters, sqrt, pi and + - * / ^ with no power inside an exponent, evaluated at fixed points to 30
digits: a call takes milliseconds and cannot hang. A set of answers matches in any order
("\{1, 2\}" == "2, 1"); a tuple "(1, 2)" does not. Departure: with no complete \boxed{}, the last
number in the text is the answer (a tiny model often omits the box); `strict=True` turns it off.

Units. Both sides first lose $...$, \$, ^\circ, a percent sign and the units or words that trail a
value, as the MATH graders do (Hendrycks et al. 2021; Minerva's normalize_final_answer, Lewkowycz
et al. 2022): "12 \text{ cm}^2" == "12", "5 square units" == "\text{5 apples}" == "5". Unlike them
a unit goes only from the end and only after a value ("\text{no solution}" keeps its words), a
lone letter is a unit only in text mode ("5\text{ m}" == "5", but "2x" stays a product), nothing is
converted ("50 cents" != "0.5"), and as in MATH "50\%" == "50" but != "0.5".

Code. The last fenced python block runs in sandbox.py against every test; 1.0 only if all pass.

    pytest tests/test_reward.py tests/test_datasets.py tests/test_sandbox.py
"""
import re
import warnings
from fractions import Fraction

from sandbox import CODE_TIMEOUT, run_code
from tasks import Problem
from workflows import boxed_contents


# ----------------------------------------------------------------------------- math verifier
# No regex below can match the same text in two ways (the usual cause of catastrophic
# backtracking), so a 100k-char completion takes milliseconds.
# 12, -3, 2.5, 1,000, 3/4, not glued to the end of another number nor an exponent (12 cm^2's 2)
NUMBER = re.compile(r"(?<![\d.^])(?<!\^\{)-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
                    r"(?:\.\d+)?(?:/\d+)?")
FRAC = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
# unsigned: 12, 1,000, 2.5, .5 (no leading zero), 1.5e3 (scientific notation)
PLAIN = re.compile(r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?")
MAX_ELEMENTS = 10  # a longer list of answers is only compared as a string
MAX_DIGITS = 200  # longer "numbers" are compared as strings: Fraction on them is slow or raises
TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
DEGREES = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\circ|\\degree|°")
VAR_EQ = re.compile(r"[a-zA-Z]\w{0,2}\s*=([^=]*)")  # "x = 5" -> " 5"
# a trailing unit's power (cm^2, \text{ft}^{3}, m²), not the value's
POWER = r"(?:\s*\^\s*(?:\{\s*[23]\s*\}|[23])|[²³])?"
# words in text mode: "\text{ square units}", "\mbox{cm}^2", "\mathrm{km/h}"
TEXT_UNIT = re.compile(r"\\(?:text|textrm|textup|textnormal|textit|textbf|mbox|mathrm)"
                       r"\s*\{([a-zA-Z\s./]*)\}" + POWER + "$")
UNIT_LETTERS = set("mgshLCFK")  # one-letter units, and only in text mode: "2\text{ x}" stays 2x
SHORT_UNITS = "cm|mm|km|ft|in|yd|mi|kg|mg|gm|lb|lbs|oz|hr|hrs|min|sec|mph|sq|cu|deg|rad|ml"
# a bare word: any of 4+ letters after a space ("7 apples"), a listed one after a space or a
# digit ("12cm"); "2 xy" keeps its letters (sympy reads no word, so a 2-3 letter word that is no
# unit is left to string equality)
BARE_UNIT = re.compile(rf"(?:(?<=\s)(?:[a-zA-Z]{{4,}}|{SHORT_UNITS})|(?<=\d)(?:{SHORT_UNITS}))"
                       rf"\.?{POWER}$")
SYMPY_MAX_CHARS = 80  # longer answers are only compared as strings
# what the sympy step accepts after LaTeX is rewritten: numbers, sqrt, pi, single letters, operators
TOKEN = re.compile(r"\d+(?:\.\d+)?|sqrt|pi|[a-z](?![a-z])|\*\*|[-+*/()]")
LATEX = (("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", "pi"), ("\\sqrt", "sqrt"),
         ("{", "("), ("}", ")"), ("^", "**"))


def extract_answer(text: str, strict: bool = False) -> str | None:
    """The last closed \\boxed{} content, else (lenient only) the last number."""
    boxes = boxed_contents(text)
    if boxes:
        return boxes[-1].strip()
    numbers = [] if strict else NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(s: str) -> str:
    """The bare answer, less $, \\text{}, degrees, percent, "x =", units, spaces, a final '.'."""
    s = s.replace("\u2212", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("{,}", ",")  # LaTeX's thousands separator: 1{,}000
    for junk in ("\\$", "$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:"):
        s = s.replace(junk, "")
    s = re.sub(r"(?<!\\)\\ ", " ", s.replace("~", " "))  # LaTeX spaces "\ " and "~", not "\\"
    s = DEGREES.sub("", s)
    # MATH's convention: "50\%" is the number 50, so a bare 0.5 is not 50%
    s = s.replace("\\%", "").replace("%", "").strip().rstrip(".").strip()
    if len(s) <= SYMPY_MAX_CHARS:  # short answers only
        whole = TEXT.fullmatch(s)  # "\text{7 apples}"
        s = whole.group(1) if whole else s
        m = VAR_EQ.fullmatch(s)
        s = _drop_units(m.group(1) if m else s)
    s = "".join(TEXT.sub(r" \1 ", s).split())
    return s[1:] if s.startswith("+") else s


def _drop_units(s: str) -> str:
    """s less the units that trail a value ("4\\sqrt{2} square units"), if a value is left."""
    head = s.rstrip()
    while m := TEXT_UNIT.search(head) or BARE_UNIT.search(head):
        if m.re is TEXT_UNIT and not all(len(w) > 1 or w in UNIT_LETTERS
                                         for w in re.findall("[a-zA-Z]+", m[1])):
            break
        head = head[:m.start()].rstrip()
    value = "".join(head.split())
    if head == s.rstrip() or not value or _value(value) is None and _to_python(value) is None:
        return s
    return head


def _value(s: str) -> Fraction | None:
    """Exact value of a normalised answer (12, -3.5, 1,000, 3/4, -\\frac{1}{2}), or None."""
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
        if ((left == ")" or left[0].isalnum() and left != "sqrt")
                and (right == "(" or right[0].isalnum())):
            out.append("*")
        out.append(right)
    return "".join(out)


def _sympy_expr(s: str):
    """A sympy expression built without evaluation, or None (only TOKEN names reach eval)."""
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
    """The same value, to 1e-9, at 3 fixed points (1 without variables)."""
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
    """The same number, expression, set of answers or normalised string."""
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
    # 1,000 is one number
    ps, gs = ([s] if v is not None else _elements(s) for s, v in ((p, pv), (g, gv)))
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
    """The same answers in any order."""
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
    return 1.0 if math_equal(extract_answer(text, strict), gold) else 0.0


# ----------------------------------------------------------------------------- code reward
FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("", "python", "py", "python3")


def extract_code(text: str) -> str | None:
    """The last fenced code block tagged python (or untagged); None if there is none."""
    blocks = [body for tag, body in FENCE.findall(text)
              if tag.strip().split(" ")[0].lower() in PYTHON_TAGS]
    return blocks[-1] if blocks else None


def code_reward(text: str, problem: Problem, timeout: float = CODE_TIMEOUT) -> float:
    """1.0 if the text's last python block passes every test. A sandbox error (a broken problem,
    judge or machine) scores 0 too, and is said: else it would look like a policy that learns
    nothing."""
    code = extract_code(text)
    if code is None:
        return 0.0
    result = run_code(code, problem, timeout)
    if result.reason.startswith("sandbox error"):
        warnings.warn(f"code reward: {result.reason} (problem {problem.id}); its programs "
                      "score 0", RuntimeWarning)
    return float(result.passed)
