"""Critic: GAE and the value loss by hand, what each critic reads, no-op start, learning."""
import math
import random

import pytest

from conftest import critic_config, train_state
import torch

from critic import (CriticBatch, ValueHead, call_advantages, critic_advantages,
                    critic_inputs, critic_key, critic_metrics, critic_values, encode,
                    explained_variance, gae, joint_history, local_observation, normalize,
                    outcome_rewards, predict_values, setup_critics, unseen, update_critic,
                    update_critics, value_loss)
import lora
from rollout import Call


def call(episode: int, slot: str, turn: int, prompt: str, text: str, reward: float = 0.0) -> Call:
    role = slot.rstrip("0123456789")
    return Call(episode, role, slot, turn, [], [], prompt, text, reward=reward)


# ---------------------------------------------------------------- GAE by hand

# One agent with three turns, outcome 1 at the last: gamma = 0.9.
R3, V3 = [0.0, 0.0, 1.0], [0.5, 0.2, 0.8]
# delta_2 = 1 - 0.8 = 0.2;  delta_1 = 0.9 * 0.8 - 0.2 = 0.52;  delta_0 = 0.9 * 0.2 - 0.5 = -0.32
DELTA3 = [-0.32, 0.52, 0.2]


def one(rewards: list[float], values: list[float], gamma: float, lam: float):
    adv, ret = gae(torch.tensor([rewards]), torch.tensor([values]), torch.ones(1, len(rewards)),
                   gamma, lam)
    return adv[0].tolist(), ret[0].tolist()


def test_gae_lambda_zero_is_one_step_td():
    adv, ret = one(R3, V3, gamma=0.9, lam=0.0)
    assert adv == pytest.approx(DELTA3)
    assert ret == pytest.approx([0.9 * 0.2, 0.9 * 0.8, 1.0])  # r_k + gamma V(s_{k+1})


def test_gae_lambda_one_is_monte_carlo():
    adv, ret = one(R3, V3, gamma=0.9, lam=1.0)
    assert ret == pytest.approx([0.81, 0.9, 1.0])  # discounted outcome, whatever V says
    assert adv == pytest.approx([0.81 - 0.5, 0.9 - 0.2, 1.0 - 0.8])
    adv, ret = one(R3, V3, gamma=1.0, lam=1.0)
    assert ret == pytest.approx([1.0, 1.0, 1.0])


