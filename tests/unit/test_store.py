"""TrajectoryStore: complete groups only, staleness drops, partials, Parquet persistence and resume at a position."""

import json
import os

import numpy as np
import pytest

from agentrl.store import StoreConfig, TrajectoryStore
from agentrl.types import Boundary, Episode, Status, Trajectory


def traj(tid: str, group: str, version: int = 0, status: Status = Status.COMPLETED, reward: float = 1.0,
         length: int = 6, routed: bool = False) -> Trajectory:
    t = Trajectory(trajectory_id=tid, task_id="task-" + group, group_id=group, env_id="toy", reward=reward,
                   status=status, reward_components={"correct": reward}, metadata={"note": tid})
    t.append_prompt([1, 2, 3])
    t.append_sampled(list(range(10, 10 + length - 3)), [-0.1 * (i + 1) / 3 for i in range(length - 3)], version)
    if routed:
        t.routed_experts = np.arange(length * 2 * 2, dtype=np.int16).reshape(length, 2, 2) % 8
    if status == Status.FAILED:
        t.failure = Boundary.TOOL
    return t


def store(tmp_path, group_size=2, **kw) -> TrajectoryStore:
    return TrajectoryStore(StoreConfig(run_dir=str(tmp_path), group_size=group_size, **kw))


def test_only_complete_groups_in_completion_order(tmp_path):
    s = store(tmp_path)
    s.put([traj("a0", "A"), traj("b0", "B")])
    assert s.take_batch(1, current_version=0, max_staleness=0) is None  # no group is complete
    s.put(traj("b1", "B"))  # B completes first
    s.put(traj("a1", "A"))
    batch = s.take_batch(1, current_version=0, max_staleness=0)
    assert batch.group_ids == ["B"] and [t.trajectory_id for t in batch.trajectories] == ["b0", "b1"]
    assert batch.index == 0 and s.position == 1
    assert s.take_batch(2, current_version=0, max_staleness=0) is None  # only A is left
    assert s.take_batch(2, current_version=0, max_staleness=0, min_groups=1).group_ids == ["A"]  # fewer will do
    st = s.stats()
    assert st["groups_consumed"] == 2 and st["trajectories_consumed"] == 4 and st["buffered_trajectories"] == 0


def test_stale_groups_are_dropped_and_lag_uses_the_oldest_version(tmp_path):
    s = store(tmp_path)
    old = traj("o0", "old", version=1)
    old.append_sampled([7, 8], [-0.5, -0.5], version=4)  # resumed under a newer policy: lag counts from 1
    s.put([old, traj("o1", "old", version=4)])
    s.put([traj("n0", "new", version=3), traj("n1", "new", version=4)])
    batch = s.take_batch(1, current_version=5, max_staleness=2)
    assert batch.group_ids == ["new"] and batch.max_lag == 2
    st = s.stats()
    assert st["groups_dropped_stale"] == 1 and st["trajectories_dropped_stale"] == 2
    assert st["buffered_groups"] == 0


def test_failed_members_stay_out_and_untrainable_groups_are_dropped(tmp_path):
    s = store(tmp_path)
    s.put([traj("f0", "F", status=Status.FAILED), traj("f1", "F", status=Status.ABORTED)])
    s.put([traj("g0", "G"), traj("g1", "G", status=Status.FAILED)])
    batch = s.take_batch(1, current_version=0, max_staleness=0)
    assert batch.group_ids == ["G"] and [t.trajectory_id for t in batch.trajectories] == ["g0"]
    assert s.stats()["groups_dropped_untrainable"] == 1


def test_put_rejects_duplicates_partials_and_overfull_groups(tmp_path):
    s = store(tmp_path)
    s.put(traj("x0", "X"))
    with pytest.raises(ValueError, match="already put"):
        s.put(traj("x0", "X"))
    with pytest.raises(ValueError, match="exceed group_size"):
        s.put([traj("x1", "X"), traj("x2", "X")])
    with pytest.raises(ValueError, match="put_partial"):
        s.put(traj("p", "P", status=Status.PARTIAL))
    with pytest.raises(ValueError, match="PARTIAL"):
        s.put_partial(traj("q", "Q"))
    with pytest.raises(ValueError, match="group_size"):
        StoreConfig(run_dir=str(tmp_path), group_size=0)
    with pytest.raises(ValueError, match="already holds a trajectory store"):
        store(tmp_path)


