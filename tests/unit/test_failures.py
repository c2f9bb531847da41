"""Failures that speak: a step's failures by boundary, the failure-rate stop, and the per-step report of what
trained."""

import logging

import pytest

from agentrl.driver import GroupReport, Progress, rollout_metrics
from agentrl.failures import FailureWatch, JobFailed, describe_failures, failure_counts, lost_actor
from agentrl.store import Selection
from agentrl.types import Boundary, Status, Trajectory


def traj(i: int, failure: Boundary | None = None, error: str = "", group: str = "g") -> Trajectory:
    return Trajectory(trajectory_id=f"t{i}", task_id="0", group_id=group, env_id="toy",
                      status=Status.FAILED if failure else Status.COMPLETED, failure=failure, error=error)


def test_a_steps_failures_are_named_by_boundary_with_the_first_message():
    batch = [traj(0), traj(1, Boundary.ENV, "ZeroDivisionError: division by zero\n  File x"),
             traj(2, Boundary.TOOL, "the environment did not answer within 30.0s"), traj(3, Boundary.ENV, "KeyError")]
    assert failure_counts(batch) == {"env": 2, "tool": 1}
    assert describe_failures(batch) == "3 failed (env 2, tool 1; first: ZeroDivisionError: division by zero)"
    assert describe_failures([traj(0)]) == ""


def test_a_dead_actor_is_named_by_the_part_of_the_job_it_was():
    from ray.exceptions import RayActorError

    # Ray's message for a killed store actor, as ray 2.x words it (its first line names no actor)
    said = ("The actor died unexpectedly before finishing this task.\n\tclass_name: TrajectoryStoreActor\n\tactor_id: "
            "e2f6\n\tpid: 4858\n\tip: 192.0.2.2\nThe actor is dead because its worker process has died.")
    assert lost_actor(RayActorError(error_msg=said)) == (
        "the trajectory store (TrajectoryStoreActor, pid 4858) died: RayActorError: The actor died unexpectedly "
        "before finishing this task.")
    assert lost_actor(RayActorError(error_msg=said.replace("TrajectoryStoreActor", "PolicyTrainer"))).startswith(
        "a trainer rank (PolicyTrainer, pid 4858) died")
    assert lost_actor(RuntimeError("rank 1 died during step")) == "RuntimeError: rank 1 died during step"


def test_a_store_that_died_under_a_rollout_workers_call_is_named_not_the_worker():
    from ray.exceptions import RayActorError

    # the text of the RayTaskError(ActorDiedError) a worker's generate raised when the store it wrote to was killed
    # (ray 2.60, trimmed): the first line is the worker's task; the dead actor is below Ray's own exception
    said = ("\x1b[36mray::RolloutWorker.generate()\x1b[39m (pid=19505, ip=192.0.2.2, actor_id=34d6)\n"
            "  File \"/x/worker.py\", line 14, in generate\n    return ray.get(self.store.put.remote(1))\n"
            "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
            "\tclass_name: _store_actor_class.<locals>.TrajectoryStoreActor\n\tactor_id: 8c43\n\tpid: 19504\n"
            "The actor is dead because its worker process has died.")
    assert lost_actor(RayActorError(error_msg=said)) == (
        "the trajectory store (TrajectoryStoreActor, pid 19504) died: ActorDiedError: The actor died unexpectedly "
        "before finishing this task.")


def test_mlflow_counts_failed_episodes_per_boundary_every_step():
    batch = [traj(0), traj(1, Boundary.ENV), traj(2, Boundary.TOOL), traj(3, Boundary.ENV), traj(4, Boundary.WORKER)]
    metrics = rollout_metrics([t.summary() for t in batch])
    assert {k: v for k, v in metrics.items() if k.startswith("rollout/failed/")} == {
        "rollout/failed/model": 0, "rollout/failed/env": 2, "rollout/failed/tool": 1, "rollout/failed/sandbox": 0,
        "rollout/failed/worker": 1}
    assert metrics["rollout/failed_fraction"] == 4 / 5


def test_the_watch_stops_once_the_windows_failed_fraction_exceeds_the_threshold():
    watch = FailureWatch("myproject/Broken-v0", max_fraction=0.5, window=2)
    watch.observe([traj(0), traj(1, Boundary.ENV, "ValueError: x")], step=1)  # 1/2: not above 0.5
    with pytest.raises(JobFailed, match=r"3 of 4 episodes failed over the last 2 RL step\(s\), up to step 2 "
                                        r"\(more than algorithm\.max_failed_fraction=0\.5\): myproject/Broken-v0: "
                                        r"2 failed \(env 2; first: ValueError: y\)"):
        watch.observe([traj(2, Boundary.ENV, "ValueError: y"), traj(3, Boundary.ENV, "ValueError: z")], step=2)
    never = FailureWatch("toy", max_fraction=1.0, window=3)
    for step in range(1, 5):
        never.observe([traj(step, Boundary.ENV, "boom")], step=step)  # 1.0 never stops
    recovering = FailureWatch("toy", max_fraction=0.5, window=1)
    recovering.observe([traj(0), traj(1)], step=1)
    recovering.observe([traj(2), traj(3, Boundary.SANDBOX, "died")], step=2)  # 1/2 within a one-step window


