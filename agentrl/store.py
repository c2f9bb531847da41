"""The trajectory store: a buffer of trajectories between the rollout workers and the trainer, persisted as it fills.

Rollout workers `put` finished trajectories (a whole GRPO group at once or one by one) and `put_partial` the ones
an iteration's token budget paused, straight from the worker (the driver sees summaries only); while episodes run,
their workers `report` snapshots taken at turn boundaries and how far each episode has got
(agentrl.rollout.snapshots), so that an episode whose worker or run died resumes from its last snapshot
(`take_snapshots`) instead of starting over. The Ray actor hands paused and snapshotted episodes out by reference
(`hand_out_partials`, `hand_out_snapshots`). The driver asks `take_batch(num_groups, current_version,
max_staleness)` (or `take_training_batch`, whose trajectories go to the trainer ranks by reference) for
training data. The store hands out *complete* groups only (all `group_size` members arrived), oldest first in the
order they completed, and only their trainable members (completed or truncated, with sampled tokens).

Staleness: a group's policy lag is `current_version − (the oldest policy version that sampled any of its tokens)`.
Groups whose lag exceeds `max_staleness` are **dropped**, not down-weighted: a down-weight would have to be an
importance weight the loss already applies per token (TIS / IcePop against the recorded inference log-probs), and a
dropped group is counted in `stats()` so the rollout side can be throttled instead. Groups without a single trainable
member (all failed or aborted) are dropped too. A trajectory that `replaces` (a failed member of its
group, resampled: algorithm.failed_members) takes that member's place; the failed one stays in the log.

Persistence (`<run_dir>/store/`), so that a run can be inspected, replayed and resumed after a crash:
- `trajectories/part-NNNNNN.parquet`: every `put`/`put_partial` call appends one small shard through `datasets`
  (written to a temporary name, fsynced, renamed), rows in `Trajectory.to_row()` form plus `seq` (arrival number)
  and `kind` ("full", "partial" or "snapshot"). Floats stay float64 so a trajectory read back is the one that was put.
- `events.jsonl`: one line per batch taken (its index and group ids), per stale/untrainable drop, per
  `take_partials` call, per progress report (sampled tokens and seconds of each running episode) and per resumption
  of snapshots (the tokens and seconds they carried over, and those sampled since that no snapshot had kept: lost).
- `config.json`: the StoreConfig.

`TrajectoryStore.open(run_dir, position=k)` rebuilds the buffer from the shards and replays the events of the first
`k` batches (all of them when `position` is None): groups handed out in later batches return to the buffer, and the
later events are cut from the log. With `k` = the position saved in the trainer's checkpoint, the next `take_batch`
returns what the uninterrupted run's did. Partial trajectories that were taken but never came back (as a newer
partial or a finished trajectory with the same id) return to the partial pool: the worker holding them died. The
same holds for snapshots: the newest one of an episode that never finished is kept for `take_snapshots`.

`TrajectoryStoreActor` (`ray.remote(TrajectoryStore)`) is the Ray actor; Ray is imported only when it is first used.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datasets import Features, List, Value

from agentrl.reward import select_trainable
from agentrl.types import EpisodeSummary, ResumePoint, Status, Trajectory

STORE_DIR = "store"
SHARD_DIR = "trajectories"
EVENTS_FILE = "events.jsonl"
CONFIG_FILE = "config.json"

# One Parquet column per field of Trajectory.to_row() (checked on every write), plus the store's own two.
ROW_FEATURES = Features({
    "trajectory_id": Value("string"), "task_id": Value("string"), "group_id": Value("string"),
    "env_id": Value("string"), "tokens": List(Value("int32")), "loss_mask": List(Value("int8")),
    "logprobs": List(Value("float64")), "versions": List(Value("int32")), "routed_experts": Value("binary"),
    "routed_experts_shape": List(Value("int32")), "prompt_length": Value("int64"), "reward": Value("float64"),
    "reward_components": Value("string"), "status": Value("string"), "failure": Value("string"),
    "error": Value("string"), "turns": Value("string"), "tool_calls": Value("string"),
    "num_tool_errors": Value("int64"), "timings": Value("string"), "env_state": Value("binary"),
    "episode": Value("string"), "prefix_cache": Value("string"), "metadata": Value("string"), "seq": Value("int64"),
    "kind": Value("string"),
})


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """Where the store persists and how trajectories form groups.

    Args:
        run_dir: the run's directory; the store writes under `<run_dir>/store/`.
        group_size: trajectories per GRPO group (a group is complete when this many have arrived).
        persist: write every trajectory to Parquet (off only for throw-away tests).
    """

    run_dir: str
    group_size: int
    persist: bool = True

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"StoreConfig.group_size must be >= 1, got {self.group_size}")
        if not self.run_dir:
            raise ValueError("StoreConfig.run_dir must name a directory, got an empty string")


@dataclass(kw_only=True, slots=True)
class Batch:
    """What `take_batch` hands out: the trainable members of `group_ids`, group after group."""

    index: int  # 0-based: the store's position before this batch
    trajectories: list[Trajectory]
    group_ids: list[str]
    max_lag: int  # the largest policy lag among the groups


@dataclass(kw_only=True, slots=True)
class Selection:
    """What the driver learns of a training batch that goes to the trainer ranks by reference
    (`take_training_batch`): which groups train and why the others taken with them do not."""

    taken: bool  # False: fewer complete groups than asked for; they wait in the store
    group_ids: list[str]  # the groups that train
    trajectories: int  # their members that train
    uniform: int  # groups left out: every member got the same reward (no advantage)
    short: int  # groups left out: a member failed and algorithm.failed_members=drop


@dataclass(kw_only=True, slots=True)
class _Group:
    members: list[Trajectory] = field(default_factory=list)
    completed_at: int = -1  # arrival number of the member that completed it


class TrajectoryStore:
    """Buffer of trajectories grouped for GRPO, with staleness control and Parquet persistence (see module doc).

    Args:
        config: the StoreConfig.
        resume: continue the store persisted under `config.run_dir` (else that directory must hold no store).
        position: with `resume`, the number of batches to keep as consumed (None: all that were taken).
    """

    def __init__(self, config: StoreConfig, *, resume: bool = False, position: int | None = None):
        self.config = config
        self._dir = os.path.join(config.run_dir, STORE_DIR)
        self._groups: OrderedDict[str, _Group] = OrderedDict()  # buffered groups in first-arrival order
        self._partials: OrderedDict[str, Trajectory] = OrderedDict()
        self._snapshots: dict[str, Trajectory] = {}  # running episodes' latest turn-boundary state
        self._progress: dict[str, tuple[int, float]] = {}  # running episodes' (sampled tokens, seconds) so far
        self._seen_ids: set[str] = set()  # finished trajectory ids ever put (duplicates are an error)
        self._seq = 0  # arrival counter over all puts
        self._num_shards = 0
        self._position = 0  # batches taken
        self._counters: Counter[str] = Counter()
        self._status_counts: Counter[str] = Counter()
        self._last_lags: list[int] = []
        if config.persist:
            if resume:
                self._restore(position)
            else:
                if os.path.exists(os.path.join(self._dir, SHARD_DIR)) and os.listdir(os.path.join(self._dir,
                                                                                                   SHARD_DIR)):
                    raise ValueError(f"{self._dir} already holds a trajectory store; open it with "
                                     f"TrajectoryStore.open({config.run_dir!r}) or use a new run_dir")
                os.makedirs(os.path.join(self._dir, SHARD_DIR), exist_ok=True)
                with open(os.path.join(self._dir, CONFIG_FILE), "w") as f:
                    json.dump(asdict(config), f)
        elif resume:
            raise ValueError("resume=True needs a persisted store (StoreConfig.persist=True)")

    @classmethod
    def open(cls, run_dir: str, *, position: int | None = None) -> TrajectoryStore:
        """Reopens the store persisted under `run_dir` at `position` batches consumed (None: as it was left)."""
        path = os.path.join(run_dir, STORE_DIR, CONFIG_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no trajectory store under {run_dir} ({path} is missing)")
        with open(path) as f:
            saved = json.load(f)
        saved["run_dir"] = run_dir  # the run may have moved
        return cls(StoreConfig(**saved), resume=True, position=position)

    # --- writing ------------------------------------------------------------------------------------------------------
    def put(self, trajectories: Trajectory | list[Trajectory]) -> int:
        """Adds finished trajectories (any status but PARTIAL) and persists them; returns the store position."""
        items = [trajectories] if isinstance(trajectories, Trajectory) else list(trajectories)
        ids: set[str] = set()
        arriving: Counter[str] = Counter()
        failed = {m.trajectory_id: m.group_id for g in self._groups.values() for m in g.members if not m.trainable}
        for t in items:
            t.validate()
            if t.status == Status.PARTIAL:
                raise ValueError(f"trajectory {t.trajectory_id} is PARTIAL: keep it with put_partial, not put")
            if t.trajectory_id in self._seen_ids or t.trajectory_id in ids:
                raise ValueError(f"trajectory {t.trajectory_id} was already put")
            ids.add(t.trajectory_id)
            replaces = t.replaces
            if replaces:  # a resampled member takes the place of a failed one
                if failed.get(replaces) != t.group_id:
                    raise ValueError(f"trajectory {t.trajectory_id} replaces {replaces}, which is not a failed member "
                                     f"of its buffered group {t.group_id}")
                del failed[replaces]
            else:
                arriving[t.group_id] += 1
            if not t.trainable:
                failed[t.trajectory_id] = t.group_id
            group = self._groups.get(t.group_id)
            if (len(group.members) if group else 0) + arriving[t.group_id] > self.config.group_size:
                raise ValueError(f"group {t.group_id} would exceed group_size={self.config.group_size} members")
        self._persist(items, kind="full")
        for t in items:
            self._add(t)
            self._counters["trajectories_put"] += 1
        return self._position

    def put_partial(self, trajectories: Trajectory | list[Trajectory]) -> None:
        """Keeps paused (PARTIAL) trajectories to be resumed by a rollout worker; a newer one replaces an older."""
        items = [trajectories] if isinstance(trajectories, Trajectory) else list(trajectories)
        for t in items:
            t.validate()
            if t.status != Status.PARTIAL:
                raise ValueError(f"put_partial takes PARTIAL trajectories; {t.trajectory_id} is {t.status.value}")
        self._persist(items, kind="partial")
        for t in items:
            self._partials.pop(t.trajectory_id, None)
            self._partials[t.trajectory_id] = t
            self._forget_running(t.trajectory_id)
            self._counters["partials_put"] += 1

    def report(self, snapshots: list[Trajectory], progress: dict[str, tuple[int, float]]) -> None:
        """From a rollout worker, while its episodes run: PARTIAL snapshots taken at turn boundaries (the newest of an
        episode replaces the older) and `progress`, each running episode's (sampled tokens, seconds) so far. Both
        are persisted; what arrives for an episode already put (a report overtaken by its result) is ignored."""
        snapshots = [t for t in snapshots if not self._overtaken(t.trajectory_id, len(t.tokens))]
        progress = {k: (int(n), float(s)) for k, (n, s) in progress.items() if not self._overtaken(k)}
        for t in snapshots:
            t.validate()
            if t.status != Status.PARTIAL or t.env_state is None:
                raise ValueError(f"a snapshot is PARTIAL with its env state; {t.trajectory_id} is {t.status.value}")
        self._persist(snapshots, kind="snapshot")
        if progress:
            self._log({"op": "progress", "episodes": progress})
        for t in snapshots:
            self._snapshots[t.trajectory_id] = t
        self._progress.update(progress)
        self._counters["snapshots_put"] += len(snapshots)

    def take_snapshots(self, trajectory_ids: list[str]) -> list[Trajectory]:
        """The snapshots of those of `trajectory_ids` that began and never finished — their worker or the run died —
        to be resumed; counts what resuming them saves and what was lost (sampled after the last snapshot)."""
        taken, restarted, carried, lost, carried_s, lost_s = [], [], 0, 0, 0.0, 0.0
        for tid in trajectory_ids:
            snapshot = self._snapshots.pop(tid, None)
            sampled, seconds = self._progress.pop(tid, (0, 0.0))
            if snapshot is not None:
                taken.append(snapshot)
                kept_n, kept_s = snapshot.num_sampled, snapshot.timings.get("episode_s", 0.0)
            elif sampled:  # it began, and no snapshot kept anything: it starts over
                restarted.append(tid)
                kept_n, kept_s = 0, 0.0
            else:
                continue  # never started
            carried, carried_s = carried + kept_n, carried_s + kept_s
            lost, lost_s = lost + max(0, sampled - kept_n), lost_s + max(0.0, seconds - kept_s)
        if taken or restarted:
            self._log({"op": "resume", "ids": [t.trajectory_id for t in taken], "restarted": restarted,
                       "carried_tokens": carried, "lost_tokens": lost, "carried_s": carried_s, "lost_s": lost_s,
                       "at": time.time()})
            self._counters["episodes_resumed"] += len(taken)
            self._counters["episodes_restarted"] += len(restarted)
            self._counters["tokens_carried"] += carried
            self._counters["tokens_lost"] += lost
        return taken

    def take_partials(self, max_count: int | None = None) -> list[Trajectory]:
        """Hands out up to `max_count` partial trajectories (oldest first) for resumption."""
        ids = list(self._partials)[: max_count if max_count is not None else None]
        taken = [self._partials.pop(i) for i in ids]
        if taken:
            self._log({"op": "take_partials", "ids": ids})
            self._counters["partials_taken"] += len(taken)
        return taken

    def held(self, trajectory_ids: list[str]) -> list[str]:
        """Those of `trajectory_ids` the store already holds (put, or paused in the partial pool): after a resume,
        the episodes a run had finished or paused past its checkpoint, which it must not sample again."""
        return [i for i in trajectory_ids if i in self._seen_ids or i in self._partials]

    def held_results(self, trajectory_ids: list[str], *, paused: bool = False) -> list[EpisodeSummary]:
        """The summaries of the finished trajectories among `trajectory_ids` that wait in the store, not yet trained
        or dropped (and with `paused`, of those in the partial pool): after a resume, those a redone step had
        finished before the run died, which its metrics count without sampling them again; after a rollout worker
        died, those it had handed over, which are not run again."""
        wanted = set(trajectory_ids)
        out = [t.summary() for g in self._groups.values() for t in g.members if t.trajectory_id in wanted]
        if paused:
            out += [t.summary() for tid, t in self._partials.items() if tid in wanted]
        return out

    # --- reading ------------------------------------------------------------------------------------------------------
    def take_batch(self, num_groups: int, current_version: int, max_staleness: int, *,
                   min_groups: int | None = None) -> Batch | None:
        """The oldest `num_groups` complete groups whose lag ≤ max_staleness, or None if there are fewer than
        `min_groups` (default: `num_groups`) of them.

        Stale and untrainable complete groups met on the way are dropped (and logged) even when None is returned.
        """
        min_groups = num_groups if min_groups is None else min_groups
        if num_groups < 1 or not 1 <= min_groups <= num_groups:
            raise ValueError(f"need 1 <= min_groups <= num_groups, got {min_groups} and {num_groups}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        chosen: list[tuple[str, int]] = []
        for group_id in self._complete_in_order():
            group = self._groups[group_id]
            trainable = [t for t in group.members if t.trainable]
            if not trainable:
                self._drop(group_id, "untrainable", current_version)
                continue
            lag = current_version - min(min((v for v in t.versions if v >= 0), default=current_version)
                                        for t in trainable)
            if lag > max_staleness:
                self._drop(group_id, "stale", current_version, lag=lag)
                continue
            chosen.append((group_id, lag))
            if len(chosen) == num_groups:
                break
        if len(chosen) < min_groups:
            return None
        group_ids = [g for g, _ in chosen]
        batch = Batch(index=self._position, group_ids=group_ids, max_lag=max(lag for _, lag in chosen),
                      trajectories=[t for g in group_ids for t in self._groups[g].members if t.trainable])
        self._log({"op": "take", "batch": self._position, "version": current_version, "groups": group_ids})
        for g in group_ids:
            del self._groups[g]
        self._position += 1
        self._counters["groups_consumed"] += len(group_ids)
        self._counters["trajectories_consumed"] += len(batch.trajectories)
        self._last_lags = [lag for _, lag in chosen]
        return batch

    def take_training_batch(self, num_groups: int, current_version: int, max_staleness: int, *,
                            min_groups: int | None = None, skip_uniform_groups: bool = False,
                            drop_short_groups: bool = False) -> tuple[Selection, list[Trajectory]]:
        """`take_batch`, then the members the loss trains on (agentrl.reward.select_trainable): a small Selection
        for the driver and the trajectories for the trainer ranks. Called as a Ray actor method with
        `num_returns=2`, the trajectories stay in the object store and reach the ranks by reference, never the
        driver."""
        batch = self.take_batch(num_groups, current_version, max_staleness, min_groups=min_groups)
        if batch is None:
            return Selection(taken=False, group_ids=[], trajectories=0, uniform=0, short=0), []
        trainable, uniform, short = select_trainable(batch.trajectories, self.config.group_size,
                                                     skip_uniform_groups=skip_uniform_groups,
                                                     drop_short_groups=drop_short_groups)
        return Selection(taken=True, group_ids=list(dict.fromkeys(t.group_id for t in trainable)),
                         trajectories=len(trainable), uniform=uniform, short=short), trainable

    @property
    def position(self) -> int:
        """Batches taken so far: save it with the trainer's checkpoint and pass it to `open` on resume."""
        return self._position

    def stats(self) -> dict[str, float]:
        """Counters for monitoring (flat, numeric)."""
        complete = sum(1 for g in self._groups.values() if len(g.members) >= self.config.group_size)
        out: dict[str, float] = {
            "position": self._position,
            "buffered_trajectories": sum(len(g.members) for g in self._groups.values()),
            "buffered_groups": len(self._groups),
            "complete_groups": complete,
            "partial_pool": len(self._partials),
            "persisted_shards": self._num_shards,
            "last_batch_max_lag": max(self._last_lags, default=0),
            "last_batch_mean_lag": sum(self._last_lags) / len(self._last_lags) if self._last_lags else 0.0,
        }
        out["running_snapshots"] = len(self._snapshots)
        for key in ("trajectories_put", "partials_put", "partials_taken", "groups_consumed",
                    "trajectories_consumed", "groups_dropped_stale", "trajectories_dropped_stale",
                    "groups_dropped_untrainable", "snapshots_put", "episodes_resumed", "episodes_restarted",
                    "tokens_carried", "tokens_lost", "resampled"):
            out[key] = self._counters[key]
        for status in Status:
            out[f"status_{status.value}"] = self._status_counts[status.value]
        return out

    @staticmethod
    def read_trajectories(run_dir: str, kinds: tuple[str, ...] = ("full", "partial")) -> datasets.Dataset:
        """The rows persisted under `run_dir` whose kind is in `kinds`, in arrival order, as a `datasets.Dataset`.

        The default is the episodes' results (finished and paused); "snapshot" rows are the running episodes'
        turn-boundary copies kept for resume, stand-ins that a later full or partial row of the same id supersedes."""
        shard_dir = os.path.join(run_dir, STORE_DIR, SHARD_DIR)
        files = _shard_files(shard_dir)
        if not files:
            return datasets.Dataset.from_list([], features=ROW_FEATURES)
        tables = [pq.read_table(f) for f in files]
        return datasets.concatenate_datasets([datasets.Dataset(t.filter(pc.is_in(t["kind"], pa.array(kinds))))
                                              for t in tables])

    # --- internals ----------------------------------------------------------------------------------------------------
    def _add(self, t: Trajectory) -> None:
        group = self._groups.setdefault(t.group_id, _Group())
        replaces = t.replaces
        if replaces:  # put() checked that it names a failed member of this group
            group.members = [t if m.trajectory_id == replaces else m for m in group.members]
            self._counters["resampled"] += 1
        else:
            group.members.append(t)
        self._seen_ids.add(t.trajectory_id)
        self._status_counts[t.status.value] += 1
        self._partials.pop(t.trajectory_id, None)  # a resumed partial came back finished
        self._forget_running(t.trajectory_id)
        if len(group.members) == self.config.group_size and not replaces:
            group.completed_at = self._seq
        self._seq += 1

    def _overtaken(self, trajectory_id: str, length: int | None = None) -> bool:
        """Whether a report about a running episode arrived after the episode's result (finished, or paused)."""
        paused = self._partials.get(trajectory_id)
        return trajectory_id in self._seen_ids or (paused is not None and (length is None
                                                                          or len(paused.tokens) >= length))

    def _forget_running(self, trajectory_id: str) -> None:
        self._snapshots.pop(trajectory_id, None)
        self._progress.pop(trajectory_id, None)

    def _complete_in_order(self) -> list[str]:
        complete = [(g.completed_at, gid) for gid, g in self._groups.items()
                    if len(g.members) >= self.config.group_size]
        return [gid for _, gid in sorted(complete)]

    def _drop(self, group_id: str, reason: str, version: int, lag: int | None = None) -> None:
        group = self._groups.pop(group_id)
        self._log({"op": "drop", "reason": reason, "position": self._position, "version": version,
                   "groups": [group_id], "lag": lag})
        self._counters[f"groups_dropped_{reason}"] += 1
        if reason == "stale":
            self._counters["trajectories_dropped_stale"] += len(group.members)

    def _persist(self, items: list[Trajectory], *, kind: str) -> None:
        if not self.config.persist or not items:
            return
        rows = []
        for i, t in enumerate(items):
            row = t.to_row()
            row["seq"], row["kind"] = self._seq + i if kind == "full" else -1, kind
            if set(row) != set(ROW_FEATURES):
                raise AssertionError(f"Trajectory.to_row() fields changed: {sorted(set(row) ^ set(ROW_FEATURES))}; "
                                     f"update ROW_FEATURES in agentrl/store.py")
            rows.append(row)
        shard_dir = os.path.join(self._dir, SHARD_DIR)
        final = os.path.join(shard_dir, f"part-{self._num_shards:06d}.parquet")
        fd, tmp = tempfile.mkstemp(dir=shard_dir, prefix=".tmp-", suffix=".parquet")
        bars_were_on = not datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # one bar per put would flood the actor's log
        try:
            with os.fdopen(fd, "wb") as f:
                datasets.Dataset.from_list(rows, features=ROW_FEATURES).to_parquet(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
        self._num_shards += 1

    def _log(self, event: dict[str, Any]) -> None:
        if not self.config.persist:
            return
        with open(os.path.join(self._dir, EVENTS_FILE), "a") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _restore(self, position: int | None) -> None:
        shard_dir = os.path.join(self._dir, SHARD_DIR)
        if not os.path.isdir(shard_dir):
            raise FileNotFoundError(f"no trajectory store under {self.config.run_dir} ({shard_dir} is missing)")
        for name in os.listdir(shard_dir):  # a shard whose write was interrupted was never acknowledged
            if name.startswith(".tmp-"):
                os.remove(os.path.join(shard_dir, name))
        events = _read_events(os.path.join(self._dir, EVENTS_FILE))
        num_taken = sum(1 for e in events if e["op"] == "take")
        if position is None:
            position = num_taken
        if not 0 <= position <= num_taken:
            raise ValueError(f"position {position} is outside the {num_taken} batches this store handed out")
        kept = [e for e in events
                if (e["op"] == "take" and e["batch"] < position) or (e["op"] == "drop" and e["position"] < position)
                or e["op"] in ("take_partials", "progress", "resume")]
        files = _shard_files(shard_dir)
        self._num_shards = len(files)
        unfinished: dict[str, tuple[int, str, Trajectory]] = {}  # newest partial or snapshot row per episode
        was_partial: set[str] = set()
        finished_at: dict[str, int] = {}
        order = 0
        for path in files:
            for row in pq.read_table(path).to_pylist():
                kind = row.pop("kind")
                row.pop("seq")
                t = Trajectory.from_row(row)
                if kind == "full":
                    self._add(t)
                    finished_at[t.trajectory_id] = order
                    self._counters["trajectories_put"] += 1
                else:
                    unfinished[t.trajectory_id] = (order, kind, t)
                    if kind == "partial":
                        was_partial.add(t.trajectory_id)
                    self._counters[f"{kind}s_put"] += 1
                order += 1
        for tid, (at, kind, t) in sorted(unfinished.items(), key=lambda kv: kv[1][0]):
            if finished_at.get(tid, -1) > at:
                continue
            if tid in was_partial:  # a paused episode, resumed since and snapshotted on the way: paused again
                self._partials[tid] = t
            else:
                self._snapshots[tid] = t
        for e in kept:
            if e["op"] == "take":
                for g in e["groups"]:
                    group = self._groups.pop(g)
                    self._counters["groups_consumed"] += 1
                    self._counters["trajectories_consumed"] += sum(t.trainable for t in group.members)
                self._position += 1
            elif e["op"] == "progress":
                self._progress.update({k: (n, s) for k, (n, s) in e["episodes"].items() if k not in self._seen_ids})
            elif e["op"] == "resume":  # its snapshots stay: every worker is gone now, they are resumed again
                self._counters["tokens_carried"] += e["carried_tokens"]
                self._counters["tokens_lost"] += e["lost_tokens"]
                self._counters["episodes_resumed"] += len(e["ids"])
                self._counters["episodes_restarted"] += len(e["restarted"])
                for tid in e["ids"] + e["restarted"]:  # counted as lost once
                    self._progress.pop(tid, None)
            elif e["op"] == "drop":
                for g in e["groups"]:
                    group = self._groups.pop(g)
                    self._counters[f"groups_dropped_{e['reason']}"] += 1
                    if e["reason"] == "stale":
                        self._counters["trajectories_dropped_stale"] += len(group.members)
        if len(kept) != len(events):  # forget what happened after `position`; it will happen again
            path = os.path.join(self._dir, EVENTS_FILE)
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)


