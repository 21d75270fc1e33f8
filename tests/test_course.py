"""The course kit: each assignment's tests fail without its functions and pass with the reference;
the tests of every assignment that does not need them still pass; no removed line stays behind."""
import ast
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from lab import course


def pytest_in(root: str, ids: list[str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *flags, *ids],
                          cwd=root, capture_output=True, text=True)


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


def test_every_assignment_names_functions_and_tests_that_exist():
    owner = {}
    for number, a in course.ASSIGNMENTS.items():
        assert set(a.needs) <= set(course.ASSIGNMENTS) \
            and number not in course.prerequisites(number)
        for name, tests in a.tests.items():
            module, function = name.split(".", 1)
            course.find_function(parse(f"{ROOT}/{module}.py"), function)  # LookupError if renamed
            assert owner.setdefault(name, number) == number, f"{name} is in two assignments"
            assert tests, f"{name} has no test"
            for test in tests:
                path, test_name = test.split("::")
                defined = {f.name for f in parse(f"{ROOT}/{path}").body
                           if isinstance(f, ast.FunctionDef)}
                assert test_name.split("[")[0] in defined, test


SOURCE = '''import os


@decorator
def kept(x):  # a header comment
    return x


class Layer:
    """A class."""

    def forward(self, x: int,
                y: int) -> int:  # x: (B, T)
        # why the next line
        z = x + y

        return z  # (B, T)

    def other(self):
        """Its docstring
        on two lines."""

        # a comment above the body
        return os.sep
# a comment after it
'''

STUBBED = '''import os


@decorator
def kept(x):  # a header comment
    raise NotImplementedError("assignment 7: write kept")


class Layer:
    """A class."""

    def forward(self, x: int,
                y: int) -> int:  # x: (B, T)
        raise NotImplementedError("assignment 7: write Layer.forward")

    def other(self):
        """Its docstring
        on two lines."""
        raise NotImplementedError("assignment 7: write Layer.other")
# a comment after it
'''


def test_stub_replaces_each_body_and_keeps_every_other_byte():
    assert course.stub(SOURCE, ["Layer.other", "kept", "Layer.forward"], 7) == STUBBED
    with pytest.raises(LookupError, match="Layer.missing"):
        course.stub(SOURCE, ["Layer.missing"], 7)


PRIVATE = [".git/HEAD", ".venv/bin/python", "runs/a/metrics.jsonl", "gpu/h100.log", ".env",
           ".env.local", "sweeps/lr/config.json", "sweeps/lr/metrics.jsonl",
           "__pycache__/lora.cpython-311.pyc", "tests/x.pyc", ".pytest_cache/v", "hw1/.assignment",
           "hw1/lora.py"]  # what no student copy holds


@pytest.mark.parametrize("source, names, words", [
    ("def f(x):\n    def g():\n        return 1\n    return g()\n", ["f", "f.g"],
     "f overlaps another stubbed function"),
    ("def f(x): return x\n", ["f"], "f: no body to replace, or a body on the def line"),
])
def test_stub_refuses_a_table_it_would_turn_into_broken_code(source, names, words):
    """An instructor's new assignment that names a function inside another, or a one-line def,
    is refused rather than written out as a stub that does not parse."""
    with pytest.raises(ValueError, match=re.escape(words)):
        course.stub(source, names, 9)


