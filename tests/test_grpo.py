"""GRPO against hand-computed numbers; the update's pi_old against a separate pass."""
import dataclasses
import math
import statistics

import pytest

from conftest import train_state, update_config
import torch

from grpo import (aggregate, kl_penalty, group_advantages, masked_mean, mismatch_stats,
                  overlay, policy_loss, policy_update, read_stats, sampler_gap, sampler_record,
                  set_advantages, tis_weight)
from lora import adapter_parameters, inject_lora, setup_adapters, use_adapter
from measure import amplification, gradient_noise, gradient_signals, gradient_stats
from rollout import Call, Rollout, old_logprobs, sequence_logprobs
from workflows import ROLES, run_workflow

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def test_masked_mean():
    assert masked_mean(LOSS, MASK).item() == pytest.approx(10 / 4)
    assert masked_mean(LOSS, MASK, dim=-1).tolist() == pytest.approx([2.0, 4.0])
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0  # no division by zero


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 3.0, 0.0])
    keys = ["a", "a", "a", "a", "b", "b", "c", ("d", 1), ("d", 1)]
    adv = group_advantages(rewards, keys)
    s = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    d = math.sqrt(2 * 1.5 ** 2 / 1)  # unbiased std of [3, 0]
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s,  # group a
                0.0, 0.0,                           # b: equal rewards, no signal
                0.0,                                # c: a group of one, no signal
                1.5 / d, -1.5 / d]                  # d: tuple keys work
    assert adv.tolist() == pytest.approx(expected, rel=1e-5)


def test_aggregation_modes_by_hand():
    assert aggregate(LOSS, MASK, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(LOSS, MASK, "mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_add_up_to_the_mini_batch(mode):
    whole = aggregate(LOSS, MASK, mode)
    parts = sum(aggregate(LOSS[i:i + 1], MASK[i:i + 1], mode, num_seqs=2, num_tokens=MASK.sum())
                for i in range(2))
    assert parts.item() == pytest.approx(whole.item())


def test_clipped_loss_is_plain_policy_gradient_at_ratio_one():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]], requires_grad=True)
    adv = torch.tensor([0.7, -1.3])
    per_token, stats = policy_loss(logp, logp.detach(), adv, MASK)
    loss = aggregate(per_token, MASK, "seq-mean-token-mean")
    loss.backward()
    plain = logp.detach().clone().requires_grad_(True)
    # REINFORCE with the same seq-mean-token-mean aggregation: -mean_i mean_t A_i log pi
    ref = -((adv[:, None] * plain * MASK).sum(-1) / MASK.sum(-1)).mean()
    ref.backward()
    assert torch.allclose(logp.grad, plain.grad)
    assert loss.item() == pytest.approx(-(0.7 * 1 + (-1.3) * 1) / 2)  # ratio 1: -mean_i A_i
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)


def test_clipping_by_hand():
    # token 1: ratio 1.5 with A > 0 is clipped at 1.28; token 2: ratio 0.5 with A < 0 at 0.8;
    # token 3: ratio 0.5 with A > 0 is not clipped (min keeps the pessimistic surr1).
    old = torch.zeros(3, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5], [0.5]])).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0, 1.0])
    per_token, stats = policy_loss(logp, old, adv, torch.ones(3, 1))
    stats = read_stats(stats)  # 0-d tensors, read as numbers once the backward pass is queued
    loss = aggregate(per_token, torch.ones(3, 1), "token-mean")
    assert loss.item() == pytest.approx(-(1.28 * 2.0 + 0.8 * -1.0 + 0.5 * 1.0) / 3)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["pg_loss"] == pytest.approx(loss.item())  # its statistic: the same token mean
    loss.backward()
    grad = logp.grad.squeeze(-1)
    assert grad[0] == 0 and grad[1] == 0  # clipped tokens pass no gradient
    assert grad[2].item() == pytest.approx(-0.5 * 1.0 / 3)  # d(-ratio*A/3)/dlogp = -ratio*A/3


