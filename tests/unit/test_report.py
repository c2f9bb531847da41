"""`agentrl report RUN_DIR`: the curves that matter as one self-contained HTML page, or a table."""

import re
import subprocess
import sys
import xml.dom.minidom

import pytest

from agentrl.report import RunCurves, summary_rows, summary_text, svg_chart, table_report, write_report
from agentrl.tracking import Tracker, TrackingConfig


@pytest.fixture()
def run_dir(tmp_path):
    tracker = Tracker(TrackingConfig(experiment="t"), str(tmp_path / "run"))
    for step in range(3):
        tracker.log_metrics({"sft/loss": 3.0 - step}, step=step)
    tracker.log_metrics({"eval/success_rate": 0.1, "time/eval_s": 30.0, "phase/setup_s": 50.0}, step=0)
    tracker.log_metrics({"time/sft_s": 200.0, "sft/steps_run": 3}, step=2)
    for step in range(1, 11):
        tracker.log_metrics({"rollout/success_rate": step / 20, "rollout/reward_mean": step / 10,
                             "rollout/reward/correct": step / 10, "rollout/reward/format": -0.01 * step,
                             "rollout/tool_error_rate": 0.1, "time/rollout_s": 4.0, "time/train_s": 2.0,
                             "train/groups_trained": 6, "train/uniform_groups": 2}, step=step)
    tracker.log_metrics({"eval/success_rate": 0.4}, step=10)
    tracker.finish()
    return str(tmp_path / "run")


def test_the_page_holds_the_panels_with_data_and_a_summary(run_dir):
    path = write_report(run_dir)
    assert path == f"{run_dir}/report.html"
    page = open(path).read()
    titles = re.findall(r"<h2>([^<]+)</h2>", page)
    assert titles == ["Success rate", "Reward", "Failures and tool errors", "What trained",
                      "Step time by phase (s)", "SFT warm start"]  # panels without data are left out
    assert "rollout/reward/correct (last 1)" in page and "rollout/reward/format (last -0.1)" in page
    assert "0.150 → 0.400 (+25.0 points)" in page  # first and last five steps of the training success rate
    assert "held-out success (greedy), before → after RL</td><td><b>0.100 (step 0) → 0.400 (step 10)" in page
    for svg in re.findall(r"<svg.*?</svg>", page, re.S):
        xml.dom.minidom.parseString(svg)  # well-formed


def test_the_chart_maps_steps_and_values_onto_the_plot_area():
    svg = svg_chart({"a": [(0, 0.0), (10, 1.0)], "b": [(5, 0.5)]}, width=148, height=132)
    # plot area: x 48..138, y 8..108 (left 48, right 10, top 8, bottom 24)
    assert "points='48.0,108.0 138.0,8.0'" in svg
    assert "<circle cx='93.0' cy='58.0'" in svg
    assert svg_chart({}) == ""


def test_the_table_and_the_command(run_dir):
    text = table_report(RunCurves(run_dir), keys=("eval/success_rate", "rollout/success_rate"), every=5, window=5)
    assert text.splitlines()[0] == "SFT: 3 steps, loss 3.000 -> 1.000"
    assert "| 5 |  | 0.150 |" in text and "| 10 | 0.400 | 0.400 |" in text
    assert text.endswith("+25.0 points")
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "report", run_dir, "--out", f"{run_dir}/r.html"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"{run_dir}/r.html"
    missing = subprocess.run([sys.executable, "-m", "agentrl.cli", "report", f"{run_dir}/nope"], capture_output=True,
                             text=True)
    assert missing.returncode == 1 and "is it the run_dir of an agentrl job?" in missing.stderr


