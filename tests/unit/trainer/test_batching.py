"""Packing: target alignment, rank/micro-batch planning, and packed = unpacked loss and gradients on the model."""

import numpy as np
import pytest
import torch

from agentrl.trainer.batching import mini_batch_indices, pack, plan_step
from agentrl.trainer.forward import PackedPolicy, micro_batch_loss
from agentrl.trainer.losses import LossConfig, grpo_advantages
from agentrl.types import Trajectory
from tests.unit.model.conftest import tiny_model


def make_traj(i: int, length: int, *, prompt: int = 3, group: str = "g", reward: float = 0.0, seed: int = 0,
              routed: tuple[int, int] | None = None) -> Trajectory:
    rng = np.random.default_rng(seed * 1000 + i)
    t = Trajectory(trajectory_id=f"t{i}", task_id=group, group_id=group, env_id="toy", reward=reward)
    t.append_prompt(rng.integers(0, 512, prompt).tolist())
    n = length - prompt
    t.append_sampled(rng.integers(0, 512, n).tolist(), (-rng.random(n) * 3).tolist(), version=0)
    if routed is not None:
        layers, k = routed
        t.routed_experts = np.stack([rng.permutation(8)[:k] for _ in range(length * layers)]).reshape(
            length, layers, k).astype(np.int16)
    return t


def test_targets_are_next_tokens_and_masks_belong_to_the_target():
    t = Trajectory(trajectory_id="x", task_id="x", group_id="x", env_id="e")
    t.append_prompt([5, 6, 7])
    t.append_sampled([8, 9], [-0.5, -0.25], version=3)
    t.append_prompt([10])  # a tool token after the answer
    t.append_sampled([11], [-1.5], version=3)
    mb = pack([t], [0], [2.0], [0.5])
    assert mb.input_ids_T.tolist() == [5, 6, 7, 8, 9, 10]
    assert mb.target_ids_T.tolist() == [6, 7, 8, 9, 10, 11]
    assert mb.loss_mask_T.tolist() == [False, False, True, True, False, True]
    assert mb.infer_logprobs_T.tolist() == [0.0, 0.0, -0.5, -0.25, 0.0, -1.5]
    assert mb.weights_T.tolist() == [0.0, 0.0, 0.5, 0.5, 0.0, 0.5]
    assert mb.cu_seqlens.tolist() == [0, 6] and mb.cu_seqlens.dtype == torch.int32


def test_plan_spreads_tokens_over_ranks_respects_the_budget_and_pads():
    long_one = make_traj(0, 300)
    short = [make_traj(i, 20) for i in range(1, 41)]
    empty = Trajectory(trajectory_id="e", task_id="e", group_id="g", env_id="e")
    empty.append_prompt([1, 2, 3])
    trajs = [long_one, *short, empty]
    plan = plan_step(trajs, [1.0] * len(trajs), world_size=2, token_budget=128, aggregation="token-mean")
    assert plan.skipped == [41] and plan.num_sequences == 41
    counts = [len(m) for m in plan.per_rank]
    assert counts[0] == counts[1]
    seen = sorted(i for mbs in plan.per_rank for mb in mbs for i in mb.trajectory_indices)
    assert seen == list(range(41))
    for mbs in plan.per_rank:
        for mb in mbs:
            assert mb.num_tokens <= 128 or mb.trajectory_indices == [0]  # only the long one exceeds the budget
    loads = [sum(mb.num_tokens for mb in mbs if not mb.is_padding) for mbs in plan.per_rank]
    assert abs(loads[0] - loads[1]) <= 19  # 299 + 40·19 tokens split within one short sequence
    total_weight = sum(float(mb.weights_T.sum()) for mbs in plan.per_rank for mb in mbs)
    assert total_weight == pytest.approx(1.0)  # token-mean over the whole batch
    assert any(mb.is_padding for mbs in plan.per_rank for mb in mbs) or counts[0] == sum(
        1 for mb in plan.per_rank[0] if not mb.is_padding)