def test_the_group_report_says_what_trained_and_why_the_rest_did_not():
    before = {"groups_dropped_stale": 1, "groups_dropped_untrainable": 0}
    after = {"groups_dropped_stale": 3, "groups_dropped_untrainable": 1}
    selected = Selection(taken=True, group_ids=["a", "b"], trajectories=4, uniform=3, short=1)
    report = GroupReport.of(8, selected, before=before, after=after)
    assert (report.trained, report.stale, report.failed) == (2, 2, 1)
    assert str(report) == "trained 2/8 groups (3 uniform, 1 short of a failed member, 2 stale, 1 failed)"
    nothing = Selection(taken=False, group_ids=[], trajectories=0, uniform=0, short=0)
    waiting = GroupReport.of(8, nothing, before=before, after=before)
    assert str(waiting) == "trained 0/8 groups (too few complete groups: they wait for the next step)"


def test_a_step_that_trained_nothing_or_skipped_its_update_says_so(caplog):
    progress = Progress(first_step=0, last_step=10)
    uniform = GroupReport(asked=4, trained=0, uniform=4, short=0, stale=0, failed=0, waiting=False)
    with caplog.at_level(logging.INFO, logger="agentrl"):
        progress.report(1, {"rollout/reward_mean": 0.0, "rollout/success_rate": 0.0}, uniform, "", 12.0)
        progress.report(2, {"rollout/reward_mean": 0.5, "rollout/success_rate": 0.5, "eval/success_rate": 0.25},
                        GroupReport(asked=4, trained=3, uniform=1, short=0, stale=0, failed=0, waiting=False),
                        "1 failed (env 1; first: KeyError)", 12.0)
        progress.report(3, {"rollout/reward_mean": 0.5, "rollout/success_rate": 0.5, "train/optimizer_steps": 1,
                            "train/optimizer_steps_skipped": 1},
                        GroupReport(asked=4, trained=4, uniform=0, short=0, stale=0, failed=0, waiting=False), "", 12.0)
        progress.report(4, {"rollout/reward_mean": 0.0, "rollout/success_rate": 0.0, "train/rolled_back_to_step": 2},
                        uniform, "", 12.0)
    first, second, third, fourth = caplog.records
    assert first.levelno == logging.WARNING and first.getMessage().startswith("step 1/10: reward 0.000")
    assert "trained 0/4 groups (4 uniform)" in first.getMessage()
    assert first.getMessage().endswith("nothing trained: the policy did not change this step")
    assert second.levelno == logging.INFO
    assert "trained 3/4 groups (1 uniform) | held-out success 0.250 | 1 failed (env 1; first: KeyError)" in \
        second.getMessage()
    assert "12s, ETA " in second.getMessage()
    assert third.levelno == logging.WARNING
    assert "trained 4/4 groups | 1 of 1 optimizer step(s) skipped: the gradient held inf or NaN | 12s" in \
        third.getMessage()
    # a rollback changed the policy though nothing trained (agentrl/stall.py)
    assert fourth.levelno == logging.WARNING and fourth.getMessage().endswith("| rolled back to RL step 2's policy")


def test_failed_episodes_are_resampled_into_their_groups_and_the_store_takes_them(tmp_path):
    from agentrl.config import load_config
    from agentrl.driver import resample_failed
    from agentrl.rollout.agent_loop import EpisodeRequest
    from agentrl.store import StoreConfig, TrajectoryStore

    class Pool:  # the second attempt at a task succeeds; as the real one, it puts the trajectories and summarises
        def __init__(self):
            self.asked: list[list[EpisodeRequest]] = []
            self.stored: list[Trajectory] = []

        def generate(self, requests, to_store=False):
            self.asked.append(requests)
            out = []
            for r in requests:
                t = Trajectory(trajectory_id=r.trajectory_id, task_id=str(r.task_index), group_id=r.group_id,
                               env_id=r.env_id, episode=r.episode())
                t.append_sampled([1, 2], [0.0, 0.0], 0)
                if r.trajectory_id.endswith("-r1"):
                    t.status, t.failure = Status.FAILED, Boundary.ENV
                self.stored.append(t)
                out.append(t.summary())
            return out

    requests = [EpisodeRequest(env_id="toy", task_index=3, group_id="g", trajectory_id=f"g-{i}", seed=i)
                for i in range(2)]
    first = [traj(0, group="g"), traj(1, Boundary.TOOL, "hung", group="g")]
    first[0].trajectory_id, first[1].trajectory_id = "g-0", "g-1"
    for t in first:
        t.append_sampled([1], [0.0], 0)
    job, _ = load_config("configs/quickstart.yaml", ["algorithm.failed_members=resample", "algorithm.max_resamples=2",
                                                     "rollout.group_size=2"])
    pool = Pool()
    again = resample_failed(job, pool, [t.summary() for t in first], requests)
    assert [[r.trajectory_id for r in asked] for asked in pool.asked] == [["g-1-r1"], ["g-1-r2"]]
    assert [t.replaces for t in again] == ["g-1", "g-1-r1"]
    assert len({r.seed for asked in pool.asked for r in asked} | {1}) == 3  # new seeds
    assert rollout_metrics([t.summary() for t in first] + again)["rollout/resampled"] == 2
    store = TrajectoryStore(StoreConfig(run_dir=str(tmp_path), group_size=2))
    store.put(first + pool.stored)
    assert [t.trajectory_id for t in store.take_batch(1, 0, 0).trajectories] == ["g-0", "g-1-r2"]
    job, _ = load_config("configs/quickstart.yaml", ["algorithm.failed_members=keep"])
    assert resample_failed(job, pool, [t.summary() for t in first], requests) == []
