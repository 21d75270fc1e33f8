"""Diagnostics and mitigations: the detectors on synthetic runs, kappa and the fixes on the tiny
model."""
import dataclasses
import json
import math
import os
import random
import re
import shutil

import pytest
import torch

from conftest import make_read_only, update_config
import diagnose
from grpo import damped_step, kl_coefs, loss_weight, set_advantages
from lab import probe, files, settings
from lab import run as lab_run
from lora import add_adapter, adapter_parameters, inject_lora
from measure import gradient_signals
from rollout import Call, Rollout
from tasks import Problem
import train
from workflows import ROLES, adherence, role_of, run_workflow, similarity, slots

# ----------------------------------------------------------------------------
# The output signals

@pytest.mark.parametrize("role, text, expected", [
    ("evaluator", r"The sum is right. \boxed{Correct}", True),
    ("evaluator", r"\boxed{Incorrect}", True),
    ("evaluator", r"It should be 3 + 4 = 7, so \boxed{7}. \boxed{Incorrect}", False),  # solved it
    ("evaluator", "Looks correct to me.", False),  # no boxed verdict
    ("evaluator", "x" * 400 + r" \boxed{Correct}", False),  # an essay, not a verdict
    ("aggregator", r"\boxed{2}", True),
    ("aggregator", r"Candidate 2. \boxed{2}", True),
    ("aggregator", r"\boxed{7}", False),  # not a candidate of three
    ("aggregator", "Candidate 2 is right because " + "it adds up " * 10 + r"\boxed{2}", False),
    ("aggregator", "2", False),
    ("orchestrator", "1. Add the tens.\n2. Count on.", True),
    ("orchestrator", "1. Add: 3 + 4 = 7.\n" + r"\boxed{7}", False),  # solved it
    ("orchestrator", "Just add them.", False),
    ("generator", r"\boxed{7}", None),
    ("synthesizer", "anything", None),
])
def test_adherence_table(role: str, text: str, expected: bool | None) -> None:
    assert adherence(role, text, 3) is expected


def test_similarity() -> None:
    a = ["the answer is seven because three plus four"]
    assert similarity(a, a) == 1.0
    assert similarity(a, ["completely different words go here now"]) == 0.0
    # 6 and 3 word trigrams, 2 shared ("the answer is", "answer is seven"): 2 of 7
    assert similarity(a, ["so the answer is seven"]) == pytest.approx(2 / 7)
    # a set's trigrams are its texts' together, words read in lower case: 2 of a's 6
    assert similarity(["The answer IS", "is seven because"], a) == pytest.approx(2 / 6)
    assert similarity([], a) == 0.0 and similarity(["too short"], ["too short"]) == 0.0


# ----------------------------------------------------------------------------
# The detectors, on run directories written here


def write_run(path, config: dict, rows: list[dict]) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"algo": "grpo", "n_agents": 3, "steps": 10, "eval_problems": 96,
                   "val_problems": 0, **config}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def healthy_rows(roles: list[str], steps: int = 9, calls: int = 16) -> list[dict]:
    """Accuracy and reward rise, adherence and lengths hold, shares stay balanced, gradient norms
    and perplexities flat; `calls` calls of each role per step."""
    rows = [{"step": 0, "eval/accuracy": 0.30}]
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": 0.3 + 0.03 * s}
        for role in roles:
            row.update({f"role/{role}/grad_norm": 0.5, f"role/{role}/grad_share": 1 / len(roles),
                        f"role/{role}/adherence": 0.8, f"role/{role}/ppl": 2.0,
                        f"role/{role}/calls": calls, f"role/{role}/len": 20.0,
                        f"adapter/{role}/update_norm": 0.1})
            row.update({f"role/{role}/sim/{o}": 0.1 for o in roles if o != role})
        if s % 3 == 0:
            row["eval/accuracy"] = 0.30 + 0.05 * s / 3
        rows.append(row)
    return rows


def captured_rows(calls: int = 16) -> list[dict]:
    """Eval-Opt on one shared adapter: the generator takes 90 % of the gradient, the evaluator
    stops giving verdicts and starts writing solutions (longer, more like the generator's);
    accuracy peaks and falls."""
    rows = healthy_rows(["generator", "evaluator"], calls=calls)
    for r in rows[1:]:
        s = r["step"]
        r.update({"role/generator/grad_share": 0.9, "role/evaluator/grad_share": 0.1,
                  "role/evaluator/adherence": max(0.0, 0.9 - 0.12 * s),
                  "role/evaluator/len": 10.0 + 5 * s,
                  "role/evaluator/sim/generator": 0.05 + 0.05 * s})
    accuracy = {3: 0.55, 6: 0.40, 9: 0.25}
    for r in rows:
        if r["step"] in accuracy:
            r["eval/accuracy"] = accuracy[r["step"]]
    return rows


def amplified_rows() -> list[dict]:
    """Voting, isolated, with a val split evaluated every 2 steps (standard error 0.05): at step 6
    the generators' gradients align (kappa 1.6 of sqrt(3) = 1.73) and their gradient norm jumps to
    3x its running median; validation accuracy falls from 0.50 (step 4) to 0.30 (step 8)."""
    rows = healthy_rows(["generator", "aggregator"], steps=12)
    val = {0: 0.40, 2: 0.45, 4: 0.50, 6: 0.48, 8: 0.30, 10: 0.32, 12: 0.33}
    for r in rows:
        if r["step"] in val:
            r.update({"val/accuracy": val[r["step"]], "val/accuracy_se": 0.05})
        if r["step"]:
            r["role/generator/kappa"] = 1.6 if r["step"] == 6 else 1.0
    rows[6]["role/generator/grad_norm"] = 1.5
    return rows


VOTING = {"workflow": "voting", "sharing": "isolated"}