def test_sequence_ratio_gspo_by_hand():
    # sequence 1: log ratios 0.1, 0.2, 0.3 -> s = exp(0.2) = 1.2214, inside [0.8, 1.28], A = +1;
    # sequence 2: log ratios -0.5, -0.1 (the third token is padding) -> s = exp(-0.3) = 0.7408,
    # below 0.8 with A = -1: clipped, the whole sequence, though its second token's ratio is 0.905
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.2, 0.3], [-0.5, -0.1, 7.0]], requires_grad=True)
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    per_token, stats = policy_loss(logp, old, adv, mask, ratio_level="sequence")
    s1 = math.exp(0.2)
    assert torch.allclose(per_token * mask, torch.tensor([[-s1] * 3, [0.8, 0.8, 0.0]]))
    loss = aggregate(per_token, mask, "seq-mean-token-mean")
    assert loss.item() == pytest.approx((-s1 + 0.8) / 2)
    assert stats["clip_frac"] == pytest.approx(2 / 5)  # of the tokens: sequence 2's two
    assert stats["ratio_mean"] == pytest.approx((3 * s1 + 2 * math.exp(-0.3)) / 5)
    loss.backward()
    # d(-s1)/dlogp_t = -s1 / 3 for each of sequence 1's tokens, halved by the mean over sequences;
    # the clipped sequence passes no gradient
    assert torch.allclose(logp.grad, torch.tensor([[-s1 / 6] * 3, [0.0, 0.0, 0.0]]))
    # per token, sequence 2's second token is not clipped
    token, _ = policy_loss(logp, old, adv, mask)
    assert aggregate(token, mask, "seq-mean-token-mean").item() != pytest.approx(loss.item())