def test_gae_intermediate_lambda_on_sequences_of_different_lengths():
    pad = 9.0  # padded entries must not leak into anything
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, pad, pad], [0.5, 1.0, pad]])
    values = torch.tensor([[0.5, 0.2, 0.8], [0.3, pad, pad], [0.1, 0.4, pad]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)  # gamma * lam = 0.45
    expected = [
        [-0.32 + 0.45 * (0.52 + 0.45 * 0.2), 0.52 + 0.45 * 0.2, 0.2],  # -0.0455, 0.61, 0.2
        [1.0 - 0.3, 0.0, 0.0],  # a single turn: R - V
        # an intermediate reward: delta_1 = 1 - 0.4 = 0.6, delta_0 = 0.5 + 0.9 * 0.4 - 0.1 = 0.76
        [0.76 + 0.45 * 0.6, 0.6, 0.0],
    ]
    for row, exp in zip(adv.tolist(), expected):
        assert row == pytest.approx(exp)
    assert ret.tolist()[0] == pytest.approx([-0.0455 + 0.5, 0.61 + 0.2, 1.0])
    assert ret.tolist()[1] == pytest.approx([1.0, 0.0, 0.0])
    assert ret.tolist()[2] == pytest.approx([1.03 + 0.1, 1.0, 0.0])


def eval_opt_calls() -> list[Call]:
    """Episode 0 refines once and ends right (1); episode 1 stops after one round, wrong (0)."""
    return [call(0, "generator", 2, "p", "t", 1.0), call(1, "evaluator", 1, "p", "t", 0.0),
            call(0, "generator", 0, "p", "t", 1.0), call(0, "evaluator", 1, "p", "t", 1.0),
            call(1, "generator", 0, "p", "t", 0.0)]


def test_outcome_reward_sits_on_each_agents_last_turn():
    assert outcome_rewards(eval_opt_calls()) == [1.0, 0.0, 0.0, 1.0, 0.0]
    # Voting: each generator is its own agent, acting once: each earns the outcome
    assert outcome_rewards(voting_calls()[:4]) == [1.0] * 4


def test_call_advantages_follow_each_agents_own_turns():
    calls = eval_opt_calls()
    values = torch.tensor([0.6, 0.3, 0.2, 0.5, 0.4])
    adv, ret = call_advantages(calls, values, gamma=1.0, lam=0.0)
    # episode 0's first generator turn bootstraps from its own next turn (0.6), not the evaluator
    assert adv.tolist() == pytest.approx([1 - 0.6, 0 - 0.3, 0.6 - 0.2, 1 - 0.5, 0 - 0.4])
    assert ret.tolist() == pytest.approx([1.0, 0.0, 0.6, 1.0, 0.0])
    adv, _ = call_advantages(calls, values, gamma=1.0, lam=1.0)
    assert adv[2].item() == pytest.approx(1 - 0.2)  # Monte Carlo: outcome minus V
    # a workflow with an intermediate reward of 0.5 on episode 0's first generator turn
    adv, _ = call_advantages(calls, values, 1.0, 0.0, rewards=[1.0, 0.0, 0.5, 1.0, 0.0])
    assert adv[2].item() == pytest.approx(0.5 + 0.6 - 0.2)


def test_own_credit_pays_every_turn_its_own_reward(tiny):
    """--credit own: a fresh critic (V = 0) at lam 0 gives each call its own reward as its
    advantage; episode 0's first generator turn solved the problem (1) before its refine broke
    it (0). Under the broadcast outcome that first turn gets the refine's 0."""
    model, tok = tiny
    lora.inject_lora(model, r=4, alpha=8)
    heads = setup_critics(model, ["critic-generator", "critic-evaluator"])
    for own, first in ((True, 1.0), (False, 0.0)):
        calls = eval_opt_calls()
        calls[0].reward, calls[2].reward = 0.0, 1.0  # the refine wrong, the first answer right
        critic_advantages(model, tok, heads, calls,
                          critic_config(critic="decentral", critic_per="role", lam=0.0,
                                         credit="own" if own else "final"))
        assert [c.advantage for c in calls] == [0.0, 0.0, first, 1.0, 0.0]


def test_a_cut_call_returns_zero_under_penalize():
    calls = eval_opt_calls()
    calls[2].truncated = True  # episode 0's first generator turn, not its last
    values = torch.tensor([0.6, 0.3, 0.2, 0.5, 0.4])
    adv, ret = call_advantages(calls, values, gamma=1.0, lam=0.0, cut_returns_zero=True)
    assert adv.tolist() == pytest.approx([1 - 0.6, 0 - 0.3, 0 - 0.2, 1 - 0.5, 0 - 0.4])
    assert ret.tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0, 0.0])
    assert (call_advantages(calls, values, gamma=1.0, lam=0.0)[0][2].item()
            == pytest.approx(0.6 - 0.2))


def test_normalize():
    # mean 3, population std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5) = 1.8708
    out = normalize(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert out.tolist() == pytest.approx([-2 / 3.5 ** 0.5, -1 / 3.5 ** 0.5, 0.0, 3 / 3.5 ** 0.5])


# ---------------------------------------------------------------- value loss by hand

def test_value_loss_unclipped_by_hand():
    values = torch.tensor([0.5, 1.0, -0.1])
    returns = torch.tensor([1.0, 0.0, 0.0])
    loss, stats = value_loss(values, values, returns)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 1.0 + 0.01) / 3)
    assert "clip_frac" not in stats  # no clip, nothing held back
    assert stats["value_loss"].item() == pytest.approx(0.5 * (0.25 + 1.0 + 0.01) / 3)


