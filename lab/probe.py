"""A trained run from its checkpoint: the gradient probe (kappa, coherence and gradient shares
on a fresh batch, no step; from several sizes, where a crowded role's kappa would align), and
the trained workflow watched call by call on one question.

    python diagnose.py --probe runs/a/ckpt              # kappa, coherence, gradient shares
    python diagnose.py --watch runs/a "What is 7 + 5?"  # every call of the trained workflow

Exercised by: pytest tests/test_diagnose.py (--probe, --watch), tests/test_train.py
"""
import dataclasses
import json
import math
import os
import random
import statistics

import torch

from grpo import set_advantages
from lab.checkpoint import read_best
from lab.files import load_run, writable
from lab.settings import check_numbers, lora_targets, read_config
from lora import adapter_for, adapter_parameters, inject_lora, load_adapters, setup_adapters
from measure import gradient_signals
from model import load_policy
from rollout import Rollout
from tasks import TASK_KIND, load_task
import train
from train import Config
from workflows import ROLES, run_workflow


def checkpoint_config(ckpt: str) -> Config:
    """The config of the run that saved `ckpt`, checked as a launch checks it."""
    if not os.path.exists(os.path.join(ckpt, "state.pt")):
        raise SystemExit(f"{ckpt} is not a checkpoint (no state.pt)")
    run_dir = os.path.dirname(os.path.normpath(ckpt))
    load_run(run_dir, ROLES)  # its errors name their own file
    cfg = read_config(os.path.join(run_dir, "config.json"), train.Config)
    try:
        check_numbers(cfg)
    except SystemExit as e:
        raise SystemExit(f"{run_dir}/config.json: {e}") from None
    return cfg


def trained_model(ckpt: str) -> tuple[Config, object, object, list[str]]:
    """The run's config, model, tokenizer and adapter names, its adapters loaded from `ckpt`."""
    cfg = checkpoint_config(ckpt)
    model, tok = load_policy(cfg.model, "cuda" if torch.cuda.is_available() else "cpu", cfg.dtype)
    inject_lora(model, cfg.lora_r, cfg.lora_alpha, lora_targets(cfg))
    names = setup_adapters(model, ROLES[cfg.workflow], cfg.sharing)
    try:
        load_adapters(model, ckpt, names)
    except Exception as e:  # a truncated or foreign adapter file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise SystemExit(f"{ckpt}: the adapters cannot be read "
                         f"({type(e).__name__}: {first})") from None
    return cfg, model, tok, names


def probe(ckpt: str, sizes: list[int], credit: str = "", seed: int = 0) -> list[dict[str, float]]:
    """kappa, coherence and gradient shares of a fresh batch of each size (problems x the run's
    group), no step. GRPO's advantages whatever the run's algorithm: the probe asks how the
    slots' gradients line up."""
    cfg = checkpoint_config(ckpt)  # everything checked before the model loads
    cfg = dataclasses.replace(cfg, credit=credit or cfg.credit)
    if cfg.group_size < 2:  # an --algo maac run may have trained with one
        raise SystemExit(f"--probe {ckpt}: its run's group_size is {cfg.group_size}; the probe's "
                         "GRPO advantages need >= 2 (a group of one has no contrast: nothing to "
                         "measure)")
    if cfg.credit == "own" and TASK_KIND[cfg.task] != "math":
        raise SystemExit(f"--probe_credit own: task {cfg.task} has no per-call verifier "
                         "(its answers are programs)")
    writable(os.path.dirname(os.path.normpath(ckpt)), "probe.json")  # known before the work
    pool, results = load_task(cfg.task, "train", cfg.train_problems, cfg.level, cfg.seed), []
    if not all(1 <= n <= len(pool) for n in sizes):
        raise SystemExit(f"--probe_problems {sizes}: each must be in [1, {len(pool)}] "
                         "(the run's training pool)")
    _, model, tok, names = trained_model(ckpt)
    settings = dataclasses.replace(cfg, balance="none")  # no mitigation: the raw gradients
    for problems in sizes:
        # seed 0: the pool's first problems; another seed, a sample of the pool
        picked = random.Random(seed).sample(range(len(pool)), problems) if seed else range(problems)
        # samples the run did not train on, the same every time
        torch.manual_seed(cfg.seed + 1 + seed)
        problem_of = [i for i in range(problems) for _ in range(cfg.group_size)]
        episodes = [pool[picked[i]] for i in problem_of]
        rollout, _, rewards = train.run_episodes(model, tok, cfg, episodes, greedy=False)
        set_advantages(rollout.calls, problem_of, cfg.adv_group)
        result = {"episodes": len(problem_of), "reward/mean": sum(rewards) / len(rewards)}
        for name in names:
            taught = [c for c in rollout.calls if adapter_for(c.role, cfg.sharing) == name]
            for p in adapter_parameters(model, name):
                p.requires_grad_(True)
            stats = gradient_signals(model, name, taught, tok.pad_token_id, settings)  # no step
            result.update({k: v[0] for k, v in stats.items()
                           if k.endswith(("kappa", "coherence", "grad_share", "/grad_norm"))})
        results.append(result)
    return results