def test_report_names_the_injected_cliff_and_capture_and_writes_plots(tmp_path):
    bad = write_run(tmp_path / "captured",
                    {"workflow": "eval_opt", "sharing": "shared", "eval_problems": 200},
                    captured_rows())
    good = write_run(tmp_path / "healthy", {"workflow": "eval_opt", "sharing": "shared"},
                     healthy_rows(["generator", "evaluator"]))
    path = diagnose.report([bad, good], str(tmp_path / "out"))
    text = open(path).read()
    captured_line = next(l for l in text.splitlines() if l.startswith("- **captured**"))
    # 0.55 -> 0.25 at 200 problems: 2 SE = 2 sqrt((0.55*0.45 + 0.25*0.75) / 200) = 0.093
    assert ("accuracy cliff: test accuracy fell from 0.550 at step 3 (the peak, chosen on test) "
            "to 0.250 at step 9 (-0.300), beyond 2 standard errors of the difference "
            "(0.093)") in captured_line
    assert "role capture: generator holds 90%" in captured_line \
        and "evaluator drifts to it" in captured_line
    assert "- **healthy**: nothing detected" in text
    # a run that never logged the diagnostics (its perplexities it logs every step) is not
    # called healthy without a word
    blind = write_run(tmp_path / "blind", {"workflow": "eval_opt", "sharing": "shared"},
                      [{k: v for k, v in r.items() if not k.endswith(diagnose.DIAGNOSTICS)}
                       for r in healthy_rows(["generator", "evaluator"])])
    blind_text = open(diagnose.report([blind], str(tmp_path / "out2"))).read()
    assert "role/generator/ppl" in open(f"{blind}/metrics.jsonl").read()
    assert ("- **blind**: nothing detected, but no step logged the diagnostics (--diag_every): "
            "capture was not looked for") in blind_text
    for name in ("accuracy", "grad_share", "adherence", "similarity", "ppl"):
        png = tmp_path / "out" / f"{name}.png"
        assert png.exists() and png.stat().st_size > 1000
        assert f"]({name}.png)" in text
    # what --overwrite of a run clears beside it: every plot diagnose.py can draw, and no other
    assert {f"{name}.png" for name in diagnose.PLOTS} == set(files.DERIVED) - {"report.md",
                                                                              "probe.json"}


def test_amplification_fires_on_a_coherent_spike_then_a_validation_fall():
    found = diagnose.findings(VOTING, amplified_rows())
    assert found == ["gradient amplification: generator (N=3), its gradient norm spikes to 1.5 "
                     "(3.0x its running median) at step 6, kappa 1.60 (sqrt(N) = 1.73); then val "
                     "accuracy falls from 0.500 at step 4 to 0.300 at step 8, beyond 2 standard "
                     "errors of the difference (0.141)"]
    no_kappa = [{k: v for k, v in r.items() if not k.endswith("kappa")} for r in amplified_rows()]
    # kappa only where measured
    assert "kappa not logged" in diagnose.find_amplification(VOTING, no_kappa)[0]
    ppl = amplified_rows()
    # 1.5x the median of 2.0
    ppl[6]["role/generator/grad_norm"], ppl[6]["role/generator/ppl"] = 0.5, 3.0
    assert "its perplexity spikes to 3 (1.5x" in diagnose.find_amplification(VOTING, ppl)[0]


@pytest.mark.parametrize("change", ["no val fall", "fall within noise", "fall too late",
                                    "fall on test only", "incoherent", "one slot", "shared adapter",
                                    "update norm only", "early steps"])
def test_amplification_does_not_fire(change):
    rows, config = amplified_rows(), VOTING
    val = [r for r in rows if "val/accuracy" in r]
    if change == "no val fall":  # the spike, and validation keeps its level
        for r in val[3:]:
            r["val/accuracy"] = 0.50
    elif change == "fall within noise":  # 0.20 against 2 sqrt(0.1^2 + 0.1^2) = 0.283
        for r in val:
            r["val/accuracy_se"] = 0.10
    elif change == "fall too late":  # the fall shows at step 12, 6 steps after the spike
        for r in val[3:-1]:
            r["val/accuracy"] = 0.50
    elif change == "fall on test only":  # the peak and the fall are judged on val where it exists
        for r in val[3:]:
            r["val/accuracy"] = 0.50
        rows[8]["eval/accuracy"] = 0.0
    elif change == "incoherent":  # kappa measured at the spike, well below 0.8 sqrt(3) = 1.39
        rows[6]["role/generator/kappa"] = 1.1
    elif change == "one slot":
        # the same spike on a role with one slot: no same-role gradients to align
        rows[6]["role/generator/grad_norm"], rows[6]["role/aggregator/grad_norm"] = 0.5, 1.5
    elif change == "shared adapter":
        # the same history under one adapter for every role: not a same-role adapter
        config = {**VOTING, "sharing": "shared"}
    elif change == "update norm only":
        # the old signal: an update-norm jump is not the paper's signature
        rows[6]["role/generator/grad_norm"], rows[6]["adapter/generator/update_norm"] = 0.5, 1.0
    elif change == "early steps":  # under 3 steps of history: no running median yet
        rows[6]["role/generator/grad_norm"], rows[3]["role/generator/grad_norm"] = 0.5, 1.5
        rows[3]["role/generator/kappa"] = 1.6  # aligned there too: only the history is short
        for r in val[2:]:
            r["val/accuracy"] = 0.30
    assert diagnose.find_amplification(config, rows) == []


def test_spikes_are_measured_against_the_running_median():
    values = list(enumerate([9.0, 1.0, 1.0, 1.0, 1.0, 2.5, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]))
    # step 3: 1.0 < 2 x median(9, 1, 1); step 5: 2.5 >= 2 x median(9, 1, 1, 1, 1) = 2; step 11: the
    # window of 5 holds 1.0 only, so 2.0 is a spike too, however large step 0 was
    assert diagnose.spikes(values, 2.0) == [(5, 2.5, 1.0), (11, 2.0, 1.0)]
    # a median of 0: no signal yet
    assert diagnose.spikes([(0, 0.0), (1, 0.0), (2, 0.0), (3, 1.0)], 2.0) == []


