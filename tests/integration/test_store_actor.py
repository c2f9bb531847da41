"""TrajectoryStoreActor: the store as a Ray actor, killed and reopened from its run directory."""

import ray

from agentrl.store import StoreConfig, TrajectoryStore
from tests.unit.test_store import traj


def test_store_actor_round_trip_and_reopen_after_kill(ray_session, tmp_path):
    from agentrl.store import TrajectoryStoreActor

    config = StoreConfig(run_dir=str(tmp_path), group_size=2)
    store = TrajectoryStoreActor.remote(config)
    for g in "ABC":
        ray.get(store.put.remote([traj(f"{g}0", g, version=1), traj(f"{g}1", g, version=2)]))
    batch = ray.get(store.take_batch.remote(2, 3, 2))
    assert batch.group_ids == ["A", "B"] and len(batch.trajectories) == 4
    assert ray.get(store.stats.remote())["complete_groups"] == 1
    ray.kill(store)
    reopened = TrajectoryStoreActor.remote(config, resume=True)
    assert ray.get(reopened.stats.remote())["position"] == 1
    assert ray.get(reopened.take_batch.remote(1, 3, 2)).group_ids == ["C"]
    ray.kill(reopened)
    assert len(TrajectoryStore.read_trajectories(str(tmp_path))) == 6
