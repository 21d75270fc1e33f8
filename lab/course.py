"""The course kit: a student version of an assignment, graded by the project's own tests.

An assignment is a few functions the project pins with hand-computed tests: `make` copies the
files git tracks with those bodies replaced by `raise NotImplementedError` (every other byte
kept); `grade`, run in the copy, runs those tests and prints each function's points.
docs/course.md is the syllabus.

    python -m lab.course list                # the assignments: functions, tests, prerequisites
    python -m lab.course make 3 --out hw3/   # assignment 3 for a student
    cd hw3 && python -m lab.course grade 3   # its tests; points per function

Functions are found by name with ast (`Class.method`): a changed signature does not break the
kit, a renamed function or test does, and tests/test_course.py says which.
"""
import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project, above lab/
MARKER = ".assignment"  # in a student copy: the number of its assignment
# Never copied where the project is no git checkout (a checkout is copied as git tracks it), nor
# what its .gitignore names, nor a run directory; the kit's own test holds the reference solutions.
SKIP = {".git", ".venv", "runs", "gpu", "__pycache__", ".pytest_cache", ".env"}
INSTRUCTOR_ONLY = os.path.join("tests", "test_course.py")


@dataclass(frozen=True)
class Assignment:
    title: str
    tests: dict[str, list[str]]  # "module.function" -> pytest node ids that grade it
    needs: tuple[int, ...] = ()  # assignments whose functions those tests also run


ASSIGNMENTS = {
    1: Assignment("LoRA: the forward pass, merging and restoring, shared vs isolated routing", {
        "lora.LoRALinear.forward": [
            "tests/test_lora.py::test_lora_linear_matches_formula",
            "tests/test_lora.py::test_fresh_adapter_is_bit_identical",
            "tests/test_lora.py::test_adapters_off_equals_base",
            "tests/test_lora.py::test_only_adapter_parameters_get_gradients"],
        "lora.LoRALinear.merged_weight": [
            "tests/test_lora.py::test_merged_bf16_base_differs_by_no_more_than_bf16_rounding"],
        "lora.merged_adapter": [
            "tests/test_lora.py::test_merged_adapter_is_the_low_rank_path_and_puts_the_base_back",
            "tests/test_rollout.py::test_merged_generation_samples_what_the_low_rank_path_samples"],
        "lora.adapter_for": ["tests/test_lora.py::test_isolated_loss_reaches_only_its_role",
                             "tests/test_lora.py::test_shared_every_role_reaches_the_one_adapter"],
    }),
    2: Assignment("Token log-probs: the sequence layout and the one-token shift", {
        "rollout.pack": ["tests/test_rollout.py::test_pack_layout"],
        "rollout.completion_logits": [
            "tests/test_rollout.py::test_logprobs_equal_direct_computation_and_ignore_padding"],
        "rollout.token_logprobs": ["tests/test_rollout.py::test_temperature_scales_logits"],
    }),
    3: Assignment("GRPO: group advantages, the clipped surrogate with clip-higher, "
                  "loss aggregation", {
        "grpo.masked_mean": ["tests/test_grpo.py::test_masked_mean"],
        "grpo.group_advantages": ["tests/test_grpo.py::test_group_advantages_by_hand"],
        "grpo.aggregate": ["tests/test_grpo.py::test_aggregation_modes_by_hand",
                           "tests/test_grpo.py::test_micro_batches_add_up_to_the_mini_batch"],
        "grpo.policy_loss": [
            "tests/test_grpo.py::test_clipped_loss_is_plain_policy_gradient_at_ratio_one",
            "tests/test_grpo.py::test_clipping_by_hand",
            "tests/test_grpo.py::test_k3_kl_by_hand",
            "tests/test_grpo.py::test_chi2_and_perplexity_by_hand",
            "tests/test_grpo.py::test_the_clip_acts_only_after_the_first_mini_batch_step[False]"],
        "grpo.kl_penalty": ["tests/test_grpo.py::test_k3_kl_by_hand"],
    }, needs=(1, 2, 5)),  # the update runs a LoRA model, its log-probs and the loss weights
    4: Assignment("The actor-critic: GAE, the value loss, central vs decentral critic inputs", {
        "critic.gae": [
            "tests/test_critic.py::test_gae_lambda_zero_is_one_step_td",
            "tests/test_critic.py::test_gae_lambda_one_is_monte_carlo",
            "tests/test_critic.py::test_gae_intermediate_lambda_on_sequences_of_different_lengths",
            "tests/test_critic.py::test_call_advantages_follow_each_agents_own_turns"],
        "critic.value_loss": ["tests/test_critic.py::test_value_loss_unclipped_by_hand",
                              "tests/test_critic.py::test_value_loss_clipped_by_hand"],
        "critic.joint_history": [
            "tests/test_critic.py::test_central_critic_reads_every_agents_history"],
        "critic.critic_inputs": [
            "tests/test_critic.py::test_decentral_critic_reads_only_its_own_agent"],
    }),
    5: Assignment("Diagnostics: kappa and coherence, gradient shares, role balance, "
                  "contract adherence", {
        "measure.amplification": [
            "tests/test_grpo.py::test_amplification_identical_and_orthogonal"],
        "measure.gradient_stats": ["tests/test_grpo.py::test_gradient_stats_shares_and_roles"],
        "grpo.loss_weight": ["tests/test_diagnose.py::test_loss_weight_by_hand"],
        "workflows.adherence": ["tests/test_diagnose.py::test_adherence_table"],
        "workflows.similarity": ["tests/test_diagnose.py::test_similarity"],
    }),
    6: Assignment("Workflow topologies: Eval-Opt and Orch-Workers, then one of your own", {
        "workflows.eval_opt": [
            "tests/test_workflows.py::test_eval_opt_stops_each_episode_on_its_own",
            "tests/test_workflows.py::test_eval_opt_prompts_carry_solution_and_critique",
            "tests/test_workflows.py::test_eval_opt_round_limits",
            "tests/test_workflows.py::test_eval_opt_missing_verdict_refines_and_is_flagged"],
        "workflows.orch_workers": [
            "tests/test_workflows.py::test_orch_workers_stages_prompts_and_final",
            "tests/test_workflows.py::test_orch_workers_fills_missing_strategies"],
    }),
}