def test_the_running_median_is_over_the_last_five_values():
    """Before step 6, the last 5 values (1, 1, 10, 10, 1) have median 1, so 2.5 is a spike; the
    last 4 or 6 have median 5.5, and at step 4 the last 3 (1, 1, 10) would call 10 a spike."""
    values = list(enumerate([10.0, 1.0, 1.0, 10.0, 10.0, 1.0, 2.5]))
    assert diagnose.spikes(values, 2.0) == [(3, 10.0, 1.0), (6, 2.5, 1.0)]


def test_a_mean_over_steps_weighs_each_by_its_calls():
    """Adherence 1.0 over 10 calls and 0.0 over 30 (a step without it does not count): 10 of 40."""
    rows = [{"role/evaluator/adherence": 1.0, "role/evaluator/calls": 10},
            {"role/evaluator/adherence": 0.0, "role/evaluator/calls": 30},
            {"role/evaluator/calls": 50}]
    assert diagnose.weighted(rows, "evaluator", "adherence") == (0.25, 40)
    assert diagnose.weighted(rows[2:], "evaluator", "adherence") == (None, 0)


def test_the_peak_is_the_earliest_of_equal_bests():
    rows = [{"step": s, "eval/accuracy": a} for s, a in [(0, 0.5), (2, 0.9), (4, 0.9)]]
    assert diagnose.peak_step(rows, [0, 2, 4]) == 2


def test_the_dip_s_low_is_chosen_on_val_and_read_on_test():
    """Val peaks at step 0 and is lowest at step 4; test is lowest at step 2 (0.30), a lucky low
    that choosing on test would report. Read at step 4, test fell 0.15, beyond 2 standard errors
    of the difference (2 sqrt(0.05^2 + 0.05^2) = 0.141); to the end, 0.10, within them."""
    test = {0: 0.60, 2: 0.30, 4: 0.45, 6: 0.50}
    val = {0: 0.60, 2: 0.50, 4: 0.30, 6: 0.50}
    rows = [{"step": s, "eval/accuracy": test[s], "eval/accuracy_se": 0.05,
             "val/accuracy": val[s]} for s in test]
    assert diagnose.find_cliff({}, rows) == [
        "accuracy dip: test accuracy fell from 0.600 at step 0 (the peak, chosen on val) to 0.450 "
        "at step 4 (-0.150) and ended at 0.500, beyond 2 standard errors of the difference "
        "(0.141)"]


def test_a_fall_and_partial_recovery_is_a_dip():
    rows = [{"step": s, "eval/accuracy": a} for s, a in [(0, 0.47), (4, 0.22), (8, 0.41)]]
    # 2 SE = 2 sqrt((0.47*0.53 + 0.22*0.78) / 32) = 2 sqrt(0.4207 / 32) = 0.229
    assert diagnose.find_cliff({"eval_problems": 32}, rows, 0.1) == [
        "accuracy dip: test accuracy fell from 0.470 at step 0 (the peak, chosen on test) to 0.220 "
        "at step 4 (-0.250) and ended at 0.410, beyond 2 standard errors of the difference (0.229)"]
    assert diagnose.find_cliff({"eval_problems": 32}, rows, 0.3) == []
    assert diagnose.find_cliff({"eval_problems": 16}, rows, 0.1) == []  # 2 SE = 0.324: within noise
    # no size, no logged error: the floor decides
    assert "noise unknown" in diagnose.find_cliff({}, rows, 0.1)[0]


def test_the_cliff_peak_is_chosen_on_val_and_the_logged_error_is_used():
    """Test accuracy 0.60 at step 2 is a lucky evaluation: val does not peak there. Chosen on test,
    the peak is biased up and a fall of 0.25 appears; chosen on val (step 4), the test fall is
    0.05."""
    test = {0: 0.30, 2: 0.60, 4: 0.40, 6: 0.35}
    rows = [{"step": s, "eval/accuracy": a, "eval/accuracy_se": 0.05} for s, a in test.items()]
    # 2 sqrt(0.05^2 + 0.05^2) = 0.141
    assert diagnose.find_cliff({}, rows) == [
        "accuracy cliff: test accuracy fell from 0.600 at step 2 (the peak, chosen on test) to "
        "0.350 at step 6 (-0.250), beyond 2 standard errors of the difference (0.141)"]
    for r, v in zip(rows, (0.30, 0.40, 0.50, 0.45)):
        r["val/accuracy"] = v
    assert diagnose.find_cliff({}, rows) == []
    assert diagnose.summary({"workflow": "single", "sharing": "shared", "algo": "grpo"},
                            rows)["accuracy"] == "0.300 / 0.400 / 0.350"


def test_capture_is_only_looked_for_on_a_shared_adapter():
    assert diagnose.find_capture({"workflow": "eval_opt", "sharing": "isolated"},
                                 captured_rows()) == []
    assert diagnose.find_capture({"workflow": "eval_opt", "sharing": "shared"}, captured_rows())


