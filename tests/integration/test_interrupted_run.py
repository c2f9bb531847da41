"""A run stopped from outside resumes with the same command and nothing lost (issue 27's data-loss report).

With the shipped config (a checkpoint every 10 RL steps, none before), a run interrupted at RL step 2 used to redo
SFT from version 0, log it twice into the same MLflow run, and then fail on every rerun: republishing v0 pruned it
at once while LATEST named it. Now SIGINT checkpoints at the step boundary (exit 130, MLflow run KILLED, the message
says how to resume), the warm start ends with a checkpoint of its own, and a kill -9 of the whole job resumes from
the last checkpoint. A checkpoint every 3 steps here (the shipped config has one every step): the kill -9 loses the
steps after the last one, which are redone, and MLflow still holds every step exactly once (a step is logged once it
is checkpointed). Then the finished run, given more steps, continues where it ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agentrl.tracking import RUN_ID_FILE, read_metric_history, resolve_tracking_uri
from agentrl.trainer.publish import latest_weights

pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["rollout.group_size=2", "rollout.groups_per_step=2", "env.eval_tasks=2", "env.kwargs.max_turns=2",
         "rollout.max_tokens_per_turn=16", "algorithm.sft_steps=3", "algorithm.sft_batch_episodes=4",
         "algorithm.sft_target_success=null", "algorithm.skip_uniform_groups=false", "algorithm.eval_every=0",
         "algorithm.steps=5", "cluster.trainer_cpus=0.5", "cluster.rollout_cpus=0.5", "trainer.num_threads=1"]


def start(run_dir: str, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", "configs/quickstart.yaml",
                             f"run_dir={run_dir}", *SHORT, "algorithm.checkpoint_every=3", *overrides], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for(proc: subprocess.Popen, line: str, timeout: float = 600) -> list[str]:
    """Reads the job's output until a line contains `line`; returns what it read."""
    seen, deadline = [], time.monotonic() + timeout
    for text in proc.stdout:
        seen.append(text)
        if line in text:
            return seen
        assert time.monotonic() < deadline, "".join(seen[-40:])
    raise AssertionError(f"the job ended before printing {line!r}:\n" + "".join(seen[-40:]))


def mlflow_status(run_dir: str) -> str:
    from mlflow import MlflowClient

    run_id = open(os.path.join(run_dir, RUN_ID_FILE)).read().strip()
    return MlflowClient(resolve_tracking_uri(None, run_dir)).get_run(run_id).info.status


def test_sigint_then_kill_9_then_resume_loses_nothing(tmp_path):
    run_dir = str(tmp_path / "run")
    first = start(run_dir)
    wait_for(first, "step 2/")
    os.kill(first.pid, signal.SIGINT)
    rest, _ = first.communicate(timeout=600)
    assert first.returncode == 128 + signal.SIGINT, rest[-3000:]
    assert "stopped by SIGINT at RL step" in rest and "run the same command to resume" in rest, rest[-3000:]
    assert mlflow_status(run_dir) == "KILLED"
    stopped_at = max(step for step, _ in read_metric_history(run_dir, "train/loss"))

    second = start(run_dir)  # resumes after the SIGINT checkpoint, without a warm start
    seen = wait_for(second, f"step {stopped_at + 1}/")
    assert not any("sft step" in line for line in seen), "".join(seen)
    os.killpg(second.pid, signal.SIGKILL)  # the whole job's process group, as a lost machine would
    second.wait(timeout=60)

    third = start(run_dir)
    out, _ = third.communicate(timeout=900)
    assert third.returncode == 0, out[-3000:]
    assert mlflow_status(run_dir) == "FINISHED"
    assert [step for step, _ in read_metric_history(run_dir, "sft/loss")] == [0, 1, 2]  # the warm start ran once
    # each step once, however often it ran; a redone step whose episodes the store already held samples none of
    # them again and still reports them
    for key in ("train/loss", "time/step_s", "rollout/reward_mean", "rollout/episodes"):
        assert [step for step, _ in read_metric_history(run_dir, key)] == [1, 2, 3, 4, 5], key
    assert all(n == 4 for _, n in read_metric_history(run_dir, "rollout/episodes"))
    version, path = latest_weights(run_dir)
    assert os.path.isdir(path) and version == 3 + 5

    # a finished run given more steps continues its curves (no warm start again, the new steps after the old)
    fourth = start(run_dir, "algorithm.steps=7")
    out, _ = fourth.communicate(timeout=900)
    assert fourth.returncode == 0, out[-3000:]
    assert [step for step, _ in read_metric_history(run_dir, "sft/loss")] == [0, 1, 2]
    assert [step for step, _ in read_metric_history(run_dir, "train/loss")] == [1, 2, 3, 4, 5, 6, 7]
    assert latest_weights(run_dir)[0] == 3 + 7