def test_value_loss_clipped_by_hand():
    values = torch.tensor([0.5, 1.0, -0.1], requires_grad=True)
    old = torch.tensor([0.0, 0.9, 0.0])
    returns = torch.tensor([1.0, 0.0, 0.0])
    loss, stats = value_loss(values, old, returns, clip=0.2)
    # first: V moved 0.5 > 0.2, clipped to 0.2, error 0.8^2 = 0.64 > 0.5^2 wins; others unclipped
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.0 + 0.01) / 3)
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert values.grad.tolist() == pytest.approx([0.0, 1.0 / 3, -0.1 / 3])  # clipped: no gradient
    # a move down is clipped too: V = -1 from 0 counts as -0.2, whose error 0.8^2 wins
    loss, stats = value_loss(torch.tensor([-1.0]), torch.zeros(1), torch.tensor([-1.0]), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * 0.64) and stats["clip_frac"] == 1.0
    # a move of exactly the clip is not clipped
    _, stats = value_loss(torch.tensor([0.5]), torch.zeros(1), torch.tensor([0.5]), clip=0.5)
    assert stats["clip_frac"] == 0.0


def test_a_critic_pass_reads_each_row_once_and_its_micro_batches_add_up_to_the_mean(
        monkeypatch):
    """A stand-in critic whose value of a row is w x (x: the row's one token id), returns 0, so a
    mini-batch's loss is 0.5 mean (w x)^2 and its gradient in w, at w = 1, mean x^2. Three rows
    x = 1, 2, 3 read as micro-batches of 2 and 1 rows give (1 + 4 + 9) / 3 = 4.667, as one pass
    would. Ten rows in three steps: 3, 3 and 4 rows, every row once."""
    import critic
    w = torch.nn.Parameter(torch.tensor(1.0))
    read = []
    def stand_in(model, head, name, id_lists, pad_id):
        read.append([ids[0] for ids in id_lists])
        return w * torch.tensor([float(ids[0]) for ids in id_lists])
    monkeypatch.setattr(critic, "critic_values", stand_in)
    batch = CriticBatch(["critic"] * 3, [[1], [2], [3]], torch.zeros(3), torch.zeros(3))
    settings = critic_config(micro_batch_tokens=2, grad_clip=100.0)
    state = train_state(None, {"critic": torch.optim.SGD([w], lr=0.0)}, heads={"critic": None})
    update_critic(state, "critic", batch, [0, 1, 2], 0, settings)
    assert read == [[1, 2], [3]] and w.grad.item() == pytest.approx(14 / 3)
    read.clear()
    ten = CriticBatch(["critic"] * 10, [[i] for i in range(10)], torch.zeros(10), torch.zeros(10))
    update_critic(state, "critic", ten, list(range(10)), 0, critic_config(critic_steps=3))
    assert read == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]


def test_explained_variance_by_hand():
    # residual [0, 0, 1]: Var 2/9; target [1, 2, 4]: Var 14/9
    pred, target = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0])
    assert explained_variance(pred, target) == pytest.approx(1 - 1 / 7)
    assert explained_variance(torch.zeros(3), target) == pytest.approx(0.0)
    assert math.isnan(explained_variance(pred, torch.ones(3)))  # constant targets: undefined


# ---------------------------------------------------------------- what each critic reads

def voting_calls() -> list[Call]:
    """Two voting episodes with distinct texts; the aggregator's prompt lists the candidates."""
    calls = []
    for e in range(2):
        outs = [f"ep{e}-solution-by-gen{i}" for i in range(3)]
        calls += [call(e, f"generator{i}", 0, f"ep{e}-question", outs[i], 1.0) for i in range(3)]
        calls.append(call(e, "aggregator", 1, f"ep{e}-pick one of: " + " | ".join(outs),
                          f"ep{e}-aggregator-choice", 1.0))
    return calls


