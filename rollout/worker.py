"""RolloutWorker: one vLLM engine running many environment episodes concurrently.

`RolloutWorker` is a plain class (tests and single-process runs use it directly); `RolloutWorkerActor` is the thin
Ray shell the driver places on the cluster. It is an async actor, so `update_weights` runs while `generate` is in
flight: generation pauses, the weights change, and the episodes continue under the new version.

RL episodes go to the trajectory store from the worker that ran them (`to_store`): the caller gets only their
summaries (agentrl.types.EpisodeSummary: counts, rewards, a few transcripts), and the episodes to continue arrive as
ResumePoints whose trajectories the worker reads from the object store, so the tokens never pass through the
driver. `RolloutPool` is the caller's side: it spreads episode requests over the workers, detects a dead worker,
replaces it and reruns the requests it held that the store had not received. A worker whose vLLM engine core died
ends its own process (vLLM cannot rebuild a dead engine in place), so that the pool replaces it the same way and its
episodes are rerun, not failed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

from agentrl.rollout.agent_loop import AgentLoop, EnvPool, EpisodeRequest, TokenBudget
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy_engine import EngineSpec, PolicyEngine
from agentrl.rollout.snapshots import SnapshotReporter
from agentrl.types import Boundary, EpisodeSummary, ResumePoint, Status, Trajectory

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 60.0  # a live worker answers within seconds, even with every core busy sampling


class RolloutWorker:
    """One engine and its episodes. `config` is the job's rollout section; `chat_format` names the model's chat format
    (None: detected from the tokenizer at `tokenizer_path`)."""

    def __init__(self, engine_spec: EngineSpec, tokenizer_path: str, config: RolloutConfig, *,
                 chat_format: str | None = None, engine: PolicyEngine | None = None, version: int = 0,
                 store: Any = None):
        from agentrl.chat import load_chat_format

        self.spec = engine_spec
        self.config = config
        self.chat = load_chat_format(tokenizer_path, chat_format)
        self.initial_version = version
        self.engine = engine
        self.envs = EnvPool(isolation=config.env_isolation)
        self.max_trajectory_tokens = config.max_trajectory_tokens  # the context schedule moves it
        self.loop = AgentLoop(engine, self.chat, config, self.envs) if engine is not None else None
        self._starting: asyncio.Lock | None = None
        self._sync: _Transfer | None = None  # an in-memory weight transfer in progress
        # the store actor the RL episodes report to while they run (for lossless resume) and end in (None: no store)
        self.store = store
        self.reporter = (SnapshotReporter(store, interval_s=config.snapshot_interval_s, snapshots=config.snapshots)
                         if store is not None else None)
        if engine is None:  # vLLM's imports (seconds of a core) now: the driver starts workers before their weights
            import vllm.v1.engine.async_llm  # noqa: F401

    async def _ready(self) -> PolicyEngine:
        """The engine, built on first use (inside the actor's event loop, where AsyncLLM must live)."""
        if self.engine is None:
            self._starting = self._starting or asyncio.Lock()
            async with self._starting:
                if self.engine is None:
                    self.engine = await PolicyEngine.create(self.spec, version=self.initial_version)
                    self.loop = AgentLoop(self.engine, self.chat, self.config, self.envs,
                                          max_trajectory_tokens=self.max_trajectory_tokens)
        return self.engine

    async def generate(self, requests: list[EpisodeRequest], resumes: list[Trajectory | ResumePoint] | None = None,
                       token_budget: int | None = None, temperature: float | None = None, *,
                       to_store: bool = False, summarize: bool = False,
                       transcripts: int = 0) -> list[Trajectory] | list[EpisodeSummary]:
        """Runs the requested episodes and continues the partial ones (`resumes`: trajectories, or ResumePoints whose
        trajectories this worker reads from the object store), all concurrently; returns every trajectory
        (completed, truncated, failed — or partial when `token_budget` sampled tokens were spent first).
        `temperature` overrides the sampling temperature for these episodes (0: greedy, for evaluation).

        `to_store` (RL episodes): their progress and snapshots go to the store while they run, their trajectories to
        the store when they end (`put`, or `put_partial` for the paused ones), and only their summaries come back —
        as with `summarize` — the first `transcripts` of them with the turns' text."""
        await self._ready()
        if to_store and self.store is None:
            raise ValueError("to_store=True needs the worker to have been started with the store actor")
        budget = TokenBudget(token_budget)
        semaphore = asyncio.Semaphore(self.config.max_concurrent_episodes)
        loop = self.loop
        if temperature is not None:
            loop = AgentLoop(self.engine, self.chat, self.config, self.envs, sampling=self.config.sampling(temperature),
                             max_trajectory_tokens=self.max_trajectory_tokens)

        reporter = self.reporter if to_store else None

        async def one(request: EpisodeRequest, resume: Trajectory | None) -> Trajectory:
            async with semaphore:
                return await loop.run(request, budget, resume, reporter)

        partials = await _resolved(resumes or [])
        jobs = [one(r, None) for r in requests] + [one(EpisodeRequest.of(p), p) for p in partials]
        t0 = time.perf_counter()
        trajectories = list(await asyncio.gather(*jobs))
        self._end_if_engine_died()  # its episodes failed at the model boundary for want of an engine
        log.info("worker ran %d episodes in %.1fs", len(trajectories), time.perf_counter() - t0)
        if to_store:
            await put_results(self.store, trajectories)
        if to_store or summarize:
            return [t.summary(transcript=i < transcripts) for i, t in enumerate(trajectories)]
        return trajectories

    async def update_weights(self, path: str, version: int) -> int:
        engine = await self._ready()
        try:
            await engine.update_weights(path, version)
        except Exception:
            self._end_if_engine_died()
            raise
        return engine.version

    # --- in-memory weight syncs: trainer rank 0 calls these through WorkerReceivers --------------------------------
    async def begin_weight_sync(self, version: int, restore: tuple[str, int], timeout_s: float) -> None:
        """Pauses the engine and opens a transfer to `version`. Until `finish_weight_sync` the engine serves
        nothing; a transfer that fails, or hears nothing for `timeout_s`, ends by loading the complete weights at
        `restore` (path, version) instead — or, if that fails too, by ending this worker."""
        engine = await self._ready()
        self._sync = _Transfer(version, restore, timeout_s)
        try:
            await engine.begin_sync()
        except Exception:
            self._sync = None
            self._end_if_engine_died()
            raise
        self._sync.watchdog = asyncio.ensure_future(self._watch_sync(self._sync))

    async def load_weights_bucket(self, bucket: dict) -> None:
        await self._in_sync(self._ready_engine().load_bucket(bucket))

    async def finish_weight_sync(self, version: int) -> int:
        """Serves the transferred weights as `version` (every tensor arrived) and resumes generation."""
        await self._in_sync(self._ready_engine().commit_sync(version))
        self._sync.watchdog.cancel()
        self._sync = None
        return self.engine.version

    async def _in_sync(self, call) -> None:
        """Runs a step of the open transfer; if it fails, restores complete weights (or ends this worker) and
        re-raises, so the sender counts this worker out."""
        sync = self._sync
        if sync is None:
            call.close()
            raise RuntimeError("no weight transfer is open on this worker (begin_weight_sync first)")
        sync.last = time.monotonic()
        try:
            await call
        except Exception:
            self._end_if_engine_died()
            await self._restore(sync, "failed")
            raise

    async def _watch_sync(self, sync: _Transfer) -> None:
        while self._sync is sync:
            idle = time.monotonic() - sync.last
            if idle >= sync.timeout_s:
                await self._restore(sync, f"heard nothing for {idle:.0f}s")
                return
            await asyncio.sleep(min(1.0, sync.timeout_s - idle))

    async def _restore(self, sync: _Transfer, why: str) -> None:
        if self._sync is not sync:
            return  # restored already (the watchdog and a failed call both saw it)
        self._sync = None
        if sync.watchdog is not None and sync.watchdog is not asyncio.current_task():
            sync.watchdog.cancel()
        path, version = sync.restore
        log.error("weight transfer to version %d %s: loading version %d from %s", sync.version, why, version, path)
        try:
            await self.engine.restore(path, version)
        except Exception:
            log.exception("restoring complete weights failed: ending this worker so that it is replaced")
            self.envs.close()
            os._exit(1)

    def _ready_engine(self) -> PolicyEngine:
        if self.engine is None:
            raise RuntimeError("the engine is not started")
        return self.engine

    async def version(self) -> int:
        return (await self._ready()).version

    async def ping(self) -> int:
        engine = await self._ready()
        try:
            await engine.check_health()
        except Exception:
            self._end_if_engine_died()
            raise
        return engine.version

    def _end_if_engine_died(self) -> None:
        """Ends this process when the engine core is gone (the caller sees the worker die and replaces it)."""
        if self.engine is None or not self.engine.dead:
            return
        log.error("the vLLM engine core of this rollout worker died; ending the worker so that it is replaced")
        self.envs.close()
        os._exit(1)

    def set_max_trajectory_tokens(self, limit: int) -> None:
        """The context schedule's current limit (applies to the turns sampled from now on)."""
        self.max_trajectory_tokens = limit
        if self.loop is not None:
            self.loop.max_trajectory_tokens = limit

    def shutdown(self) -> None:
        self.envs.close()
        if self.engine is not None:
            self.engine.shutdown()


@dataclass(slots=True)
class _Transfer:
    """An in-memory weight transfer open on a worker."""

    version: int
    restore: tuple[str, int]  # complete weights to fall back on: (path, version)
    timeout_s: float
    last: float = field(default_factory=time.monotonic)  # when the sender was last heard
    watchdog: Any = None


async def _resolved(resumes: list[Trajectory | ResumePoint]) -> list[Trajectory]:
    """The trajectories to continue: ResumePoints' read from the object store (the store put them there)."""
    refs = [r.trajectory for r in resumes if isinstance(r, ResumePoint)]
    fetched = iter(await asyncio.gather(*refs)) if refs else iter(())
    return [next(fetched) if isinstance(r, ResumePoint) else r for r in resumes]


async def put_results(store: Any, trajectories: list[Trajectory]) -> None:
    """Hands episodes' results to the store actor: the finished ones (`put`) and the paused ones (`put_partial`)."""
    finished = [t for t in trajectories if t.status != Status.PARTIAL]
    paused = [t for t in trajectories if t.status == Status.PARTIAL]
    if finished:
        await store.put.remote(finished)
    if paused:
        await store.put_partial.remote(paused)


def rollout_worker_actor(num_cpus: float = 1.0, num_gpus: float = 0.0, **options: Any):
    """The Ray actor class for RolloutWorker with the given resources (imported lazily: envs and tests need no Ray)."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1000, **options)(RolloutWorker)


class RolloutPool:
    """The driver's handle on N rollout worker actors, with replacement of dead workers.

    `generate` splits the requests over the workers; if a worker dies (RayActorError), a new one is started at the
    current weights and its share is rerun. A share that fails again comes back as FAILED at the worker boundary,
    so one broken machine cannot stall the run.
    """

    def __init__(self, actor_cls, num_workers: int, args: tuple, kwargs: dict[str, Any] | None = None, *,
                 store: Any = None):
        self.actor_cls, self.args, self.kwargs = actor_cls, args, {**(kwargs or {}), "store": store}
        self.store = store  # the store actor: running RL episodes report to it and a rerun resumes their snapshots
        self.workers = [self._start() for _ in range(num_workers)]
        # complete weights on disk, (path, version): what a replacement starts from, and an engine whose in-memory
        # transfer failed falls back on
        self.weights: tuple[str, int] = (args[0].model, self.kwargs.get("version", 0))
        self.version = self.weights[1]  # the version the engines serve
        self._weight_source: tuple[Any, Any] | None = None  # (trainer group, rollout.weight_sync) of in-memory syncs
        self.max_trajectory_tokens: int | None = None  # the context schedule's limit, once set
        self.restarts = 0

    def _start(self):
        return self.actor_cls.remote(*self.args, **self.kwargs)

    def start_engines(self) -> list[Any]:
        """Starts every worker's engine now, without waiting, instead of at its first episodes: once the weights
        exist, the engines start while the driver does other work (the warm start's SFT). Returns the calls (each
        resolves to the version its engine serves). A worker whose engine fails to start fails its first call, as
        it would without this."""
        return [worker.ping.remote() for worker in self.workers]

    def _replace(self, index: int, dead: Any) -> None:
        """Replaces worker `index`, whose handle `dead` failed — unless another call already replaced it (async
        steps notice one death twice: in a weight update and in the rollout submitted before it)."""
        import ray

        if self.workers[index] is not dead:
            return
        self.restarts += 1
        log.warning("rollout worker %d died; starting a replacement", index)
        ray.kill(dead)  # one that stopped answering without dying must not keep its engine beside the replacement's
        spec, *rest = self.args
        # built on the newest complete weights on disk (the ones it started with may be pruned), then brought to the
        # version the others serve if that one only exists in memory
        spec = replace(spec, model=self.weights[0])
        self.workers[index] = self.actor_cls.remote(spec, *rest, **{**self.kwargs, "version": self.weights[1]})
        if self.max_trajectory_tokens is not None:
            ray.get(self.workers[index].set_max_trajectory_tokens.remote(self.max_trajectory_tokens))
        if self._weight_source is not None and self.version != self.weights[1]:
            record = self._stream([index])
            if record.failed:  # it serves the weights on disk, its tokens say which version
                log.warning("the replacement of rollout worker %d did not take weights version %d in memory: %s",
                            index, self.version, record.errors)

    def submit(self, requests: list[EpisodeRequest], resumes: list[Trajectory | ResumePoint] | None = None,
               token_budget: int | None = None, temperature: float | None = None, *, to_store: bool = False,
               summarize: bool = False, transcripts: int = 0) -> list[Share]:
        """Starts the episodes on the workers without waiting; `collect` returns them (RolloutWorker.generate says
        what `to_store`, `summarize` and `transcripts` do). With `to_store` a rerun resumes their snapshots."""
        if to_store and self.store is None:
            raise ValueError("to_store=True needs the pool to have been given the store actor")
        shares: list[tuple[list, list]] = [([], []) for _ in self.workers]
        for request in requests:  # a group's members go to one worker: they share the prompt prefix
            shares[_stable_hash(request.group_id) % len(shares)][0].append(request)
        for i, partial in enumerate(resumes or []):
            shares[i % len(shares)][1].append(partial)
        budget = None if token_budget is None else max(1, token_budget // len(self.workers))
        options = {"to_store": to_store, "summarize": summarize, "transcripts": transcripts}
        return [self._run(Share(i, reqs, parts, budget, temperature, options)) for i, (reqs, parts) in
                enumerate(shares) if reqs or parts]

    def _run(self, share: Share) -> Share:
        share.worker = self.workers[share.index]
        share.ref = share.worker.generate.remote(share.requests, share.partials, share.budget, share.temperature,
                                                 **share.options)
        return share

    def collect(self, submitted: list[Share]) -> list[Trajectory] | list[EpisodeSummary]:
        """Waits for submitted episodes; a dead worker is replaced and its share rerun once."""
        import ray

        out: list = []
        for share in submitted:
            try:
                out.extend(ray.get(share.ref))
            except ray.exceptions.RayActorError:
                if self._answers(share.worker):  # an actor it called died (the store): the driver restarts the job
                    raise
                self._replace(share.index, share.worker)
                share, held = self._resumable(share)
                out.extend(held)
                try:
                    out.extend(ray.get(self._run(share).ref))
                except ray.exceptions.RayActorError as exc:
                    if self._answers(share.worker):
                        raise
                    self._replace(share.index, share.worker)
                    out.extend(self._failed(share, f"rollout worker died twice: {exc}"))
        return out

    @staticmethod
    def _answers(worker: Any) -> bool:
        """Whether `worker` still answers after a call on it failed with RayActorError. That error also reaches the
        driver through a live worker when an actor the worker called died (the store, whose death the driver handles
        by restarting from its checkpoint); replacing the live worker then would only start a second engine beside
        it (~40 s on 2 cores) before the restart."""
        import ray

        try:
            ray.get(worker.ping.remote(), timeout=PING_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - gone, not answering, or an unhealthy engine: replaced as before
            return False
        return True

    def _resumable(self, share: Share) -> tuple[Share, list[EpisodeSummary]]:
        """A dead worker's share, to rerun, and the summaries of what it had handed to the store before it died
        (not rerun); the episodes it had snapshotted continue from their snapshots."""
        import ray

        if not share.options["to_store"]:
            return share, []
        ids = [r.trajectory_id for r in share.requests] + [p.trajectory_id for p in share.partials]
        held = ray.get(self.store.held_results.remote(ids, paused=True))
        done = {t.trajectory_id for t in held}
        snapshots = {t.trajectory_id: t for t in ray.get(self.store.hand_out_snapshots.remote(
            [i for i in ids if i not in done]))}
        if done or snapshots:
            log.info("rerunning a dead worker's share: %d episode(s) the store had received, %d resume from their "
                     "snapshots", len(done), len(snapshots))
        resumes = [snapshots.pop(p.trajectory_id, p) for p in share.partials if p.trajectory_id not in done]
        fresh = [r for r in share.requests if r.trajectory_id not in snapshots and r.trajectory_id not in done]
        resumes += [snapshots[r.trajectory_id] for r in share.requests if r.trajectory_id in snapshots]
        return replace(share, requests=fresh, partials=resumes), held

    def _failed(self, share: Share, error: str) -> list[Trajectory] | list[EpisodeSummary]:
        """The share's episodes as FAILED at the worker boundary (into the store with `to_store`)."""
        import ray

        failed = _failed(share.requests, share.partials, error)
        if share.options["to_store"]:
            held = set(ray.get(self.store.held.remote([t.trajectory_id for t in failed])))
            failed = [t for t in failed if t.trajectory_id not in held]
            ray.get(self.store.put.remote(failed))
        if share.options["to_store"] or share.options["summarize"]:
            return [t.summary() for t in failed]
        return failed

    def generate(self, requests: list[EpisodeRequest], resumes: list[Trajectory | ResumePoint] | None = None,
                 token_budget: int | None = None, temperature: float | None = None, *, to_store: bool = False,
                 summarize: bool = False, transcripts: int = 0) -> list[Trajectory] | list[EpisodeSummary]:
        return self.collect(self.submit(requests, resumes, token_budget, temperature, to_store=to_store,
                                        summarize=summarize, transcripts=transcripts))

    def set_max_trajectory_tokens(self, limit: int) -> None:
        import ray

        self.max_trajectory_tokens = limit
        workers = list(self.workers)
        refs = [w.set_max_trajectory_tokens.remote(limit) for w in workers]
        for i, ref in enumerate(refs):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                self._replace(i, workers[i])

    def sync_weights(self, trainer: Any, config: Any) -> Any:
        """The trainer's current weights into every engine, in memory (trainer/weight_stream.py; `config` is
        rollout.weight_sync); returns the trainer's SyncRecord. Workers that failed the transfer (they fell back on
        complete weights, or died) are replaced if dead and sent the weights again, once."""
        self._weight_source = (trainer, config)
        record = self._stream(range(len(self.workers)))
        self.version = record.version
        if record.failed:
            log.warning("%d rollout worker(s) missed the weight sync to version %d: syncing them again",
                        len(record.failed), record.version)
            alive = [i for i in record.failed if not self._replace_if_dead(i)]  # a replacement is synced as built
            again = self._stream(alive) if alive else None
            if again is not None and again.failed:
                raise RuntimeError(f"rollout workers {again.failed} failed two weight syncs to version "
                                   f"{record.version} in a row: {again.errors}")
        return record

    def _stream(self, indices) -> Any:
        trainer, config = self._weight_source
        receivers = WorkerReceivers([self.workers[i] for i in indices], self.weights, config.timeout_s)
        record = trainer.sync_weights(receivers, bucket_bytes=config.bucket_mb << 20, dtype=self.args[0].dtype)
        chosen = list(indices)
        record.failed = [chosen[j] for j in record.failed]
        record.errors = {chosen[j]: message for j, message in record.errors.items()}
        return record

    def _replace_if_dead(self, index: int) -> bool:
        """Replaces worker `index` if it no longer answers; returns whether it did."""
        worker = self.workers[index]
        if self._answers(worker):
            return False
        self._replace(index, worker)
        return True

    def published(self, path: str, version: int) -> None:
        """Complete weights written to disk at `path` as `version` (the engines were synced in memory)."""
        self.weights = (path, version)

    def update_weights(self, path: str, version: int) -> None:
        """Every engine reloads the weights written at `path` as `version` (rollout.weight_sync.mode=disk)."""
        import ray

        self.weights = (path, version)
        self.version = version
        workers = list(self.workers)
        refs = [w.update_weights.remote(path, version) for w in workers]
        for i, ref in enumerate(refs):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                self._replace(i, workers[i])

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)


