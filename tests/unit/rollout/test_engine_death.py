"""A call to the engine core that is in flight when the core dies ends with EngineDied instead of waiting for ever.

vLLM resolves a utility call (pause, resume, a weight update, an RPC) only when the core replies; its monitor thread
marks the engine `errored` once the core's process has ended. The stand-in below behaves so: its calls never return,
and it turns errored a moment after the call starts. The real engine's case is in
tests/integration/test_rollout_workers.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentrl.rollout.policy_engine import DEATH_POLL_S, EngineDied, PolicyEngine


class CoreThatDies:
    """An AsyncLLM whose engine core dies `after_s` into the first call; no call is ever answered."""

    def __init__(self, after_s: float):
        self.after_s, self.died_at = after_s, None
        self.pending: list[asyncio.Future] = []

    @property
    def errored(self) -> bool:
        return self.died_at is not None and time.monotonic() >= self.died_at

    def _never_answered(self, *args, **kwargs):
        if self.died_at is None:
            self.died_at = time.monotonic() + self.after_s
        future = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        return future

    pause_generation = resume_generation = start_weight_update = update_weights = _never_answered
    finish_weight_update = collective_rpc = reset_prefix_cache = check_health = _never_answered


@pytest.mark.parametrize("call", ["begin_sync", "load_bucket", "commit_sync", "update_weights", "check_health"])
def test_a_call_in_flight_when_the_core_dies_raises_promptly(call):
    engine = PolicyEngine(CoreThatDies(after_s=0.3))
    engine.receives_in_memory = True  # begin_sync's check; the stand-in takes any call
    args = {"begin_sync": (), "load_bucket": ({"names": []},), "commit_sync": (3,), "update_weights": ("/w", 3),
            "check_health": ()}[call]

    async def run():
        with pytest.raises(EngineDied, match="died"):
            await asyncio.wait_for(getattr(engine, call)(*args), timeout=30)
        return time.monotonic() - (engine.llm.died_at - 0.3)  # from the call to the core (not vLLM's imports)

    elapsed = asyncio.run(run())
    assert 0.3 <= elapsed < 0.3 + 2 * DEATH_POLL_S + 1.0, elapsed
    assert engine.version == 0  # nothing was committed
    assert all(f.cancelled() for f in engine.llm.pending)  # the abandoned call is not left to run on


def test_a_call_the_core_answers_returns_its_result():
    class Answers:
        errored = False

        async def check_health(self):
            await asyncio.sleep(DEATH_POLL_S * 2.5)  # across several polls
            return "ok"

    assert asyncio.run(PolicyEngine(Answers())._control(Answers().check_health())) == "ok"


def test_a_cancelled_caller_cancels_the_call_it_waits_on():
    llm = CoreThatDies(after_s=60.0)

    async def run():
        waiting = asyncio.ensure_future(PolicyEngine(llm).check_health())
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)

    asyncio.run(run())
    assert len(llm.pending) == 1 and llm.pending[0].cancelled()
