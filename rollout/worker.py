"""RolloutWorker: one vLLM engine running many environment episodes concurrently.

`RolloutWorker` is a plain class (tests and single-process runs use it directly); `RolloutWorkerActor` is the thin
Ray shell the driver places on the cluster. It is an async actor, so `update_weights` runs while `generate` is in
flight: generation pauses, the weights change, and the episodes continue under the new version.

`RolloutPool` is the caller's side: it spreads episode requests over the workers, detects a dead worker, replaces
it and reruns the requests it held. A worker whose vLLM engine core died ends its own process (vLLM cannot rebuild a
dead engine in place), so that the pool replaces it the same way and its episodes are rerun, not failed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib
from dataclasses import replace
from typing import Any

from agentrl.rollout.agent_loop import AgentLoop, EnvPool, EpisodeRequest, TokenBudget
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy_engine import EngineSpec, PolicyEngine
from agentrl.rollout.snapshots import SnapshotReporter
from agentrl.types import Boundary, Status, Trajectory

log = logging.getLogger(__name__)


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
        # the store actor the running RL episodes report to, for lossless resume (None: nothing is reported)
        self.reporter = (SnapshotReporter(store, interval_s=config.snapshot_interval_s, snapshots=config.snapshots)
                         if store is not None else None)

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

    async def generate(self, requests: list[EpisodeRequest], resumes: list[Trajectory] | None = None,
                       token_budget: int | None = None, temperature: float | None = None,
                       report: bool = False) -> list[Trajectory]:
        """Runs the requested episodes and continues the partial ones, all concurrently; returns every trajectory
        (completed, truncated, failed — or partial when `token_budget` sampled tokens were spent first).
        `temperature` overrides the sampling temperature for these episodes (0: greedy, for evaluation); `report`
        sends their progress and snapshots to the store while they run (RL episodes, which the store receives)."""
        await self._ready()
        budget = TokenBudget(token_budget)
        semaphore = asyncio.Semaphore(self.config.max_concurrent_episodes)
        loop = self.loop
        if temperature is not None:
            loop = AgentLoop(self.engine, self.chat, self.config, self.envs, sampling=self.config.sampling(temperature),
                             max_trajectory_tokens=self.max_trajectory_tokens)

        reporter = self.reporter if report else None

        async def one(request: EpisodeRequest, resume: Trajectory | None) -> Trajectory:
            async with semaphore:
                return await loop.run(request, budget, resume, reporter)

        jobs = [one(r, None) for r in requests] + [one(request_of(p), p) for p in resumes or []]
        t0 = time.perf_counter()
        trajectories = await asyncio.gather(*jobs)
        self._end_if_engine_died()  # its episodes failed at the model boundary for want of an engine
        log.info("worker ran %d episodes in %.1fs", len(trajectories), time.perf_counter() - t0)
        return list(trajectories)

    async def update_weights(self, path: str, version: int) -> int:
        engine = await self._ready()
        try:
            await engine.update_weights(path, version)
        except Exception:
            self._end_if_engine_died()
            raise
        return engine.version

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


def request_of(partial: Trajectory) -> EpisodeRequest:
    """The request a paused or snapshotted episode continues (the agent loop records it when the episode starts)."""
    missing = [k for k in ("task_index", "seed", "env_kwargs") if k not in partial.metadata]
    if missing:
        raise ValueError(f"trajectory {partial.trajectory_id} cannot be resumed: its metadata lacks {missing} (it "
                         "was not started by agentrl's agent loop)")
    meta = partial.metadata
    return EpisodeRequest(env_id=partial.env_id, task_index=meta["task_index"], group_id=partial.group_id,
                          trajectory_id=partial.trajectory_id, seed=meta["seed"], env_kwargs=meta["env_kwargs"],
                          replaces=meta.get("replaces"))


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
        self.weights: tuple[str, int] | None = None
        self.max_trajectory_tokens: int | None = None  # the context schedule's limit, once set
        self.restarts = 0

    def _start(self):
        return self.actor_cls.remote(*self.args, **self.kwargs)

    def _replace(self, index: int, dead: Any) -> None:
        """Replaces worker `index`, whose handle `dead` failed — unless another call already replaced it (async
        steps notice one death twice: in a weight update and in the rollout submitted before it)."""
        import ray

        if self.workers[index] is not dead:
            return
        self.restarts += 1
        log.warning("rollout worker %d died; starting a replacement", index)
        spec, *rest = self.args
        kwargs = dict(self.kwargs)
        if self.weights is not None:  # built on the weights now served: the ones it started with may be pruned
            spec = replace(spec, model=self.weights[0])
            kwargs["version"] = self.weights[1]
        self.workers[index] = self.actor_cls.remote(spec, *rest, **kwargs)
        if self.max_trajectory_tokens is not None:
            ray.get(self.workers[index].set_max_trajectory_tokens.remote(self.max_trajectory_tokens))

    def submit(self, requests: list[EpisodeRequest], resumes: list[Trajectory] | None = None,
               token_budget: int | None = None, temperature: float | None = None,
               report: bool = False) -> list[tuple[int, tuple, Any, Any]]:
        """Starts the episodes on the workers without waiting; `collect` returns them. With `report` (RL episodes,
        whose results go to the store) they report to the store while they run, and a rerun resumes them."""
        shares: list[tuple[list, list]] = [([], []) for _ in self.workers]
        for request in requests:  # a group's members go to one worker: they share the prompt prefix
            shares[_stable_hash(request.group_id) % len(shares)][0].append(request)
        for i, partial in enumerate(resumes or []):
            shares[i % len(shares)][1].append(partial)
        budget = None if token_budget is None else max(1, token_budget // len(self.workers))
        report = report and self.store is not None
        return [(i, (reqs, parts, budget, temperature, report), self.workers[i],
                 self.workers[i].generate.remote(reqs, parts, budget, temperature, report))
                for i, (reqs, parts) in enumerate(shares) if reqs or parts]

    def collect(self, submitted: list[tuple[int, tuple, Any, Any]]) -> list[Trajectory]:
        """Waits for submitted episodes; a dead worker is replaced and its share rerun once."""
        import ray

        out: list[Trajectory] = []
        for i, args, worker, ref in submitted:
            try:
                out.extend(ray.get(ref))
            except ray.exceptions.RayActorError:
                self._replace(i, worker)
                args = self._resumable(args)
                worker = self.workers[i]
                try:
                    out.extend(ray.get(worker.generate.remote(*args)))
                except ray.exceptions.RayActorError as exc:
                    self._replace(i, worker)
                    out.extend(_failed(args[0], args[1], f"rollout worker died twice: {exc}"))
        return out

    def _resumable(self, args: tuple) -> tuple:
        """A dead worker's share, to rerun: the episodes it had snapshotted continue from their snapshots."""
        import ray

        requests, partials, budget, temperature, report = args
        if not report:
            return args
        ids = [r.trajectory_id for r in requests] + [p.trajectory_id for p in partials]
        snapshots = {t.trajectory_id: t for t in ray.get(self.store.take_snapshots.remote(ids))}
        resumes = [snapshots.pop(p.trajectory_id, p) for p in partials]
        fresh = [r for r in requests if r.trajectory_id not in snapshots]
        resumes += [snapshots[r.trajectory_id] for r in requests if r.trajectory_id in snapshots]
        if len(fresh) < len(requests):
            log.info("rerunning a dead worker's share: %d episode(s) resume from their snapshots",
                     len(requests) - len(fresh))
        return fresh, resumes, budget, temperature, report

    def generate(self, requests: list[EpisodeRequest], resumes: list[Trajectory] | None = None,
                 token_budget: int | None = None, temperature: float | None = None,
                 report: bool = False) -> list[Trajectory]:
        return self.collect(self.submit(requests, resumes, token_budget, temperature, report))

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

    def update_weights(self, path: str, version: int) -> None:
        import ray

        self.weights = (path, version)
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


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())


def _failed(requests: list[EpisodeRequest], partials: list[Trajectory], error: str) -> list[Trajectory]:
    out = [Trajectory(trajectory_id=r.trajectory_id, task_id=str(r.task_index), group_id=r.group_id,
                      env_id=r.env_id, status=Status.FAILED, failure=Boundary.WORKER, error=error,
                      metadata={"replaces": r.replaces} if r.replaces else {}) for r in requests]
    for p in partials:
        p.status, p.failure, p.error = Status.FAILED, Boundary.WORKER, error
        out.append(p)
    return out