def test_capture_compares_windows_that_hold_enough_calls():
    """Steps 1-3 against 7-9 (48 evaluator calls each): adherence 0.66 -> 0.02, pooled 0.34,
    2 SE = 2 sqrt(0.34 * 0.66 * 2 / 48) = 0.19; length 20 -> 50 tokens; similarity 0.15 -> 0.45."""
    shared = {"workflow": "eval_opt", "sharing": "shared"}
    assert diagnose.find_capture(shared, captured_rows()) == [
        "role capture: generator holds 90% of the shared gradient on average, and evaluator drifts "
        "to it over steps 1-3 (48 calls) against 7-9 (48): its adherence falls from 0.66 to 0.02 "
        "(2 standard errors: 0.19), its length grows from 20 to 50 tokens, its similarity to "
        "generator rises from 0.15 to 0.45"]
    # 8 calls a step over 6 steps: each window needs 4 steps to hold 32 calls, so they would
    # overlap (steps 1-4 and 3-6, adherence 0.75 and 0.25) and say nothing, however steep the fall
    steep = captured_rows(calls=8)[:7]
    for r, kept in zip(steep[1:], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]):
        r["role/evaluator/adherence"] = kept
    assert diagnose.find_capture(shared, steep) == []
    # 6 calls a step: the first third is widened to steps 1-6 (36 calls), the last to steps 4-9
    assert diagnose.find_capture(shared, captured_rows(calls=6)) == []


def test_capture_needs_a_fall_beyond_noise_and_the_role_turning_into_the_dominant_one():
    shared = {"workflow": "eval_opt", "sharing": "shared"}
    def rows_with(calls: int, adherence: list[float]) -> list[dict]:
        rows = captured_rows(calls)
        for r, a in zip(rows[1:], adherence):
            r["role/evaluator/adherence"] = a
        return rows
    # a fall of 0.22, at 33 or at 120 calls a window
    adherence = [0.6] * 3 + [0.45] * 3 + [0.38] * 3
    # 33 calls: pooled 0.49, 2 SE = 2 sqrt(0.49 * 0.51 * 2 / 33) = 0.246 > 0.22
    assert diagnose.find_capture(shared, rows_with(11, adherence)) == []
    assert "(2 standard errors: 0.13)" in diagnose.find_capture(shared, rows_with(40, adherence))[0]
    same_length = captured_rows()
    # it breaks its format but writes no more: not the generator's behaviour
    for r in same_length[1:]:
        r["role/evaluator/len"] = 20.0
    assert diagnose.find_capture(shared, same_length) == []
    unlike = captured_rows()
    for r in unlike[1:]:
        r["role/evaluator/sim/generator"] = 0.1
    assert diagnose.find_capture(shared, unlike) == []
    balanced = captured_rows()
    for r in balanced[1:]:  # no dominant role: 60 % is below 70 %
        r["role/generator/grad_share"], r["role/evaluator/grad_share"] = 0.6, 0.4
    assert diagnose.find_capture(shared, balanced) == []


def test_diagnose_rejects_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        diagnose.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="a run directory's name is empty"):
        diagnose.main([""])
    (tmp_path / "notes.txt").write_text("mine")
    # a file: not made the report's directory
    with pytest.raises(SystemExit, match="notes.txt: no metrics.jsonl"):
        diagnose.main([str(tmp_path / "notes.txt")])
    run = write_run(tmp_path / "run", {"workflow": "single", "sharing": "shared"},
                    healthy_rows(["generator"]))
    with pytest.raises(SystemExit, match=re.escape("notes.txt: cannot write report.md there "
                                                   "(a file, not a dir")):
        diagnose.main([run, "--out", str(tmp_path / "notes.txt")])
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("config, metrics, words", [
    ({}, None, "config.json lacks workflow, sharing, algo, n_agents, steps, eval_problems, "
               "val_problems"),
    ({"workflow": "bogus"}, None,
     "config.json: workflow 'bogus' is not one of single, eval_opt, voting, orch_workers"),
    ({"sharing": 1}, None, "config.json: sharing is 1, not a string"),
    ({"n_agents": "3"}, None, 'config.json: n_agents is "3", not a whole number'),
    (None, '{"step": 0, "eval/accuracy": null}\n',
     "metrics.jsonl, step 0: eval/accuracy is null, not a number"),
    (None, '{"step": 0, "eval/accuracy": "0.5"}\n',
     'metrics.jsonl, step 0: eval/accuracy is "0.5", not a number'),
    (None, b"\xff\xfe\x00\x81\n", "metrics.jsonl is not text; the log is damaged"),
    (None, '{"step": 2, "eval/accuracy": 0.75}\n',
     r"metrics.jsonl begins at step 2, not at step 0 \(the evaluation before training\)"),
    (None, '{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 2}\n{"step": 0}\n',
     r"metrics.jsonl: step 2 follows step 2 \(a damaged log\)"),
    (None, "a directory", r"metrics.jsonl cannot be read \(Is a directory\)"),
])
def test_damaged_run_files_are_one_line_errors(tmp_path, config, metrics, words):
    """What diagnose.py reads of a run is checked as it is read: a config lacking a setting or
    holding an unknown value, a metric that is not a number, a log that is not text or not a
    file."""
    run = write_run(tmp_path / "run", {"workflow": "voting", "sharing": "isolated"},
                    healthy_rows(["generator", "aggregator"]))
    if config is not None:
        saved = {} if config == {} else {**json.load(open(f"{run}/config.json")), **config}
        with open(f"{run}/config.json", "w") as f:
            json.dump(saved, f)
    if metrics == "a directory":
        os.remove(f"{run}/metrics.jsonl")
        os.mkdir(f"{run}/metrics.jsonl")
    elif metrics is not None:
        with open(f"{run}/metrics.jsonl", "wb") as f:
            f.write(metrics if isinstance(metrics, bytes) else metrics.encode())
    with pytest.raises(SystemExit, match=f"^{re.escape(run)}[/:] ?{words}"):
        diagnose.main([run])