def node_ids(number: int) -> list[str]:
    return list(dict.fromkeys(t for tests in ASSIGNMENTS[number].tests.values() for t in tests))


def prerequisites(number: int) -> set[int]:
    """The assignments whose functions an assignment's tests run, directly or through others."""
    needs = ASSIGNMENTS[number].needs
    return set(needs).union(*(prerequisites(n) for n in needs))


# ----------------------------------------------------------------------------
# Stubbing: a function body out, the rest of the file byte for byte


def find_function(tree: ast.Module, name: str) -> ast.FunctionDef:
    node = tree
    for part in name.split("."):
        node = next((n for n in node.body
                     if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part),
                    None)
        if node is None:
            raise LookupError(f"no function {name!r}")
    return node


def body_range(lines: list[str], fn: ast.FunctionDef) -> tuple[int, int, str]:
    """Lines [start, end) (0-based) of the body after the docstring, with the comments and blank
    lines above its first statement; and the body's indentation."""
    has_doc = ast.get_docstring(fn, clean=False) is not None
    if len(fn.body) <= has_doc or fn.body[0].lineno == fn.lineno:
        raise ValueError(f"{fn.name}: no body to replace, or a body on the def line")
    start = fn.body[has_doc].lineno - 1
    floor = fn.body[0].end_lineno if has_doc else fn.lineno  # the docstring's or header's end
    while start > floor and lines[start - 1].strip()[:1] in ("", "#"):
        start -= 1
    return start, fn.end_lineno, " " * fn.body[has_doc].col_offset


def stub(source: str, names: list[str], number: int) -> str:
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    ranges = sorted(((body_range(lines, find_function(tree, n)), n) for n in names), reverse=True)
    limit = len(lines)
    for (start, end, indent), name in ranges:  # bottom up: the line numbers above stay right
        if end > limit:  # an instructor's table naming a function and one nested in it
            raise ValueError(f"{name} overlaps another stubbed function")
        lines[start:end] = [f'{indent}raise NotImplementedError('
                            f'"assignment {number}: write {name}")\n']
        limit = start
    return "".join(lines)


# ----------------------------------------------------------------------------
# make and grade


def skipped(root: str, out: str, ignored: list[str], directory: str,
            names: list[str]) -> set[str]:
    """What a copy without git leaves out of a directory: SKIP, the .gitignore's names, .env*,
    run directories, the instructor's test, student copies and the copy itself."""
    paths = {n: os.path.join(directory, n) for n in names}
    return {n for n, p in paths.items() if n in SKIP or n.startswith(".env")
            or any(fnmatch(n, pattern) for pattern in ignored)
            or all(os.path.isfile(os.path.join(p, f)) for f in ("config.json", "metrics.jsonl"))
            or os.path.relpath(p, root) == INSTRUCTOR_ONLY
            or os.path.exists(os.path.join(p, MARKER)) or os.path.realpath(p) == out}