def test_a_copy_leaves_out_history_environments_runs_secrets_caches_and_other_copies(tmp_path):
    """A project without git: the tree less its history, environments, runs (runs/ and any
    directory holding a run's config.json and metrics.jsonl), the GPU checks' gpu/, .env files,
    caches, what its .gitignore names, the instructor's test and other copies."""
    root = tmp_path / "project"
    for path in ["lora.py", "docs/course.md", "tests/test_lora.py", "tests/test_course.py",
                 ".gitignore", "scratch/notes.md", *PRIVATE]:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("x")
    (root / ".gitignore").write_text("# the instructor's\nscratch/\n*.pyc\n")
    # a copy inside the project, as a student makes it
    course.copy_project(str(root), str(root / "hw2"))
    copied = sorted(str(p.relative_to(root / "hw2")) for p in (root / "hw2").rglob("*")
                    if p.is_file())
    assert copied == [".gitignore", "docs/course.md", "lora.py", "tests/test_lora.py"]
    (root / "hw3").mkdir()
    (root / "hw3" / "notes").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        course.make(1, str(root / "hw3"), str(root))
    with pytest.raises(SystemExit,
                       match="hw3/notes is a file, not a directory; choose another --out"):
        course.main(["make", "1", "--out", str(root / "hw3" / "notes")])


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_copy_of_a_git_checkout_holds_the_files_git_tracks(tmp_path):
    """A git checkout: the files git tracks, as the working tree holds them (the instructor's
    test aside); nothing untracked or ignored, whatever its name."""
    root = tmp_path / "project"
    for path in ["lora.py", "docs/course.md", "tests/test_course.py", "gone.py", "notes.txt",
                 *(p for p in PRIVATE if not p.startswith(".git/"))]:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("x")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "lora.py", "docs", "tests/test_course.py",
                    "gone.py"], check=True)
    (root / "lora.py").write_text("edited")
    os.remove(root / "gone.py")
    course.copy_project(str(root), str(tmp_path / "hw"))
    copied = sorted(str(p.relative_to(tmp_path / "hw")) for p in (tmp_path / "hw").rglob("*"))
    assert copied == ["docs", "docs/course.md", "lora.py"]
    assert (tmp_path / "hw" / "lora.py").read_text() == "edited"


def test_make_refuses_an_out_it_cannot_create_before_copying(tmp_path):
    (tmp_path / "afile").write_text("x")
    for out, words in ((str(tmp_path / "afile" / "sub"), "afile is a file, not a directory"),
                       ("", "--out is empty"),
                       (str(tmp_path / ("x" * 300)), "cannot be written (File name too long)")):
        with pytest.raises(SystemExit, match=re.escape(words)):
            course.main(["make", "3", "--out", out])
    assert os.listdir(tmp_path) == ["afile"]


VALID = f"not an assignment number ({', '.join(map(str, course.ASSIGNMENTS))})"


@pytest.mark.parametrize("content, words", [
    ("abc", f"holds 'abc', {VALID}"),
    ("", f"holds nothing, {VALID}"),
    ("9\n", f"holds '9', {VALID}"),
    ("dir", "is a directory"),
])
def test_grade_names_a_wrong_assignment_file(content, words, tmp_path, monkeypatch):
    monkeypatch.setattr(course, "ROOT", str(tmp_path))
    monkeypatch.setattr(course, "grade", lambda number: pytest.fail("graded"))
    if content == "dir":
        (tmp_path / course.MARKER).mkdir()
    else:
        (tmp_path / course.MARKER).write_text(content)
    with pytest.raises(SystemExit, match=re.escape(f"{course.MARKER} {words}")):
        course.main(["grade"])


def test_the_reference_passes_every_assignments_tests():
    ids = [t for number in course.ASSIGNMENTS for t in course.node_ids(number)]
    res = pytest_in(ROOT, ids, "-x")
    assert res.returncode == 0, res.stdout[-3000:]


def removed(number: int) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """Per function, the lines `make` removes that appear nowhere else in the project and are
    12 characters or more; per stubbed module, the reference's lines that stay."""
    kept, bodies = {}, {}
    for name in course.ASSIGNMENTS[number].tests:
        module, function = name.split(".", 1)
        with open(f"{ROOT}/{module}.py", encoding="utf-8") as f:
            lines = kept.setdefault(module, f.read().splitlines())
        start, end, _ = course.body_range(
            lines, course.find_function(ast.parse("\n".join(lines)), function))
        bodies[name] = (module, start, end)
    staying = {m: [l for i, l in enumerate(lines)
                   if not any(m == mod and s <= i < e for mod, s, e in bodies.values())]
               for m, lines in kept.items()}
    elsewhere = {l.strip() for lines in staying.values() for l in lines}
    for directory, _, files in os.walk(ROOT):
        if set(os.path.relpath(directory, ROOT).split(os.sep)) & course.SKIP:
            continue
        for f in files:
            path = os.path.join(directory, f)
            if os.path.relpath(path, ROOT) not in {f"{m}.py" for m in kept}:
                with open(path, encoding="utf-8", errors="ignore") as text:
                    elsewhere |= {l.strip() for l in text}
    secret = {}
    for name, (module, start, end) in bodies.items():
        secret[name] = {l.strip() for l in kept[module][start:end]} - elsewhere
        secret[name] = {l for l in secret[name] if len(l) >= 12}
    return secret, staying


