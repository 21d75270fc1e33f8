"""A grid's tables over seeds, from finished runs: Paper A's main table, where each cell's
learning signal went, a demo's signals cell by cell, the default run's gain split at the
generator's first answers, and the plots. Every difference is paired by seed, with its 95 %
interval from Student's t on n - 1 degrees of freedom and a floor from the evaluation's own size;
"not distinguishable" where the interval covers 0.

    python -m lab.grid --demo default --seeds 0,1,2   # trains the cells, then writes these tables

Exercised by: pytest tests/test_grid.py (the intervals against hand-computed ones)
"""
import dataclasses
import math
import re
import statistics
from functools import partial

import matplotlib

matplotlib.use("Agg")  # headless: the plots are files
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from diagnose import KAPPA_FRAC, markdown, multiplicity, peak_step, series
from lab.run import evaluation_samples
from train import Config
from workflows import ROLES

Runs = dict[str, dict[str, tuple[dict, list[dict]]]]  # cell -> seed -> a run's (config, rows)


def accuracy_numbers(config: dict, rows: list[dict]) -> dict[str, float]:
    """Test accuracy at step 0 (the base model in the run's workflow), the peak (chosen on val
    where logged), the end, and the evaluation nearest the middle step (NaN: none inside)."""
    acc = dict(series(rows, "eval/accuracy"))
    steps = sorted(acc)
    peak = acc[peak_step(rows, steps)]
    inside = [step for step in steps if 0 < step < config["steps"]]
    middle = (acc[min(inside, key=lambda step: abs(step - config["steps"] / 2))] if inside
              else math.nan)
    start, end = acc[steps[0]], acc[steps[-1]]
    return {"start": start, "peak": peak, "end": end, "peak - end": peak - end,
            "end - start": end - start, "end - middle": end - middle}


def main_table(by_cell: Runs) -> list[str]:
    """Paper A's main table: a row per cell, accuracy_numbers' means over the seeds (range)."""
    lines = mean_table({cell: [accuracy_numbers(*run) for run in runs.values()]
                        for cell, runs in by_cell.items()})
    configs = [config for runs in by_cell.values() for config, _ in runs.values()]
    fields = {f.name for f in dataclasses.fields(Config)}  # config.json also holds the run's id
    sampled = sorted({c["workflow"] for c in configs
                      if evaluation_samples(Config(**{k: v for k, v in c.items() if k in fields}))})
    decoding = "greedy" + (f" ({', '.join(sampled)}: sampled at the training temperature)"
                           if sampled else "")
    return lines + ["", f"Held-out accuracy, {decoding}, "
                    f"on {configs[0]['eval_problems']} problems, "
                    f"every {configs[0]['eval_every']} of {configs[0]['steps']} steps; "
                    "start = step 0, before any update."]


def nan_mean(values: list[float]) -> float:
    return statistics.mean(values) if values else math.nan


def crowded_and_judge(config: dict) -> tuple[str, str | None]:
    """The role with the most slots, and the workflow's first other role (None: no other)."""
    n = multiplicity(config)
    crowded = max(n, key=n.get)
    return crowded, next((r for r in ROLES[config["workflow"]] if r != crowded), None)


def step_mean(rows: list[dict], pattern: str, per_step=statistics.mean) -> float:
    """per_step(the values of the keys matching `pattern`), meaned over the steps after 0."""
    return nan_mean([per_step(hits) for r in rows if r["step"] > 0
                     if (hits := [v for k, v in r.items() if re.fullmatch(pattern, k)])])


def signal_numbers(config: dict, rows: list[dict]) -> dict[str, float]:
    """Where one run's learning signal went (docs/learning.md), each a mean over its training
    steps, and at the last evaluation the final answer's accuracy against the first one's."""
    crowded, judge = crowded_and_judge(config)
    mean = partial(step_mean, rows)
    last = next(r for r in reversed(rows) if "eval/accuracy" in r)
    return {"reward": mean(r"reward/mean"), "crowded solved": mean(rf"role/{crowded}/solved"),
            "fallback": mean(r"contract/fallback_rate"), "no contrast": mean(r"adv/zero_frac"),
            "empty mini-batches": mean(r"adapter/[^/]+/empty_batches", per_step=sum),
            "update norm": mean(r"adapter/[^/]+/update_norm"),
            "crowded share": mean(rf"role/{crowded}/grad_share"),
            "judge adherence": mean(rf"role/{judge}/adherence") if judge else math.nan,
            "verdict agrees": mean(r"role/evaluator/verdict_acc"),
            "final - first answer": last["eval/accuracy"] - last.get("eval/first_answer", math.nan)}


