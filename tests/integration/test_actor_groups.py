"""The driver's handles on groups of Ray actors, on stand-in actors: the trainer group's typed calls (every rank gets
the call, rank 0 answers, a rank that dies or outlasts the call timeout raises ActorLost at once instead of leaving
the driver waiting on rank 0) and the rollout pool's replacement of a dead worker (once per death, however many of
the pool's calls notice it)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from agentrl.failures import ActorLost

ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0)
class Rank:
    """Stands in for a PolicyTrainer rank: records what it was asked; rank 1 can be told to hang or die."""

    def __init__(self, rank: int, misbehave: str = ""):
        self.rank, self.misbehave, self.calls = rank, misbehave, []

    def step(self, trajectories, loss=None):
        self.calls.append(("step", len(trajectories), loss))
        if self.rank == 1 and self.misbehave == "hang":
            time.sleep(60)
        if self.rank == 1 and self.misbehave == "die":
            os._exit(1)
        return {"loss": float(self.rank)}

    def set_lr(self, lr):
        self.calls.append(("set_lr", lr))

    def seen(self):
        return self.calls


def group(misbehave: str = "", timeout: float | None = 10.0):
    from agentrl.trainer.actor import TrainerGroup

    return TrainerGroup(ranks=[Rank.remote(r, misbehave) for r in range(2)], placement_group=None,
                        call_timeout_s=timeout)


def test_every_rank_gets_the_call_and_rank_0_answers(ray_session):
    g = group()
    assert g.step(["a", "b", "c"], "sft") == {"loss": 0.0}
    g.set_lr(0.5)
    assert ray.get([r.seen.remote() for r in g.ranks]) == [[("step", 3, "sft"), ("set_lr", 0.5)]] * 2


def test_a_rank_that_hangs_or_dies_raises_at_once(ray_session):
    hanging = group("hang", timeout=2.0)
    # both actors up first: the 2 s are the step's, and a loaded machine can take longer than that to start an actor
    # (rank 0 was once reported as late beside rank 1)
    ray.get([r.seen.remote() for r in hanging.ranks])
    t0 = time.monotonic()
    with pytest.raises(ActorLost, match=r"trainer rank\(s\) \[1\] did not finish step within "
                                        r"cluster.trainer_timeout_s=2s"):
        hanging.step([1])
    assert time.monotonic() - t0 < 20
    with pytest.raises(ActorLost, match="trainer rank 1 died during step"):
        group("die").step([1])


@ray.remote(num_cpus=0, max_concurrency=4)  # as the real one, it answers while episodes run
class Worker:
    """Stands in for a RolloutWorker: episodes come back as their ids after `delay_s`."""

    def __init__(self, spec, tokenizer_path, config, *, version: int = 0, store=None, delay_s: float = 0.0):
        self.version, self.delay_s = version, delay_s

    def pid(self):
        return os.getpid()

    def generate(self, requests, resumes=None, budget=None, temperature=None, **options):
        time.sleep(self.delay_s)
        return [r.trajectory_id for r in requests]

    def update_weights(self, path, version):
        self.version = version
        return version

    def set_max_trajectory_tokens(self, limit):
        pass


def test_a_dead_rollout_worker_is_replaced_once_however_many_calls_notice(ray_session):
    from agentrl.rollout.agent_loop import EpisodeRequest
    from agentrl.rollout.policy_engine import EngineSpec
    from agentrl.rollout.worker import RolloutPool

    pool = RolloutPool(Worker, 1, (EngineSpec(model="v0"), "tok", None), {"delay_s": 2.0})
    asks = [EpisodeRequest(env_id="toy", task_index=i, group_id="g", trajectory_id=f"g-{i}") for i in range(2)]
    submitted = pool.submit(asks)  # an async step's rollout, in flight
    time.sleep(0.5)
    os.kill(ray.get(pool.workers[0].pid.remote()), signal.SIGKILL)
    pool.update_weights("v1", 1)  # notices the death first: replaced, on the new weights
    assert pool.restarts == 1 and ray.get(pool.workers[0].update_weights.remote("v1", 1)) == 1
    assert sorted(pool.collect(submitted)) == ["g-0", "g-1"]  # the rollout's failure reruns it on that replacement
    assert pool.restarts == 1
    pool.shutdown()


@ray.remote(num_cpus=0)
class PutsThenDies:
    """Stands in for a RolloutWorker whose first instance dies after handing its episodes to the store, before it
    could return their summaries."""

    def __init__(self, spec, tokenizer_path, config, *, version: int = 0, store=None, marker: str = ""):
        self.store, self.marker = store, marker

    def generate(self, requests, resumes=None, budget=None, temperature=None, **options):
        from agentrl.types import Trajectory

        trajectories = []
        for r in requests:
            t = Trajectory(trajectory_id=r.trajectory_id, task_id=str(r.task_index), group_id=r.group_id,
                           env_id=r.env_id, episode=r.episode())
            t.append_sampled([1, 2], [0.0, 0.0], 0)
            trajectories.append(t)
        ray.get(self.store.put.remote(trajectories))
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return [t.summary() for t in trajectories]

    def set_max_trajectory_tokens(self, limit):
        pass


def test_what_a_dead_worker_handed_to_the_store_is_not_run_again(ray_session, tmp_path):
    from agentrl.rollout.agent_loop import EpisodeRequest
    from agentrl.rollout.policy_engine import EngineSpec
    from agentrl.rollout.worker import RolloutPool
    from agentrl.store import StoreConfig, TrajectoryStoreActor

    store = TrajectoryStoreActor.remote(StoreConfig(run_dir=str(tmp_path / "run"), group_size=2))
    pool = RolloutPool(PutsThenDies, 1, (EngineSpec(model="v0"), "tok", None), {"marker": str(tmp_path / "died")},
                       store=store)
    asks = [EpisodeRequest(env_id="toy", task_index=i, group_id="g", trajectory_id=f"g-{i}") for i in range(2)]
    try:
        back = pool.generate(asks, to_store=True)  # a rerun would put them twice: the store refuses that
        stats = ray.get(store.stats.remote())
    finally:
        pool.shutdown()
        ray.kill(store)
    assert pool.restarts == 1 and os.path.exists(tmp_path / "died")
    assert sorted(s.trajectory_id for s in back) == ["g-0", "g-1"] and all(s.num_sampled == 2 for s in back)
    assert stats["trajectories_put"] == 2 and stats["complete_groups"] == 1