def test_sequence_and_token_ratio_are_one_and_agree_on_policy():
    """Under --one_step pi_old is the policy itself: both ratios are 1, and loss and gradient
    agree."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]], requires_grad=True)
    adv, grads = torch.tensor([0.7, -1.3]), []
    for level in ("token", "sequence"):
        per_token, stats = policy_loss(logp, logp.detach(), adv, MASK, ratio_level=level)
        aggregate(per_token, MASK, "seq-mean-token-mean").backward()
        assert stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0
        grads.append(logp.grad.clone())
        logp.grad = None
    assert torch.allclose(grads[0], grads[1])
    with pytest.raises(ValueError, match="sequence"):
        policy_loss(logp, logp.detach(), adv, MASK, ratio_level="seq")


def test_k3_kl_by_hand():
    logp = torch.tensor([[-1.0]])
    ref = torch.tensor([[-2.0]])
    kl, stats = kl_penalty(logp, ref, torch.ones(1, 1))
    k3 = math.exp(-1.0) - (-1.0) - 1  # exp(ref - logp) - (ref - logp) - 1
    assert stats["kl_ref"] == pytest.approx(k3) and kl.item() == pytest.approx(k3)
    per_token, stats = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 1))
    loss = aggregate(per_token + 0.5 * kl, torch.ones(1, 1), "token-mean")
    assert loss.item() == pytest.approx(0.5 * k3)
    assert "kl_ref" not in stats  # the surrogate alone has no KL term


def test_chi2_and_perplexity_by_hand():
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[2.0, 0.5], [1.0, 1.0]]))  # ratios, since old log-probs are 0
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    _, stats = policy_loss(logp, old, torch.zeros(2), mask)
    assert stats["chi2"] == pytest.approx((4 + 0.25 + 1) / 3 - 1)
    # 0.5 log_ratio^2 over the three tokens: (log 2)^2 / 3
    assert stats["approx_kl"] == pytest.approx(math.log(2) ** 2 / 3)
    # exp(-token mean log-prob) per sequence: exp(-(log 2 + log 0.5) / 2) = 1 and exp(0) = 1
    assert stats["ppl"] == pytest.approx(1.0)
    # sequences that differ: exp(-(log 0.5 + log 0.25) / 2) = sqrt(8) and exp(-log 0.5) = 2,
    # their mean 2.4142 (one mean over the three tokens would give 2^(4/3) = 2.52)
    probs = torch.tensor([[0.5, 0.25], [0.5, 1.0]])
    _, stats = policy_loss(torch.log(probs), old, torch.zeros(2), mask)
    assert stats["ppl"] == pytest.approx((math.sqrt(8) + 2) / 2)


def test_set_advantages_groups_by_slot_and_stage_or_by_role():
    """Two episodes of one problem. Eval-Opt's generator, first answers 1, 0 and refines 1, 1:
    by slot and stage the first answers are one group (+-0.5 / sqrt(0.5) = +-0.7071) and the
    refines another, without contrast; by role the four are one (mean 0.75, sample std 0.5).
    Voting's generator0 and generator1, 1 1 | 0 0: by role one group (std sqrt(1/3): +-0.866),
    by slot one per slot (+-0.7071)."""
    def calls(spec):
        return [Call(e, slot.rstrip("01"), slot, turn, [1], [1], "", "", reward=r)
                for e, slot, turn, r in spec]
    refine = calls([(0, "generator", 0, 1.0), (1, "generator", 0, 0.0),
                    (0, "generator", 2, 1.0), (1, "generator", 2, 1.0)])
    vote = calls([(0, "generator0", 0, 1.0), (0, "generator1", 0, 1.0),
                  (1, "generator0", 0, 0.0), (1, "generator1", 0, 0.0)])
    for cs, by, expected in [(refine, "slot", [0.7071, -0.7071, 0.0, 0.0]),
                             (refine, "role", [0.5, -1.5, 0.5, 0.5]),
                             (vote, "role", [0.866, 0.866, -0.866, -0.866]),
                             (vote, "slot", [0.7071, 0.7071, -0.7071, -0.7071])]:
        set_advantages(cs, [0, 0], by)
        assert [c.advantage for c in cs] == pytest.approx(expected, abs=1e-4), (by, expected)


def test_logged_kl_and_chi2_read_the_completion_tokens_and_the_token_ratios():
    """k3 to the reference over the real token only: exp(log 2) - log 2 - 1 = 0.3069 (the pad's
    0 would halve it); chi2 is of the token ratios 2 and 1 under GSPO too: (4 + 1) / 2 - 1 = 1.5
    (the sequence ratio sqrt(2) would give 1.0)."""
    zeros = torch.zeros(1, 2)
    ref = torch.tensor([[math.log(2), 0.0]])
    _, stats = kl_penalty(zeros, ref, torch.tensor([[1.0, 0.0]]))
    assert stats["kl_ref"] == pytest.approx(1 - math.log(2))
    logp = torch.tensor([[math.log(2), 0.0]])
    _, stats = policy_loss(logp, zeros, torch.zeros(1), torch.ones(1, 2), ratio_level="sequence")
    assert stats["chi2"] == pytest.approx(1.5)


def test_overlay_writes_each_row_over_the_start_of_its_own():
    got = overlay(torch.zeros(2, 3), [torch.tensor([1.0, 2.0]), None])
    assert got.tolist() == [[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]


def test_the_sampler_s_record_is_laid_out_as_the_update_s_tokens_and_only_where_it_is():
    """Two calls of 3 and 2 tokens, one sampled (its record: -1, -2, -3) and one hand-made (no
    record): the gap is read where a record is, and is 0 elsewhere (pi_old itself)."""
    sampled = Call(0, "generator", "generator", 0, [5], [1, 2, 3], "", "",
                   rollout_logp=torch.tensor([-1.0, -2.0, -3.0]))
    made = Call(1, "generator", "generator", 0, [5], [4, 2], "", "")
    logp, known = sampler_record([sampled, made], "cpu")
    assert logp.tolist() == [[-1.0, -2.0, -3.0], [0.0, 0.0, 0.0]]
    assert known.tolist() == [[True, True, True], [False, False, False]]
    old_logp = torch.full((2, 3), -1.5)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weight, gap = sampler_gap(old_logp, (logp, known), mask, tis_cap=2.0, measure=True)
    # pi_old / pi_rollout: e^-0.5, e^0.5, e^1.5 capped at 2; 1 where there is no record
    assert weight.flatten().tolist() == pytest.approx([math.exp(-0.5), math.exp(0.5), 2.0,
                                                       1.0, 1.0, 1.0])
    # |log pi_old - log pi_rollout| over the 5 tokens: (0.5 + 0.5 + 1.5 + 0 + 0) / 5
    assert float(gap["mismatch_mean"]) == pytest.approx(0.5)
    assert sampler_gap(old_logp, None, mask, tis_cap=0.0, measure=False) == (None, {})


def test_amplification_identical_and_orthogonal():
    g = torch.tensor([3.0, 4.0, 0.0])
    kappa, coherence = amplification([g, g, g])
    assert kappa == pytest.approx(math.sqrt(3)) and coherence == pytest.approx(1.0)
    kappa, coherence = amplification([torch.eye(3)[i] * (i + 1) for i in range(3)])
    assert kappa == pytest.approx(1.0) and coherence == pytest.approx(0.0)
    kappa, coherence = amplification([g, -g])  # opposed slots cancel
    assert kappa == pytest.approx(0.0) and coherence == pytest.approx(-1.0)
    # (1, 0) and (1, 1): |(2, 1)| / sqrt(1 + 2) = sqrt(5 / 3), at an angle of 45 degrees
    kappa, coherence = amplification([torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])])
    assert kappa == pytest.approx(math.sqrt(5 / 3)) and coherence == pytest.approx(0.5 ** 0.5)


def test_gradient_stats_shares_and_roles():
    grads = {"generator0": torch.tensor([1.0, 0.0]), "generator1": torch.tensor([1.0, 0.0]),
             "aggregator": torch.tensor([0.0, 3.0])}
    roles = {"generator0": "generator", "generator1": "generator", "aggregator": "aggregator"}
    stats = gradient_stats(grads, roles)
    # the sum of its slots' gradients
    assert stats["role/generator/grad_norm"] == pytest.approx(2.0)
    assert stats["role/generator/kappa"] == pytest.approx(math.sqrt(2))
    assert stats["role/generator/grad_share"] == pytest.approx(2 / 5)
    assert stats["role/aggregator/grad_share"] == pytest.approx(3 / 5)
    assert "role/aggregator/kappa" not in stats  # one slot: nothing to be coherent with
    # a slot with no gradient (no contrast) is no slot to line up with; one role owns no share
    lone = gradient_stats({"generator0": torch.tensor([1.0, 0.0]),
                           "generator1": torch.tensor([0.0, 0.0])},
                          {"generator0": "generator", "generator1": "generator"})
    assert "role/generator/kappa" not in lone and "role/generator/grad_share" not in lone
    assert stats["slot/aggregator/grad_norm"] == pytest.approx(3.0)


# ----------------------------------------------------------------------------
# pi_old: no separate pass where the update is on-policy


def sampled_calls(tiny, episodes: int = 6) -> list[Call]:
    """Voting calls of the tiny model under isolated adapters whose B is not 0, with
    advantages of both signs."""
    model, tok = tiny
    inject_lora(model, r=4, alpha=8)
    setup_adapters(model, ROLES["voting"], "isolated")
    torch.manual_seed(0)
    for p in adapter_parameters(model, "generator"):
        torch.nn.init.normal_(p, std=0.05)
        p.requires_grad_(True)
        p.grad = torch.zeros_like(p)  # as train.make_optimizers leaves them
    rollout = Rollout(model, tok, "isolated", max_new_tokens=8, temperature=1.0)
    run_workflow("voting", ["What is 1 + 2?"] * episodes, rollout, n_agents=3)
    calls = [c for c in rollout.calls if c.role == "generator"]
    for i, c in enumerate(calls):
        c.advantage = (-1.0) ** i * (1 + i % 3)
    return calls


def updated(tiny, calls: list[Call], minibatch_size: int) -> list[torch.Tensor]:
    model, tok = tiny
    params = adapter_parameters(model, "generator")
    start = [p.detach().clone() for p in params]
    settings = update_config(minibatch_size=minibatch_size)
    sgd = torch.optim.SGD(params, lr=0.5)
    policy_update(train_state(model, {"generator": sgd}),
                  "generator", calls, tok.pad_token_id, settings)
    after = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    return after


def test_on_policy_old_logprobs_are_the_updates_own(tiny):
    """The first mini-batch reads pi_old from its own forward pass, detached: the numbers a
    separate pass before the step would give, without the pass."""
    calls = sampled_calls(tiny)
    model, tok = tiny
    old = old_logprobs(model, calls, "generator", tok.pad_token_id, 1.0, 1024)
    with use_adapter(model, "generator"):
        logp, _, _ = sequence_logprobs(model, calls, tok.pad_token_id, 1.0)  # (B, T), with gradient
    for c, row in zip(calls, logp.detach()):
        assert torch.allclose(old[id(c)], row[: len(c.completion_ids)], atol=1e-6)


def test_old_logprob_pass_only_for_the_mini_batches_after_the_first_step(tiny):
    calls = sampled_calls(tiny)  # 18 generator calls
    model, tok = tiny
    rows_without_grad = []
    original = model.forward

    def counting(*args, **kw):
        if not torch.is_grad_enabled():
            rows_without_grad.append(kw["input_ids"].shape[0])
        return original(*args, **kw)
    model.forward = counting
    for minibatch_size, expected in [(18, 0), (4, 14), (8, 10)]:
        rows_without_grad.clear()
        updated(tiny, calls, minibatch_size=minibatch_size)
        assert sum(rows_without_grad) == expected, minibatch_size


def test_gradient_noise_by_hand():
    # 2 / 2
    assert (gradient_noise(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), 1, 1)
            == pytest.approx(1.0))
    # one direction
    assert gradient_noise(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), 1, 1) == 0.0
    assert (gradient_noise(torch.tensor([3.0, 0.0]), torch.tensor([1.0, 0.0]), 1, 1)
            == pytest.approx(4 / 16))
    # halves of 2 and 1 problems of one gradient m: a pure signal (|g0 - g1|^2 / |g|^2 reads 1/9)
    m = torch.tensor([1.0, 2.0])
    assert gradient_noise(2 * m, m, 2, 1) == pytest.approx(0.0, abs=1e-7)
    # 2 x 1 x |(3, 0) / 2 - (1, 0)|^2 / |(4, 0)|^2 = 2 x 0.25 / 16
    assert (gradient_noise(torch.tensor([3.0, 0.0]), torch.tensor([1.0, 0.0]), 2, 1)
            == pytest.approx(0.5 / 16))


def test_the_gradient_noise_is_read_off_two_halves_of_the_problems(tiny):
    """grad_noise is n0 n1 |g0 / n0 - g1 / n1|^2 / |g0 + g1|^2, g_h the gradient of the calls of
    half h of the problems (group_size consecutive episodes each, alternating halves), n_h its
    problems. Reference from three separate updates' gradient norms, here n0 = 2 and n1 = 1:
    |g0 - 2 g1|^2 = 3 |g0|^2 + 6 |g1|^2 - 2 |g0 + g1|^2 (g0 . g1 from the three norms); over a
    single problem there is no second half, and no grad_noise."""
    # 6 episodes x 3 generators; with group_size 2, problems 0 and 2 (episodes 0, 1, 4, 5) in half 0
    calls = sampled_calls(tiny)
    model, tok = tiny
    settings = update_config(one_step=True, group_size=2, grad_clip=1e9)

    # the gradient norm of an update on part alone
    def norm(part: list[Call]) -> tuple[float, dict]:
        opt = torch.optim.SGD(adapter_parameters(model, "generator"), lr=0.0)
        stats = policy_update(train_state(model, {"generator": opt}),
                              "generator", part, tok.pad_token_id, settings)
        return stats["adapter/generator/grad_norm"][0], stats
    stats = gradient_signals(model, "generator", calls, tok.pad_token_id, settings)
    both, _ = norm(calls)
    half = [[c for c in calls if c.episode // 2 % 2 == h] for h in (0, 1)]
    # each call's term is 1 / len(batch)
    a0, a1 = (norm(part)[0] * len(part) / len(calls) for part in half)  # |g0|, |g1|
    assert len(half[0]) == 12 and len(half[1]) == 6
    assert stats["adapter/generator/grad_noise"][0] == pytest.approx(
        (3 * a0 ** 2 + 6 * a1 ** 2 - 2 * both ** 2) / (2 * both ** 2), rel=1e-3)
    one = gradient_signals(model, "generator", calls, tok.pad_token_id,
                           dataclasses.replace(settings, group_size=6))
    assert "adapter/generator/grad_noise" not in one and "role/generator/kappa" in one


def test_the_gradient_signals_move_nothing_and_add_up_to_the_updates_gradient(tiny):
    """measure.gradient_signals before an update leaves that update as it was, to the bit (no step,
    no random state touched, the gradients zeroed after), and under --one_step the slots' gradients
    it measures sum to the gradient the update steps on."""
    calls = sampled_calls(tiny)
    model, tok = tiny
    params = adapter_parameters(model, "generator")
    start = [p.detach().clone() for p in params]
    settings = update_config(one_step=True, group_size=2, grad_clip=1e9)

    def update(measured_first: bool) -> tuple[list[torch.Tensor], dict, dict]:
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
        signals = (gradient_signals(model, "generator", calls, tok.pad_token_id, settings)
                   if measured_first else {})
        assert all(p.grad is not None and not p.grad.any() for p in params)
        assert all(torch.equal(p, p0) for p, p0 in zip(params, start))
        sgd = torch.optim.SGD(params, lr=0.5)
        stats = policy_update(train_state(model, {"generator": sgd}), "generator", calls,
                              tok.pad_token_id, settings)
        return [p.detach().clone() for p in params], stats, signals

    plain, stats, _ = update(False)
    after, _, signals = update(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, after))
    assert not all(torch.equal(a, p0) for a, p0 in zip(plain, start))  # the update moved
    total = stats["adapter/generator/grad_norm"][0]  # before the clip, which does not act here
    assert signals["role/generator/grad_norm"][0] == pytest.approx(total, rel=1e-4)
    assert signals["role/generator/kappa"][0] > 0 and "adapter/generator/grad_noise" in signals


def test_truncated_importance_weight_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    sampled = torch.tensor([[-1.5, -1.0, -0.5]])
    w = tis_weight(old, sampled, cap=1.2)
    assert w[0].tolist() == pytest.approx([1.2, math.exp(-1.0), 1.0])  # e^0.5 = 1.65 is capped
    logp = old.clone().requires_grad_(True)
    adv, mask = torch.tensor([2.0]), torch.ones(1, 3)
    weighted, _ = policy_loss(logp, old, adv, mask, is_weight=w)
    plain, _ = policy_loss(logp, old, adv, mask)
    # each token's term times its weight
    assert weighted[0].tolist() == pytest.approx((w * plain)[0].tolist())
    weighted.sum().backward()
    # d/dlogp of -w * ratio * A at ratio 1
    assert logp.grad[0].tolist() == pytest.approx((-2.0 * w)[0].tolist())


def test_mismatch_stats_by_hand_and_zero_for_equal_policies():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
    sampled = torch.tensor([[-1.5, -1.0, -0.5], [-3.25, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    st = read_stats(mismatch_stats(old, sampled, mask))
    assert st["mismatch_mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.25) / 4)
    assert st["mismatch_max"] == pytest.approx(1.0)  # the padding's gap of 9 is masked
    k3 = [math.exp(g) - g - 1 for g in (0.5, -1.0, 0.0, 0.25)]
    assert st["mismatch_kl"] == pytest.approx(sum(k3) / 4)
    assert set(read_stats(mismatch_stats(old, old, mask)).values()) == {0.0}
    # no token in the mask: a max of nothing, 0
    assert read_stats(mismatch_stats(old, sampled, torch.zeros(2, 3)))["mismatch_max"] == 0.0


def test_no_optimizer_step_on_a_mini_batch_without_a_live_call(tiny):
    """AdamW moves an adapter on a zero gradient once it has momentum; with skip_empty the
    dead mini-batch takes no step, and without it the adapter moves."""
    calls = sampled_calls(tiny)
    model, tok = tiny
    params = adapter_parameters(model, "generator")
    moved = {}
    for skip in (True, False):
        start = [p.detach().clone() for p in params]
        opt = torch.optim.AdamW(params, lr=0.01)
        settings = update_config(minibatch_size=len(calls), skip_empty=skip)
        policy_update(train_state(model, {"generator": opt}),
                      "generator", calls, tok.pad_token_id, settings)
        after_live = [p.detach().clone() for p in params]
        dead = [dataclasses.replace(c, advantage=0.0) for c in calls]
        stats = policy_update(train_state(model, {"generator": opt}),
                              "generator", dead, tok.pad_token_id, settings)
        assert stats["adapter/generator/empty_batches"] == [1]
        moved[skip] = max((p - a).abs().max().item() for p, a in zip(params, after_live))
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
    assert moved[True] == 0.0
    assert moved[False] > 1e-4


def test_the_diagnostics_measure_the_sampler_gap_and_the_plain_update_never_reads_it(tiny):
    """fp32 tiny model: the sampler's recorded log-probs are the trainer's up to float rounding,
    so a record shifted down by 0.5 nats is a known gap of 0.5 a token. The diagnostics' pass
    measures it; the plain update's gradient is the same to the bit with or without the shift;
    truncated importance sampling (tis_cap > 0) reads it and weighs every token by e^0.5."""
    calls = sampled_calls(tiny)
    assert all(c.rollout_logp is not None and len(c.rollout_logp) == len(c.completion_ids)
               for c in calls)
    model, tok = tiny
    shifted = [dataclasses.replace(c, rollout_logp=c.rollout_logp - 0.5) for c in calls]
    params = adapter_parameters(model, "generator")

    def gradient(calls: list[Call], settings) -> torch.Tensor:
        sgd = torch.optim.SGD(params, lr=0.0)
        stats = policy_update(train_state(model, {"generator": sgd}), "generator", calls,
                              tok.pad_token_id, settings)
        assert not [k for k in stats if "mismatch" in k]  # the update logs no gap
        return torch.cat([p.grad.reshape(-1) for p in params]).clone()

    plain = update_config(minibatch_size=len(calls))
    assert torch.equal(gradient(calls, plain), gradient(shifted, plain))
    tis = dataclasses.replace(plain, tis_cap=2.0)
    assert not torch.allclose(gradient(calls, tis), gradient(shifted, tis))
    signals = gradient_signals(model, "generator", calls, tok.pad_token_id, plain)
    assert 0 <= max(signals["role/generator/mismatch_max"]) < 1e-4
    signals = gradient_signals(model, "generator", shifted, tok.pad_token_id, plain)
    assert statistics.mean(signals["role/generator/mismatch_mean"]) == pytest.approx(0.5, abs=1e-4)
    assert statistics.mean(signals["role/generator/mismatch_kl"]) == pytest.approx(
        math.exp(0.5) - 1.5, abs=1e-4)  # k3 of a gap of 0.5


def test_a_mini_batch_with_a_non_finite_gradient_is_not_applied(tiny):
    """A NaN in one gradient: that mini-batch leaves the adapter and AdamW's state as they were
    and is counted; the next one steps as usual."""
    calls = sampled_calls(tiny)
    model, tok = tiny
    params = adapter_parameters(model, "generator")
    opt = torch.optim.AdamW(params, lr=0.01)
    settings = update_config(minibatch_size=len(calls))
    # momentum
    policy_update(train_state(model, {"generator": opt}),
                  "generator", calls, tok.pad_token_id, settings)
    weights = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    hook = params[0].register_hook(lambda g: g * float("nan"))
    stats = policy_update(train_state(model, {"generator": opt}),
                          "generator", calls, tok.pad_token_id, settings)
    hook.remove()
    assert (stats["adapter/generator/skipped_nonfinite"] == [1]
            and "adapter/generator/grad_norm" not in stats)
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    assert all(torch.equal(v, old[k]) for s, old in zip(opt.state.values(), state)
               for k, v in s.items())
    stats = policy_update(train_state(model, {"generator": opt}),
                          "generator", calls, tok.pad_token_id, settings)
    assert stats["adapter/generator/skipped_nonfinite"] == [0]
    assert max((p - w).abs().max().item() for p, w in zip(params, weights)) > 1e-4


@pytest.mark.parametrize("one_step", [True, False])
def test_the_clip_acts_only_after_the_first_mini_batch_step(tiny, one_step):
    """One optimizer step over all calls (the default) is on-policy: every ratio is 1 and nothing
    is clipped. With several mini-batches, the later ones are scored by a policy the earlier steps
    moved, and a large step pushes some token ratios out of [0.8, 1.28]."""
    calls = sampled_calls(tiny)  # 18 generator calls
    model, tok = tiny
    params = adapter_parameters(model, "generator")
    settings = update_config(minibatch_size=4, one_step=one_step)
    sgd = torch.optim.SGD(params, lr=0.5)
    stats = policy_update(train_state(model, {"generator": sgd}), "generator", calls,
                          tok.pad_token_id, settings)
    clipped = stats["role/generator/clip_frac"]
    assert (max(clipped) > 0) == (not one_step), clipped
    assert one_step == all(r == pytest.approx(1.0) for r in stats["role/generator/ratio_mean"])


def test_damping_without_the_adapters_gradient_ema_is_refused_in_one_line(tiny):
    """A script's training state that holds no gradient EMA for the adapter: --damping says what
    it needs before any pass; without damping the update needs none."""
    model, tok = tiny
    calls = sampled_calls(tiny, 2)
    sgd = torch.optim.SGD(adapter_parameters(model, "generator"), lr=0.0)
    state = train_state(model, {"generator": sgd})
    state.emas.clear()
    with pytest.raises(ValueError, match=r"--damping needs state.emas\['generator'\]"):
        policy_update(state, "generator", calls, tok.pad_token_id, update_config(damping=0.5))
    assert policy_update(state, "generator", calls, tok.pad_token_id, update_config())
