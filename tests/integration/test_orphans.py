"""Every process a rollout worker started ends with it, however it ends (issue 27): vLLM's engine core used to run
on, reparented to init with ~1.7 GB, after its worker was killed; agentrl's vLLM plugin now makes each process vLLM
starts exit when the one that started it is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.processes import children, still_alive_after

pytest.importorskip("vllm")

WORKER = textwrap.dedent("""
    import asyncio, sys
    from agentrl.rollout.policy_engine import EngineSpec, PolicyEngine

    async def main():
        engine = await PolicyEngine.create(EngineSpec(model=sys.argv[1], max_model_len=512,
                                                      kv_cache_memory_bytes=64 << 20))  # held while killed
        print("ready", flush=True)
        await asyncio.sleep(3600)

    if __name__ == "__main__":  # vLLM spawns its engine core, which imports this module again
        asyncio.run(main())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_engine_core_ends_when_its_worker_is_killed(tmp_path):
    from agentrl.init_model import init_model

    checkpoint = init_model(str(tmp_path / "ckpt"), preset="tiny", vocab_size=512, env_ids=("agentrl/Calc-v0",))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    worker = subprocess.Popen([sys.executable, str(script), checkpoint], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in worker.stdout:  # vLLM logs to stdout too
            if line.strip() == "ready":
                break
        else:
            raise AssertionError(f"the worker ended (exit {worker.wait()}) before its engine was ready")
        started = children(worker.pid)
        assert any("EngineCore" in open(f"/proc/{p}/cmdline").read() for p in started), started
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    left = still_alive_after(started, 15)
    for pid in left:  # do not leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after their worker was killed: {left}"
