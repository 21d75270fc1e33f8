"""The main table in miniature and the demos: which cells they train, resuming, and their tables."""
import dataclasses
import json
import math
import os
import shutil

import pytest

from lab import files, grid, settings, tables
from lab import run as lab_run
import train
from workflows import ROLES

TINY = ["--model", "tiny", "--steps", "2", "--eval_every", "1", "--eval_problems", "2",
        "--problems_per_step", "2", "--group_size", "2", "--max_new_tokens", "6", "--lora_r", "4"]


def test_reproduce_hands_every_other_flag_to_train_in_order(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(grid, "reproduce",
                        lambda out, flags, seeds, results: seen.append((out, flags, seeds, results))
                        or "report.md")
    grid.main(["--reproduce", "--model", "Qwen/Qwen3-1.7B", "--out", str(tmp_path),
               "--steps", "200", "--results", "kept"])
    assert seen == [(str(tmp_path), ["--model", "Qwen/Qwen3-1.7B", "--steps", "200"], [0, 1, 2],
                     "kept")]
    with pytest.raises(SystemExit):  # a flag train.py does not know stops before the first cell
        grid.main(["--reproduce", "--stepz", "3"])
    assert len(seen) == 1


@pytest.mark.parametrize("argv, words", [
    (["--reproduce", "--sharing", "shared"], "--sharing: the cells set it themselves"),
    (["--demo", "critics", "--algo", "maac"], "--algo: the cells set it themselves"),
    (["--demo", "amplification", "--start_from", "runs/x"],
     "--start_from: the cells of a seed go on from that seed's own start"),
    (["--reproduce", "--overwrite"], "--overwrite: the grid never deletes a cell"),
    (["--demo", "default", "--resume"], "--resume: the grid resumes an interrupted cell itself"),
    (["--demo", "default", "--steps", "0"], "--steps 0: the grid compares its cells after RL"),
    (["--demo", "critics", "--seed=3"], "--seed: each cell's seed is one of --seeds"),
    (["--reproduce", "--out", ""], "--out is empty: name the directory for the cells"),
])
def test_a_flag_that_would_make_the_cells_one_is_refused(argv, words, capsys):
    with pytest.raises(SystemExit):
        grid.parse_args(argv)
    assert words in capsys.readouterr().err


def test_a_finished_cell_trained_with_the_task_s_own_length_is_reused(tmp_path, capsys):
    """A cell given no --max_new_tokens was trained with its task's (0 is resolved before
    config.json is written): found finished, not "trained with other settings"."""
    flags = [f for i, f in enumerate(TINY) if "--max_new_tokens" not in TINY[max(i - 1, 0):i + 1]]
    assert "--max_new_tokens" not in flags and len(flags) == len(TINY) - 2
    train.main(train.parse_config([*flags, "--steps", "1", "--out", str(tmp_path / "cell")]))
    capsys.readouterr()
    grid.train_cells(str(tmp_path), [("cell", [*flags, "--steps", "1"])])
    assert capsys.readouterr().out == f"{tmp_path / 'cell'}: already finished\n"
    # a setting that acts nowhere in the cell does not tell it apart (Eval-Opt has no --n_agents)
    config = json.loads((tmp_path / "cell" / "config.json").read_text())
    assert config["workflow"] == "eval_opt"
    (tmp_path / "cell" / "config.json").write_text(json.dumps({**config, "n_agents": 2}))
    grid.train_cells(str(tmp_path), [("cell", [*flags, "--steps", "1"])])
    assert capsys.readouterr().out == f"{tmp_path / 'cell'}: already finished\n"
    # nor does a finished cell's checkpoint, let go to save disk
    shutil.rmtree(tmp_path / "cell" / "ckpt")
    grid.train_cells(str(tmp_path), [("cell", [*flags, "--steps", "1"])])
    assert capsys.readouterr().out == f"{tmp_path / 'cell'}: already finished\n"


def test_a_cell_whose_config_lacks_its_steps_is_not_finished(tmp_path):
    """Not taken as done (nor a KeyError): the cell is then resumed, which says what is wrong."""
    config = {k: v for k, v in dataclasses.asdict(train.Config()).items() if k != "steps"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    assert grid.finished(str(tmp_path)) is False


def test_every_cells_settings_are_checked_before_the_first_cell_trains(tmp_path, monkeypatch):
    """A flag that only a later cell refuses (the optimizer demo's single agent has no aggregator)
    stops the grid before anything trains; so does --demo default on a task its table cannot
    split."""
    monkeypatch.setattr(grid, "train_cells", lambda *a: pytest.fail("a cell was trained"))
    cases = [(["--demo", "optimizer", "--role_kl", "aggregator=0.05"],
              "cell seed0/single: --role_kl: 'aggregator' is not a role of single"),
             (["--demo", "default", "--task", "humaneval"], "only a math task scores"),
             (["--demo", "amplification", "--lam", "0.5"],
              "--lam sets the critics of --algo maac.* \\(in every cell\\)")]
    tiny = TINY[:TINY.index("--problems_per_step")] + TINY[TINY.index("--group_size"):]
    for argv, words in cases:  # (the optimizer demo's cells set --problems_per_step themselves)
        with pytest.raises(SystemExit, match=words):
            grid.main([*argv, "--seeds", "0", "--out", str(tmp_path), *tiny])
    assert os.listdir(tmp_path) == []


def test_a_flag_reaches_only_the_cells_where_it_acts():
    """--n_agents counts Voting's generators, --max_rounds Eval-Opt's turns, --lam a critic's GAE:
    each reaches those cells alone (train.py would refuse it in the others); a flag that acts
    everywhere reaches every cell, and --minibatch_size acts in a warm-up too."""
    flags = ["--n_agents", "2", "--max_rounds=3", "--lr", "1e-3", "--minibatch_size", "8"]
    for name, cell in grid.grid_cells(flags, [0]):
        c, typed = train.parse_config(cell), settings.typed_flags(cell)
        assert ("n_agents" in typed, "max_rounds" in typed) == (c.workflow == "voting",
                                                                c.workflow == "eval_opt"), name
        assert (c.lr, c.minibatch_size) == (1e-3, 8)
    cells = grid.demo_cells("critics", "home", ["--lam", "0.5"], [0])
    assert {name: train.parse_config(flags).lam for name, flags in cells} == {
        "seed0/start": 0.95, "seed0/grpo": 0.95, "seed0/central": 0.5, "seed0/decentral": 0.5}
    # a demo's own flags too: without a warm-up its --minibatch_size acts in the cells that
    # take mini-batch steps alone, and a start that never used it may differ in it
    cells = grid.demo_cells("optimizer", "home", ["--sft_warmup", "0"], [0])
    grid.check_cells(cells, "home", ["--sft_warmup", "0"])
    assert {name: train.parse_config(flags).minibatch_size for name, flags in cells} == {
        "seed0/start": 16, "seed0/isolated": 4, "seed0/isolated-one_step": 16, "seed0/single": 4}


def test_demo_trains_its_cells_for_every_seed_and_reports_them(tmp_path, capsys):
    """The plumbing of --demo on the tiny model: every cell and seed trained with the demo's flags,
    the flags after --demo passed on (and overriding), one table row per cell, a verdict per
    cell."""
    out = str(tmp_path / "demo")
    tiny = [*TINY, "--sft_warmup", "2"]
    grid.main(["--demo", "capture", "--seeds", "0,1", "--out", out, *tiny])
    printed = capsys.readouterr().out
    spec = grid.DEMOS["capture"]
    for seed in (0, 1):
        for cell, flags in spec.cells.items():
            config, rows = files.load_run(f"{out}/capture/seed{seed}/{cell}", ROLES)
            assert (config["seed"], config["steps"], config["sft_warmup"]) == (seed, 2, 2)
            assert config["sharing"] == flags[flags.index("--sharing") + 1]
            assert "sft/loss/first" in rows[0] and rows[-1]["step"] == 2
            # every cell of a seed goes on from one warm-up and step-0 evaluation under a
            # shared adapter
            assert config["start_from"] == f"{out}/capture/seed{seed}/start"
            assert rows[0] == files.load_run(config["start_from"], ROLES)[1][0]
        start, rows = files.load_run(f"{out}/capture/seed{seed}/start", ROLES)
        assert (start["sharing"], start["steps"], [r["step"] for r in rows]) == ("shared", 0, [0])
    report = open(f"{out}/capture/report.md").read()
    assert report.startswith("# Demo: capture")
    for cell in spec.cells:
        assert f"| {cell} | " in report
        assert f"{cell} (" in printed and "found in" in printed
    assert "seed1/shared-balance_role" in report  # runs named by seed and cell
    assert os.path.exists(f"{out}/capture/adherence.png")
    assert "![demo.png](demo.png)" in report and os.path.exists(f"{out}/capture/demo.png")
    for seed in (0, 1):  # the seed table: the aggregator's adherence at every RL step of each cell
        cells = [[r["role/aggregator/adherence"]
                  for r in files.load_run(f"{out}/capture/seed{seed}/{cell}", ROLES)[1]
                  if "role/aggregator/adherence" in r] for cell in spec.cells]
        assert all(len(adh) == 2 for adh in cells)
        assert f"| {seed} | " + " | ".join(", ".join(f"{v:.2f}" for v in adh)
                                           for adh in cells) + " |" in report
    grid.main(["--demo", "capture", "--seeds", "0", "--out", out, *tiny])  # done: nothing trains
    assert "train.py" not in capsys.readouterr().out
    with pytest.raises(SystemExit,
                       match=r"seed0/\S+ was trained with other settings \(--lr 0.01 differs"):
        grid.main(["--demo", "capture", "--seeds", "0", "--out", out, *tiny, "--lr", "0.01"])
    # a flag left out is its default, which the finished cells were not trained with
    with pytest.raises(SystemExit, match=r"seed0/\S+ was trained with other settings "
                                         r"\(--sft_warmup \d+ differs from the run's config \(2\)"):
        grid.main(["--demo", "capture", "--seeds", "0", "--out", out, *TINY])


def test_the_optimizer_demos_single_agent_warms_up_itself():
    """A cell of another workflow than the demo's cannot go on from the seed's start (only RL
    settings may differ): it trains its own warm-up; the others go on from the start."""
    cells = dict(grid.demo_cells("optimizer", "home", ["--lr", "1e-3"], [4]))
    assert set(cells) == {"seed4/start", "seed4/isolated", "seed4/isolated-one_step",
                          "seed4/single"}
    for name, flags in cells.items():
        c = train.parse_config(flags)
        assert (c.seed, c.lr, c.lr_floor) == (4, 1e-3, 1.0)  # the demo's flags, then the caller's
        assert c.steps == (0 if name == "seed4/start" else 12)
        assert c.start_from == ("" if name in ("seed4/start", "seed4/single")
                                else "home/seed4/start")
    single = train.parse_config(cells["seed4/single"])
    assert (single.workflow, single.problems_per_step, single.one_step, single.minibatch_size) == \
        ("single", 6, False, 4)


def test_the_capture_dose_cells_differ_in_rl_settings_only():
    """Every cell of the dose goes on from the seed's one shared warm-up, so only the loss's
    aggregation, the optimizer steps and the anchor tell them apart."""
    cells = dict(grid.demo_cells("capture_dose", "home", [], [0]))
    got = {name: train.parse_config(flags) for name, flags in cells.items()
           if name != "seed0/start"}
    assert all(c.start_from == "home/seed0/start" and c.sharing == "shared" for c in got.values())
    assert [(c.loss_agg, c.one_step, c.role_kl) for c in got.values()] == [
        ("seq-mean-token-mean", True, ""), ("token-mean", True, ""), ("token-mean", False, ""),
        ("token-mean", False, "aggregator=0.5")]


def test_the_critics_demo_sets_grpo_against_both_critics_on_orch_workers():
    """Paper B in miniature: every cell is Orch-Workers and goes on from the seed's one GRPO
    warm-up, so the cells differ in the algorithm and the critic only; a flag after the demo's name
    (the sparse reward's --level 4) reaches the start and every cell."""
    cells = dict(grid.demo_cells("critics", "home", ["--level", "4"], [0]))
    got = {name: train.parse_config(flags) for name, flags in cells.items()}
    assert all(c.workflow == "orch_workers" and c.level == 4 for c in got.values())
    assert {name: (c.algo, c.critic, c.steps, c.start_from) for name, c in got.items()} == {
        "seed0/start": ("grpo", "central", 0, ""),
        "seed0/grpo": ("grpo", "central", 8, "home/seed0/start"),
        "seed0/central": ("maac", "central", 8, "home/seed0/start"),
        "seed0/decentral": ("maac", "decentral", 8, "home/seed0/start")}
    assert not grid.DEMOS["critics"].finding  # no mechanism: the detector is not asked


def test_a_demo_cell_s_numbers_by_hand():
    """Voting on one shared adapter (N = 3 generators, the crowded role; the aggregator its
    judge): kappa 1.2, 1.5, 1.7 has mean 1.4667 and 2 of 3 steps at >= 0.8 sqrt(3) = 1.386;
    the generators' mean share 0.8 against the aggregator's 0.2."""
    config = {"workflow": "voting", "sharing": "shared", "n_agents": 3}
    rows = [{"step": 0, "eval/accuracy": 0.3}]
    for step, (kappa, share, adherence, reward, norm) in enumerate(
            [(1.2, 0.9, 0.9, 0.2, 0.5), (1.5, 0.7, 0.6, 0.4, 0.3), (1.7, 0.8, 0.3, 0.6, 0.4)], 1):
        rows.append({"step": step, "role/generator/kappa": kappa,
                     "role/generator/grad_share": share, "role/aggregator/grad_share": 1 - share,
                     "role/aggregator/adherence": adherence, "reward/mean": reward,
                     "adapter/shared/update_norm": norm})
    rows[2]["eval/accuracy"], rows[3]["eval/accuracy"] = 0.6, 0.45
    got = tables.cell_numbers(config, rows)
    assert got["kappa"] == pytest.approx(4.4 / 3) and got["coherent steps"] == pytest.approx(2 / 3)
    assert got["update norm"] == pytest.approx(0.4) and got["top share"] == pytest.approx(0.8)
    assert (got["adherence first"], got["adherence last"]) == (0.9, 0.3)
    assert (got["reward first"], got["reward last"]) == (0.2, 0.6)
    assert (got["accuracy start"], got["accuracy peak"], got["accuracy end"]) == (0.3, 0.6, 0.45)
    assert math.isnan(got["explained variance"])  # no critic


def test_a_demo_tables_the_critics_numbers_and_drops_what_no_cell_logged():
    config = {"workflow": "orch_workers", "sharing": "shared", "n_agents": 3}
    rows = [{"step": 0, "eval/accuracy": 0.25},
            {"step": 1, "critic/explained_variance": 0.1, "adv/std": 0.5,
             "adapter/shared/grad_noise": 0.9},
            {"step": 2, "critic/explained_variance": 0.3, "adv/std": 0.3,
             "adapter/shared/grad_noise": 0.7, "eval/accuracy": 0.5}]
    numbers = tables.cell_numbers(config, rows)
    assert (numbers["explained variance"], numbers["advantage std"]) == pytest.approx((0.2, 0.4))
    assert numbers["gradient noise"] == pytest.approx(0.8)
    assert (numbers["accuracy start"], numbers["accuracy end"]) == (0.25, 0.5)
    grpo = tables.cell_numbers(config, [{k: v for k, v in r.items()
                                         if k != "critic/explained_variance"} for r in rows])
    header = tables.mean_table({"central": [numbers], "grpo": [grpo]})[0]
    assert "explained variance" in header and "kappa" not in header  # no cell logged a kappa
    assert tables.mean_table({"central": [numbers], "grpo": [grpo]})[3].split(" | ")[-3] == "-"


def test_demo_names_must_be_known():
    with pytest.raises(SystemExit):
        grid.main(["--demo", "collapse"])


def test_reproduce_trains_every_cell_for_every_seed_and_tables_them(tmp_path, capsys):
    """The plumbing of --reproduce on the tiny model: a run per cell and seed with the grid's flags
    (the flags after them override), the main table and the findings, and a second call trains
    nothing."""
    out = str(tmp_path / "grid")
    grid.main(["--reproduce", "--seeds", "0,1", "--out", out, *TINY])
    for seed in (0, 1):
        for workflow, sharing in grid.GRID:
            config, rows = files.load_run(f"{out}/seed{seed}/{workflow}-{sharing}", ROLES)
            assert (config["workflow"], config["sharing"], config["seed"]) == \
                (workflow, sharing, seed)
            # TINY overrides GRID_FLAGS
            assert (config["eval_every"], config["eval_problems"]) == (1, 2)
            assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1, 2]
    report = open(f"{out}/report.md").read()
    assert report.startswith("# Paper A's main table in miniature")
    assert "| cell | start | peak | end | peak - end | end - start | end - middle |" in report
    for workflow, sharing in grid.GRID:
        assert f"| {workflow}-{sharing} | " in report
    assert "- isolated peaks higher, voting: peak" in report \
        and "- shared plateaus, eval_opt:" in report
    assert ("| cell | reward | crowded solved | fallback | no contrast | empty mini-batches "
            "| update norm |") in report
    assert "![curves.png](curves.png)" in report and os.path.exists(f"{out}/curves.png")
    assert "| seed1/voting-isolated |" in report  # diagnose.py's report on every run follows
    capsys.readouterr()
    grid.main(["--reproduce", "--seeds", "0,1", "--out", out, *TINY])  # done: nothing trains
    assert "train.py" not in capsys.readouterr().out


def fake_run(workflow: str, sharing: str, accuracy: list[float], val: list[float] = (),
             problems: int = 50) -> tuple[dict, list[dict]]:
    """A run's (config, rows) with test (and val) accuracy at steps 0, 2, 4 (`problems`
    problems)."""
    config = {"workflow": workflow, "sharing": sharing, "steps": 4, "eval_every": 2,
              "eval_problems": problems}
    rows = [{"step": 2 * i, "eval/accuracy": a} for i, a in enumerate(accuracy)]
    for row, v in zip(rows, val):
        row["val/accuracy"] = v
    return config, rows


def test_the_peak_is_chosen_on_val_and_read_on_test():
    numbers = tables.accuracy_numbers(*fake_run("voting", "isolated", [0.4, 0.5, 0.8],
                                                val=[0.5, 0.9, 0.6]))
    # not test's own best, 0.8
    assert numbers["peak"] == 0.5 and math.isclose(numbers["peak - end"], -0.3)
    # no val split
    assert tables.accuracy_numbers(*fake_run("voting", "isolated", [0.4, 0.5, 0.8]))["peak"] == 0.8


def test_a_paired_interval_by_hand():
    """Differences 0.10, 0.12, 0.14: mean 0.12, standard deviation 0.02, standard error
    0.02 / sqrt 3 = 0.01155; t at 97.5 % with 2 degrees of freedom is 4.303: half-width 0.0497."""
    mean, se, half = tables.interval([0.10, 0.12, 0.14])
    assert math.isclose(mean, 0.12) and math.isclose(se, 0.02 / math.sqrt(3)) \
        and math.isclose(half, 0.04969, rel_tol=1e-3)
    assert tables.paired_verdict([0.10, 0.12, 0.14]) == \
        "+0.120 (SE 0.012; 95 % CI +0.07 to +0.17, t with 2 df) over 3 seeds: holds"
    # twice the standard error is not enough on 2 degrees of freedom: 0.1 +- 0.0577 covers 0
    assert tables.paired_verdict([0.0, 0.1, 0.2]).endswith("not distinguishable at 3 seeds")
    # the evaluation's own noise: 64 problems at p = 0.5 over 3 seeds, sqrt(0.25 / 64 / 3) = 0.0361
    assert math.isclose(tables.noise_floor([0.4, 0.6], 64, 3), 0.0361, rel_tol=1e-3)
    assert tables.paired_verdict([0.10, 0.12, 0.14], floor=0.05) == \
        "+0.120 (SE 0.050; 95 % CI -0.10 to +0.34, t with 2 df) over 3 seeds: " \
        "not distinguishable at 3 seeds"
    # beyond 30 df: 30's value
    assert tables.interval([0.1] * 40, floor=0.01)[2] == pytest.approx(0.02042)
    assert tables.paired_verdict([0.1]) == "+0.100 on one seed: no verdict"


def test_each_tabulated_t_leaves_2_5_percent_in_its_upper_tail():
    """Student's t distribution with df degrees of freedom, integrated here (Simpson's rule over
    its density): each value of T95 has CDF 0.975, within what rounding it to three decimals
    moves (a value of another df, or a quantile of another level, is far outside)."""
    def density(t: float, df: int) -> float:
        log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
        return math.exp(log_c - (df + 1) / 2 * math.log1p(t * t / df))

    def cdf(x: float, df: int, n: int = 2000) -> float:  # 0.5 + the integral over [0, x]
        h = x / n
        inner = sum((4 if i % 2 else 2) * density(i * h, df) for i in range(1, n))
        return 0.5 + h / 3 * (density(0.0, df) + inner + density(x, df))

    assert len(tables.T95) == 30
    for df, t in enumerate(tables.T95, start=1):
        assert abs(cdf(t, df) - 0.975) <= 0.0006 * density(t, df), (df, t, cdf(t, df))


def test_the_findings_by_hand():
    """Differences paired by seed over three seeds, on a million problems so that the evaluation's
    noise floor does not matter. Voting shared ends 0.6, 0.6, 0.9 against the single agent's 0.6,
    0.5, 0.7: differences 0, 0.1, 0.2, mean 0.1, standard error 0.1 / sqrt 3, half-width 0.248."""
    seeds, n = "012", 10 ** 6
    by_cell = {"single-shared": {s: fake_run("single", "shared", [0.4, 0.5, e], problems=n)
                                 for s, e in zip(seeds, (0.6, 0.5, 0.7))},
               "voting-shared": {s: fake_run("voting", "shared", [0.4, 0.6, e], problems=n)
                                 for s, e in zip(seeds, (0.6, 0.6, 0.9))},
               "voting-isolated": {s: fake_run("voting", "isolated", [0.4, 0.8, e], problems=n)
                                   for s, e in zip(seeds, (0.5, 0.3, 0.4))},
               "eval_opt-shared": {s: fake_run("eval_opt", "shared", [0.5, 0.4, 0.2], problems=n)
                                   for s in seeds}}
    numbers = tables.accuracy_numbers(*by_cell["voting-isolated"]["1"])
    assert numbers["peak"] == 0.8 and math.isclose(numbers["peak - end"], 0.5)
    assert math.isclose(numbers["end - middle"], -0.5) \
        and math.isclose(numbers["end - start"], -0.1)
    lines = tables.claims(by_cell)
    for expected in [
            # ends - 0.4 = 0.2, 0.2, 0.5: mean 0.3, sd sqrt(0.03), se 0.1, half-width 0.43
            "- multi-agent RL above its base, voting-shared: end - start +0.300 (SE 0.100; 95 % CI "
            "-0.13 to +0.73, t with 2 df) over 3 seeds: not distinguishable at 3 seeds",
            "- multi-agent RL above single-agent RL, voting-shared: end - single's end +0.100 "
            "(SE 0.058; 95 % CI -0.15 to +0.35, t with 2 df) over 3 seeds: "
            "not distinguishable at 3 seeds",
            # -0.3 on every seed: no spread but the evaluation's noise, the opposite holds
            "- multi-agent RL above its base, eval_opt-shared: end - start -0.300 (SE 0.000; 95 % "
            "CI -0.30 to -0.30, t with 2 df) over 3 seeds: the opposite holds",
            # peaks 0.8 against 0.6, 0.6, 0.9: 0.2, 0.2, -0.1
            "- isolated peaks higher, voting: peak - shared's peak +0.100 (SE 0.100; 95 % CI -0.33 "
            "to +0.53, t with 2 df) over 3 seeds: not distinguishable at 3 seeds",
            "- shared plateaus, eval_opt: end - middle -0.200 (SE 0.000; 95 % CI -0.20 to -0.20, t "
            "with 2 df) over 3 seeds: the opposite holds (a plateau: not distinguishable from 0)"]:
        assert expected in lines, (expected, lines)
    # no isolated cell to compare
    assert not any("isolated peaks higher, eval_opt" in line for line in lines)
    # evaluated at the start and the end only: no middle, and no plateau to claim
    ends = {s: ({**config, "eval_every": 4}, [rows[0], rows[-1]])
            for s, (config, rows) in by_cell["eval_opt-shared"].items()}
    assert math.isnan(tables.accuracy_numbers(*ends["0"])["end - middle"])
    assert not any("shared plateaus" in line for line in tables.claims({"eval_opt-shared": ends}))
    table = tables.main_table(by_cell)
    assert ("| voting-isolated | 0.40 (0.40 to 0.40) | 0.80 (0.80 to 0.80) | 0.40 (0.30 to 0.50) "
            "| 0.40 (0.30 to 0.50) |") in "\n".join(table)
    # on 50 problems the floor decides where the seeds agree: -0.3 on every seed,
    # SE sqrt(p (1 - p) / 150)
    small = {cell: {s: fake_run(c["workflow"], c["sharing"], [r["eval/accuracy"] for r in rows])
                    for s, (c, rows) in runs.items()} for cell, runs in by_cell.items()}
    assert any("eval_opt-shared: end - start -0.300 (SE 0.04" in line
               for line in tables.claims(small))


def test_the_default_runs_gain_and_its_parts_by_hand():
    """Two seeds: the workflow 0.5 -> 0.7 and 0.6 -> 0.7, its first answers 0.5 -> 0.5 and
    0.4 -> 0.6: gains 0.2 and 0.1, of which the first answers' 0 and 0.2, the rest's 0.2 and
    -0.1."""
    def run(acc, first):
        return ({"eval_problems": 96},
                [{"step": 0, "eval/accuracy": acc[0], "eval/first_answer": first[0]},
                 {"step": 10, "eval/accuracy": acc[1], "eval/first_answer": first[1]}])
    lines = tables.gain_table({"1": run((0.6, 0.7), (0.4, 0.6)), "0": run((0.5, 0.7), (0.5, 0.5))})
    assert lines[2:4] == ["| 0 | 0.500 -> 0.700 | 0.500 -> 0.500 | +0.000 -> +0.200 |",
                          "| 1 | 0.600 -> 0.700 | 0.400 -> 0.600 | +0.200 -> +0.100 |"]
    # gains 0.2, 0.1: mean 0.15, se 0.05, t with 1 df 12.706
    assert "- gain of workflow: +0.150 (SE 0.050; 95 % CI -0.49 to +0.79, t with 1 df) " \
           "over 2 seeds: not distinguishable at 2 seeds" in lines
    # a run still going has only its step-0 evaluation, or one before its last step: no gain yet
    config, rows = run((0.6, 0.7), (0.4, 0.6))
    for unfinished in ([rows[0]], [rows[0], {**rows[1], "step": 4}]):
        with pytest.raises(SystemExit, match="seed 2: no evaluation after RL yet"):
            tables.gain_table({"2": ({**config, "steps": 10}, unfinished)})


def test_where_the_signal_went_by_hand():
    """signal_numbers on two constructed steps of Voting under one shared adapter: means over the
    training steps (step 0 is the evaluation before training), empty mini-batches summed over
    adapters."""
    config = {"workflow": "voting", "sharing": "isolated", "n_agents": 3}
    rows = [{"step": 0, "eval/accuracy": 0.5, "eval/first_answer": 0.25},
            {"step": 1, "adv/zero_frac": 0.25, "adapter/generator/empty_batches": 1,
             "adapter/aggregator/empty_batches": 1, "adapter/generator/update_norm": 0.2,
             "adapter/aggregator/update_norm": 0.4, "role/aggregator/adherence": 0.1,
             "reward/mean": 0.25, "role/generator/solved": 0.5},
            {"step": 2, "adv/zero_frac": 0.75, "adapter/generator/empty_batches": 0,
             "adapter/aggregator/empty_batches": 0, "adapter/generator/update_norm": 0.6,
             "adapter/aggregator/update_norm": 0.8, "role/aggregator/adherence": 0.3,
             "eval/accuracy": 0.5, "eval/first_answer": 0.625}]
    got = tables.signal_numbers(config, rows)
    assert math.isclose(got["no contrast"], 0.5) and math.isclose(got["empty mini-batches"], 1.0)
    assert math.isclose(got["update norm"], (0.3 + 0.7) / 2) \
        and math.isclose(got["judge adherence"], 0.2)
    assert got["reward"] == 0.25 and got["crowded solved"] == 0.5  # only step 1 logged them
    # the last evaluation's, not the first's
    assert math.isclose(got["final - first answer"], -0.125)
    assert math.isnan(got["crowded share"]) and math.isnan(got["verdict agrees"]) \
        and math.isnan(got["fallback"])  # not logged here


def test_a_demo_tables_what_each_role_does_not_see_where_a_critic_logged_it():
    """Paper B's information gap (critic.unseen) reaches the critics demo's table: a role's mean
    over the steps that logged it; a GRPO cell, which logs none, shows '-'."""
    config = {"workflow": "orch_workers", "sharing": "shared", "n_agents": 3}
    rows = [{"step": 0, "eval/accuracy": 0.25},
            {"step": 1, "role/worker/unseen": 0.5, "role/synthesizer/unseen": 0.0},
            {"step": 2, "role/worker/unseen": 0.7, "eval/accuracy": 0.5}]
    numbers = tables.cell_numbers(config, rows)
    assert numbers["worker unseen"] == pytest.approx(0.6)
    assert numbers["synthesizer unseen"] == 0.0
    assert math.isnan(numbers["orchestrator unseen"])
    grpo = tables.cell_numbers(config, rows[:1] + [{"step": 2, "eval/accuracy": 0.5}])
    header, _, central, plain = tables.mean_table({"central": [numbers], "grpo": [grpo]})
    column = header.split(" | ").index("worker unseen")
    assert central.split(" | ")[column] == "0.60" and plain.split(" | ")[column] == "-"
    assert "orchestrator unseen" not in header


def test_a_demo_of_two_workflows_tables_each_roles_numbers_where_its_cells_have_them():
    """The optimizer demo sets Voting against a single agent: a number only Voting's roles have
    (the aggregator's) is '-' in the single agent's row, and a column only where a cell logged
    it."""
    voting = {"workflow": "voting", "sharing": "isolated", "n_agents": 3}
    single = {"workflow": "single", "sharing": "isolated", "n_agents": 3}
    rows = [{"step": 0, "eval/accuracy": 0.25},
            {"step": 1, "role/generator/kappa": 1.2, "role/aggregator/adherence": 0.5,
             "eval/accuracy": 0.5}]
    table = tables.demo_table({"isolated": {"0": (voting, rows)},
                               "single": {"0": (single, rows[:1] + [{"step": 1,
                                                                      "eval/accuracy": 0.75}])}})
    header, _, iso, one = ([cell.strip() for cell in line.strip("|").split("|")]
                           for line in table)
    assert "aggregator unseen" not in header and "kappa" in header
    assert iso[header.index("kappa")] == "1.20" and one[header.index("kappa")] == "-"
    assert one[header.index("accuracy end")] == "0.75"


def test_a_grid_run_from_another_directory_finds_its_finished_cells(tmp_path, monkeypatch, capsys):
    """The cells train with the project as their working directory; a relative --out given from
    elsewhere is the caller's: the grid trains and finds its cells there, and a second run
    retrains nothing. --results keeps each run's logs and its printed lines, no checkpoint."""
    monkeypatch.chdir(tmp_path)
    tiny = [*TINY, "--sft_warmup", "2", "--steps", "1"]
    grid.main(["--demo", "capture", "--seeds", "0", "--out", "here", "--results", "kept", *tiny])
    assert os.path.isdir(tmp_path / "here" / "capture" / "seed0" / "start")
    kept = {os.path.relpath(os.path.join(root, name), tmp_path / "kept")
            for root, _, names in os.walk(tmp_path / "kept") for name in names}
    cells = ["start", *grid.DEMOS["capture"].cells]
    assert kept == {f"seed0/{cell}/{name}" for cell in cells for name in grid.LOGS}
    for cell in cells:  # the copy is the run's own, and its log holds the step's line
        here, there = (tmp_path / d / "seed0" / cell for d in ("here/capture", "kept"))
        assert (there / "metrics.jsonl").read_text() == (here / "metrics.jsonl").read_text()
        assert files.load_run(str(there), ROLES)[1][-1]["step"] == (0 if cell == "start" else 1)
    assert "step 1/1" in (tmp_path / "kept" / "seed0" / "shared" / "log.txt").read_text()
    capsys.readouterr()
    grid.main(["--demo", "capture", "--seeds", "0", "--out", "here", *tiny])
    assert "train.py" not in capsys.readouterr().out  # done: nothing trains again


def test_an_interrupted_cell_goes_on_only_with_its_own_settings(tmp_path):
    """A cell with a checkpoint but short of its last step resumes; given another --lr (or any
    setting that acts in it) it is refused as a finished cell is, never trained on under two."""
    flags = [*TINY, "--steps", "1"]
    train.main(train.parse_config([*flags, "--out", str(tmp_path / "cell")]))
    config = json.loads((tmp_path / "cell" / "config.json").read_text())
    (tmp_path / "cell" / "config.json").write_text(json.dumps({**config, "steps": 2}))
    with pytest.raises(SystemExit, match=r"cell was trained with other settings \(--lr 0.01"):
        grid.train_cells(str(tmp_path), [("cell", [*TINY, "--lr", "0.01"])])
