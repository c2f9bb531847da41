"""Expert parallelism in the DeepSpeed trainer: two CPU ranks on gloo (Ray actors), ZeRO-2, experts split 4 + 4.

The EP run must take the same step as the data-parallel run (expert_parallel=1) on the same batch, with routing
replay on part of it; its weights leave in the non-EP layout (published weights and the checkpoint's `model/`
directory load into a plain model), and it resumes from its own checkpoint exactly.
"""

import numpy as np
import pytest
import torch

from agentrl.model.checkpoint import load_checkpoint_tensors
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.net import free_port
from agentrl.trainer import create_trainer_group
from agentrl.trainer.expert_checkpoint import MODEL_DIR
from agentrl.trainer.publish import state_dict_checksums
from tests.integration.test_trainer import SKEWED_VOCAB, config, make_groups, model_dir, on_all  # noqa: F401


def _batch():
    batch = make_groups(0, 4, seed=1)
    rng = np.random.default_rng(5)
    for i, t in enumerate(batch):  # routing replay: the engine's experts, tokens × 3 MoE layers × top-2
        t.routed_experts = np.stack([rng.choice(8, 2, replace=False) for _ in range(len(t.tokens) * 3)]
                                    ).reshape(len(t.tokens), 3, 2).astype(np.int16)
        if i % 3:  # rows of −1: these sequences route themselves
            t.routed_experts[:] = -1
    return batch


def _cfg(run_dir, expert_parallel):
    return config(run_dir, zero_stage=2, lr=1e-3, expert_parallel=expert_parallel)


@pytest.fixture(scope="module")
def data_parallel_step(ray_session, model_dir, tmp_path_factory):
    """Metrics and full weights after one step and after a second (skewed) step without expert parallelism."""
    group = create_trainer_group(_cfg(tmp_path_factory.mktemp("dp"), 1), model_dir, num_ranks=2)
    try:
        first = on_all(group, "step", _batch())[0]
        state = on_all(group, "full_state_dict")[0]
        second = on_all(group, "step", make_groups(100, 4, seed=3, vocab=SKEWED_VOCAB))[0]
        return first, state, second, on_all(group, "full_state_dict")[0]
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def ep_group(ray_session, model_dir, data_parallel_step, tmp_path_factory):
    # after the data-parallel group has gone: two groups of 2 ranks do not fit on 2 CPUs at once
    run_dir = tmp_path_factory.mktemp("ep")
    group = create_trainer_group(_cfg(run_dir, 2), model_dir, num_ranks=2)
    yield group, run_dir
    group.shutdown()


def _assert_states_close(got, want, atol=2e-6):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def test_expert_parallel_step_equals_the_data_parallel_step(ep_group, data_parallel_step, model_dir):
    group, _ = ep_group
    first, state, second, state2 = data_parallel_step
    info = on_all(group, "info")
    assert [i["expert_parallel"] for i in info] == [2, 2]
    assert info[0]["parameters"] == HybridMoEForCausalLM.from_pretrained(model_dir).parameter_counts()[0]
    metrics = on_all(group, "step", _batch())
    m = metrics[0]
    assert m["loss"] == pytest.approx(first["loss"], rel=1e-6, abs=1e-9)
    assert m["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-5)
    assert 0 < m["ep/all_to_all_s"] < m["step_s"] and 0 < m["ep/all_to_all_share"] < 1
    assert 0 < m["ep/rows_sent_frac"] < 1 and m["ep/rank_load_max_over_mean"] >= 1
    _assert_states_close(on_all(group, "full_state_dict")[0], state)
    # a second step on skewed data: Quantile Balancing's bias (from histograms summed over the ranks) and Adam's
    # second update agree as well, and every rank holds the same replicated weights and biases
    m2 = on_all(group, "step", make_groups(100, 4, seed=3, vocab=SKEWED_VOCAB))[0]
    assert m2["expert_load_max_over_mean"] == pytest.approx(second["expert_load_max_over_mean"], rel=1e-6)
    _assert_states_close(on_all(group, "full_state_dict")[0], state2, atol=1e-5)
    checks = on_all(group, "replica_checksum")
    assert checks[0] == checks[1]


def test_expert_parallel_weights_leave_in_the_non_ep_layout_and_resume(ep_group):
    group, run_dir = ep_group
    state = on_all(group, "full_state_dict")[0]
    published = on_all(group, "publish_weights")[0]
    assert published.checksums == state_dict_checksums(state)
    plain = HybridMoEForCausalLM.from_pretrained(published.path)
    _assert_states_close(plain.state_dict(), state, atol=0)

    path = on_all(group, "save_checkpoint", {"note": "ep"})[0]
    from_checkpoint = HybridMoEForCausalLM.from_pretrained(f"{path}/{MODEL_DIR}")
    _assert_states_close(from_checkpoint.state_dict(), state, atol=0)
    assert load_checkpoint_tensors(f"{path}/{MODEL_DIR}").keys() == load_checkpoint_tensors(published.path).keys()

    before = on_all(group, "replica_checksum")[0]
    after_next = on_all(group, "step", make_groups(200, 2, seed=4))[0]
    weights_after_next = on_all(group, "replica_checksum")[0]
    on_all(group, "load_checkpoint", path)
    assert on_all(group, "replica_checksum")[0] == before
    again = on_all(group, "step", make_groups(200, 2, seed=4))[0]
    assert on_all(group, "replica_checksum")[0] == weights_after_next  # Adam's state came back for the experts too
    assert again["loss"] == pytest.approx(after_next["loss"], rel=1e-6, abs=1e-9)
    assert again["grad_norm"] == pytest.approx(after_next["grad_norm"], rel=1e-6)


def _spawned_rank(rank, world, port, expert_parallel, run_dir, model_path, out):
    from agentrl.trainer import zero
    from agentrl.trainer.policy_trainer import PolicyTrainer

    engine_config = zero.engine_config

    def small_buckets(**kwargs):  # gradient buckets fill during the backward pass, as in a large model: their
        config = engine_config(**kwargs)  # reductions interleave with the backward all-to-alls
        config["zero_optimization"].update(reduce_bucket_size=3000, allgather_bucket_size=3000)
        return config

    zero.engine_config = small_buckets
    trainer = PolicyTrainer(_cfg(run_dir, expert_parallel), model_path, rank=rank, world_size=world,
                            master_port=port)
    metrics = trainer.step(_batch())
    state = trainer.full_state_dict()
    if rank == 0:
        torch.save((metrics, state), out)
    trainer.close()


@pytest.mark.slow
def test_four_ranks_average_expert_gradients_over_the_expert_data_parallel_group(model_dir, tmp_path):
    """4 ranks, experts in 2 shards: each shard's gradient is averaged over the 2 ranks that hold it (DeepSpeed's
    expert-data-parallel group), the step still equals the data-parallel one, also with ZeRO's gradient reductions
    interleaved with the all-to-alls of the backward pass. Spawned processes, not Ray actors."""
    import torch.multiprocessing as mp

    results = {}
    for ep in (1, 2):
        port = free_port()
        out = tmp_path / f"ep{ep}.pt"
        mp.spawn(_spawned_rank, args=(4, port, ep, str(tmp_path / f"run{ep}"), model_dir, str(out)), nprocs=4)
        results[ep] = torch.load(out, weights_only=False)
    (m1, s1), (m2, s2) = results[1], results[2]
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-6, abs=1e-9)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    _assert_states_close(s2, s1)
