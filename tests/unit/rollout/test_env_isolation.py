"""Env calls bounded in wall time even when the env's code holds the GIL (issue 27): each env instance in its own
process (rollout.env_isolation=process), killed when a call overruns; the worker's event loop keeps running.

A scripted engine stands in for vLLM (the agent loop's env handling is what is tested): it calls the probe the task
names, then answers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from agentrl.chat import get_format
from agentrl.chat.tokenizers import HFTokenizer
from agentrl.rollout.agent_loop import AgentLoop, EnvPool, EpisodeRequest
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy_engine import Generation
from agentrl.tokenizer import byte_tokenizer
from agentrl.types import Boundary, Status
from tests.faulty_envs import ENV_ID, task_index
from tests.processes import alive, still_alive_after

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class ScriptedEngine:
    """Calls `probe` with what the prompt asks for; once a tool result is in the context, answers "done"."""

    seeded_sampling = True

    def __init__(self, chat):
        self.chat = chat

    async def generate(self, prompt_ids, sampling, stop_token_ids, into=None):
        task = self.chat.tokenizer.decode(prompt_ids).split("Run the probe with ")[-1]  # the system prompt is before
        if "<tool_response>" in task:
            reply = "<answer>done</answer>"
        else:
            what = re.match(r"(\w+)\.", task).group(1)
            reply = "<tool_call>" + json.dumps({"name": "probe", "arguments": {"what": what}}) + "</tool_call>"
        ids = self.chat.tokenizer.hf.encode(reply, add_special_tokens=False) + [stop_token_ids[0]]
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids), finish_reason="stop")


def loop_for(isolation: str, timeout_s: float) -> AgentLoop:
    chat = get_format("agentrl", HFTokenizer(byte_tokenizer()))
    config = RolloutConfig(env_timeout_s=timeout_s, env_isolation=isolation, max_trajectory_tokens=100_000)
    return AgentLoop(ScriptedEngine(chat), chat, config)


def request(kind: str, n: int = 0) -> EpisodeRequest:
    return EpisodeRequest(env_id=ENV_ID, task_index=task_index(kind), group_id=f"{kind}-{n}",
                          trajectory_id=f"{kind}-{n}")


async def run_with_ticker(loop: AgentLoop, kinds: list[str]):
    """Runs one episode per kind concurrently; also returns the longest gap between the event loop's 50 ms ticks."""
    gaps, done = [0.0], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.05)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    started = time.perf_counter()
    trajs = await asyncio.gather(*(loop.run(request(k, i)) for i, k in enumerate(kinds)))
    elapsed = time.perf_counter() - started
    done.set()
    await tick
    return trajs, elapsed, max(gaps)


def test_a_tool_holding_the_gil_fails_its_episode_on_time_and_the_others_go_on():
    loop = loop_for("process", timeout_s=1.0)
    try:
        trajs, elapsed, gap = asyncio.run(run_with_ticker(loop, ["hog", "ok", "sleep", "ok"]))
    finally:
        loop.envs.close()
    hog, ok, sleep, ok2 = trajs
    for t in (hog, sleep):
        assert t.status == Status.FAILED and t.failure == Boundary.TOOL, (t.status, t.error)
        assert "did not answer within 1.0s" in t.error
    assert ok.status == ok2.status == Status.COMPLETED and ok.reward == 1.0
    assert elapsed < 1.0 + 8.0  # the hour-long calls were cut at the timeout (the rest: starting the env processes)
    assert gap < 0.8, gap  # the worker's event loop never stalled


def test_in_threads_the_same_kind_of_call_freezes_the_worker():
    """Why envs get processes: a brief GIL-holding call in a thread stops the event loop for all of it."""
    loop = loop_for("thread", timeout_s=0.2)
    trajs, elapsed, gap = asyncio.run(run_with_ticker(loop, ["hog_briefly"]))
    assert gap > 0.6, gap  # no tick for the whole computation: the 0.2 s timeout could not fire during it
    # once the loop runs again, the overdue timeout and the call's result race: either may end the episode
    assert trajs[0].status in (Status.FAILED, Status.COMPLETED) and elapsed > 0.6, (trajs[0].status, elapsed)


def test_env_errors_a_dead_env_process_and_10_mb_results_are_reported_not_raised():
    loop = loop_for("process", timeout_s=5.0)
    try:
        raised, died, flood = asyncio.run(run_with_ticker(loop, ["raise", "die", "flood"]))[0]
        again = asyncio.run(loop.run(request("ok")))  # a fresh process replaces the dead one
    finally:
        loop.envs.close()
    assert raised.status == Status.FAILED and raised.failure == Boundary.TOOL and "the probe broke" in raised.error
    assert died.status == Status.FAILED and died.failure == Boundary.ENV and "died during step()" in died.error
    assert flood.status == Status.COMPLETED  # the env cut the result to max_tool_output_chars
    assert again.status == Status.COMPLETED


def test_an_env_registered_at_run_time_is_built_in_its_process():
    import gymnasium

    from envs.calc import CalcEnv

    gymnasium.register(id="tests/RuntimeCalc-v0", entry_point=CalcEnv)  # a class, not a 'module:Class' string
    pool = EnvPool(isolation="process")

    async def build():
        env = await pool.acquire("tests/RuntimeCalc-v0", {"num_tasks": 5})
        prompt, info = await env.call("reset", seed=0, options={"task_index": 3})
        return env.pid, prompt, info

    try:
        pid, prompt, info = asyncio.run(build())
    finally:
        pool.close()
    assert pid != os.getpid() and prompt and info["task_id"]


CHILD = textwrap.dedent("""
    import asyncio, os, sys
    from agentrl.rollout.agent_loop import EnvPool

    async def main():
        pool = EnvPool(isolation="process")
        envs = [await pool.acquire("agentrl/Calc-v0", {"num_tasks": 5}) for _ in range(2)]
        print(pool._host._proc.pid, *(e.pid for e in envs), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_env_processes_end_when_their_worker_is_killed():
    worker = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in worker.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(p) for p in pids)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    assert still_alive_after(pids, 10) == []


def test_an_observation_longer_than_the_trajectory_budget_truncates_the_episode_within_it():
    """A tool's 10 MB answer is cut by the env to max_tool_output_chars (20k characters), which is still more than a
    short trajectory budget: the episode ends TRUNCATED without it, never longer than the budget (a 20k-token
    trajectory once reached the trainer and took 11 GB there)."""
    chat = get_format("agentrl", HFTokenizer(byte_tokenizer()))
    loop = AgentLoop(ScriptedEngine(chat), chat, RolloutConfig(env_isolation="thread", max_trajectory_tokens=2000))
    try:
        flood = asyncio.run(loop.run(request("flood")))
    finally:
        loop.envs.close()
    assert flood.status == Status.TRUNCATED and "do not fit in the trajectory token budget of 2000" in flood.error
    assert 0 < len(flood.tokens) <= 2000 and flood.num_sampled > 0
