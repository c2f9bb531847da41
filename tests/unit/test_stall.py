"""StallWatch: when the driver undoes the update that stalled a run (agentrl/stall.py)."""

import pytest

from agentrl.stall import STALLED_STEPS, StallWatch


def _feed(watch: StallWatch, steps: list[tuple[int, float]]) -> list[bool]:
    return [watch.observe(trained, success) for trained, success in steps]


def test_an_update_after_which_nothing_trains_and_success_falls_is_undone():
    watch = StallWatch()
    # seed 3's run (docs/benchmarks.md): 9 of 16 groups trained at 0.4 success, then every episode failed alike
    said = _feed(watch, [(12, 0.3), (9, 0.4)] + [(0, 0.0)] * STALLED_STEPS)
    assert said == [False, False] + [False] * (STALLED_STEPS - 1) + [True]


def test_a_step_that_trains_ends_the_stall():
    watch = StallWatch()
    assert not any(_feed(watch, [(9, 0.4), (0, 0.0), (0, 0.0), (3, 0.1), (0, 0.0), (0, 0.0)]))
    assert watch.observe(0, 0.0)  # three idle steps in a row since the last one that trained


def test_a_solved_run_and_a_run_that_never_trained_are_not_stalled():
    solved = StallWatch()
    assert not any(_feed(solved, [(4, 0.9)] + [(0, 1.0)] * 5))  # every group succeeded: done, not collapsed
    never = StallWatch()
    assert not any(_feed(never, [(0, 0.0)] * 5))  # no update to undo (the warm start's own policy)


def test_after_a_rollback_the_restored_policy_is_judged_by_its_own_updates():
    watch = StallWatch()
    assert _feed(watch, [(9, 0.4)] + [(0, 0.0)] * 3)[-1]
    watch.reset()
    assert not any(_feed(watch, [(0, 0.0)] * 4))  # it failed alike before any update of its own: nothing to undo
    assert _feed(watch, [(5, 0.5)] + [(0, 0.1)] * 3)[-1]


def test_a_stall_needs_at_least_one_step():
    with pytest.raises(ValueError):
        StallWatch(steps=0)
    assert StallWatch(steps=1).observe(0, 0.0) is False  # nothing trained yet


def test_a_resumed_watch_sees_the_stall_the_checkpoint_was_in():
    watch = StallWatch()
    _feed(watch, [(9, 0.4), (0, 0.0), (0, 0.0)])
    resumed = StallWatch.resumed(watch.state())
    assert resumed.observe(0, 0.0) and watch.observe(0, 0.0)
    assert not StallWatch.resumed(None).observe(0, 0.0)


class _Trainer:
    """As TrainerGroup.roll_back answers: the restored checkpoint's client state, or no checkpoint to go back to."""

    def __init__(self, state: dict | None):
        self.state = state

    def roll_back(self) -> dict:
        if self.state is None:
            raise FileNotFoundError("no checkpoint under run/checkpoints from before step 9 to roll back to")
        return self.state


class _Pool:
    def __init__(self):
        self.synced = []

    def sync_weights(self, trainer, config):
        from types import SimpleNamespace

        self.synced.append(trainer)
        return SimpleNamespace(version=12, num_bytes=100)


def test_the_driver_publishes_the_restored_policy_or_goes_on_without_a_checkpoint(caplog):
    import logging

    from agentrl.config import load_config
    from agentrl.driver import Published, roll_back

    job, _ = load_config("configs/quickstart.yaml", [])
    pool = _Pool()
    with caplog.at_level(logging.WARNING, logger="agentrl"):
        published, restored = roll_back(job, _Trainer({"rl_step": 20}), pool, 24, 1, None)
    assert restored == 20 and published.version == 12 and len(pool.synced) == 1  # into every engine
    assert "the policy goes back to RL step 20's" in caplog.records[-1].getMessage()
    before = Published(version=11, sync_s=0.1)
    with caplog.at_level(logging.WARNING, logger="agentrl"):
        assert roll_back(job, _Trainer(None), pool, 24, 1, before) == (before, None)
    assert len(pool.synced) == 1 and "cannot roll back: FileNotFoundError" in caplog.records[-1].getMessage()
