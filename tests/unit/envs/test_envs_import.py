"""agentrl.envs loads no torch, Ray or vLLM: not on import, and not when every built-in env is made and played."""

import subprocess
import sys

HEAVY = ("torch", "ray", "vllm", "deepspeed", "mlflow")


def loaded_after(code: str) -> list[str]:
    probe = f"""
import sys
{code}
print(",".join(m for m in {HEAVY!r} if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [m for m in result.stdout.strip().split(",") if m]


def test_importing_agentrl_envs_loads_no_heavy_framework():
    assert loaded_after("import agentrl.envs") == []


def test_making_and_playing_every_builtin_env_loads_no_heavy_framework():
    code = """
import agentrl.envs as envs
small = {"agentrl/DocSearch-v0": {"context_tokens": 2048}}
for env_id in envs.list_envs():
    env = envs.make(env_id, num_tasks=3, **small.get(env_id, {}))
    assert envs.play(env, env.oracle, seed=0).reward == 1.0
"""
    assert loaded_after(code) == []


def test_the_probe_would_notice_a_heavy_import():
    assert loaded_after("import json\nsys.modules['torch'] = json") == ["torch"]