def test_partials_are_kept_replaced_and_handed_out_once(tmp_path):
    s = store(tmp_path)
    s.put_partial([traj("p0", "P", status=Status.PARTIAL), traj("p1", "P", status=Status.PARTIAL)])
    newer = traj("p0", "P", status=Status.PARTIAL, length=9)
    s.put_partial(newer)
    taken = s.take_partials()
    assert [t.trajectory_id for t in taken] == ["p1", "p0"] and len(taken[1].tokens) == 9
    assert s.take_partials() == []
    assert s.stats()["partials_taken"] == 2


def test_rows_round_trip_exactly_through_parquet(tmp_path):
    s = store(tmp_path)
    t = traj("r0", "R", routed=True)
    t.logprobs[4] = -0.123456789012345678  # float64 survives
    s.put([t, traj("r1", "R")])
    ds = TrajectoryStore.read_trajectories(str(tmp_path))
    assert len(ds) == 2 and ds[0]["kind"] == "full" and ds[1]["seq"] == 1
    back = TrajectoryStore.open(str(tmp_path)).take_batch(1, 0, 0).trajectories[0]
    assert back.logprobs == t.logprobs and back.tokens == t.tokens and back.versions == t.versions
    assert np.array_equal(back.routed_experts, t.routed_experts) and back.metadata == {"note": "r0"}
    assert back.status == Status.COMPLETED and back.reward_components == {"correct": 1.0}


def _fill(s, groups, version=0):
    for g in groups:
        s.put([traj(f"{g}0", g, version), traj(f"{g}1", g, version)])


def test_reopen_restores_buffer_and_position(tmp_path):
    s = store(tmp_path)
    _fill(s, "ABCDE")
    s.take_batch(2, 0, 0)
    s.put(traj("Z0", "Z"))  # an incomplete group stays buffered
    s.put_partial(traj("P0", "P", status=Status.PARTIAL))
    before = s.stats()
    r = TrajectoryStore.open(str(tmp_path))
    after = r.stats()
    for key in ("position", "buffered_trajectories", "buffered_groups", "complete_groups", "partial_pool",
                "groups_consumed", "trajectories_put"):
        assert after[key] == before[key], key
    assert r.take_batch(3, 0, 0).group_ids == ["C", "D", "E"]


def test_resume_at_an_earlier_position_replays_the_same_batches(tmp_path):
    s = store(tmp_path)
    _fill(s, "ABC")
    first = [s.take_batch(1, v, 5).group_ids for v in range(2)]
    _fill(s, "DE", version=1)
    # batch 2 asked at version 5 with max_staleness 3: C (version 0) and D, E (version 1) are all too old
    assert s.take_batch(1, 5, 3) is None
    assert s.stats()["groups_dropped_stale"] == 3 and s.stats()["buffered_groups"] == 0
    # the trainer's checkpoint was at position 1: for it, batch 1 and the drops never happened
    r = TrajectoryStore.open(str(tmp_path), position=1)
    assert r.position == 1 and r.stats()["groups_dropped_stale"] == 0 and r.stats()["buffered_groups"] == 4
    assert r.take_batch(1, 1, 5).group_ids == first[1] == ["B"]
    assert r.take_batch(2, 2, 5).group_ids == ["C", "D"]
    events = [json.loads(x) for x in open(os.path.join(tmp_path, "store", "events.jsonl"))]
    assert [e["batch"] for e in events if e["op"] == "take"] == [0, 1, 2]
    assert not any(e["op"] == "drop" for e in events)
    with pytest.raises(ValueError, match="position 9"):
        TrajectoryStore.open(str(tmp_path), position=9)


def test_a_crash_loses_nothing_that_was_acknowledged(tmp_path):
    s = store(tmp_path)
    _fill(s, "AB")
    s.put_partial(traj("p", "P", status=Status.PARTIAL))
    assert len(s.take_partials()) == 1  # a worker took it, then the run died before it came back
    s.take_batch(1, 0, 0)
    shard_dir = os.path.join(tmp_path, "store", "trajectories")
    open(os.path.join(shard_dir, ".tmp-crashed.parquet"), "wb").write(b"PAR1 half a file")
    with open(os.path.join(tmp_path, "store", "events.jsonl"), "a") as f:
        f.write('{"op": "take", "bat')  # an event cut by the crash
    r = TrajectoryStore.open(str(tmp_path))
    assert r.position == 1 and r.stats()["buffered_groups"] == 1
    assert [t.trajectory_id for t in r.take_partials()] == ["p"]  # back in the pool
    assert not any(n.startswith(".tmp-") for n in os.listdir(shard_dir))
    finished = traj("p", "P", version=0)
    finished.status = Status.COMPLETED
    r.put(finished)
    assert TrajectoryStore.open(str(tmp_path)).stats()["partial_pool"] == 0  # it came back finished


