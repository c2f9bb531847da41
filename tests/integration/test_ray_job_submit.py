"""`scripts/submit.sh` against a real local Ray cluster: `ray start --head`, `ray job submit`, the job succeeds.

The cluster is a separate one from the session fixture's (its own ports and temp dir), started with the token auth
that Ray 2.60 turns on for new clusters; the submission authenticates with RAY_AUTH_MODE=token. The job ships the
checkout as its working_dir, so this also checks that the uploaded tree (not installed) imports as agentrl.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from agentrl.net import free_port

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture()
def ray_cluster():
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    dashboard = free_port()
    # as with an activated virtualenv: the job's `python` (resolved on the cluster) is this interpreter
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_TEST_TEMP_DIR": temp_dir,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    # every port its own: the job agent's http port defaults to 52365, and a Ray instance still alive on this machine
    # (another test's, a user's job) holding it leaves the head without an agent ("No available agent to submit job")
    subprocess.run([ray_bin, "start", "--head", "--num-cpus", "2", "--disable-usage-stats", "--port",
                    str(free_port()), "--dashboard-port", str(dashboard), "--dashboard-agent-listen-port",
                    str(free_port()), "--dashboard-agent-grpc-port", str(free_port()), "--temp-dir", temp_dir],
                   check=True, env=env, capture_output=True, timeout=180)
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def cluster_processes(temp_dir: str) -> list:
    """The processes of the cluster started with `--temp-dir temp_dir`: each names that directory (or its session
    directory under it) on its command line. `ray stop` would stop every Ray cluster on the machine, a user's too."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            mine = any(temp_dir in arg for arg in proc.info["cmdline"] or [])
            if mine and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def stop_cluster(temp_dir: str, grace_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL what is still up after `grace_s`, and return only once every process is gone."""
    procs = cluster_processes(temp_dir)
    for signal_them in ("terminate", "kill"):
        for proc in procs:
            try:
                getattr(proc, signal_them)()
            except psutil.NoSuchProcess:
                pass
        procs = wait_gone(procs, grace_s)
    assert not procs, f"Ray processes survived SIGKILL for {grace_s} s: {[p.pid for p in procs]}"


def wait_gone(procs: list, timeout_s: float) -> list:
    """The processes still running after up to `timeout_s`. A zombie counts as gone: the cluster's processes are
    not our children (`ray start` detaches them), so where nothing reaps them they stay zombies, and SIGKILL is
    delivered asynchronously, so a killed process reads as running for a moment (CI once saw a raylet, killed
    after its 15 s of SIGTERM grace, still running on the next line)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        procs = alive
        time.sleep(0.1)


def test_stopping_the_test_cluster_leaves_other_ray_processes_alone(ray_cluster, ray_session):
    """The session's own Ray instance (another cluster on this machine) survives the stop of this test's one."""
    _, env = ray_cluster

    def running_ray() -> set[int]:  # a stopped process may linger as a zombie where nothing reaps it
        return {p.pid for p in psutil.process_iter(["name", "status"])
                if p.info["name"] in ("raylet", "gcs_server") and p.info["status"] != psutil.STATUS_ZOMBIE}

    before = running_ray()
    ours = {p.pid for p in cluster_processes(env["RAY_TEST_TEMP_DIR"])}
    assert ours & before and before - ours  # two clusters run; ours is a part
    stop_cluster(env["RAY_TEST_TEMP_DIR"])
    after = running_ray()
    assert before - ours <= after and not ours & after
    assert ray_session.is_initialized() and ray_session.cluster_resources()


def test_a_short_job_submitted_with_ray_job_submit_succeeds(tmp_path, ray_cluster):
    address, env = ray_cluster
    run_dir = tmp_path / "job"
    overrides = [f"run_dir={run_dir}", "algorithm.steps=1", "algorithm.sft_steps=1", "algorithm.sft_batch_episodes=2",
                 "algorithm.skip_uniform_groups=false",
                 "rollout.group_size=2", "rollout.groups_per_step=1", "env.eval_tasks=1", "algorithm.eval_every=0",
                 "rollout.max_tokens_per_turn=16"]
    env = {**env, "RAY_ADDRESS": address, "RAY": os.path.join(os.path.dirname(sys.executable), "ray")}
    for _ in range(12):  # a fresh head's job agent can take a few seconds to register; the job is not created then
        done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "submit.sh"), "configs/quickstart.yaml",
                               *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        log = done.stdout + done.stderr
        if done.returncode == 0 or "No available agent to submit job" not in log:
            break
        time.sleep(5)
    assert done.returncode == 0, log[-4000:]
    assert "succeeded" in log, log[-4000:]
    # the job really trained and tracked: one RL step's checkpoint and its metrics in the run's MLflow store
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")] == [1]
    assert os.path.isdir(run_dir / "checkpoints")