def test_runs_of_one_name_are_refused_not_merged(tmp_path):
    """The report keys runs by their directory's name: a second run of a name would replace the
    first and the report would show one row for two runs."""
    a, b = (write_run(tmp_path / side / "run", {"workflow": "single", "sharing": "shared"},
                      healthy_rows(["generator"])) for side in ("a", "b"))
    with pytest.raises(SystemExit, match=re.escape(f"{a} and {b} are both named run")):
        diagnose.main([a, b, "--out", str(tmp_path / "out")])
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("argv, words", [
    (["--probe", "R/ckpt", "R"], "run directories and --probe given together"),
    (["--probe", "R/ckpt", "--watch", "R", "Q"], "--probe and --watch given together"),
    (["R", "--watch", "R", "Q"], "run directories and --watch given together"),
    (["R", "--sample"], "--sample goes with --watch only; with run directories it would be "
                        "ignored"),
    (["--probe", "R/ckpt", "--sample"], "--sample goes with --watch only"),
    (["--watch", "R", "Q", "--probe_problems", "4"], "--probe_problems goes with --probe only"),
    (["--watch", "R", "Q", "--out", "elsewhere"], "--out goes with run directories only"),
    (["--watch", "R", "Q", "--sample", "--out", "d"], "--out goes with run directories only"),
    (["R", "--seed", "3"],
     "--seed goes with --probe or --watch --sample only; with run directories it would be ignored"),
    (["--watch", "R", "Q", "--seed=3"], "--seed goes with --probe or --watch --sample only"),
    (["--probe", "R/ckpt", "--probe_problems", "4,,8"],
     "--probe_problems 4,,8: not whole numbers separated by commas"),
    (["--probe", "R/ckpt", "--probe_problems", "4,4"],
     "--probe_problems 4,4: a batch size is given twice"),
    (["R", "--out", ""], "--out is empty: name the directory for report.md"),
    (["--watch", "R", " "], "--watch RUN QUESTION: the question is empty"),
])
def test_flags_that_would_be_ignored_are_refused_before_any_work(argv, words, monkeypatch):
    for name in ("probe", "watch", "report", "load_run"):
        monkeypatch.setattr(diagnose, name, lambda *a, **k: pytest.fail("work began"))
    with pytest.raises(SystemExit, match=f"^{re.escape(words)}"):
        diagnose.main(argv)


def full_run(path, **settings) -> str:
    """A run directory as train.py leaves it, but for its checkpoint (an empty state.pt): every
    setting in config.json, a step-0 row."""
    config = dataclasses.asdict(train.Config(model="tiny", out=str(path), **settings))
    run = write_run(path, config, [{"step": 0, "eval/accuracy": 0.5}])
    os.makedirs(f"{run}/ckpt")
    open(f"{run}/ckpt/state.pt", "w").close()
    return run


def test_watch_and_probe_refuse_a_config_that_lacks_a_setting_or_an_empty_log(tmp_path,
                                                                             monkeypatch):
    """Config(**saved) would give a lost setting its default (a Voting run watched as Eval-Opt);
    an empty log is named as it is, not blamed on config.json. Before the model loads."""
    monkeypatch.setattr(probe, "load_policy", lambda *a: pytest.fail("the model loaded first"))
    run = full_run(tmp_path / "run", workflow="voting", sharing="isolated")
    saved = json.load(open(f"{run}/config.json"))
    for lost in ("lora_r", "workflow"):
        with open(f"{run}/config.json", "w") as f:
            json.dump({k: v for k, v in saved.items() if k != lost}, f)
        for argv in (["--watch", run, "What is 2 + 3?"], ["--probe", f"{run}/ckpt"]):
            with pytest.raises(SystemExit, match=rf"^{re.escape(run)}/config.json lacks {lost}\b"):
                diagnose.main(argv)
    with open(f"{run}/config.json", "w") as f:
        json.dump(saved, f)
    open(f"{run}/metrics.jsonl", "w").close()
    for argv in (["--watch", run, "What is 2 + 3?"], ["--probe", f"{run}/ckpt"]):
        with pytest.raises(SystemExit, match=f"^{re.escape(run)}: metrics.jsonl is empty"):
            diagnose.main(argv)


def test_probe_refuses_a_group_of_one_and_writes_no_infinity(tmp_path, monkeypatch, capsys):
    """With --group_size 1 (an --algo maac run) every GRPO advantage of the probe is 0: refused
    before the model loads. Where kappa's episodes to align cannot be estimated (no probe with a
    coherence), they are said not measured, and probe.json holds null, not Infinity."""
    monkeypatch.setattr(probe, "load_policy", lambda *a: pytest.fail("the model loaded first"))
    lone = full_run(tmp_path / "lone", workflow="voting", algo="maac", group_size=1)
    with pytest.raises(SystemExit, match=re.escape(f"--probe {lone}/ckpt: its run's group_size "
                                                   "is 1; the probe's GRPO advantages need >= 2")):
        diagnose.main(["--probe", f"{lone}/ckpt"])
    run = full_run(tmp_path / "run", workflow="voting", sharing="isolated")
    flat = [{"episodes": 8, "reward/mean": 0.0}, {"episodes": 16, "reward/mean": math.nan}]
    monkeypatch.setattr(diagnose, "probe", lambda *a: flat)
    diagnose.main(["--probe", f"{run}/ckpt", "--probe_problems", "2,4"])
    assert "generator: kappa would reach 0.8 sqrt(N) (not measured: no probe size had a reward " \
        "contrast)" in capsys.readouterr().out
    text = open(f"{run}/probe.json").read()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == {"probes": [flat[0], {"episodes": 16, "reward/mean": None}],
                                "episodes_to_align": {"generator": None}}
    apart = [{"episodes": 8, "role/generator/coherence": -0.1},
             {"episodes": 16, "role/generator/coherence": 0.2}]
    monkeypatch.setattr(diagnose, "probe", lambda *a: apart)
    diagnose.main(["--probe", f"{run}/ckpt", "--probe_problems", "2,4"])
    assert "generator: kappa would reach 0.8 sqrt(N) never" in capsys.readouterr().out
    assert json.load(open(f"{run}/probe.json"))["episodes_to_align"] == {"generator": "never"}