def test_central_critic_reads_every_agents_history():
    calls = voting_calls()
    episode0 = [c for c in calls if c.episode == 0]
    at_aggregator = joint_history(episode0, 1)
    for c in episode0[:3]:
        assert c.prompt in at_aggregator and c.text in at_aggregator
        assert f"[{c.slot}] output:\n{c.text}" in at_aggregator
    assert "[generator0, generator1, generator2] prompt:\nep0-question" in at_aggregator
    assert episode0[3].prompt in at_aggregator  # the acting agent's prompt ...
    assert episode0[3].text not in at_aggregator  # ... but not what it has yet to say
    at_start = joint_history(episode0, 0)
    assert "ep0-question" in at_start and "solution" not in at_start

    keys, texts = critic_inputs(calls, "central")
    assert keys == ["critic"] * len(calls)
    assert texts[0] == texts[1] == texts[2] == at_start  # co-acting agents share a joint step
    assert texts[3] == at_aggregator
    assert "ep1" not in texts[3] and "ep0" not in texts[7]  # episodes never mix


def test_unseen_is_what_a_central_critic_reads_and_a_decentral_one_does_not():
    """An aggregator quoting every candidate lacks nothing; a worker shown one line of an
    orchestrator's three-line plan lacks the other two: 'A1' and 'C3' of 'A1', 'B22', 'C3'."""
    # list markers are not content
    calls = [call(0, "orchestrator", 0, "plan q", "1. A1\n2) B22\n\n- C3"),
             call(0, "worker0", 1, "q, follow B22", "x = 2"),
             call(0, "worker1", 1, "q, A1 B22 C3", "y"),
             call(0, "synthesizer", 2, "q, A1 B22 C3, x = 2", "2")]
    # 13 characters said; "y" unquoted
    assert unseen(calls) == [None, 4 / 7, 0.0, pytest.approx(1 / 13)]
    agg = voting_calls()
    assert [unseen(agg)[i] for i in range(4)] == [None, None, None, 0.0]


def test_critic_metrics_by_hand():
    """Two Voting episodes (generator0-2, aggregator each). Returns 1 0 1 1 | 0 0 1 0 (mean 0.5,
    variance 0.25) against values 0.1 ... 0.8: the errors 0.9 -0.2 0.7 0.6 -0.5 -0.6 0.3 -0.8 have
    mean 0.05 and variance 3.02 / 8 = 0.3775, so explained variance 1 - 0.3775 / 0.25 = -0.51."""
    calls = voting_calls()
    for c, a in zip(calls, [0.5, -0.5, 0.5, 0.2, -0.1, -0.2, 0.3, -0.4]):
        c.advantage = a
    values = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    returns = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    m = critic_metrics(calls, CriticBatch(["critic"] * 8, [[1]] * 8, values, returns))
    assert m["critic/explained_variance"] == pytest.approx(-0.51)
    # the generators' six calls, the aggregator's two, generator0's two (episodes 0 and 1)
    assert m["role/generator/value"] == pytest.approx(2.4 / 6)
    assert m["role/generator/return"] == pytest.approx(0.5)
    assert m["role/generator/adv"] == pytest.approx(0.5 / 6)
    assert m["role/aggregator/value"] == pytest.approx(0.6)
    assert m["role/aggregator/adv"] == pytest.approx(-0.1)
    assert (m["slot/generator0/value"], m["slot/generator0/return"],
            m["slot/generator0/adv"]) == pytest.approx((0.3, 0.5, 0.2))
    # the aggregator's prompt quotes every candidate; a generator's quotes no one
    assert m["role/aggregator/unseen"] == 0.0 and "role/generator/unseen" not in m
    # every return equal: nothing to explain, no explained variance logged
    flat = critic_metrics(calls, CriticBatch(["critic"] * 8, [[1]] * 8, values, torch.ones(8)))
    assert "critic/explained_variance" not in flat and flat["role/aggregator/return"] == 1.0


def test_decentral_critic_reads_only_its_own_agent():
    calls = voting_calls()
    keys, texts = critic_inputs(calls, "decentral", per="slot")
    assert keys[:4] == ["critic-generator0", "critic-generator1", "critic-generator2",
                        "critic-aggregator"]
    others = [c.text for c in calls]
    for c, text in zip(calls[:3], texts[:3]):
        assert text == local_observation(c) and c.prompt in text
        assert not any(o in text for o in others)  # no agent's output, its own included
    keys, _ = critic_inputs(calls, "decentral", per="role")
    assert keys[:4] == ["critic-generator"] * 3 + ["critic-aggregator"]
    with pytest.raises(ValueError, match="decentral"):
        critic_key("generator0", "generator", "shared")