@pytest.mark.parametrize("number", sorted(course.ASSIGNMENTS))
def test_a_stubbed_copy_fails_its_own_tests_and_passes_the_others(number, tmp_path):
    out = str(tmp_path / f"hw{number}")
    course.make(number, out)
    assert not [path for path, dirs, files in os.walk(out) if set(dirs + files) & course.SKIP]
    secret, staying = removed(number)
    assert all(secret.values()), secret  # every function had a body of its own to remove
    every_secret = set().union(*secret.values())
    for directory, _, files in os.walk(out):
        for f in files:
            with open(os.path.join(directory, f), encoding="utf-8", errors="ignore") as text:
                leaked = {l.strip() for l in text} & every_secret
            assert not leaked, (f, leaked)
    # the rest of a stubbed file is the reference's, line for line
    for module, lines in staying.items():
        with open(f"{out}/{module}.py", encoding="utf-8") as f:
            stubbed = f.read().splitlines()
        assert [l for l in stubbed if 'raise NotImplementedError("assignment' not in l] == lines
    for name in course.ASSIGNMENTS[number].tests:  # each body is one raise after the docstring
        module, function = name.split(".", 1)
        fn = course.find_function(parse(f"{out}/{module}.py"), function)
        assert isinstance(fn.body[-1], ast.Raise) \
            and len(fn.body) == 1 + (ast.get_docstring(fn) is not None)
    graded = subprocess.run([sys.executable, "-m", "lab.course", "grade"], cwd=out,
                            capture_output=True, text=True)
    assert graded.returncode == 1 \
        and f"total 0/{len(course.node_ids(number))} points" in graded.stdout, \
        graded.stdout[-3000:]
    others = [t for j in course.ASSIGNMENTS if j != number and number not in course.prerequisites(j)
              for t in course.node_ids(j)]
    res = pytest_in(out, others, "-x")
    assert res.returncode == 0, res.stdout[-3000:]


def test_every_command_of_the_syllabus_parses():
    """docs/course.md's commands take the flags train.py, diagnose.py, lab/grid.py, lab/bench.py and
    lab/course.py take today, and a report reads runs that the page trains (YOURS, the student's
    workflow, is read as single)."""
    from lab import bench
    import diagnose
    from lab import grid
    import train
    with open(f"{ROOT}/docs/course.md") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.DOTALL)
    trained, scripts = set(), set()
    for line in "\n".join(blocks).splitlines():
        words = [{"YOURS": "single"}.get(w, w) for w in shlex.split(line, comments=True)
                 if "=" not in w or w.startswith("-")]  # no environment variables
        if words[1:2] == ["-m"] and words[2].startswith("lab."):
            words[1:3] = [words[2].replace(".", "/") + ".py"]  # a tool in lab/, by its file
        if words[:1] != [".venv/bin/python"] or words[1] in ("-m", "workflows.py"):
            continue
        script, args = words[1], words[2:]
        scripts.add(script)
        if script == "train.py":
            trained.add(train.parse_config(args).out)
        elif script == "lab/grid.py":
            train.parse_config(grid.parse_args(args)[1])
        elif script == "diagnose.py":
            assert set(diagnose.make_parser().parse_args(args).runs) <= trained, line
        else:
            {"lab/bench.py": bench.make_parser,
             "lab/course.py": course.make_parser}[script]().parse_args(args)
    assert scripts == {"train.py", "diagnose.py", "lab/grid.py", "lab/bench.py",
                       "lab/course.py"}, scripts