def test_a_read_only_run_is_diagnosed_and_probed_only_where_it_can_be_written(tmp_path,
                                                                              monkeypatch):
    run = write_run(tmp_path / "run", {"workflow": "single", "sharing": "shared"},
                    healthy_rows(["generator"]))
    make_read_only(run, monkeypatch)
    with pytest.raises(SystemExit,
                       match=re.escape(f"{run}: cannot write report.md there (read-only)")):
        diagnose.main([run])
    assert os.path.exists(diagnose.report([run], str(tmp_path / "elsewhere")))


# ----------------------------------------------------------------------------
# Loss weights and coherence damping, by hand


def call(role: str, slot: str, tokens: int) -> Call:
    return Call(episode=0, role=role, slot=slot, stage=0, prompt_ids=[1],
                completion_ids=[2] * tokens, prompt="", text="")


def test_loss_weight_by_hand():
    mb = ([call("generator", f"generator{i}", 4) for i in range(3)]
          + [call("aggregator", "aggregator", 2)])
    assert loss_weight(mb, "generator", "none") == (1.0, 4, 14)
    assert loss_weight(mb, "generator", "role") == (0.5, 3, 12)  # two roles, each averaged alone
    assert loss_weight(mb, "aggregator", "role") == (0.5, 1, 2)
    assert loss_weight(mb, "generator", "multiplicity") == (pytest.approx(1 / 3), 4, 14)
    assert loss_weight(mb, "aggregator", "multiplicity") == (1.0, 4, 14)


def test_damped_step_by_hand():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    ema = {}
    w.grad = torch.tensor([1.0, 0.0])
    assert damped_step(opt, [w], ema, damping=0.5) == 1.0  # no history yet: a full step
    assert w.tolist() == [-1.0, 0.0]
    w.grad = torch.tensor([2.0, 0.0])  # the same direction again: cos 1, step halved
    assert damped_step(opt, [w], ema, damping=0.5) == pytest.approx(0.5)
    assert w.tolist() == pytest.approx([-2.0, 0.0])
    assert ema["g"].tolist() == pytest.approx([0.9 * 1 + 0.1 * 2, 0.0])
    w.grad = torch.tensor([-1.0, 0.0])  # against the history: no damping (max(0, cos))
    assert damped_step(opt, [w], ema, damping=0.5) == 1.0
    assert opt.param_groups[0]["lr"] == 1.0  # the schedule's learning rate is untouched


# ----------------------------------------------------------------------------
# Kappa and the mitigations on the tiny model


def with_adapters(tiny):
    """The tiny model with isolated generator and aggregator adapters whose B is not 0, so that
    every LoRA weight gets a gradient."""
    model, tok = tiny
    inject_lora(model, r=4, alpha=8)
    torch.manual_seed(0)
    for name in ("generator", "aggregator"):
        add_adapter(model, name)
        for p in adapter_parameters(model, name):
            torch.nn.init.normal_(p, std=0.05)
            p.requires_grad_(True)
            p.grad = torch.zeros_like(p)
    return model, tok


def voting_calls(tiny, episodes: int, reward_of, seed: int = 0) -> list[Call]:
    """One question, `episodes` Voting episodes of one-token outputs (isolated adapters); each
    episode's reward, `reward_of(its generator calls)`, is broadcast to all of its calls."""
    model, tok = tiny
    torch.manual_seed(seed)
    rollout = Rollout(model, tok, "isolated", max_new_tokens=1, temperature=1.0)
    run_workflow("voting", ["Say one word."] * episodes, rollout, "math")
    for e in range(episodes):
        reward = reward_of([c for c in rollout.calls if c.episode == e and c.role == "generator"])
        for c in rollout.calls:
            if c.episode == e:
                c.reward = reward
    set_advantages(rollout.calls, [0] * episodes, "slot")
    return rollout.calls


def measure(tiny, calls: list[Call], adapter: str, balance: str = "none") -> dict[str, float]:
    """Per-slot gradient statistics of all `calls` in one batch, without moving the adapter."""
    model, tok = tiny
    settings = update_config(one_step=True, micro_batch_tokens=4096,
                              balance=balance)
    stats = gradient_signals(model, adapter, calls, tok.pad_token_id, settings)
    return {k: v[0] for k, v in stats.items() if len(v) == 1}


def test_same_prompt_and_broadcast_reward_amplify_same_role_gradients(tiny):
    """Paper A's mechanism: three generator slots see one prompt and one reward that depends on all
    of them, so each slot's gradient carries the same direction; kappa = |sum g| / sqrt(sum |g|^2)
    rises well above 1 (sqrt(3) = 1.73 at most). Control: a coin-flip reward, unrelated to the
    outputs. The slots' gradients are then uncorrelated in expectation; one-token outputs give
    them few directions, so one batch is noisy and the control averages four."""
    def share_of_even_tokens(gens):
        return sum(c.completion_ids[:1] != [] and c.completion_ids[0] % 2 == 0
                   for c in gens) / len(gens)
    tiny = with_adapters(tiny)
    gens = [c for c in voting_calls(tiny, 96, share_of_even_tokens) if c.role == "generator"]
    coherent = measure(tiny, gens, "generator")
    assert coherent["role/generator/kappa"] > 1.4 \
        and coherent["role/generator/coherence"] > 0.5, coherent
    control = []
    for seed in range(4):
        coin = random.Random(seed + 1)
        gens = [c for c in voting_calls(tiny, 96, lambda _: float(coin.random() < 0.5), seed)
                if c.role == "generator"]
        control.append(measure(tiny, gens, "generator"))
    assert sum(c["role/generator/kappa"] for c in control) / 4 < 1.25, control
    assert sum(c["role/generator/coherence"] for c in control) / 4 < 0.3, control


