"""The trainer under real DeepSpeed: two CPU ranks on gloo as Ray actors (ZeRO-3 and ZeRO-2).

One ZeRO-3 group serves the first tests in order (engine start-up is the expensive part); the kill-and-resume test
builds its own ZeRO-2 group, kills it mid-step and starts another.
"""

import numpy as np
import pytest
import torch

from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.trainer import LossConfig, TrainerConfig, create_trainer_group
from agentrl.trainer.batching import plan_step
from agentrl.trainer.forward import PackedPolicy, micro_batch_loss
from agentrl.trainer.losses import grpo_advantages
from agentrl.trainer.publish import directory_checksums, latest_weights, state_dict_checksums
from agentrl.types import Trajectory

TIMEOUT = 240  # a deadlocked collective fails the test instead of hanging it
SKEWED_VOCAB = np.random.default_rng(123).choice(512, 24, replace=False)


def make_traj(i: int, length: int, *, group: str, rng: np.random.Generator, vocab=None, version: int = 0,
              routed: np.ndarray | None = None) -> Trajectory:
    vocab = np.arange(512) if vocab is None else vocab
    t = Trajectory(trajectory_id=f"{group}-{i}", task_id=group, group_id=group, env_id="toy",
                   reward=float(rng.random() < 0.5) + 0.1 * i)
    t.append_prompt(rng.choice(vocab, 5).tolist())
    n = length - 5
    t.append_sampled(rng.choice(vocab, n).tolist(), (-5.5 - rng.random(n)).tolist(), version=version)
    t.routed_experts = routed
    return t