def test_the_summary_a_finished_run_prints(run_dir, tmp_path):
    import os

    from agentrl.trainer.publish import LATEST_FILE, WEIGHTS_DIR

    os.makedirs(f"{run_dir}/{WEIGHTS_DIR}/v13")
    open(f"{run_dir}/{WEIGHTS_DIR}/{LATEST_FILE}", "w").write("v13")
    text = summary_text(RunCurves(run_dir), prog=".venv/bin/agentrl",
                        eval_command="agentrl eval c.yaml --checkpoint " + run_dir)
    lines = [line.strip() for line in text.splitlines()]
    row = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in lines if "  " in line}
    assert row["status"] == "FINISHED" and row["RL steps"] == "10"
    assert row["training success, first → last 5 steps"] == "0.150 → 0.400 (+25.0 points)"
    assert row["reward, first → last 5 steps"] == "0.300 → 0.800 (+0.500)"
    assert row["held-out success (greedy), before → after RL"] == "0.100 (step 0) → 0.400 (step 10)"
    # sums over the steps: set-up 50 s, SFT 200 s, rollout 10 × 4 s, training 10 × 2 s, evaluation 30 s
    assert row["wall time by phase"] == ("set-up 50 s, SFT warm start 3.3 min, RL rollout 40 s, RL training 20 s, "
                                         "held-out evaluation 30 s")
    assert row["newest weights"] == f"{run_dir}/{WEIGHTS_DIR}/v13 (version 13)"
    assert "mlflow ui --backend-store-uri sqlite:///" in row["MLflow"]
    assert f"the curves on one page:  .venv/bin/agentrl report {run_dir}" in lines
    assert f"evaluate the weights:    agentrl eval c.yaml --checkpoint {run_dir}" in lines


def _run_that_trains_until(tmp_path, last_trained: int, steps: int = 10) -> str:
    tracker = Tracker(TrackingConfig(experiment="t"), str(tmp_path / f"run{last_trained}"))
    for step in range(1, steps + 1):
        trained = step <= last_trained
        tracker.log_metrics({"rollout/success_rate": 0.5 if trained else 0.0,
                             "train/groups_trained": 9 if trained else 0,
                             "train/uniform_groups": 7 if trained else 16}, step=step)
    tracker.finish()
    return str(tmp_path / f"run{last_trained}")


def test_the_summary_says_when_a_run_stopped_training(run_dir, tmp_path):
    """A policy that collapsed (every group's rewards equal, so nothing trains) is named in the summary, with the
    step it stopped at; a run whose last one or two steps happened to train nothing, or that trained throughout,
    is not."""
    def rows(path):  # summary_text prints these rows (test_the_summary_a_finished_run_prints)
        return dict(summary_rows(RunCurves(path)))

    assert rows(_run_that_trains_until(tmp_path, 6))["stalled"] == (
        "nothing trained in the last 4 RL steps (from step 7): every group's rewards were equal (training success "
        "0.000 at the last step), so the policy is still the one step 6 trained")
    assert rows(_run_that_trains_until(tmp_path, 0))["stalled"].endswith("so the policy is still the warm start's")
    assert "stalled" not in rows(_run_that_trains_until(tmp_path, 8))  # two idle steps: not yet
    assert "stalled" not in rows(run_dir)


def test_the_summary_says_where_the_run_rolled_back(tmp_path):
    """A run the driver rolled back (agentrl/stall.py) names each rollback: the step, and whose policy it restored."""
    tracker = Tracker(TrackingConfig(experiment="t"), str(tmp_path / "run"))
    for step in range(1, 11):
        metrics = {"rollout/success_rate": 0.5, "train/groups_trained": 0 if step in (5, 6, 7) else 9}
        if step in (7, 9):
            metrics["train/rolled_back_to_step"] = {7: 4, 9: 0}[step]
        tracker.log_metrics(metrics, step=step)
    tracker.finish()
    rows = dict(summary_rows(RunCurves(str(tmp_path / "run"))))
    assert rows["rolled back"] == (
        "at step 7 to RL step 4's policy; at step 9 to the warm start's policy: each time its last 3 RL steps "
        "trained no group (every group's rewards equal) and their success rate had fallen since the update before "
        "them")
    assert "stalled" not in rows  # it trained again after the rollback
    assert "rolled back" not in dict(summary_rows(RunCurves(_run_that_trains_until(tmp_path, 6))))