def test_role_balance_reweights_the_gradient_shares_by_hand(tiny):
    """Shared adapter, 3 generator calls per aggregator call. Without balancing, a role's gradient
    is its part of the mini-batch mean; with --balance role each role's loss is averaged alone and
    halved, so role r's gradient is scaled by N / (2 N_r): shares move towards the aggregator."""
    tiny = with_adapters(tiny)
    calls = voting_calls(tiny, 24, lambda gens: float(sum(gens[0].completion_ids) % 2 == 0))
    for c in calls:  # one shared adapter: measure everything under "generator"'s weights
        c.slot = c.slot if c.role == "generator" else "aggregator"
    plain = measure(tiny, calls, "generator", "none")
    balanced = measure(tiny, calls, "generator", "role")
    n = len(calls)
    n_role = {r: sum(c.role == r for c in calls) for r in ("generator", "aggregator")}
    expected = {r: plain[f"role/{r}/grad_norm"] * n / (2 * n_role[r]) for r in n_role}
    for r in n_role:
        assert balanced[f"role/{r}/grad_norm"] == pytest.approx(expected[r], rel=1e-4)
        assert balanced[f"role/{r}/grad_share"] == pytest.approx(
            expected[r] / sum(expected.values()), rel=1e-4)
    assert balanced["role/aggregator/grad_share"] > plain["role/aggregator/grad_share"]


def odd_length_wins(problems, texts, **settings) -> list[float]:
    return [float(len(t) % 2) for t in texts]


TOY = [Problem(f"toy-{i}", f"Question {i}: reply with the number 7.", "7") for i in range(16)]


def test_isolated_generator_moves_further_than_a_single_agent_and_one_step_evens_it(tmp_path,
                                                                                    monkeypatch):
    """Same data and learning rate: Voting's generator adapter gets three slots' calls, so three
    times the optimizer steps and a larger update than the single agent's; --one_step removes it."""
    monkeypatch.setattr(lab_run, "load_task", lambda *args: TOY)
    monkeypatch.setattr(train, "score_batch", odd_length_wins)  # reward contrast in every group
    norms = {}
    for name, kw in [("single", dict(workflow="single", one_step=False)),
                     ("voting", dict(workflow="voting", one_step=False)),
                     ("one_step", dict(workflow="voting", one_step=True))]:
        out = str(tmp_path / name)
        cfg = train.Config(model="tiny", sharing="isolated", steps=1, problems_per_step=4,
                           group_size=8, max_new_tokens=16, truncated="keep", temperature=1.0,
                           lr=1e-2, warmup_steps=0, lora_r=4, minibatch_size=16, eval_problems=1,
                           out=out, **kw)
        train.main(cfg)
        last = [json.loads(l) for l in open(f"{out}/metrics.jsonl")][-1]
        norms[name] = last["adapter/generator/update_norm"]
    assert norms["voting"] > 1.5 * norms["single"], norms
    assert norms["one_step"] < 1.1 * norms["single"], norms


def test_episodes_to_align_extrapolates_the_cosine_to_the_detectors_line():
    """cos = 1 / (1 + b / n) with b = 48: 0.25 at 16 episodes, 0.4 at 32. For N = 3 the line is
    kappa >= 0.8 sqrt(3), that is cos >= (0.64 * 3 - 1) / 2 = 0.46, reached at
    n = 48 * 0.46 / 0.54."""
    # 8: no reward contrast, nothing measured
    probes = [{"episodes": 8}, {"episodes": 16, "role/generator/coherence": 0.25},
              {"episodes": 32, "role/generator/coherence": 0.4}]
    assert (probe.episodes_to_align(probes, "generator", 3, diagnose.KAPPA_FRAC)
            == pytest.approx(48 * 0.46 / 0.54))
    probes[1]["role/generator/coherence"] = -0.02  # no shared direction measured at one size
    assert probe.episodes_to_align(probes, "generator", 3, diagnose.KAPPA_FRAC) == math.inf
    # nothing measured at all
    assert probe.episodes_to_align(probes[:1], "generator", 3, diagnose.KAPPA_FRAC) is None


def test_a_run_is_read_back_with_its_lora_targets_as_train_py_read_them(tmp_path):
    """--lora_targets "q_proj, v_proj" (a space after the comma) trains; --probe and --watch load
    the same layers from its config."""
    out = str(tmp_path / "run")
    train.main(train.Config(model="tiny", workflow="single", steps=0, eval_problems=1,
                            max_new_tokens=4, lora_r=4, lora_targets="q_proj, v_proj", out=out))
    _, model, _, _ = probe.trained_model(f"{out}/ckpt")
    assert {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
            if type(m).__name__ == "LoRALinear"} == {"q_proj", "v_proj"}


