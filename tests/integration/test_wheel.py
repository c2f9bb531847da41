"""What users install: the wheel built from this checkout holds every package and data file the commands need
(the wheel once lacked agentrl.plan, and agentrl plan failed from it). The wheel is installed into its own
directory and run from there, not from the checkout; its dependencies come from the environment."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_built_wheel_runs_plan_envs_presets_and_init_model(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), ROOT], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("agentrl-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for package in ("agentrl", "agentrl/model", "agentrl/plan", "agentrl/chat", "agentrl/envs", "agentrl/rollout",
                    "agentrl/trainer"):
        assert f"{package}/__init__.py" in names, package
    assert {"agentrl/chat/templates/kimi.jinja", "agentrl/chat/templates/qwen3.jinja"} <= set(names)
    assert "agentrl = agentrl.cli:main" in entry_points and "agentrl.rollout.vllm_plugin:register" in entry_points
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}

    def agentrl(*args: str) -> str:
        code = "import sys, agentrl; assert agentrl.__file__.startswith(sys.argv[1]); " \
               "from agentrl.cli import main; main(sys.argv[2:])"
        done = subprocess.run([sys.executable, "-c", code, str(target), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    assert "total" in agentrl("plan", "--preset", "k3")
    assert "agentrl/Calc-v0" in agentrl("envs")
    assert "kimi-linear-tiny" in agentrl("presets")
    out = agentrl("init-model", "--preset", "kimi-linear-tiny", "--out", str(tmp_path / "kimi"))
    assert os.path.exists(os.path.join(out.strip(), "tiktoken.model"))