def test_plan_rejects_mixed_routing_and_wrong_layer_counts():
    a, b = make_traj(0, 10, routed=(2, 2)), make_traj(1, 10)
    with pytest.raises(ValueError, match="1 of 2"):
        plan_step([a, b], [1.0, 1.0], world_size=1, token_budget=64, aggregation="token-mean")
    with pytest.raises(ValueError, match="2 MoE layers; the model has 3"):
        plan_step([a], [1.0], world_size=1, token_budget=64, aggregation="token-mean", num_moe_layers=3)
    with pytest.raises(ValueError, match="no|none"):
        plan_step([a], [None], world_size=1, token_budget=64, aggregation="token-mean")


def _loss_and_grads(model, plan, config):
    model.zero_grad()
    forward = PackedPolicy(model)
    total = 0.0
    for micro in plan.per_rank[0]:
        out = micro_batch_loss(forward, micro, config)
        out.loss.backward()
        total += out.loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config", [
    LossConfig(kind="ppo", aggregation="seq-mean-token-mean", old_logprobs="inference", eps_high=0.28),
    LossConfig(kind="gspo", tis_cap=2.0, icepop_band=(0.1, 10.0), eps_low=3e-3, eps_high=4e-3),
    LossConfig(kind="sft", aggregation="token-mean"),
], ids=["ppo", "gspo", "sft"])
def test_packed_and_unpacked_batches_give_the_same_loss_and_gradients(config):
    model = tiny_model()
    trajs = [make_traj(i, length, group=f"g{i % 2}", reward=float(i % 3)) for i, length in
             enumerate([37, 9, 64, 15, 23, 50])]
    advs = grpo_advantages(trajs, normalize_std=True)
    kw = dict(world_size=1, aggregation=config.aggregation)
    packed = plan_step(trajs, advs, token_budget=10_000, **kw)
    unpacked = plan_step(trajs, advs, token_budget=2, **kw)
    assert len(packed.per_rank[0]) == 1 and len(unpacked.per_rank[0]) == 6
    loss_p, grads_p = _loss_and_grads(model, packed, config)
    loss_u, grads_u = _loss_and_grads(model, unpacked, config)
    assert loss_p == pytest.approx(loss_u, rel=1e-5, abs=1e-7)
    assert grads_p.keys() == grads_u.keys() and len(grads_p) > 20
    for name in grads_p:
        torch.testing.assert_close(grads_p[name], grads_u[name], rtol=1e-4, atol=1e-7, msg=name)


def test_routing_replay_packs_experts_in_token_order_and_forces_them():
    model = tiny_model().eval()
    num_moe = len(model.moe_layers)
    trajs = [make_traj(i, n, routed=(num_moe, 2)) for i, n in enumerate([12, 30, 7])]
    plan = plan_step(trajs, [1.0] * 3, world_size=1, token_budget=1000, aggregation="token-mean",
                     num_moe_layers=num_moe)
    mb = plan.per_rank[0][0]
    want = np.concatenate([t.routed_experts[:-1] for t in trajs])
    assert np.array_equal(mb.forced_experts_TLK.numpy(), want)
    with torch.no_grad():
        logp, _ = PackedPolicy(model)(mb.input_ids_T, mb.cu_seqlens, mb.target_ids_T, mb.forced_experts_TLK)
        free, _ = PackedPolicy(model)(mb.input_ids_T, mb.cu_seqlens, mb.target_ids_T)
        for j, t in enumerate(trajs):  # each sequence alone, with its own experts forced
            ids = torch.tensor(t.tokens)
            out = model(ids[:-1], target_ids=ids[1:], forced_experts=torch.as_tensor(t.routed_experts[:-1]).long())
            lo, hi = int(mb.cu_seqlens[j]), int(mb.cu_seqlens[j + 1])
            torch.testing.assert_close(logp[lo:hi], out.token_logprobs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logp, free)  # the forced (random) routing is not the model's own


