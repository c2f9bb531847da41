"""Failures that speak: what failed in a step, by boundary, and the rule that stops a job that keeps failing.

A failed episode (an env that raised, a tool that timed out, a sandbox that died, an engine error) is data: it is kept
in the store and left out of the advantages (agentrl.reward). One such episode is noise; a step where most episodes
fail is an env (or infrastructure) that does not work, and training on through it only produces a flat reward curve
that looks like a policy that has not learned. `FailureWatch` stops the job instead, naming the env, the boundary and
the exception.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from agentrl.types import EpisodeSummary, Status, Trajectory


class JobFailed(RuntimeError):
    """The job cannot go on for a reason outside agentrl's code (the env, its oracle, the model); the message says
    what, in one line. The driver ends the MLflow run FAILED and the command exits non-zero."""


class ActorLost(RuntimeError):
    """A trainer rank or the trajectory store died or stopped answering. The job's state is in its last checkpoint and
    the store's log, so the driver tears the actors down and restarts from there (up to `cluster.max_restarts`)."""


class EnvCodeError(RuntimeError):
    """An environment's own code raised while agentrl ran it outside an episode (e.g. playing its oracle to train a
    tokenizer): the env to blame, and its exception as the cause."""

    def __init__(self, env_id: str, cause: BaseException):
        super().__init__(f"{env_id}: {first_line(cause)}")
        self.env_id = env_id


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


# the job's actor classes, by the part of the job a user knows them as
ACTOR_ROLES = {"TrajectoryStoreActor": "the trajectory store", "PolicyTrainer": "a trainer rank",
               "RolloutWorker": "a rollout worker"}


def lost_actor(exc: BaseException) -> str:
    """One line naming the job's part behind a Ray actor error — Ray's own first line says only "The actor died
    unexpectedly" and puts the class and pid on the lines after it."""
    text = str(exc)
    fields = dict(line.strip().split(": ", 1) for line in text.splitlines()[1:]
                  if line.startswith("\t") and ": " in line)
    # Ray names a class made in a function by its qualified name (`_store_actor_class.<locals>.TrajectoryStoreActor`)
    class_name = fields.get("class_name", "").rsplit(".", 1)[-1]
    role = ACTOR_ROLES.get(class_name)
    if role is None:
        return first_line(exc)
    pid = f", pid {fields['pid']}" if "pid" in fields else ""
    # seen through another actor's task (a rollout worker that called the dead store), Ray's first line is that
    # task's; the death is the line Ray's own exception starts
    cause = next((line.strip().removeprefix("ray.exceptions.") for line in text.splitlines()
                  if line.strip().startswith("ray.exceptions.")), None)
    return f"{role} ({class_name}{pid}) died: {cause or first_line(exc)}"


def failure_counts(trajectories: Sequence[Trajectory | EpisodeSummary]) -> dict[str, int]:
    """Failed episodes per boundary (env, tool, sandbox, model, worker)."""
    return dict(Counter(t.failure.value if t.failure else "unknown"
                        for t in trajectories if t.status == Status.FAILED))


def describe_failures(trajectories: Sequence[Trajectory | EpisodeSummary]) -> str:
    """`3 failed (env 2, tool 1; first: ZeroDivisionError: division by zero)`, or "" when none failed."""
    failed = [t for t in trajectories if t.status == Status.FAILED]
    if not failed:
        return ""
    counts = ", ".join(f"{boundary} {n}" for boundary, n in sorted(failure_counts(failed).items()))
    first = failed[0].error.strip().splitlines()[0][:200] if failed[0].error.strip() else "no message"
    return f"{len(failed)} failed ({counts}; first: {first})"


class FailureWatch:
    """Raises JobFailed once more than `max_fraction` of the episodes of the last `window` steps failed."""

    def __init__(self, env_id: str, max_fraction: float, window: int):
        self.env_id = env_id
        self.max_fraction = max_fraction
        self.steps: deque[tuple[int, int]] = deque(maxlen=window)  # (failed, episodes) per step

    def observe(self, trajectories: Sequence[Trajectory | EpisodeSummary], step: int) -> None:
        failed = [t for t in trajectories if t.status == Status.FAILED]
        self.steps.append((len(failed), len(trajectories)))
        total_failed = sum(f for f, _ in self.steps)
        total = sum(n for _, n in self.steps)
        if total and total_failed / total > self.max_fraction:
            raise JobFailed(
                f"{total_failed} of {total} episodes failed over the last {len(self.steps)} RL step(s), up to step "
                f"{step} (more than algorithm.max_failed_fraction={self.max_fraction}): {self.env_id}: "
                f"{describe_failures(failed or trajectories) or 'see the trajectory store'}")
