"""A run's files on disk: its directory and its lock, config.json, the metrics and samples logs
and their TensorBoard copy, and a finished run read back for the reports (`load_run`). The rules
in full: docs/runs.md.

    python train.py --out runs/a              # config.json, metrics.jsonl, samples.jsonl, tb/,
                                                ckpt/, best/
    python train.py --out runs/a --overwrite  # start it over (its own files go, nothing else)

A run is never overwritten implicitly. A kill at any moment leaves whole files: logs are appended
a line at a time (a torn last line is dropped when read back), config.json is written through a
rename. A write that fails (a full disk) stops the run in one line naming the file, leaving the
file as it was. A run holds its directory with an OS lock; under torchrun only rank 0 writes.

Exercised by: pytest tests/test_train.py, tests/test_refusals.py, tests/test_distributed.py
"""
import fcntl
import json
import os
import shutil
import threading
import time

from lab.machine import gather_lists, rank_and_world


# ----------------------------------------------------------------------------
# Files: config, logs (all written whole)


def fsync(*paths: str) -> None:
    """Flush files or directories (their renames) to the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def cannot_write(path: str, e: OSError) -> SystemExit:
    return SystemExit(f"{path} cannot be written ({e.strerror or e}); the run stops here, the "
                      "files it wrote before kept whole")


def write_bytes(path: str, flags: int, data: bytes) -> None:
    """`data` written to `path` and on the disk when it returns; a symbolic link there is refused.
    A failed write leaves the file at its size (a log keeps no half row) and raises its OSError,
    which os.write names (torch.save and safetensors' would not)."""
    try:
        fd = os.open(path, os.O_WRONLY | flags | os.O_NOFOLLOW, 0o644)
    except OSError:
        if os.path.islink(path):
            raise SystemExit(f"{path} is a symbolic link; a run writes only its own files: "
                             "remove it") from None
        raise
    size = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError:
        os.ftruncate(fd, size)
        raise
    finally:
        os.close(fd)


def write_whole(path: str, text: str) -> None:
    """Write a file through a rename: a kill or a full disk leaves the old or the new."""
    tmp = path + ".tmp"
    try:
        if os.path.lexists(tmp):  # left by a kill, or planted
            os.remove(tmp)
        write_bytes(tmp, os.O_CREAT | os.O_EXCL, text.encode())
        os.replace(tmp, path)
    except OSError as e:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise cannot_write(path, e) from None


def write_files(directory: str, files: dict[str, bytes]) -> None:
    """A new directory of `files` (path -> bytes) on the disk; removed if a write fails."""
    path = directory
    try:
        for name, data in files.items():
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_bytes(path, os.O_CREAT | os.O_EXCL, data)
        fsync(*(root for root, _, _ in os.walk(directory)))
    except OSError as e:
        shutil.rmtree(directory, ignore_errors=True)
        raise cannot_write(path, e) from None


def append_jsonl(path: str, rows: list[dict]) -> None:
    """Rows at the end of a log, on the disk before the step's checkpoint names the step."""
    try:
        write_bytes(path, os.O_CREAT | os.O_APPEND,
                    "".join(json.dumps(row) + "\n" for row in rows).encode())
    except OSError as e:
        raise cannot_write(path, e) from None


def read_jsonl(path: str) -> list[dict]:
    """The rows of a log; a torn last line (a kill while it was written) is dropped."""
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: not a complete run directory")
    try:
        with open(path) as f:
            lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    except OSError as e:  # a directory in its place, a file not readable
        raise SystemExit(f"{path} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:  # a log is JSON, text
        raise SystemExit(f"{path} is not text; the log is damaged") from None
    rows = []
    for k, (i, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if k < len(lines) - 1:
                raise SystemExit(f"{path}, line {i}: not JSON; the log is damaged") from None
            continue
        row = rows[-1]
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            raise SystemExit(f"{path}, line {i}: not a row of this log "
                             "(an object with an integer step)")
    return rows


RUN_ID = "run_id"  # config.json's one entry that is no setting; checkpoints record it too
# What the reports (diagnose.py, lab/tables.py) read of a run's config, and each one's type
READ = {"workflow": str, "sharing": str, "algo": str, "n_agents": int, "steps": int,
        "eval_problems": int, "val_problems": int}


def read_config_json(path: str) -> dict:
    """The object of settings in a run's config.json, or one line naming the file."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not JSON"
        raise SystemExit(f"{path} cannot be read ({why})") from None
    if not isinstance(config, dict):
        raise SystemExit(f"{path} is not a config of this project (an object of settings)")
    return config


def config_run_id(out: str) -> str:
    """The run id in out/config.json, "" where the run was made before runs had one."""
    return read_config_json(os.path.join(out, "config.json")).get(RUN_ID, "")


def load_run(run_dir: str, workflows: dict) -> tuple[dict, list[dict]]:
    """A run's config and its metrics rows, checked: a lost setting of READ would take a default
    (a Voting run read as Eval-Opt)."""
    if not run_dir:
        raise SystemExit("a run directory's name is empty: name the run")
    for name in ("metrics.jsonl", "config.json"):
        if not os.path.exists(os.path.join(run_dir, name)):
            raise SystemExit(f"{run_dir}: no {name} (not a train.py run directory)")
    config = read_config_json(os.path.join(run_dir, "config.json"))
    if missing := [name for name in READ if name not in config]:
        raise SystemExit(f"{run_dir}/config.json lacks {', '.join(missing)} "
                         "(a run's config holds every setting of train.py)")
    for name, kind in READ.items():
        if type(config[name]) is not kind:
            raise SystemExit(f"{run_dir}/config.json: {name} is {json.dumps(config[name])}, not "
                             f"{'a string' if kind is str else 'a whole number'}")
    if config["workflow"] not in workflows:
        raise SystemExit(f"{run_dir}/config.json: workflow {config['workflow']!r} is not one of "
                         f"{', '.join(workflows)}")
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    if not rows:
        raise SystemExit(f"{run_dir}: metrics.jsonl is empty (the run has not logged a step yet)")
    for row in rows:
        for key, value in row.items():
            if type(value) not in (int, float):
                raise SystemExit(f"{run_dir}/metrics.jsonl, step {row['step']}: {key} is "
                                 f"{json.dumps(value)}, not a number")
    steps = [row["step"] for row in rows]
    if steps[0] != 0:
        raise SystemExit(f"{run_dir}/metrics.jsonl begins at step {steps[0]}, not at step 0 (the "
                         "evaluation before training): a damaged log")
    if back := next(((a, b) for a, b in zip(steps, steps[1:]) if b <= a), None):
        raise SystemExit(f"{run_dir}/metrics.jsonl: step {back[1]} follows step {back[0]} "
                         "(a damaged log)")
    return config, rows


tb_writers: dict[str, object] = {}  # run directory -> this process's TensorBoard writer


def tensorboard_row(out: str, row: dict, samples: list[dict] | None = None) -> None:
    """A metrics row's numbers as TensorBoard scalars in <out>/tb, and the step's episodes as text.
    purge_step: after --resume, TensorBoard drops what was written past the checkpoint."""
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
    try:
        if out not in tb_writers:
            threading.excepthook = quiet_tensorboard_thread
            tb_writers[out] = SummaryWriter(os.path.join(out, "tb"), purge_step=row["step"])
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                tb_writers[out].add_scalar(key, value, row["step"])
        for k, episode in enumerate(samples or []):
            tb_writers[out].add_text(f"episodes/{k}", transcript(episode), row["step"])
        tb_writers[out].flush()
    except OSError as e:  # the writer is broken: the next run in this process makes its own
        tb_writers.pop(out, None)
        raise cannot_write(os.path.join(out, "tb"), e) from None


def quiet_tensorboard_thread(args) -> None:
    """threading.excepthook: an OSError in TensorBoard's thread (a full disk) is raised again at
    the next flush, where tensorboard_row says it in one line; its traceback is left out."""
    if not (isinstance(args.exc_value, OSError)
            and type(args.thread).__module__.startswith("tensorboard.")):
        threading.__excepthook__(args)


def transcript(episode: dict, limit: int = 600) -> str:
    """A samples.jsonl episode as Markdown for TensorBoard's TEXT tab; texts are indented code
    blocks (a model's ``` or * shows as written), each cut to `limit` characters."""
    lines = [f"**{episode['problem']}**, episode {episode['episode']}: "
             f"reward **{episode['reward']:g}**",
             code_block(episode["question"], limit), "expected:",
             code_block(episode["answer"], limit)]
    for i, c in enumerate(episode["calls"], 1):
        lines += [f"**{i}. {c['slot']}** ({c['role']}, stage {c['stage']}): "
                  f"reward {c['reward']:g}, "
                  f"advantage **{c['advantage']:+.3f}**", code_block(c["output"], limit)]
    return "\n\n".join(lines + ["**final answer:**", code_block(episode["final"], limit)])


def code_block(text: str, limit: int) -> str:
    more = f" [... {len(text) - limit} more characters]" if len(text) > limit else ""
    cut = text[:limit] + more
    return "\n".join("    " + line for line in cut.splitlines() or [""])


def close_tensorboard() -> None:
    while tb_writers:
        tb_writers.popitem()[1].close()


def episode_samples(step: int, calls: list, outcomes, problems, rewards: list[float],
                    group_size: int, count: int) -> list[dict]:
    """samples.jsonl's episodes, the first of each of the first `count` groups, whole."""
    return [{"step": step, "episode": e, "problem": problems[e].id,
             "question": problems[e].question, "answer": problems[e].answer,
             "final": outcomes[e].final, "reward": rewards[e], "info": outcomes[e].info,
             "calls": [{"role": c.role, "slot": c.slot, "stage": c.stage, "prompt": c.prompt,
                        "output": c.text, "reward": c.reward, "advantage": c.advantage}
                       for c in calls if c.episode == e]}
            for e in list(range(0, len(problems), group_size))[:count]]


# ----------------------------------------------------------------------------
# The run directory

RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl", "tb", "ckpt", "ckpt.tmp", "ckpt.old",
             "best", "best.tmp", "best.old")
# What diagnose.py writes beside a run's files: its report, probe and plots (diagnose.PLOTS, by
# name: another picture in the directory stays), gone with the run.
DERIVED = ("report.md", "probe.json", *(f"{name}.png" for name in (
    "accuracy", "reward", "grad_norm", "update_norm", "kappa", "coherence", "grad_share", "ppl",
    "chi2", "entropy", "adherence", "similarity", "length")))
LOCK = ".lock"  # in --out, kept by --overwrite: it is not one of the run's files
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where train.py is
SOURCES = ("lab", "tests", "docs", ".git", ".venv", ".ci")  # the project's own folders
held_locks: list[int] = []  # the lock file this process holds (one run at a time)


def lock_run(out: str) -> None:
    """Hold --out for the run's life with flock on out/.lock, which the kernel drops however the
    process ends (kill -9 leaves no stale lock); under torchrun rank 0 holds it."""
    error = ""
    if rank_and_world()[0] == 0:
        unlock_run()  # this process's earlier run (an earlier train.main) is over
        error = take_lock(out)
    error = max(gather_lists([error]))
    if error:
        raise SystemExit(error)


def take_lock(out: str) -> str:
    """Make --out and flock its .lock; returns why it cannot ("" when held)."""
    if not out:
        return "--out is empty: name the run's directory"
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out} is a file, not a directory"
    parent = os.path.abspath(out)
    while not os.path.exists(parent):  # the nearest existing ancestor is where the run will be made
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        where = ("write in it" if parent == os.path.abspath(out)
                 else f"create a directory in {parent}")
        return f"--out {out}: cannot {where}"
    if os.path.realpath(out) == os.path.realpath(PROJECT):  # every later runs/NAME inside it
        return f"--out {out} is the project's own directory; choose one for the run (runs/NAME)"
    inside = os.path.relpath(os.path.realpath(out), os.path.realpath(PROJECT)).split(os.sep)[0]
    if inside in SOURCES:  # an --overwrite there would delete the project's own files
        return f"--out {out} is inside the project's {inside}/; choose one for the run (runs/NAME)"
    if home := enclosing_run(out):  # that run's next save or --overwrite would delete this one
        return f"--out {out} is inside the run in {home}; choose a directory outside it"
    if inner := run_below(out):  # that run could no longer be resumed inside this one
        return (f"--out {out} holds the run in {inner} below it; "
                "choose a directory with no run in it")
    # a run kept or copied read-only
    own = [os.path.join(out, name) for name in (LOCK,) + RUN_FILES]
    own += [os.path.join(root, n) for path in own for root, dirs, files in os.walk(path)
            for n in dirs + files]
    if read_only := [p for p in own if os.path.exists(p) and not os.access(p, os.W_OK)]:
        return (f"--out {out}: {read_only[0]} is read-only; make the run writable (chmod -R u+w) "
                "or copy it")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:  # a name too long, a read-only file system
        return f"--out {out} cannot be made ({e.strerror})"
    lock = os.path.join(out, LOCK)
    if os.path.islink(lock) or os.path.isdir(lock):
        kind = "symbolic link" if os.path.islink(lock) else "directory"
        return f"--out {out}: its {LOCK} is a {kind}, not a lock file; remove it"
    # not inherited by the programs the run starts (PEP 446): the lock ends with this process
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        time.sleep(0.1)  # the holder writes its pid just after it takes the lock
        holder = os.read(fd, 32).decode().strip() or "unknown"
        os.close(fd)
        return f"--out {out} is in use by another run (pid {holder}); wait for it to end or stop it"
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as e:  # a full disk
        os.close(fd)
        return f"--out {out}: its {LOCK} cannot be written ({e.strerror})"
    held_locks.append(fd)
    return ""


def holds_run(path: str) -> bool:
    """Whether `path` is a run directory: a config.json with READ's settings beside a lock, a log
    or a checkpoint (pytest, among others, keeps a .lock in its directories)."""
    try:
        names = set(os.listdir(path))
        config = read_config_json(os.path.join(path, "config.json"))
    except (OSError, SystemExit):  # no directory, no config of a run
        return False
    return set(READ) <= set(config) and bool(names & {LOCK, "metrics.jsonl", "ckpt", "best"})


def enclosing_run(out: str) -> str:
    """The run directory that holds `out` below it, or ""."""
    path = os.path.realpath(out)
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        if holds_run(path):
            return path
    return ""


def run_below(out: str, depth: int = 4) -> str:
    """A run directory at most `depth` levels below `out` (a demo grid's cells are four), or ""."""
    top = os.path.abspath(out).rstrip(os.sep).count(os.sep)
    for root, dirs, _ in os.walk(out):
        if root != out and holds_run(root):
            return root
        if os.path.abspath(root).rstrip(os.sep).count(os.sep) - top >= depth:
            dirs.clear()
    return ""


def unlock_run() -> None:
    """Let the run directory go (closing the file drops its lock)."""
    while held_locks:
        os.close(held_locks.pop())


def check_run_dir(out: str, overwrite: bool) -> list[str]:
    """The run files already in --out; touches nothing."""
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if held and not holds_run(out):  # a run's names, but no run: --overwrite would delete them
        raise SystemExit(f"--out {out} holds {', '.join(held)} but no run (no run's config.json "
                         "beside its log or checkpoint), so nothing there is deleted: choose "
                         "another --out")
    if held and not overwrite:
        raise SystemExit(f"--out {out} already holds a run: add --resume to continue it, "
                         "--overwrite to start it over, or choose another --out")
    return held


def writable(directory: str, what: str) -> None:
    """Make `directory` if it is missing; stop in one line if `what` cannot be written there."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:  # a file in the way, or a parent that cannot be written
        why = "a file, not a directory" if os.path.isfile(directory) else e.strerror
        raise SystemExit(f"{directory}: cannot write {what} there ({why})") from None
    if not os.access(directory, os.W_OK):
        raise SystemExit(f"{directory}: cannot write {what} there (read-only)")


def start_run_dir(out: str, held: list[str], config: dict) -> None:
    """Clear the old run's own files and diagnose.py's (--overwrite), write the config."""
    derived = [os.path.join(out, f) for f in DERIVED if os.path.exists(os.path.join(out, f))]
    derived = derived if held else []  # a directory without a run keeps what is in it
    # config.json last: a directory left half cleared by a kill is still known as a run
    last = [os.path.join(out, "config.json")] if "config.json" in held else []
    for path in derived + [os.path.join(out, f) for f in held if f != "config.json"] + last:
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    os.makedirs(out, exist_ok=True)
    write_whole(os.path.join(out, "config.json"), json.dumps(config, indent=2))