class WorkerReceivers:
    """Rollout workers as the receivers of an in-memory weight sync (trainer/weight_stream.Receivers). The trainer's
    rank 0 calls it, so the buckets' descriptions go from the trainer to the workers without the driver; a worker
    that fails a call is left out of the rest of the transfer and listed in `failed`."""

    def __init__(self, workers: list[Any], restore: tuple[str, int], timeout_s: float):
        self.workers, self.restore, self.timeout_s = list(workers), restore, timeout_s
        self.failed: list[int] = []
        self.errors: dict[int, str] = {}  # what each failed worker's call raised

    def begin(self, version: int) -> None:
        self._wait({i: w.begin_weight_sync.remote(version, self.restore, self.timeout_s) for i, w in self._live()})

    def load(self, bucket: dict):
        refs = {i: w.load_weights_bucket.remote(bucket) for i, w in self._live()}
        return lambda: self._wait(refs)

    def finish(self, version: int) -> None:
        self._wait({i: w.finish_weight_sync.remote(version) for i, w in self._live()})

    def _live(self) -> list[tuple[int, Any]]:
        return [(i, w) for i, w in enumerate(self.workers) if i not in self.failed]

    def _wait(self, refs: dict[int, Any]) -> None:
        import ray

        for i, ref in refs.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                message = str(exc).strip().splitlines()[-1]
                log.warning("rollout worker %d failed a weight sync: %s", i, message)
                if i not in self.failed:
                    self.failed.append(i)
                    self.errors[i] = message


