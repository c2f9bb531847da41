"""Kill a two-rank ZeRO-2 run (Ray actors) in the middle of a step and resume it from its checkpoint and its store."""

import pytest

from agentrl.store import StoreConfig, TrajectoryStore
from agentrl.trainer import LossConfig, create_trainer_group
from tests.integration.test_trainer import TIMEOUT, config, make_groups, model_dir, on_all  # noqa: F401


def _train_one(group, store, version):
    batch = store.take_batch(2, current_version=version, max_staleness=4)
    assert batch is not None
    return on_all(group, "step", batch.trajectories)[0], batch


def test_kill_mid_run_and_resume_repeats_the_next_step_and_loses_nothing(ray_session, model_dir, tmp_path):
    import ray

    run = tmp_path / "run"
    cfg = config(run, zero_stage=2, lr=1e-3, loss=LossConfig(kind="gspo", eps_low=3e-3, eps_high=4e-3))
    store = TrajectoryStore(StoreConfig(run_dir=str(run), group_size=4))
    put_ids = []

    def arrive(first, count, version):
        trajs = make_groups(first, count, seed=6, version=version)
        for g in range(count):
            store.put(trajs[4 * g: 4 * g + 4])
        put_ids.extend(t.trajectory_id for t in trajs)

    group = create_trainer_group(cfg, model_dir, num_ranks=2)
    arrive(0, 4, version=0)
    m1, _ = _train_one(group, store, 0)
    on_all(group, "save_checkpoint", {"store_position": store.position})
    arrive(4, 2, version=1)  # arrives after the checkpoint: must survive the crash
    m2, batch2 = _train_one(group, store, 1)  # the uninterrupted run's next step
    weights_after_2 = on_all(group, "replica_checksum")[0]
    arrive(6, 2, version=2)
    batch3 = store.take_batch(2, current_version=2, max_staleness=4)
    pending = [r.step.remote(batch3.trajectories) for r in group.ranks]
    group.shutdown()  # killed mid-step
    with pytest.raises(ray.exceptions.RayError):
        ray.get(pending, timeout=TIMEOUT)
    del store  # the store "crashes" too: no close, no flush

    group = create_trainer_group(cfg, model_dir, num_ranks=2)
    try:
        state = on_all(group, "load_checkpoint")[0]
        assert state["store_position"] == 1 and state["version"] == 1 and state["global_step"] == 1
        resumed = TrajectoryStore.open(str(run), position=state["store_position"])
        r2, rbatch2 = _train_one(group, resumed, state["version"])
        assert rbatch2.group_ids == batch2.group_ids
        assert r2["loss"] == pytest.approx(m2["loss"], rel=1e-6, abs=1e-9)
        assert r2["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-6)
        assert r2["step"] == m2["step"] == 2 and r2["version"] == 2
        # the update itself repeats too: Adam's moments, its step count and the QB biases came back exactly
        assert on_all(group, "replica_checksum")[0] == weights_after_2
        assert m1["loss"] != m2["loss"]
        persisted = TrajectoryStore.read_trajectories(str(run))
        assert sorted(persisted["trajectory_id"]) == sorted(put_ids)
        st = resumed.stats()
        assert st["trajectories_consumed"] + st["buffered_trajectories"] == len(put_ids)
        assert resumed.take_batch(2, 2, 4).group_ids == batch3.group_ids  # the batch in flight at the crash
    finally:
        group.shutdown()