def make_groups(first: int, count: int, *, size: int = 4, seed: int = 0, vocab=None, version: int = 0,
                lengths=(120, 20, 45, 9, 70, 33, 15, 250)) -> list[Trajectory]:
    rng = np.random.default_rng(seed * 7919 + first)
    return [make_traj(m, lengths[(g * size + m) % len(lengths)], group=f"g{g}", rng=rng, vocab=vocab,
                      version=version) for g in range(first, first + count) for m in range(size)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny hybrid with routers skewed towards two experts, saved once for every rank to load."""
    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config("tiny")).float()
    with torch.no_grad():
        for moe in model.moe_layers:
            moe.gate.weight[:2] += 0.3 * torch.randn(moe.gate.weight.shape[1]).sign()
    path = tmp_path_factory.mktemp("init") / "model"
    model.save_pretrained(str(path))
    return str(path)


def config(run_dir, **overrides) -> TrainerConfig:
    base = dict(run_dir=str(run_dir), zero_stage=3, lr=1e-4, micro_batch_tokens=256, num_threads=1,
                zero3_param_persistence_threshold=0, dist_timeout_s=120.0,
                loss=LossConfig(tis_cap=1.1, icepop_band=(0.8, 1.25), eps_high=0.28))
    base.update(overrides)
    return TrainerConfig(**base)


def on_all(group, method, *args):
    import ray

    return ray.get([getattr(r, method).remote(*args) for r in group.ranks], timeout=TIMEOUT)


@pytest.fixture(scope="module")
def zero3(ray_session, model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("zero3-run")
    group = create_trainer_group(config(run_dir), model_dir, num_ranks=2)
    yield group, run_dir
    group.shutdown()


def reference_step(state: dict, model_dir: str, trajectories, loss: LossConfig) -> tuple[float, float]:
    """Loss and gradient norm of the whole batch in one plain PyTorch process (no DeepSpeed, no ranks)."""
    model = HybridMoEForCausalLM.from_pretrained(model_dir)
    model.load_state_dict(state)
    model.train()
    plan = plan_step(trajectories, grpo_advantages(trajectories, normalize_std=True), world_size=1,
                     token_budget=10_000, aggregation=loss.aggregation, num_moe_layers=len(model.moe_layers))
    total = 0.0
    for micro in plan.per_rank[0]:
        out = micro_batch_loss(PackedPolicy(model), micro, loss)
        out.loss.backward()
        total += out.loss.item()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return total, norm.item()


def test_zero3_ranks_that_route_differently_train_as_one_batch(zero3, model_dir):
    group, _ = zero3
    cfg = config("unused")
    batch = make_groups(0, 4, seed=1)
    # routing replay with disjoint experts per rank: rank 0's sequences use experts {0, 1}, rank 1's {4..7}
    plan = plan_step(batch, [1.0] * len(batch), world_size=2, token_budget=cfg.micro_batch_tokens,
                     aggregation="token-mean")
    rank_of = {i: r for r, mbs in enumerate(plan.per_rank) for mb in mbs for i in mb.trajectory_indices}
    rng = np.random.default_rng(5)
    for i, t in enumerate(batch):
        experts = [0, 1] if rank_of[i] == 0 else [4, 5, 6, 7]
        t.routed_experts = np.stack([rng.choice(experts, 2, replace=False) for _ in range(len(t.tokens) * 3)]
                                    ).reshape(len(t.tokens), 3, 2).astype(np.int16)
    assert {rank_of[i] for i in range(len(batch))} == {0, 1}
    state = on_all(group, "full_state_dict")[0]
    want_loss, want_norm = reference_step(state, model_dir, batch, cfg.loss)

    metrics = on_all(group, "step", batch)
    timing = ("step_s", "tokens_per_s")
    assert {k: v for k, v in metrics[0].items() if k not in timing} == {
        k: v for k, v in metrics[1].items() if k not in timing}  # every rank reports the global metrics
    m = metrics[0]
    assert m["loss"] == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    assert m["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    assert m["version"] == 1 and m["num_sequences"] == 16 and m["micro_batches"] >= 2
    assert 0 < m["icepop_masked_frac"] < 1 and 0 < m["tis_truncated_frac"] < 1
    for _ in range(2):  # more steps with natural routing on both ranks
        on_all(group, "step", make_groups(10 + _ * 4, 4, seed=2))
    checks = on_all(group, "replica_checksum")
    assert checks[0] == checks[1]  # full weights and the Quantile Balancing biases agree


def test_quantile_balancing_keeps_expert_load_flat_on_skewed_data(zero3):
    group, _ = zero3
    loads = []
    for step in range(6):
        m = on_all(group, "step", make_groups(100 + 8 * step, 8, seed=3, vocab=SKEWED_VOCAB))[0]
        loads.append(m["expert_load_max_over_mean"])
    # two updates to settle: the first sets the bias for step 0's scores, and the router itself moves under the first
    # optimizer steps (run alone, on the module's untrained fixture, step 1 still read 1.45; after this file's earlier
    # tests had trained the fixture it read < 1.2: the assertion must not depend on which tests ran first)
    assert max(loads[2:]) < 1.2 and loads[-1] < loads[0], loads
    # the same data through the trained weights with the bias removed is far from flat: the bias does the work
    state = on_all(group, "full_state_dict")[0]
    model = HybridMoEForCausalLM(preset_config("tiny")).float().eval()
    model.load_state_dict(state)
    tokens = torch.as_tensor(np.random.default_rng(9).choice(SKEWED_VOCAB, 2048))
    ratios = {}
    for label, zero_bias in (("trained", False), ("unbiased", True)):
        if zero_bias:
            for moe in model.moe_layers:
                moe.gate.e_score_correction_bias.zero_()
        with torch.no_grad():
            routed = model(tokens[None]).routed_experts  # [T, L, K]
        counts = torch.stack([torch.bincount(routed[:, layer].reshape(-1), minlength=8) for layer in range(3)])
        ratios[label] = (counts.max(1).values / counts.float().mean(1)).max().item()
    assert ratios["unbiased"] > 1.5 and ratios["trained"] < 1.2, ratios


def test_a_rank_whose_micro_batches_are_all_padding_steps_with_the_others(zero3):
    """One trajectory for two ranks: rank 1 runs a padding micro-batch and its routers observe nothing. It must still
    join Quantile Balancing's collective (skipping it paired its next collective with rank 0's and the step failed);
    both ranks then report the same metrics, expert loads included, and hold the same weights and biases."""
    group, _ = zero3
    batch = [make_traj(0, 80, group="alone", rng=np.random.default_rng(4))]
    metrics = on_all(group, "step", batch)
    timing = ("step_s", "tokens_per_s")
    assert {k: v for k, v in metrics[0].items() if k not in timing} == {
        k: v for k, v in metrics[1].items() if k not in timing}
    assert metrics[0]["num_sequences"] == 1 and metrics[0]["micro_batches"] == 1
    assert {f"expert_load/layer{i}" for i in (1, 2, 3)} <= set(metrics[0])  # rank 0's loads, seen by both
    checks = on_all(group, "replica_checksum")
    assert checks[0] == checks[1]


def test_published_weights_match_the_trainer_and_reproduce_its_logprobs(zero3):
    group, run_dir = zero3
    published = on_all(group, "publish_weights")
    p = published[0]
    assert published[1].path == p.path and p.version == on_all(group, "info")[0]["version"]
    assert latest_weights(str(run_dir)) == (p.version, p.path)
    state = on_all(group, "full_state_dict")[0]
    assert directory_checksums(p.path) == p.checksums == state_dict_checksums(state)
    assert p.num_bytes == sum(t.numel() * t.element_size() for t in state.values())
    probe = make_groups(500, 2, seed=4)
    trainer_logprobs = on_all(group, "logprobs", probe)[0]
    loaded = HybridMoEForCausalLM.from_pretrained(p.path).eval()
    for t, want in zip(probe, trainer_logprobs):
        ids = torch.tensor(t.tokens)
        with torch.no_grad():
            got = loaded(ids[:-1], target_ids=ids[1:]).token_logprobs
        np.testing.assert_allclose(got.numpy(), want[1:], rtol=1e-5, atol=1e-5)
    biases = [m.gate.e_score_correction_bias for m in loaded.moe_layers]
    assert all(b.abs().sum() > 0 for b in biases)  # the QB biases travel with the weights
