"""The SFT warm start's stop (agentrl.driver.warm_start), with the trainer, the engines and the evaluation faked: which
steps it checks the held-out success rate at, and where it stops."""

from __future__ import annotations

import os

import pytest

from agentrl import driver
from agentrl.config import load_config

# the quickstart's fresh-model overrides do not apply to the shipped checkpoint: load_config says so, rightly
pytestmark = pytest.mark.filterwarnings("ignore:model.overrides")

WARM_START = os.path.join(os.path.dirname(__file__), os.pardir, "data", "quickstart-warm-start")


class Trainer:
    def step(self, batch, loss):
        return {"loss": 1.0}

    def set_lr(self, lr):
        pass

    def reset_reference(self):
        pass

    def save_checkpoint(self, state):
        pass


class Pool:
    def submit(self, *args, **kwargs):
        return []

    def collect(self, submitted):
        return []


class Metrics:
    def __init__(self):
        self.steps = []

    def add(self, step, metrics):
        self.steps.append((step, metrics))

    def flush(self, **kwargs):
        pass

    def state(self):
        return {}


class NoStop:
    requested = False


def checks_of(tmp_path, monkeypatch, rates: list[float], *overrides: str) -> list[tuple[int, float]]:
    """The SFT steps (1-based) whose check ran, with the success rate each saw, for a warm start whose successive
    checks see `rates`."""
    job, _ = load_config("configs/quickstart.yaml", [
        f"run_dir={tmp_path}", f"model.checkpoint={os.path.abspath(WARM_START)}", "algorithm.sft_batch_episodes=1",
        "algorithm.sft_target_success=0.4", *overrides])
    seen = iter(rates)
    monkeypatch.setattr(driver, "evaluate", lambda pool, job, sampler: {"eval/success_rate": next(seen)})
    monkeypatch.setattr(driver, "publish", lambda job, trainer, pool: None)
    metrics = Metrics()
    driver.warm_start(job, Trainer(), metrics, Pool(), driver.TaskSampler(job), NoStop())
    return [(step + 1, m["sft/eval_success_rate"]) for step, m in metrics.steps if "sft/eval_success_rate" in m]


def test_the_warm_start_checks_every_sft_eval_every_steps_and_stops_at_the_target(tmp_path, monkeypatch):
    checks = checks_of(tmp_path, monkeypatch, [0.1, 0.3, 0.5, 0.9], "algorithm.sft_steps=30",
                       "algorithm.sft_eval_every=5", "algorithm.sft_check_every_step_from=null")
    assert checks == [(5, 0.1), (10, 0.3), (15, 0.5)]


def test_near_its_target_the_warm_start_checks_after_every_step(tmp_path, monkeypatch):
    """From the first check at `sft_check_every_step_from` on, every step is checked (and stays so after a lower
    one), so a sharp rise stops near the target instead of up to sft_eval_every - 1 steps past it."""
    checks = checks_of(tmp_path, monkeypatch, [0.1, 0.25, 0.35, 0.15, 0.38, 0.45, 0.9], "algorithm.sft_steps=30",
                       "algorithm.sft_eval_every=5", "algorithm.sft_check_every_step_from=0.2")
    assert checks == [(5, 0.1), (10, 0.25), (11, 0.35), (12, 0.15), (13, 0.38), (14, 0.45)]


def test_the_warm_start_never_checks_at_its_last_step(tmp_path, monkeypatch):
    """The last SFT step is not checked: the job evaluates right after the warm start anyway."""
    checks = checks_of(tmp_path, monkeypatch, [0.25, 0.3, 0.3, 0.3], "algorithm.sft_steps=8",
                       "algorithm.sft_eval_every=5", "algorithm.sft_check_every_step_from=0.2")
    assert [step for step, _ in checks] == [5, 6, 7]
