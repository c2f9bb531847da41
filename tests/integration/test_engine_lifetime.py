"""An engine that is shut down and dropped is freed, its engine-core process, zmq sockets and memory with it, however
the caller runs its event loop.

Two defects hid each other here. The first engine a process built lived until exit: vLLM keeps the exception of a
failed optional import (`vllm.multimodal.media.audio`, torchcodec) whose traceback's frames reach back to the frame
that built the engine (rollout/engine.py, `release_import_frames`); at exit its `__del__` ran against a half-torn-down
interpreter ("Exception ignored in: <function AsyncLLM.__del__ ...>"). And an engine shut down from outside its
stopped loop never closed its sockets (vLLM schedules that in the loop), so once engines were freed, the zmq
context's `term()` blocked the process that collected it (rollout/policy_engine.py, `PolicyEngine.shutdown`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

BUILD_AND_DROP = textwrap.dedent("""
    import asyncio, gc, sys, weakref
    from agentrl.rollout.policy_engine import EngineSpec, PolicyEngine, SamplingSpec

    async def build_and_generate():  # a request starts the engine's output handler, a task in this loop
        engine = await PolicyEngine.create(EngineSpec(model=sys.argv[1], max_model_len=512,
                                                      kv_cache_memory_bytes=64 << 20))
        await engine.generate([1, 2, 3], SamplingSpec(max_tokens=4), stop_token_ids=[])
        return engine

    async def build_and_shut_down():
        engine = await build_and_generate()
        engine.shutdown()
        return weakref.ref(engine.llm)

    def in_a_loop_the_caller_drives():  # the engine is shut down from outside its loop, then the loop is closed
        loop = asyncio.new_event_loop()
        engine = loop.run_until_complete(build_and_generate())
        engine.shutdown()
        loop.close()
        return weakref.ref(engine.llm)

    if __name__ == "__main__":  # vLLM spawns its engine core, which imports this module again
        llm = asyncio.run(build_and_shut_down()) if sys.argv[2] == "asyncio.run" else in_a_loop_the_caller_drives()
        gc.collect()
        holders = [type(r).__name__ for r in gc.get_referrers(llm())] if llm() is not None else []
        print("engine freed" if llm() is None else f"engine alive, held by {holders}", flush=True)
""")


@pytest.mark.parametrize("loop", ["asyncio.run", "driven by the caller"])
def test_a_shut_down_engine_is_freed(tmp_path, loop):
    from agentrl.init_model import init_model

    checkpoint = init_model(str(tmp_path / "ckpt"), preset="tiny", vocab_size=512, env_ids=("agentrl/Calc-v0",))
    script = tmp_path / "build_and_drop.py"
    script.write_text(BUILD_AND_DROP)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    try:
        done = subprocess.run([sys.executable, str(script), checkpoint, loop], capture_output=True, text=True,
                              env=env, timeout=240)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the process did not end (a zmq context blocked in term()?): {e.stdout!r}") from None
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine freed" in done.stdout, done.stdout[-2000:]
    logged = done.stdout + done.stderr  # vLLM logs to stdout
    for sign in ("Exception ignored", "output_handler failed", "Task was destroyed but it is pending"):
        assert sign not in logged, logged[-3000:]