def test_probe_measures_a_checkpoint(tmp_path, monkeypatch, capsys):
    # as many toy problems as each split asks for: the run's config keeps the default pool size,
    # from which the probe draws its own (arith) problems
    monkeypatch.setattr(lab_run, "load_task",
                        lambda task, split, n, *args: (TOY * (n // len(TOY) + 1))[:n])
    monkeypatch.setattr(train, "score_batch", odd_length_wins)
    out = str(tmp_path / "run")
    train.main(train.Config(model="tiny", workflow="voting", sharing="shared", steps=1,
                            problems_per_step=2, group_size=8, max_new_tokens=16, truncated="keep",
                            temperature=1.0, lora_r=4, eval_problems=1, out=out))
    diagnose.main(["--probe", f"{out}/ckpt", "--probe_problems", "2,4", "--probe_credit", "final"])
    small, result = json.load(open(f"{out}/probe.json"))["probes"]
    assert {"reward/mean", "slot/generator0/grad_norm", "role/aggregator/grad_norm"} <= set(result)
    assert 0 < result["role/generator/kappa"] <= 3 ** 0.5 + 1e-6 \
        and (small["episodes"], result["episodes"]) == (16, 32)
    assert "role/generator" in capsys.readouterr().out
    diagnose.main(["--probe", f"{out}/ckpt", "--probe_problems", "4", "--probe_credit", "own"])
    # the same batch, each generator paid for its own
    own = json.load(open(f"{out}/probe.json"))["probes"][0]
    assert own["reward/mean"] == result["reward/mean"] \
        and own["role/generator/grad_norm"] != result["role/generator/grad_norm"]
    diagnose.main(["--probe", f"{out}/ckpt", "--probe_problems", "4", "--seed", "1"])
    other = json.load(open(f"{out}/probe.json"))["probes"][0]  # another batch
    assert other["role/generator/grad_norm"] != result["role/generator/grad_norm"]
    with monkeypatch.context() as m:  # bad input is refused before the model loads
        m.setattr(probe, "load_policy", lambda *a: pytest.fail("the model loaded first"))
        with pytest.raises(SystemExit, match=re.escape("--probe_problems [0]: each must be in "
                                                       "[1, 256] (the run's training pool)")):
            diagnose.main(["--probe", f"{out}/ckpt", "--probe_problems", "0"])
    with pytest.raises(SystemExit):
        diagnose.main(["--probe", f"{out}/ckpt", "--probe_problems", "4;8"])
    make_read_only(out, monkeypatch)  # said before the probe runs, whose result would be lost
    with pytest.raises(SystemExit,
                       match=re.escape(f"{out}: cannot write probe.json there (read-only)")):
        diagnose.main(["--probe", f"{out}/ckpt"])


def test_role_kl_names_must_be_roles_of_the_workflow():
    assert kl_coefs(train.Config(workflow="voting", kl_coef=0.01,
                                          role_kl="aggregator=0.1")) == \
        {"generator": 0.01, "aggregator": 0.1}
    with pytest.raises(ValueError, match="'evaluator' is not a role of voting"):
        kl_coefs(train.Config(workflow="voting", role_kl="evaluator=0.1"))
    with pytest.raises(ValueError, match="not role=number"):
        kl_coefs(train.Config(workflow="voting", role_kl="aggregator=lots"))
    # a blank item is refused, not skipped
    for blank in (",,", "aggregator=0.1,,generator=0.2", "aggregator=0.1,"):
        with pytest.raises(ValueError, match=f"--role_kl {blank}: an empty item between commas"):
            kl_coefs(train.Config(workflow="voting", role_kl=blank))
    assert kl_coefs(train.Config(workflow="voting", role_kl=" ")) == \
        {"generator": 0.0, "aggregator": 0.0}
    # checked as --kl_coef is, not taken for off or trained into NaN
    for value in ("-1", "nan", "inf"):
        with pytest.raises(ValueError,
                           match=re.escape(f"--role_kl aggregator={value}: must be in [0, inf)")):
            kl_coefs(train.Config(workflow="voting",
                                           role_kl=f"generator=0.1, aggregator={value}"))


@pytest.mark.parametrize("workflow,sharing", [("single", "shared"), ("eval_opt", "isolated"),
                                              ("voting", "isolated"), ("orch_workers", "shared")])
def test_watch_prints_every_call_of_a_trained_workflow(workflow, sharing, tmp_path, capsys):
    out = str(tmp_path / "run")
    train.main(train.Config(model="tiny", workflow=workflow, sharing=sharing, steps=1,
                            problems_per_step=1, group_size=2, max_new_tokens=6, lora_r=4,
                            eval_problems=1, out=out))
    capsys.readouterr()
    final = probe.watch(out, "What is 2 + 3?")
    printed = capsys.readouterr().out
    stages = [line for line in printed.splitlines() if line.startswith("=== stage")]
    for slot in slots(workflow):
        adapter = "shared" if sharing == "shared" else role_of(slot)
        assert any(f": {slot} (adapter {adapter})" in line for line in stages), (slot, stages)
    assert printed.count("--- prompt:") == printed.count("--- output:") == len(stages)
    assert "What is 2 + 3?" in printed and f"=== final answer:\n{final}" in printed
    if workflow == "single":  # a question past the model's context is cut, and said to be
        assert "were cut to their head and tail" not in printed
        probe.watch(out, "What is 2 + 3? " * 800)
        assert "=== 1 prompt(s) longer than the model's context" in capsys.readouterr().out


def test_watch_needs_a_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    train.main(train.Config(model="tiny", workflow="single", steps=0, eval_problems=1,
                            lora_r=4, out=out))
    shutil.rmtree(f"{out}/ckpt")  # as a run killed before its step-0 checkpoint leaves it
    with pytest.raises(SystemExit, match="no state.pt"):
        diagnose.main(["--watch", out, "What is 2 + 3?"])


def test_damaged_runs_are_one_line_errors_and_a_torn_last_line_is_dropped(tmp_path, capsys):
    out = str(tmp_path / "run")
    train.main(train.Config(model="tiny", workflow="single", steps=2, eval_every=1, eval_problems=1,
                            lora_r=4, out=out))
    with open(f"{out}/metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # killed while writing
    config, rows = files.load_run(out, ROLES)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for name in ("shared/adapter_model.safetensors",):
        with open(f"{out}/ckpt/{name}", "r+b") as f:
            f.truncate(50)
    with pytest.raises(SystemExit, match="adapters cannot be read"):
        diagnose.main(["--probe", f"{out}/ckpt"])
    open(f"{out}/metrics.jsonl", "w").close()
    with pytest.raises(SystemExit, match="metrics.jsonl is empty"):
        diagnose.main([out])
    os.remove(f"{out}/config.json")
    with pytest.raises(SystemExit, match="no config.json"):
        diagnose.main([out])