def test_in_memory_store_writes_nothing(tmp_path):
    s = TrajectoryStore(StoreConfig(run_dir=str(tmp_path / "x"), group_size=1, persist=False))
    s.put(traj("a", "A"))
    assert s.take_batch(1, 0, 0).group_ids == ["A"]
    assert not os.path.exists(tmp_path / "x")


def test_held_names_what_a_resumed_run_must_not_sample_again(tmp_path):
    s = store(tmp_path)
    _fill(s, "AB")
    s.put_partial(traj("C0", "C", status=Status.PARTIAL))
    r = TrajectoryStore.open(str(tmp_path), position=0)
    assert r.held(["A0", "B1", "C0", "C1", "D0"]) == ["A0", "B1", "C0"]
    # the finished ones come back for the redone step's metrics, until trained
    assert [t.trajectory_id for t in r.held_results(["A0", "B1", "C0", "D0"])] == ["A0", "B1"]
    r.take_batch(1, 0, 0)
    assert [t.trajectory_id for t in r.held_results(["A0", "B1"])] == ["B1"]


def running(tid: str, group: str, length: int = 6, routed: bool = False) -> Trajectory:
    """A snapshot of a running episode at a turn boundary, as the rollout worker sends it."""
    return traj(tid, group, length=length, routed=routed).snapshot(b'{"turn": 1}', episode_s=2.0)


def test_snapshots_resume_the_newest_and_count_what_was_lost(tmp_path):
    s = store(tmp_path)
    s.report([running("A0", "A", length=6)], {"A0": (3, 2.0), "A1": (5, 1.5)})
    s.report([running("A0", "A", length=9)], {"A0": (8, 4.0), "A1": (7, 2.5)})
    taken = s.take_snapshots(["A0", "A1", "B0"])  # B0 never started
    assert [(t.trajectory_id, len(t.tokens), t.status) for t in taken] == [("A0", 9, Status.PARTIAL)]
    # A0 carried its 6 sampled tokens and lost the 2 sampled after its snapshot; A1 had no snapshot: all 7 lost
    stats = s.stats()
    assert (stats["tokens_carried"], stats["tokens_lost"]) == (6, 9)
    assert (stats["episodes_resumed"], stats["episodes_restarted"]) == (1, 1)
    assert s.take_snapshots(["A0", "A1"]) == []  # handed out once
    event = [json.loads(line) for line in open(tmp_path / "store" / "events.jsonl")][-1]
    assert event["op"] == "resume" and event["ids"] == ["A0"] and event["restarted"] == ["A1"]
    assert event["lost_s"] == pytest.approx((4.0 - 2.0) + 2.5)


def test_reading_a_run_gives_results_unless_snapshots_are_asked_for(tmp_path):
    s = store(tmp_path)
    s.report([running("A0", "A", length=6)], {"A0": (3, 2.0)})
    s.put([traj("A0", "A"), traj("A1", "A")])
    s.put_partial(traj("B0", "B", status=Status.PARTIAL, length=9))
    assert TrajectoryStore.read_trajectories(str(tmp_path))["kind"] == ["full", "full", "partial"]
    everything = TrajectoryStore.read_trajectories(str(tmp_path), kinds=("full", "partial", "snapshot"))
    assert sorted(everything["kind"]) == ["full", "full", "partial", "snapshot"]


def test_a_report_overtaken_by_the_result_is_ignored(tmp_path):
    s = store(tmp_path)
    s.put(traj("A0", "A"))
    s.put_partial(traj("B0", "B", status=Status.PARTIAL, length=9))
    s.report([running("A0", "A"), running("B0", "B", length=7)], {"A0": (3, 1.0), "B0": (4, 1.0)})
    assert s.take_snapshots(["A0", "B0"]) == [] and s.stats()["tokens_lost"] == 0
    s.report([running("C0", "C")], {"C0": (3, 1.0)})
    s.put(traj("C0", "C"))  # finished after its snapshot: nothing to resume
    assert s.take_snapshots(["C0"]) == [] and s.stats()["running_snapshots"] == 0