def test_kl_term_uses_the_frozen_reference_forward():
    import copy

    model = tiny_model()
    reference = PackedPolicy(copy.deepcopy(model).eval().requires_grad_(False))
    trajs = [make_traj(i, 30, group="g", reward=float(i)) for i in range(4)]
    plan = plan_step(trajs, grpo_advantages(trajs, normalize_std=False), world_size=1, token_budget=1000,
                     aggregation="token-mean")
    config = LossConfig(kl_coef=0.5)
    same = micro_batch_loss(PackedPolicy(model), plan.per_rank[0][0], config, reference=reference)
    assert same.host_sums()["kl"] == pytest.approx(0.0, abs=1e-9)  # π_θ = π_ref: k3 is exactly zero
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    moved = micro_batch_loss(PackedPolicy(model), plan.per_rank[0][0], config, reference=reference)
    without = micro_batch_loss(PackedPolicy(model), plan.per_rank[0][0], LossConfig(kl_coef=0.0), reference=reference)
    kl_mean = moved.host_sums()["kl"] / moved.host_sums()["tokens"]
    assert kl_mean > 0.01
    assert moved.loss.item() - without.loss.item() == pytest.approx(0.5 * kl_mean, rel=1e-4)


def test_sft_fits_at_temperature_one_and_rl_at_the_sampling_temperature():
    """A policy sampled at τ = 0.5: its SFT loss is the cross-entropy of the untempered model (the loss a τ = 1
    policy gives), its PPO entropy that of softmax(z/τ)."""
    model = tiny_model()
    with torch.no_grad():  # logits far from uniform, so that the temperature matters
        model.lm_head.weight.mul_(30.0)
    trajs = [make_traj(i, 30, group="g", reward=float(i)) for i in range(4)]
    plan = plan_step(trajs, grpo_advantages(trajs, normalize_std=False), world_size=1, token_budget=1000,
                     aggregation="token-mean")
    micro = plan.per_rank[0][0]
    hot, plain = PackedPolicy(model, temperature=0.5), PackedPolicy(model)
    sft = LossConfig(kind="sft", aggregation="token-mean")
    assert micro_batch_loss(hot, micro, sft).loss.item() == pytest.approx(
        micro_batch_loss(plain, micro, sft).loss.item(), rel=1e-6)
    with torch.no_grad():
        tempered, _ = plain(*micro.forward_args("cpu"), temperature=0.5)
    mask = micro.loss_mask_T.bool()
    # the SFT loss is the token-mean negative log-likelihood at τ = 1, not at 0.5 (which differs)
    nll_plain = -plain(*micro.forward_args("cpu"))[0][mask].mean().item()
    assert micro_batch_loss(hot, micro, sft).loss.item() == pytest.approx(nll_plain, rel=1e-5)
    assert abs(-tempered[mask].mean().item() - nll_plain) > 0.1
    ppo = LossConfig(kind="ppo")
    with torch.no_grad():
        _, tempered_entropy = plain(*micro.forward_args("cpu"), temperature=0.5)
    assert micro_batch_loss(hot, micro, ppo).host_sums()["entropy"] == pytest.approx(
        float((tempered_entropy * micro.loss_mask_T).sum()), rel=1e-5)
    assert micro_batch_loss(hot, micro, ppo).host_sums()["entropy"] != pytest.approx(
        micro_batch_loss(plain, micro, ppo).host_sums()["entropy"], rel=1e-3)


def test_mini_batches_hold_whole_groups_and_lose_no_trajectory():
    batch = [make_traj(g * 4 + m, 12, group=f"g{g}", reward=float(m % 2)) for g in range(5) for m in range(4)]
    advantages = grpo_advantages(batch, normalize_std=True)
    parts = mini_batch_indices(batch, advantages, 2)
    assert [sorted({batch[i].group_id for i in p}) for p in parts] == [["g0", "g1"], ["g2", "g3", "g4"]]
    assert sorted(i for p in parts for i in p) == list(range(20))
    assert mini_batch_indices(batch, advantages, 1) == [list(range(20))]
    assert len(mini_batch_indices(batch, advantages, 9)) == 5  # never more mini-batches than groups
    # a group without a trained member (its episodes failed: no advantage) rides in the first mini-batch
    failed = {4, 5, 6, 7}
    advantages = [None if i in failed else a for i, a in enumerate(advantages)]
    parts = mini_batch_indices(batch, advantages, 4)
    assert len(parts) == 4 and failed <= set(parts[0])
    assert sorted(i for p in parts for i in p) == list(range(20))
    for p in parts:  # every mini-batch plans (has a trained token)
        plan_step([batch[i] for i in p], [advantages[i] for i in p], world_size=1, token_budget=64,
                  aggregation="token-mean")