def ignored_names(root: str) -> list[str]:
    """The .gitignore's patterns, as names (`runs/` as runs); one with a path matches no name."""
    try:
        with open(os.path.join(root, ".gitignore"), encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except (OSError, UnicodeDecodeError):
        return []
    return [line.rstrip("/") for line in lines if line and not line.startswith(("#", "!"))]


def copy_project(root: str, out: str) -> None:
    """The files git tracks as the working tree holds them, less the instructor's test; without
    git, the tree less what `skipped` names."""
    try:
        tracked = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # no git, or no checkout here
        shutil.copytree(root, out, dirs_exist_ok=True, ignore=partial(
            skipped, root, os.path.realpath(out), ignored_names(root)))
        return
    os.makedirs(out, exist_ok=True)
    for path in filter(None, os.fsdecode(tracked).split("\0")):
        source = os.path.join(root, path)
        if path == INSTRUCTOR_ONLY or os.path.isdir(source) or not os.path.lexists(source):
            continue  # a submodule, or a file deleted and not yet committed
        os.makedirs(os.path.join(out, os.path.dirname(path)), exist_ok=True)
        shutil.copy2(source, os.path.join(out, path), follow_symlinks=False)


def make(number: int, out: str, root: str = ROOT) -> None:
    if not out:
        raise SystemExit("--out is empty: name a directory for the student copy")
    there = os.path.abspath(out)
    while not os.path.exists(there):  # out or the nearest directory above it that exists
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        raise SystemExit(f"--out {out}: {there} is a file, not a directory; choose another --out")
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"{out} exists and is not empty; choose another --out")
    try:
        copy_project(root, out)
    except OSError as e:  # a name too long, a full or read-only disk
        why = e.strerror or type(e).__name__
        raise SystemExit(f"--out {out}: cannot be written ({why})") from None
    names = [name.split(".", 1) for name in ASSIGNMENTS[number].tests]
    for module in dict.fromkeys(module for module, _ in names):
        functions = [function for m, function in names if m == module]
        path = os.path.join(out, f"{module}.py")
        with open(path, encoding="utf-8", newline="") as f:
            source = f.read()
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(stub(source, functions, number))
    with open(os.path.join(out, MARKER), "w") as f:
        f.write(f"{number}\n")
    print(f"{out}: assignment {number}, {ASSIGNMENTS[number].title}\n"
          f"to write: {', '.join(ASSIGNMENTS[number].tests)}\n"
          f"to grade, in {out}: python -m lab.course grade")


def run_tests(ids: list[str], root: str = ROOT) -> dict[str, bool]:
    """Whether each test id passed (all its parameters did), run in one pytest process."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--tb=short", f"--junitxml={report}", *ids], cwd=root)
        cases = ET.parse(report).iter("testcase") if os.path.exists(report) else []
        outcome = {}  # node id -> passed
        for case in cases:
            node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            outcome[node] = not any(child.tag in ("failure", "error", "skipped") for child in case)
    ran = {i: [ok for node, ok in outcome.items() if node == i or node.startswith(i + "[")]
           for i in ids}
    return {i: bool(oks) and all(oks) for i, oks in ran.items()}


def grade(number: int, root: str = ROOT) -> int:
    """Print the points of each function; 0 if every test passed."""
    passed = run_tests(node_ids(number), root)
    print(f"\nassignment {number}: {ASSIGNMENTS[number].title}")
    width = max(len(name) for name in ASSIGNMENTS[number].tests)
    for name, tests in ASSIGNMENTS[number].tests.items():
        failed = [t.split("::")[1] for t in tests if not passed[t]]
        print(f"  {name:<{width}}  {len(tests) - len(failed)}/{len(tests)}"
              + (f"  failed: {', '.join(failed)}" if failed else ""))
    total = sum(passed.values())
    print(f"total {total}/{len(passed)} points")
    return 0 if total == len(passed) else 1


def assigned(root: str) -> int:
    """The assignment number that `make` wrote in a student copy's MARKER."""
    path = os.path.join(root, MARKER)
    if not os.path.exists(path):
        raise SystemExit(f"no {MARKER} here (not a student copy): name the assignment")
    if os.path.isdir(path):
        raise SystemExit(f"{path} is a directory, not the file of the copy's assignment number")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read().strip()
    number = {str(n): n for n in ASSIGNMENTS}.get(text)
    if number is None:
        held = repr(text[:40]) if text else "nothing"
        raise SystemExit(f"{path} holds {held}, not an assignment number "
                         f"({', '.join(map(str, ASSIGNMENTS))}): name the assignment")
    return number


def show() -> None:
    for number, a in ASSIGNMENTS.items():
        needs = (f" (its tests also run assignments {sorted(prerequisites(number))})"
                 if a.needs else "")
        print(f"{number}. {a.title}{needs}")
        for name, tests in a.tests.items():
            print(f"   {name}: {', '.join(t.split('::')[1] for t in tests)}")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab.course",
                                     description=__doc__.split("\n\n")[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the assignments, their functions and tests")
    p = commands.add_parser("make", help="copy the project with one assignment's functions stubbed",
                            allow_abbrev=False)
    p.add_argument("number", type=int, choices=sorted(ASSIGNMENTS), help="the assignment")
    p.add_argument("--out", required=True, help="directory of the student copy (new or empty)")
    p = commands.add_parser("grade", help="run an assignment's tests here, points per function",
                            allow_abbrev=False)
    p.add_argument("number", type=int, nargs="?", choices=sorted(ASSIGNMENTS),
                   help=f"the assignment (default: the one this copy was made for, from {MARKER})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.command == "list":
        show()
    elif args.command == "make":
        make(args.number, args.out)
    else:
        return grade(assigned(ROOT) if args.number is None else args.number)
    return 0


if __name__ == "__main__":
    sys.exit(main())