def by_seed(a: dict[str, dict], b: dict[str, dict], key: str,
            key_b: str | None = None) -> list[float]:
    """a[seed][key] - b[seed][key_b] for every seed both ran: what a seed shares cancels."""
    return [a[s][key] - b[s][key_b or key] for s in sorted(a.keys() & b.keys())]


# Two-sided 95 % critical values of Student's t by degrees of freedom, 1 to 30 (beyond: 30's, a
# little wide). A mean over n seeds has n - 1: with 3 seeds the interval is 4.30 standard errors
# wide on each side, not 2 (|t| = 2 on 2 degrees of freedom is a two-sided p of 0.18).
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
       2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
       2.052, 2.048, 2.045, 2.042)


def noise_floor(accuracies: list[float], problems: int, seeds: int) -> float:
    """One evaluation's binomial standard error over sqrt(seeds) (0.036 for three seeds of 64
    problems near 0.5). A paired difference of evaluations of the same problems errs between 0
    and sqrt(2) times this; the floor takes one evaluation's."""
    p = statistics.mean(accuracies)
    return math.sqrt(p * (1 - p) / problems / seeds)


def interval(diffs: list[float], floor: float = 0.0) -> tuple[float, float, float]:
    """Mean, standard error (at least `floor`) and 95 % t half-width of paired differences."""
    n = len(diffs)
    mean, se = statistics.mean(diffs), max(statistics.stdev(diffs) / math.sqrt(n), floor)
    return mean, se, T95[min(n - 1, len(T95)) - 1] * se


def paired_verdict(diffs: list[float], floor: float = 0.0) -> str:
    """interval() in words: it holds where the interval lies above 0, the opposite below."""
    if len(diffs) < 2:
        return f"{diffs[0] if diffs else math.nan:+.3f} on one seed: no verdict"
    mean, se, half = interval(diffs, floor)
    n = len(diffs)
    holds = ("holds" if mean - half > 0 else "the opposite holds" if mean + half < 0
             else f"not distinguishable at {n} seeds")
    return (f"{round(mean, 3) + 0.0:+.3f} (SE {se:.3f}; "
            f"95 % CI {mean - half:+.2f} to {mean + half:+.2f}, "
            f"t with {n - 1} df) over {n} seeds: {holds}")


def claims(by_cell: Runs) -> list[str]:
    """Paper A's findings, a line each, with this grid's numbers as differences paired by seed."""
    numbers = {cell: {seed: accuracy_numbers(*run) for seed, run in runs.items()}
               for cell, runs in by_cell.items() if runs}
    accuracies = [x[k] for runs in numbers.values() for x in runs.values()
                  for k in ("start", "peak", "end")]
    seeds = min(len(runs) for runs in numbers.values())
    config = next(config for runs in by_cell.values() for config, _ in runs.values())
    verdict = partial(paired_verdict, floor=noise_floor(accuracies, config["eval_problems"], seeds))
    lines = []
    single = numbers.get("single-shared")
    for cell, runs in ((c, r) for c, r in numbers.items() if not c.startswith("single")):
        lines.append(f"multi-agent RL above its base, {cell}: end - start "
                     f"{verdict(by_seed(runs, runs, 'end', 'start'))}")
        if single:
            lines.append(f"multi-agent RL above single-agent RL, {cell}: end - single's end "
                         f"{verdict(by_seed(runs, single, 'end'))}")
    for w in sorted({c.rsplit("-", 1)[0] for c in numbers}):
        iso, sh = numbers.get(f"{w}-isolated"), numbers.get(f"{w}-shared")
        if iso and sh:
            lines.append(f"isolated peaks higher, {w}: peak - shared's peak "
                         f"{verdict(by_seed(iso, sh, 'peak'))}")
            lines.append(f"isolated falls further at the end, {w}: (peak - end) - shared's "
                         f"{verdict(by_seed(iso, sh, 'peak - end'))}")
        if sh and w != "single" and not any(math.isnan(x["end - middle"]) for x in sh.values()):
            lines.append(f"shared plateaus, {w}: end - middle "
                         f"{verdict([x['end - middle'] for x in sh.values()])} "
                         "(a plateau: not distinguishable from 0)")
    return [f"- {line}" for line in lines] + [
        "", "Each difference is paired by seed: its mean, its standard error over the seeds "
        "(at least the evaluation's own noise, tables.noise_floor) and its 95 % interval from the "
        "t distribution; it holds where the interval excludes 0. The peak is the step chosen on "
        "the val split, read on test: the choice does not bias it upward."]


