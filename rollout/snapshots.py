"""Lossless resume of running episodes: what a rollout worker tells the trajectory store while its episodes run.

At every turn boundary (the tool's observation appended) an episode hands the reporter a PARTIAL snapshot of itself
with the env's saved state, and the reporter watches how far each running episode has got: sampled tokens, the turn
being streamed included, and seconds. Every `interval_s` it sends the newest snapshot of each episode and the
progress of all of them in one fire-and-forget call (`TrajectoryStore.report`): at most one Parquet shard per worker
per interval, and the episodes never wait on the store. An episode whose worker dies, or whose run is killed, is
resumed from its last snapshot (`TrajectoryStore.take_snapshots`); what it sampled after that snapshot is counted as
lost. With seeded sampling the resumed episode samples what the uninterrupted one would have.

The snapshot is a copy taken at the boundary (the episode goes on mutating its trajectory), O(length) per turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from agentrl.rollout.policy_engine import Generation
from agentrl.types import Trajectory

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Running:
    trajectory: Trajectory
    started: float  # perf_counter when this attempt began
    earlier_s: float  # seconds the episode ran before this attempt (resumed from a partial or a snapshot)
    turn: Generation | None = None  # the turn being streamed, not yet in the trajectory


class SnapshotReporter:
    """A worker's reports on its running episodes to the store actor `store` (see the module docstring).

    Args:
        store: the TrajectoryStore actor handle.
        interval_s: seconds between two reports.
        snapshots: send turn-boundary snapshots; off, only the progress is reported (what a kill loses is still
            counted, nothing is resumed).
    """

    def __init__(self, store: Any, *, interval_s: float = 1.0, snapshots: bool = True):
        if interval_s <= 0:
            raise ValueError(f"the snapshot interval must be > 0 s, got {interval_s}")
        self.store, self.interval_s, self.snapshots = store, interval_s, snapshots
        self._running: dict[str, _Running] = {}
        self._pending: dict[str, Trajectory] = {}
        self._task: asyncio.Task | None = None

    def started(self, trajectory: Trajectory) -> None:
        """An episode begins (or resumes) on this worker."""
        self._running[trajectory.trajectory_id] = _Running(trajectory, time.perf_counter(),
                                                           trajectory.timings.get("episode_s", 0.0))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._report_every())

    def streaming(self, trajectory_id: str, turn: Generation | None) -> None:
        """The turn the engine is streaming into `turn` (None once it is part of the trajectory)."""
        running = self._running.get(trajectory_id)
        if running is not None:
            running.turn = turn

    def boundary(self, trajectory: Trajectory, env_state: bytes) -> None:
        """The episode is at a turn boundary with the env in `env_state`: it can resume from here."""
        running = self._running.get(trajectory.trajectory_id)
        if running is not None:
            self._pending[trajectory.trajectory_id] = trajectory.snapshot(env_state, episode_s=self._seconds(running))

    def ended(self, trajectory_id: str) -> None:
        """The episode returned to the caller: nothing more to report about it."""
        self._running.pop(trajectory_id, None)
        self._pending.pop(trajectory_id, None)

    def report(self) -> None:
        """Sends the pending snapshots and every running episode's progress."""
        progress = {tid: (r.trajectory.num_sampled + (len(r.turn.token_ids) if r.turn is not None else 0),
                          self._seconds(r)) for tid, r in self._running.items()}
        snapshots, self._pending = list(self._pending.values()), {}
        if progress or snapshots:
            self.store.report.remote(snapshots, progress)  # not awaited: a lost report loses at most one interval

    async def _report_every(self) -> None:
        while self._running:
            await asyncio.sleep(self.interval_s)
            try:
                self.report()
            except Exception:  # a report is best effort; the episodes go on without it
                log.exception("could not report the running episodes to the trajectory store")

    @staticmethod
    def _seconds(running: _Running) -> float:
        return running.earlier_s + time.perf_counter() - running.started