def test_encode_keeps_the_most_recent_tokens(tiny):
    _, tok = tiny
    full = encode(tok, ["Problem: What is 12 + 7? The answer is"], max_tokens=10_000)[0]
    cut = encode(tok, ["Problem: What is 12 + 7? The answer is"], max_tokens=5)[0]
    assert len(full) > 5 and cut == full[-5:]


# ---------------------------------------------------------------- the critic on the tiny model

def test_value_head_shapes_and_zero_start():
    head = ValueHead(8)
    out = head(torch.randn(5, 8))
    assert out.shape == (5,) and torch.equal(out, torch.zeros(5))


def test_fresh_critic_is_a_no_op(tiny):
    model, tok = tiny
    lora.inject_lora(model, r=4, alpha=8)
    lora.setup_adapters(model, ["generator"], "shared")
    heads = setup_critics(model, ["critic"])
    ids = encode(tok, ["What is 12 + 7?", "Candidate 1 2 3"], max_tokens=64)
    values = critic_values(model, heads["critic"], "critic", ids, tok.pad_token_id)
    assert values.shape == (2,) and torch.equal(values, torch.zeros(2))
    x = torch.tensor([ids[0]])
    base = model(x, output_hidden_states=True).hidden_states[-1]
    with lora.use_adapter(model, "critic"):
        assert torch.equal(model(x, output_hidden_states=True).hidden_states[-1], base)
    assert lora.lora_layers(model)[0].active is None  # critic_values restored the adapter