def cell_series(config: dict, rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The signals the demos follow, step by step, in one run (each role's unseen: maac only)."""
    crowded, judge = crowded_and_judge(config)
    judge = judge or crowded
    adapter = "shared" if config["sharing"] == "shared" else crowded
    keys = {"kappa": f"role/{crowded}/kappa", "update norm": f"adapter/{adapter}/update_norm",
            "adherence": f"role/{judge}/adherence", "reward": "reward/mean",
            "accuracy": "eval/accuracy",
            "explained variance": "critic/explained_variance", "advantage std": "adv/std",
            "gradient noise": f"adapter/{adapter}/grad_noise"}
    keys |= {f"{r} share": f"role/{r}/grad_share" for r in ROLES[config["workflow"]]}
    keys |= {f"{r} unseen": f"role/{r}/unseen" for r in ROLES[config["workflow"]]}
    return {name: series(rows, key) for name, key in keys.items()}


def cell_numbers(config: dict, rows: list[dict]) -> dict[str, float]:
    """What the demos compare; coherent steps: kappa >= the detector's KAPPA_FRAC sqrt(N)."""
    n = max(multiplicity(config).values())
    got = {name: [v for _, v in points] for name, points in cell_series(config, rows).items()}
    kappa, adh, reward, acc = got["kappa"], got["adherence"], got["reward"], got["accuracy"]
    shares = [statistics.mean(vs) for name, vs in got.items() if name.endswith(" share") and vs]
    return {"kappa": nan_mean(kappa),
            "coherent steps": nan_mean([k >= KAPPA_FRAC * math.sqrt(n) for k in kappa]),
            "update norm": nan_mean(got["update norm"]),
            "adherence first": (adh or [math.nan])[0], "adherence last": (adh or [math.nan])[-1],
            "top share": max(shares, default=math.nan),
            "reward first": (reward or [math.nan])[0], "reward last": (reward or [math.nan])[-1],
            "accuracy start": acc[0], "accuracy peak": max(acc), "accuracy end": acc[-1],
            **{k: nan_mean(got[k])
               for k in ("explained variance", "advantage std", "gradient noise")},
            **{k: nan_mean(vs) for k, vs in got.items() if k.endswith(" unseen")}}


def demo_table(by_cell: Runs) -> list[str]:
    return mean_table({cell: [cell_numbers(*run) for run in runs.values()]
                       for cell, runs in by_cell.items()})


def gain_table(runs: dict[str, tuple[dict, list[dict]]]) -> list[str]:
    """Test accuracy before -> after RL seed by seed: the workflow's, its generator's first
    answers' and the rest's, then each gain's paired interval. Each run must have finished."""
    head = ["seed", "workflow", "generator's first answers", "the rest of the workflow adds"]
    gains, accuracies, table = {"workflow": [], "first answers": [], "the rest": []}, [], []
    for seed, (config, rows) in sorted(runs.items(), key=lambda item: int(item[0])):
        first, last = rows[0], rows[-1]
        if len(rows) < 2 or last["step"] != config.get("steps", last["step"]):
            raise SystemExit(f"seed {seed}: no evaluation after RL yet (the last is of step "
                             f"{last['step']}); a gain needs the finished run")
        acc = [first["eval/accuracy"], last["eval/accuracy"]]
        answer = [first["eval/first_answer"], last["eval/first_answer"]]
        rest = [a - b for a, b in zip(acc, answer)]
        for key, pair in zip(gains, (acc, answer, rest)):
            gains[key].append(pair[1] - pair[0])
        accuracies += acc
        table.append([seed, *(f"{a:.3f} -> {b:.3f}" for a, b in (acc, answer)),
                      f"{rest[0]:+.3f} -> {rest[1]:+.3f}"])
    floor = noise_floor(accuracies, config["eval_problems"], len(runs))
    verdicts = [f"- gain of {key}: {paired_verdict(diffs, floor)}" for key, diffs in gains.items()]
    return markdown(head, table) + [""] + verdicts


def mean_table(rows: dict[str, list[dict[str, float]]]) -> list[str]:
    """A row per cell: each number's mean over the seeds, and its range when there are several;
    NaN or absent (not logged, or a role the workflow lacks) is "-"; none logged: no column."""
    every = dict.fromkeys(k for numbers in rows.values() for x in numbers for k in x)  # in order
    keys = [k for k in every if any(not math.isnan(x.get(k, math.nan))
                                    for numbers in rows.values() for x in numbers)]
    table = []
    for cell, numbers in rows.items():
        table.append([cell])
        for k in keys:
            vs = [x[k] for x in numbers if not math.isnan(x.get(k, math.nan))]
            table[-1].append("-" if not vs else f"{vs[0]:.2f}" if len(vs) == 1 else
                             f"{statistics.mean(vs):.2f} ({min(vs):.2f} to {max(vs):.2f})")
    return markdown(["cell", *keys], table)


def seed_table(signal: str, by_cell: Runs) -> list[str]:
    """The signal at every step it was logged, a row per seed and a column per cell."""
    cells = {cell: {seed: cell_series(*run)[signal] for seed, run in runs.items()}
             for cell, runs in by_cell.items()}
    seeds = sorted({seed for runs in cells.values() for seed in runs}, key=int)
    return [f"{signal}, step by step:", ""] + markdown(["seed", *cells], [
        [seed, *(", ".join(f"{v:.2f}" for _, v in runs.get(seed, [])) or "-"
                 for runs in cells.values())] for seed in seeds])


SIGNALS = {"accuracy": "held-out accuracy (test)",
           "explained variance": "the critics' explained variance of the returns",
           "gradient noise": "noise's share of the policy gradient (grad_noise)",
           "kappa": "kappa of the crowded role's slots (dashed: the detector's 0.8 sqrt(N))",
           "update norm": "change of the crowded role's adapter in a step (L2)",
           "adherence": "the supervisory role's calls that keep its contract",
           "generator share": "the generators' share of the shared gradient"}


def demo_plot(signals: tuple[str, ...], by_cell: Runs, path: str) -> str:
    """A panel per signal: every seed of a cell as a thin line, their mean as a thick one."""
    fig, axes = plt.subplots(1, len(signals), figsize=(5.5 * len(signals), 3.8), squeeze=False)
    for ax, signal in zip(axes[0], signals):
        for i, (cell, runs) in enumerate(by_cell.items()):
            curves = [c for c in (dict(cell_series(*run)[signal]) for run in runs.values()) if c]
            if not curves:  # e.g. no gradient share under isolated adapters
                continue
            for c in curves:
                ax.plot(list(c), list(c.values()), color=f"C{i}", alpha=0.25, linewidth=1)
            steps = sorted(set().union(*curves))  # a step's mean is over the seeds that logged it
            ax.plot(steps, [statistics.mean(c[t] for c in curves if t in c) for t in steps],
                    color=f"C{i}", linewidth=2.5, marker="o", markersize=4,
                    label=f"{cell}, {len(curves)} seeds")
        if signal == "kappa":
            config = next(config for runs in by_cell.values() for config, _ in runs.values())
            n = max(multiplicity(config).values())
            ax.axhline(KAPPA_FRAC * math.sqrt(n), color="grey", linestyle="--", linewidth=1)
        ax.set_title(SIGNALS.get(signal, signal), fontsize=9)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged in these runs", ha="center", transform=ax.transAxes)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------
# Paper B in miniature (`--demo critics`): the cells seed by seed, and their paired differences

CRITIC_CELLS = {"grpo": "GRPO", "central": "central", "decentral": "decentral"}


def critics_table(by_cell: Runs, unseen: bool = True) -> list[str]:
    """A row per seed and cell, as docs/learning.md gives it: test accuracy at each evaluation (val
    at the first and the last), the workers' length (first, shortest, last), the critic's explained
    variance's range and step means of the rest; "-" where the run logged none."""
    head = ["seed", "cell", "test accuracy", "worker length", "explained variance",
            "advantage std", "gradient noise"]
    head += ["unseen: worker, synthesizer"] * unseen + ["mean reward"]
    table, seeds = [], sorted({seed for runs in by_cell.values() for seed in runs}, key=int)
    for seed, cell in ((s, c) for s in seeds for c in CRITIC_CELLS if s in by_cell.get(c, {})):
        _, rows = by_cell[cell][seed]
        got = {k: [v for _, v in series(rows, key)] for k, key in (
            ("test", "eval/accuracy"), ("val", "val/accuracy"), ("len", "role/worker/len"),
            ("ev", "critic/explained_variance"), ("adv", "adv/std"),
            ("noise", "adapter/shared/grad_noise"), ("reward", "reward/mean"),
            ("worker", "role/worker/unseen"), ("synthesizer", "role/synthesizer/unseen"))}
        mean = lambda k: f"{statistics.mean(got[k]):.2f}" if got[k] else "-"  # noqa: E731
        parts = [seed, CRITIC_CELLS[cell],
                 ", ".join(f"{a:.2f}" for a in got["test"])
                 + f" (val {got['val'][0]:.2f} -> {got['val'][-1]:.2f})",
                 f"{got['len'][0]:.0f}, {min(got['len']):.0f}, {got['len'][-1]:.0f}",
                 f"{min(got['ev']):+.2f} to {max(got['ev']):+.2f}" if got["ev"] else "-",
                 mean("adv"), mean("noise")]
        if unseen:
            parts.append(f"{mean('worker')}, {mean('synthesizer')}" if got["worker"] else "-")
        table.append(parts + [mean("reward")])
    return markdown(head, table)


def paired_line(diffs: list[float], floor: float = 0.0) -> str:
    """interval() as the docs write it, with "1 df" after it when that is all, and each seed's
    difference: "-0.14 (0.12; -0.65 to +0.38; +0.00, -0.38, -0.03)"."""
    if len(diffs) < 2:
        return f"{diffs[0]:+.2f} on one seed: no interval" if diffs else "no seed logged it"
    mean, se, half = interval(diffs, floor)
    df = "" if len(diffs) > 2 else f", {len(diffs) - 1} df"
    return (f"{mean:+.2f} ({se:.2f}; {mean - half:+.2f} to {mean + half:+.2f}{df}; "
            + ", ".join(f"{d:+.2f}" for d in diffs) + ")")


def critics_differences(by_cell: Runs) -> dict[str, str]:
    """The critics demo's paired differences: each pair of cells' last test accuracy, and central
    minus decentral in the step means of adv/std and grad_noise (where both logged it)."""
    acc = {cell: {seed: accuracy_numbers(*run) for seed, run in runs.items()}
           for cell, runs in by_cell.items()}
    config = next(iter(by_cell["grpo"].values()))[0]
    floor = noise_floor([x[k] for runs in acc.values() for x in runs.values()
                         for k in ("start", "end")], config["eval_problems"], len(acc["grpo"]))
    out = {f"{a} minus {b}": paired_line(by_seed(acc[a], acc[b], "end"), floor)
           for a, b in (("central", "decentral"), ("central", "grpo"), ("decentral", "grpo"))}
    for name, key in (("advantages' spread", "adv/std"),
                      ("noise share", "adapter/shared/grad_noise")):
        a, b = ({seed: statistics.mean(vs) for seed, (_, rows) in by_cell[cell].items()
                 if (vs := [v for _, v in series(rows, key)])} for cell in ("central", "decentral"))
        out[name] = paired_line([a[s] - b[s] for s in sorted(a.keys() & b.keys(), key=int)])
    return out