def test_snapshots_survive_a_restart_and_are_resumed_there(tmp_path):
    s = store(tmp_path)
    _fill(s, "A")
    s.report([running("B0", "B", routed=True)], {"B0": (3, 2.0)})
    s.put_partial(traj("P0", "P", status=Status.PARTIAL))
    s.take_partials()
    s.report([running("P0", "P", length=9)], {"P0": (6, 3.0)})  # the resumed partial got further
    s.report([running("C0", "C")], {})
    s.put(traj("C0", "C"))
    r = TrajectoryStore.open(str(tmp_path), position=0)
    (b0,) = r.take_snapshots(["B0", "C0"])
    assert b0.tokens == running("B0", "B").tokens and b0.env_state == b'{"turn": 1}'
    assert b0.routed_experts.shape == (6, 2, 2) and b0.timings["episode_s"] == 2.0
    (p0,) = r.take_partials()  # a partial resumed and snapshotted since: paused again at its newest state
    assert len(p0.tokens) == 9
    assert r.stats()["tokens_carried"] == 3


def test_resume_counts_a_loss_once_across_restarts(tmp_path):
    s = store(tmp_path)
    s.report([running("A0", "A")], {"A0": (5, 3.0)})
    s.take_snapshots(["A0"])  # the worker died: 2 tokens lost
    r = TrajectoryStore.open(str(tmp_path))  # then the run died before A0 reported again
    assert r.stats()["tokens_lost"] == 2
    r.take_snapshots(["A0"])
    assert r.stats()["tokens_lost"] == 2 and r.stats()["tokens_carried"] == 6


def test_a_snapshot_must_be_partial_with_its_env_state(tmp_path):
    s = store(tmp_path)
    with pytest.raises(ValueError, match="PARTIAL with its env state"):
        s.report([traj("A0", "A")], {})


def stand_in(failed_id: str, group: str, tid: str) -> Trajectory:
    """A resampled member (algorithm.failed_members=resample) standing in for `failed_id`."""
    t = traj(tid, group, reward=0.0)
    t.episode = Episode(task_index=0, replaces=failed_id)
    return t


def test_a_resampled_member_takes_the_failed_ones_place_and_survives_a_restart(tmp_path):
    s = store(tmp_path)
    s.put([traj("A0", "A"), traj("A1", "A", status=Status.FAILED), stand_in("A1", "A", "A1-r1")])
    batch = s.take_batch(1, 0, 0)
    assert [t.trajectory_id for t in batch.trajectories] == ["A0", "A1-r1"]  # a full group again
    assert s.stats()["resampled"] == 1 and s.stats()["status_failed"] == 1
    s.put([traj("B0", "B", status=Status.FAILED), traj("B1", "B"), stand_in("B0", "B", "B0-r1")])
    r = TrajectoryStore.open(str(tmp_path), position=1)
    assert [t.trajectory_id for t in r.take_batch(1, 0, 0).trajectories] == ["B0-r1", "B1"]
    assert [e["op"] for e in map(json.loads, open(tmp_path / "store" / "events.jsonl"))].count("take") == 2


def test_a_stand_in_must_replace_a_failed_member_of_its_own_group(tmp_path):
    s = store(tmp_path)
    s.put([traj("A0", "A"), traj("A1", "A", status=Status.FAILED)])
    for bad, why in ((stand_in("A0", "A", "x"), "A0"), (stand_in("A1", "B", "y"), "A1"),
                     (stand_in("Z9", "A", "z"), "Z9")):
        with pytest.raises(ValueError, match=f"replaces {why}, which is not a failed member"):
            s.put(bad)
    failed_again = stand_in("A1", "A", "A1-r1")
    failed_again.status, failed_again.failure = Status.FAILED, Boundary.ENV
    s.put([failed_again, stand_in("A1-r1", "A", "A1-r2")])  # a stand-in that failed: replaced again
    assert [t.trajectory_id for t in s.take_batch(1, 0, 0).trajectories] == ["A0", "A1-r2"]
    assert s.stats()["resampled"] == 2