class LocalReceivers:
    """An in-process RolloutWorker as the receiver of a weight sync (tests, benchmarks, one-process runs); `run`
    runs a coroutine on the worker's event loop to its end."""

    def __init__(self, worker: RolloutWorker, run, restore: tuple[str, int], timeout_s: float = 300.0):
        self.worker, self.run, self.restore, self.timeout_s = worker, run, restore, timeout_s
        self.failed: list[int] = []

    def begin(self, version: int) -> None:
        self.run(self.worker.begin_weight_sync(version, self.restore, self.timeout_s))

    def load(self, bucket: dict):
        self.run(self.worker.load_weights_bucket(bucket))
        return lambda: None

    def finish(self, version: int) -> None:
        self.run(self.worker.finish_weight_sync(version))


@dataclass(slots=True)
class Share:
    """One worker's part of a submission: what it runs, how, and the call in flight."""

    index: int  # the worker's slot in the pool
    requests: list[EpisodeRequest]
    partials: list[Trajectory | ResumePoint]
    budget: int | None
    temperature: float | None
    options: dict[str, Any]  # to_store, summarize, transcripts
    worker: Any = None  # the actor handle that runs it
    ref: Any = None  # its generate call


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())


def _failed(requests: list[EpisodeRequest], partials: list[Trajectory | ResumePoint], error: str) -> list[Trajectory]:
    """The episodes as FAILED at the worker boundary; a partial one keeps its tokens where the caller holds them (a
    ResumePoint's stay in the object store: the failed record is its ids and request)."""
    out = [Trajectory(trajectory_id=r.trajectory_id, task_id=str(r.task_index), group_id=r.group_id,
                      env_id=r.env_id, status=Status.FAILED, failure=Boundary.WORKER, error=error,
                      episode=r.episode()) for r in requests]
    for p in partials:
        if isinstance(p, ResumePoint):
            p = Trajectory(trajectory_id=p.trajectory_id, group_id=p.group_id, env_id=p.env_id, episode=p.episode,
                           task_id=str(p.episode.task_index) if p.episode else "")
        p.status, p.failure, p.error = Status.FAILED, Boundary.WORKER, error
        out.append(p)
    return out