def watch(run: str, question: str, sample: bool = False, seed: int = 0) -> str:
    """Print every call of the trained workflow on one question (prompts as the model read
    them); `run`: a run directory (its newest checkpoint) or a checkpoint, RUN/best."""
    ckpt = run if os.path.exists(os.path.join(run, "state.pt")) else os.path.join(run, "ckpt")
    cfg, model, tok, _ = trained_model(ckpt)
    torch.manual_seed(seed)
    rollout = Rollout(model, tok, cfg.sharing, max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.temperature, top_p=cfg.top_p, greedy=not sample)
    outcome = run_workflow(cfg.workflow, [question], rollout, kind=TASK_KIND[cfg.task],
                           n_agents=cfg.n_agents, max_rounds=cfg.max_rounds)[0]
    decoding = f"sampled at temperature {cfg.temperature}, seed {seed}" if sample else "greedy"
    best = read_best(ckpt)
    kept = f" (step {best['step']}, {best['metric']} {best['score']:.3f})" if best else ""
    print(f"{cfg.workflow}, {cfg.sharing} adapters, from {ckpt}{kept}; {decoding}")
    for call in rollout.calls:
        print(f"\n=== stage {call.stage + 1}: {call.slot} "
              f"(adapter {adapter_for(call.role, cfg.sharing)})")
        print(f"--- prompt:\n{call.prompt}\n--- output:\n{call.text}")
    print(f"\n=== final answer:\n{outcome.final}\n=== info: {outcome.info}")
    if rollout.prompts_cut:
        print(f"=== {rollout.prompts_cut} prompt(s) longer than the model's context left room "
              "for were cut to their head and tail: the question, or the texts before it, lost "
              "their middle")
    return outcome.final


# ----------------------------------------------------------------------------
# Where kappa would align, from probes of several sizes


def episodes_to_align(results: list[dict[str, float]], role: str, n_slots: int,
                      frac: float) -> float | None:
    """Episodes at which the role's kappa would reach frac sqrt(N) (diagnose.py's amplification
    line, KAPPA_FRAC), from probes of several sizes. A slot's gradient = a shared direction + its
    own sampling noise gives two slots' cosine over n episodes 1 / (1 + b / n), so
    b = n (1 / cos - 1); kappa^2 = 1 + (N - 1) cos reaches the line at
    cos c = (frac^2 N - 1) / (N - 1), at n = b c / (1 - c). inf (never) if a probe's cosine is
    <= 0; a probe with no gradient (no reward contrast) measured nothing and is left out, and
    None says no probe is left: not measured."""
    c = (frac ** 2 * n_slots - 1) / (n_slots - 1)
    cosines = [(r["episodes"], r[f"role/{role}/coherence"]) for r in results
               if f"role/{role}/coherence" in r]
    if not cosines:
        return None
    if min(cos for _, cos in cosines) <= 0:
        return math.inf
    b = statistics.mean(n * (1 / cos - 1) for n, cos in cosines)
    return b * c / (1 - c)


def write_probe(results: list[dict[str, float]], run_dir: str, slots: dict[str, int],
                frac: float) -> None:
    """Print the probe's figures by size and where each crowded role's kappa (`slots`: its slot
    count) would reach frac sqrt(N); save both in RUN/probe.json (infinity as "never")."""
    align = {role: episodes_to_align(results, role, n, frac) for role, n in slots.items()
             if n > 1 and len(results) > 1}
    for k in dict.fromkeys(k for r in results for k in r):  # every key, in the order first seen
        print(f"{k:40s}" + "".join(f" {r.get(k, math.nan):10.4f}" for r in results))
    for role, n in align.items():
        print(f"{role}: kappa would reach {frac} sqrt(N) " + (
            "(not measured: no probe size had a reward contrast)" if n is None else
            "never (a coherence <= 0 at some probe size)" if n == math.inf else
            f"at about {n:.0f} episodes"))
    align = {role: "never" if n == math.inf else n for role, n in align.items()}
    results = [{k: v if math.isfinite(v) else None for k, v in r.items()} for r in results]
    with open(os.path.join(run_dir, "probe.json"), "w") as f:
        json.dump({"probes": results, "episodes_to_align": align}, f, indent=2, allow_nan=False)