def _shard_files(shard_dir: str) -> list[str]:
    if not os.path.isdir(shard_dir):
        return []
    return sorted(os.path.join(shard_dir, n) for n in os.listdir(shard_dir)
                  if n.startswith("part-") and n.endswith(".parquet"))


def _read_events(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    events = []
    with open(path) as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash: the event never completed
                break
    return events


_actor_class = None


def _store_actor_class():
    """The store as a Ray actor. Besides TrajectoryStore's methods it hands out the episodes to resume as ResumePoints
    (ids and an object reference to the trajectory): the driver routes them to rollout workers, which read the
    tokens from the object store."""
    import ray

    class TrajectoryStoreActor(TrajectoryStore):
        def hand_out_partials(self, max_count: int | None = None) -> list[ResumePoint]:
            """`take_partials`, by reference."""
            return [ResumePoint.of(t, ray.put(t)) for t in self.take_partials(max_count)]

        def hand_out_snapshots(self, trajectory_ids: list[str]) -> list[ResumePoint]:
            """`take_snapshots`, by reference."""
            return [ResumePoint.of(t, ray.put(t)) for t in self.take_snapshots(trajectory_ids)]

    return ray.remote(num_cpus=0)(TrajectoryStoreActor)


def __getattr__(name: str):
    if name == "TrajectoryStoreActor":
        global _actor_class
        if _actor_class is None:
            _actor_class = _store_actor_class()
        return _actor_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
