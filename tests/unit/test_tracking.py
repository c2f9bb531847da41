"""Tracking in the embedded MLflow store: a run directory's curves read back, a resumed run continuing them."""

import pytest

from agentrl.tracking import Tracker, TrackingConfig, read_metric_history, start_and_end


def test_curves_read_back_from_the_run_directory_in_step_order(tmp_path):
    tracker = Tracker(TrackingConfig(experiment="t"), str(tmp_path))
    for step in (2, 1, 3):
        tracker.log_metrics({"rollout/success_rate": step / 10, "nan_is_dropped": float("nan")}, step=step)
    tracker.finish()
    assert read_metric_history(str(tmp_path), "rollout/success_rate") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert read_metric_history(str(tmp_path), "nan_is_dropped") == []
    resumed = Tracker(TrackingConfig(experiment="t"), str(tmp_path))  # a resumed job reopens its run
    resumed.log_metrics({"rollout/success_rate": 0.4}, step=4)
    assert [s for s, _ in read_metric_history(str(tmp_path), "rollout/success_rate")] == [1, 2, 3, 4]


def test_a_directory_without_a_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="run_dir of an agentrl job"):
        read_metric_history(str(tmp_path), "rollout/success_rate")


def test_start_and_end_are_window_means():
    history = [(1, 0.1), (2, 0.3), (3, 0.5), (4, 0.6), (5, 0.8)]
    assert start_and_end(history, 2) == pytest.approx((0.2, 0.7))
    with pytest.raises(ValueError, match="no two disjoint windows"):
        start_and_end(history, 3)


def test_the_run_is_named_after_its_directory_and_keeps_its_artifacts_there(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from agentrl.tracking import EXPERIMENT_KIND_TAG

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # MLflow's own default would put artifacts under ./mlruns here
    run_dir = tmp_path / "runs" / "my-first-run"
    tracker = Tracker(TrackingConfig(experiment="t"), str(run_dir))
    tracker.log_config({"a": 1}, "a: 1\n")
    run = MlflowClient(tracker.uri).get_run(tracker.run_id)
    assert run.info.run_name == "my-first-run"
    assert (run_dir / "artifacts" / tracker.run_id / "artifacts" / "config.yaml").exists()
    assert not (tmp_path / "mlruns").exists()
    experiment = MlflowClient(tracker.uri).get_experiment(tracker.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == "custom_model_development"  # the UI opens on runs, not traces
    assert tracker.run_page() == (f"mlflow ui --backend-store-uri {tracker.uri}, then http://127.0.0.1:5000/#/"
                                  f"experiments/{tracker.experiment_id}/runs/{tracker.run_id}")
    named = Tracker(TrackingConfig(experiment="t", run_name="ablation-3"), str(tmp_path / "other"))
    assert MlflowClient(named.uri).get_run(named.run_id).info.run_name == "ablation-3"


def test_transcripts_are_logged_at_the_first_the_last_and_every_nth_step(tmp_path):
    from agentrl.types import Trajectory

    tracker = Tracker(TrackingConfig(experiment="t", transcripts_every=5), str(tmp_path))
    episode = Trajectory(trajectory_id="x", task_id="0", group_id="g", env_id="toy")
    batch = [episode.summary(transcript=True)]
    for step in range(1, 8):
        tracker.log_transcripts(batch, step, last=step == 7)
    tracker.log_transcripts([episode.summary()], 10)  # a step that logs, but no summary carries a transcript
    logged = sorted(f.path for f in tracker.client.list_artifacts(tracker.run_id, "transcripts"))
    assert logged == [f"transcripts/step_{s:06d}.{ext}" for s in (1, 5, 7) for ext in ("html", "json")]
    never = Tracker(TrackingConfig(experiment="t", transcripts_every=0), str(tmp_path / "never"))
    never.log_transcripts(batch, 1, last=True)
    assert never.client.list_artifacts(never.run_id) == []


def test_pending_metrics_reach_mlflow_at_the_checkpoint_and_a_resume_logs_only_what_is_missing(tmp_path):
    """A step's metrics wait for its checkpoint; the checkpoint carries them, so a run killed between the checkpoint
    and the log logs them when it resumes, and a step already logged is not logged again."""
    from agentrl.driver import PendingMetrics

    tracker = Tracker(TrackingConfig(experiment="t"), str(tmp_path))
    pending = PendingMetrics(tracker)
    pending.add(1, {"time/step_s": 1.0, "train/loss": 0.5})
    pending.add(2, {"time/step_s": 2.0, "train/loss": 0.4})
    assert read_metric_history(str(tmp_path), "time/step_s") == []  # not checkpointed yet
    carried = pending.state()["pending_metrics"]
    pending.flush(log_s=0.1)
    assert read_metric_history(str(tmp_path), "time/step_s") == [(1, 1.0), (2, 2.0)]
    assert read_metric_history(str(tmp_path), "time/log_s") == [(2, 0.1)]
    # a resume from that checkpoint: steps 1 and 2 are in MLflow already; a third carried step is not
    assert tracker.log_missing([*carried, (3, {"time/step_s": 3.0})]) == 1
    assert read_metric_history(str(tmp_path), "time/step_s") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert tracker.log_missing(carried) == 0