def randomize_heads(heads, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def test_values_ignore_left_padding_and_batching(tiny):
    model, tok = tiny
    lora.inject_lora(model, r=4, alpha=8)
    heads = setup_critics(model, ["critic-a", "critic-b"])
    randomize_heads(heads)
    ids = encode(tok, ["What is 12 + 7?", "the answer", "What is 12 + 7?", "Candidate 1 2 3"], 64)
    keys = ["critic-a", "critic-a", "critic-a", "critic-b"]
    alone = torch.cat([critic_values(model, heads[k], k, [x], tok.pad_token_id)
                       for k, x in zip(keys, ids)])  # (4,), no padding
    together = predict_values(model, heads, keys, ids, tok.pad_token_id, batch_size=2)  # (4,)
    assert torch.allclose(together, alone, atol=1e-5)
    assert together[0] == together[2] and together[0] != together[3]


WORDS = "the answer is boxed correct candidate problem solve generator evaluator".split()


def toy_batch(tok, rng: random.Random, n: int):
    """"A ..." is worth 1 and "B ..." 0, then random filler, plus noise on the return."""
    texts, returns = [], []
    for _ in range(n):
        good = rng.random() < 0.5
        texts.append(("A " if good else "B ") + " ".join(rng.choices(WORDS, k=rng.randint(2, 6))))
        returns.append(float(good) + rng.gauss(0, 0.1))
    return encode(tok, texts, max_tokens=32), torch.tensor(returns)


def test_critic_learns_a_known_value(tiny):
    model, tok = tiny
    lora.inject_lora(model, r=8, alpha=16)
    heads = setup_critics(model, ["critic"])
    params = lora.adapter_parameters(model, "critic") + list(heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    rng = random.Random(0)
    test_ids, test_returns = toy_batch(tok, rng, 64)

    def held_out_ev() -> float:
        with torch.no_grad():
            v = critic_values(model, heads["critic"], "critic", test_ids, tok.pad_token_id)
        return explained_variance(v, test_returns)

    assert held_out_ev() == pytest.approx(0.0)  # predicts 0 for everything
    for _ in range(60):
        ids, returns = toy_batch(tok, rng, 16)
        values = critic_values(model, heads["critic"], "critic", ids, tok.pad_token_id)
        loss, _ = value_loss(values, values.detach(), returns, clip=None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert held_out_ev() > 0.5
    assert any(p.abs().sum() > 0 for p in lora.adapter_parameters(model, "critic")[1::2])  # B moved


def test_a_critic_mini_batch_with_a_non_finite_gradient_is_not_applied(tiny):
    """Two critics, two mini-batches each; critic-a's gradients are NaN: its weights and AdamW
    state stay as they were, critic-b learns, and critic/skipped_nonfinite counts both critics'."""
    model, tok = tiny
    lora.inject_lora(model, r=4, alpha=8)
    heads = setup_critics(model, ["critic-a", "critic-b"])
    params = {k: lora.adapter_parameters(model, k) + list(heads[k].parameters()) for k in heads}
    optimizers = {k: torch.optim.AdamW(ps, lr=1e-2) for k, ps in params.items()}
    for ps in params.values():
        for p in ps:
            p.grad = torch.zeros_like(p)
    ids, returns = toy_batch(tok, random.Random(0), 8)
    batch = CriticBatch(["critic-a", "critic-b"] * 4, ids, torch.zeros(8), returns)
    s = critic_config(critic_steps=2)
    before = {k: [p.detach().clone() for p in ps] for k, ps in params.items()}
    hook = heads["critic-a"].out.weight.register_hook(lambda g: g * float("nan"))
    stats = update_critics(train_state(model, optimizers, heads), batch, tok.pad_token_id, s)
    hook.remove()
    # 2 steps each
    assert stats["critic/skipped_nonfinite"] == [2] and len(stats["critic/grad_norm"]) == 2
    assert all(torch.equal(p, b) for p, b in zip(params["critic-a"], before["critic-a"]))
    assert not optimizers["critic-a"].state and optimizers["critic-b"].state
    assert not torch.equal(heads["critic-b"].out.bias, before["critic-b"][-1])


@pytest.mark.parametrize("steps, taken", [(3, [3, 3]), (2, [2, 2]), (5, [5, 4])])
def test_every_critic_takes_the_same_steps_unless_it_has_fewer_rows(tiny, steps, taken):
    """A central critic reads every agent's rows, a decentral one its own: both take `steps` AdamW
    steps a training step, the central one over larger mini-batches (12 rows in 3 steps: 4 a step;
    4 rows: 1, 1 and 2), and a critic with fewer rows than steps one step a row."""
    model, tok = tiny
    lora.inject_lora(model, r=4, alpha=8)
    heads = setup_critics(model, ["central", "critic-generator0"])
    optimizers = {k: torch.optim.AdamW(lora.adapter_parameters(model, k)
                                       + list(heads[k].parameters()), lr=1e-2) for k in heads}
    for opt in optimizers.values():
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.zeros_like(p)
    ids, returns = toy_batch(tok, random.Random(0), 16)
    keys = ["central"] * 12 + ["critic-generator0"] * 4
    stats = update_critics(train_state(model, optimizers, heads),
                           CriticBatch(keys, ids, torch.zeros(16), returns), tok.pad_token_id,
                           critic_config(critic_steps=steps))
    assert len(stats["critic/grad_norm"]) == sum(taken)
    assert [o.state[o.param_groups[0]["params"][0]]["step"].item()
            for o in optimizers.values()] == taken


def test_the_value_clip_logs_how_often_it_held_a_value_back(tiny):
    """With --value_clip each micro-batch logs critic/clip_frac, the share of its values that
    moved further than the clip from their rollout values; without it, nothing."""
    model, tok = tiny
    lora.inject_lora(model, r=4, alpha=8)
    heads = setup_critics(model, ["critic"])
    optimizer = torch.optim.AdamW(lora.adapter_parameters(model, "critic")
                                  + list(heads.parameters()), lr=1e-1)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    ids, returns = toy_batch(tok, random.Random(0), 8)
    batch = CriticBatch(["critic"] * 8, ids, torch.zeros(8), returns)
    for clip, logged in ((None, False), (1e-4, True)):
        stats = update_critics(train_state(model, {"critic": optimizer}, heads), batch,
                               tok.pad_token_id, critic_config(critic_steps=2, value_clip=clip))
        assert ("critic/clip_frac" in stats) == logged
    # two steps at lr 0.1 have moved every value past 1e-4 from the rollout's 0
    assert stats["critic/clip_frac"] == [1.0, 1.0]
