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


def test_a_local_job_beside_a_ray_start_cluster_starts_its_own_instance_and_each_stops_alone(ray_cluster, ray_session):
    """A job without an address starts its own local Ray instance even where `ray start` left its address for
    ray.init() to find (its default would join that cluster); and the session's own Ray instance (another cluster on
    this machine) survives the stop of this test's one."""
    _, env = ray_cluster
    temp_dir = env["RAY_TEST_TEMP_DIR"]
    with open(os.path.join(temp_dir, "ray_current_cluster")) as f:
        started = f.read().strip()
    # the state `ray start` leaves with the default temp dir: <RAY_TMPDIR>/ray/ray_current_cluster names the cluster
    default_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: the job's instance puts its sockets there
    os.makedirs(os.path.join(default_tmp, "ray"))
    with open(os.path.join(default_tmp, "ray", "ray_current_cluster"), "w") as f:
        f.write(started)
    job_env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": default_tmp}
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import ray; from agentrl.config import load_config; from agentrl.driver import "
             "connect; connect(load_config('configs/quickstart.yaml')[0]); "
             "print('gcs', ray.get_runtime_context().gcs_address); ray.shutdown()"],
            cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(default_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    joined = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("gcs ")]
    assert joined and joined[0] != started, (started, done.stdout, done.stderr[-2000:])

    def running_ray() -> set[int]:  # a stopped process may linger as a zombie where nothing reaps it
        return {p.pid for p in psutil.process_iter(["name", "status"])
                if p.info["name"] in ("raylet", "gcs_server") and p.info["status"] != psutil.STATUS_ZOMBIE}

    before = running_ray()
    ours = {p.pid for p in cluster_processes(temp_dir)}
    assert ours & before and before - ours  # two clusters run; ours is a part
    stop_cluster(temp_dir)
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
