"""The trainer group's typed calls on real Ray actors: every rank gets the call, rank 0 answers, and a rank that dies
or outlasts the call timeout raises ActorLost at once instead of leaving the driver waiting on rank 0."""

from __future__ import annotations

import os
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
    t0 = time.monotonic()
    with pytest.raises(ActorLost, match=r"trainer rank\(s\) \[1\] did not finish step within "
                                        r"cluster.trainer_timeout_s=2s"):
        group("hang", timeout=2.0).step([1])
    assert time.monotonic() - t0 < 20
    with pytest.raises(ActorLost, match="trainer rank 1 died during step"):
        group("die").step([1])
