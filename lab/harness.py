"""What runs inside the code sandbox (sandbox.py), and the judge of assert-style tests outside it.

sandbox.run_code runs a read-only copy of this file alone, as `python -I -S harness.py <report
fd>`: it reads its job (code, the tests' inputs or the judge's pipes, nonce, limits, uid) from
stdin, applies the limits, drops to the uid, runs the tests, then writes "<nonce> <tests passed>"
to the report fd and exits 0; any failure exits 1 with no such line. Run outside the sandbox as
`python -I harness.py judge <requests fd> <replies fd>`, it is an assert-style problem's judge: it
runs the tests and asks the sandboxed program (run_assert) for each call of the candidate's
function, reading each reply as plain data only (encode, decode); its exit status is the verdict.
Standard library and Python 3.8 syntax only: the sandbox may run it on the system python3.

    pytest tests/test_sandbox.py
"""
import builtins
import json
import os
import resource
import sys
import traceback

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
    dict, bytes, complex, range or long int as {"<its type>": ...}; an iterator as {"iter": [...]}.
    Anything else is refused, a subclass of a builtin too (its __eq__ could always say yes)."""
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
        if t is range:
            return {"range": [encode(x.start), encode(x.stop), encode(x.step)]}
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
        if name == "range" and type(v) is list and len(v) == 3:
            parts = [decode(part, depth + 1) for part in v]
            if all(type(part) is int for part in parts):
                return range(*parts)
        if type(v) is list and (name in ("dict", "iter") or name in TAGGED):
            items = [decode(item, depth + 1) for item in v]
            if name == "iter":
                return iter(items)
            if name != "dict":
                return TAGGED[name](items)
            if all(type(pair) is list and len(pair) == 2 for pair in items):
                return dict(items)
    raise ValueError("not plain data")


def run_assert(job, report):
    """Serve an assert-style problem's judge: each request one call of the candidate's function,
    each reply its result as plain data. Returns the calls served."""
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
    """Test i in a forked child, its stdout the trainer's file for it; 0 if the program ended
    cleanly."""
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
CLONE_NEWNS, CLONE_NEWUSER = 0x20000, 0x10000000
KEPT_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
              "relatime": 1 << 21}


def private_scratch(size, uid, hidden):
    """In the run's own mount namespace: every mount read-only, a private tmpfs of `size` bytes
    over /tmp (the working directory), /var/tmp and /dev/shm, `hidden` covered where it can be."""
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
    # No fresh uid to drop to: the program would be root in these namespaces. In a user and mount
    # namespace nested in them the kernel locks every mount copied from the more privileged one
    # (mount_namespaces(7)): it can neither remount a read-only mount writable nor unmount the
    # private /tmp or /proc to reach what they cover. No uid is mapped in it (/proc is read-only
    # by now): its capabilities reach no file (user_namespaces(7)).
    if uid is None and libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "cannot lock the sandbox's mounts")


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
    """The candidate's function, to the judge's tests: each call a request to run_assert. `trouble`
    keeps the worst that went wrong (a test that catches the exception is not believed)."""

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
    """Outside the sandbox, never with the candidate's code: run the prompt and tests, a Candidate
    as the function. Exit status: 0 all passed, 1 a test failed, 2 a call got no plain reply (or
    none was made), 3 a call with data not plain; 4 (it raises) the judge itself failed."""
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
