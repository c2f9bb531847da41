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
