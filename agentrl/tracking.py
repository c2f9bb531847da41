"""Experiment tracking in MLflow: the resolved config, per-step metrics, readable transcripts.

The only module that imports MLflow (when a tracker is made: `TrackingConfig` loads without it, so configs and the
commands that need no MLflow work on a core install), and it uses MlflowClient alone: the fluent API keeps a process-global tracking
URI and active run (and writes MLFLOW_TRACKING_URI into the environment), which two jobs in one process would share.
The embedded default writes a sqlite store inside the run directory
(`<run_dir>/mlflow.db`, artifacts under `<run_dir>/artifacts`), so `mlflow ui --backend-store-uri
sqlite:///<run_dir>/mlflow.db` shows the reward curve of a local run; the run is named after its directory; a tracking-server URI in the config (or MLFLOW_TRACKING_URI) sends everything to a shared server. Only the
driver logs (trainer rank 0 reports its metrics through it), so curves never double.

A resumed run reopens the same MLflow run (its id is kept in the run directory) and continues its curves at the
step it resumes from. The driver logs a step once it is checkpointed (agentrl.driver.PendingMetrics), so the curves
hold each step once, however often the run was stopped and resumed.
"""

from __future__ import annotations

import html
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.types import EpisodeSummary

RUN_ID_FILE = "mlflow_run_id"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # the MLflow UI's choice between its GenAI and model-training views


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    experiment: str = "agentrl"  # the MLflow experiment the run belongs to
    run_name: str | None = None  # the MLflow run's name (None: the run directory's name)
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI, else sqlite in the run directory
    transcripts_every: int = 5  # log sample transcripts at the first, the last and every n-th step (0: never)
    transcripts_per_step: int = 4  # trajectories per logged step

    def __post_init__(self):
        if self.transcripts_every < 0 or self.transcripts_per_step < 0:
            raise ValueError("tracking.transcripts_every and transcripts_per_step must be >= 0")


def default_tracking_uri(run_dir: str) -> str:
    return "sqlite:///" + os.path.abspath(os.path.join(run_dir, "mlflow.db"))


def resolve_tracking_uri(configured: str | None, run_dir: str) -> str:
    """Where a job logs: the configured URI, else MLFLOW_TRACKING_URI, else the run directory's sqlite store."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(run_dir)


class Tracker:
    """One MLflow run per training job."""

    def __init__(self, config: TrackingConfig, run_dir: str):
        from mlflow import MlflowClient

        self.config = config
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.uri = resolve_tracking_uri(config.tracking_uri, run_dir)
        self.client = MlflowClient(self.uri)
        id_file = os.path.join(run_dir, RUN_ID_FILE)
        if os.path.exists(id_file):  # a resumed job continues its run
            self.run_id = open(id_file).read().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = config.run_name or os.path.basename(os.path.abspath(run_dir))
            self.run_id = self.client.create_run(self._experiment_id(), run_name=name).info.run_id
            with open(id_file, "w") as f:
                f.write(self.run_id)
        self.experiment_id = self.client.get_run(self.run_id).info.experiment_id

    def _experiment_id(self) -> str:
        """The configured experiment, created if needed. In the run directory's own store its artifacts go to
        `<run_dir>/artifacts` (MLflow's default is `./mlruns` under whatever directory the job was started from), and
        it is marked a model-training experiment, so that the UI opens on its runs, not on an empty GenAI traces page."""
        experiment = self.client.get_experiment_by_name(self.config.experiment)
        if experiment is not None:
            return experiment.experiment_id
        own_store = self.uri == default_tracking_uri(self.run_dir)
        location = Path(self.run_dir, "artifacts").resolve().as_uri() if own_store else None
        return self.client.create_experiment(self.config.experiment, artifact_location=location,
                                             tags={EXPERIMENT_KIND_TAG: "custom_model_development"})

    def run_page(self) -> str:
        return run_page(self.uri, self.experiment_id, self.run_id)

    def log_config(self, resolved: Mapping[str, Any], yaml_text: str) -> None:
        """The whole resolved config as flattened params, and the YAML file as an artifact."""
        from mlflow.entities import Param

        params = {k: str(v)[:500] for k, v in _flatten(resolved).items()}
        existing = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in existing]  # immutable: a resume skips them
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        self.client.log_text(self.run_id, yaml_text, "config.yaml")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        clean = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None and _finite(v)]
        for i in range(0, len(clean), 500):
            self.client.log_batch(self.run_id, metrics=clean[i:i + 500])

    def logged_steps(self, key: str) -> set[int]:
        """The steps at which `key` has been logged in this run."""
        return {m.step for m in self.client.get_metric_history(self.run_id, key)}

    def log_missing(self, steps: list[tuple[int, dict[str, float]]]) -> int:
        """Logs those of `steps` ((step, metrics) pairs) that MLflow lacks, judged by each one's first metric; returns
        how many it logged. The driver's checkpoints carry the metrics of the steps they complete, so that a run killed
        between a checkpoint and logging its steps logs them when it resumes, and never twice."""
        logged: dict[str, set[int]] = {}
        count = 0
        for step, metrics in steps:
            if not metrics:
                continue
            key = min(metrics)
            if key not in logged:
                logged[key] = self.logged_steps(key)
            if step not in logged[key]:
                self.log_metrics(metrics, step=step)
                count += 1
        return count

    def set_tag(self, key: str, value: Any) -> None:
        self.client.set_tag(self.run_id, key, str(value))

    def log_transcripts(self, episodes: list[EpisodeSummary], step: int, *, last: bool = False) -> None:
        """A few episodes' transcripts as an HTML page (readable in the MLflow UI) and JSON, at the first step, the
        `last` one and every `transcripts_every`-th (a short run has some too); the episodes whose summaries carry
        their turns' text (the rollout workers add it to the first `transcripts_per_step` of theirs)."""
        every = self.config.transcripts_every
        if not every or not (step == 1 or last or step % every == 0):
            return
        chosen = [e for e in episodes if e.turns is not None][: self.config.transcripts_per_step]
        if not chosen:
            return
        records = [transcript_record(t) for t in chosen]
        self.client.log_text(self.run_id, json.dumps(records, indent=1), f"transcripts/step_{step:06d}.json")
        self.client.log_text(self.run_id, transcripts_html(records, step), f"transcripts/step_{step:06d}.html")

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def run_page(uri: str, experiment_id: str, run_id: str) -> str:
    """Where to look at a run: its page's URL, after the command that serves it when the store is local."""
    if uri.startswith(("http://", "https://")):
        base, serve = uri.rstrip("/"), ""
    else:
        base, serve = "http://127.0.0.1:5000", f"mlflow ui --backend-store-uri {uri}, then "
    return f"{serve}{base}/#/experiments/{experiment_id}/runs/{run_id}"


def read_metric_history(run_dir: str, key: str, tracking_uri: str | None = None) -> list[tuple[int, float]]:
    """(step, value) of `key` in the run that the job in `run_dir` logged to, in step order: for scripts, tests and
    notebooks after (or during) a run. `tracking_uri`: the job's `tracking.tracking_uri`, if it set one."""
    from mlflow import MlflowClient

    id_file = os.path.join(run_dir, RUN_ID_FILE)
    if not os.path.exists(id_file):
        raise FileNotFoundError(f"{run_dir!r} holds no {RUN_ID_FILE}: is it the run_dir of an agentrl job?")
    client = MlflowClient(resolve_tracking_uri(tracking_uri, run_dir))
    run_id = open(id_file).read().strip()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def start_and_end(history: list[tuple[int, float]], window: int) -> tuple[float, float]:
    """Means of the first and of the last `window` values of a curve: one RL step's success rate is a noisy estimate
    (a few hundred episodes at most), so a rise is read between windows, not between single steps."""
    values = [v for _, v in history]
    if len(values) < 2 * window:
        raise ValueError(f"a curve of {len(values)} points has no two disjoint windows of {window}")
    return sum(values[:window]) / window, sum(values[-window:]) / window


def transcript_record(t: EpisodeSummary) -> dict[str, Any]:
    return {"trajectory_id": t.trajectory_id, "task_id": t.task_id, "env": t.env_id, "status": t.status.value,
            "failure": t.failure.value if t.failure else None, "error": t.error, "reward": t.reward,
            "reward_components": t.reward_components, "policy_versions": t.policy_versions,
            "num_tokens": t.num_tokens, "num_sampled": t.num_sampled,
            "turns": [{"role": role, "text": text} for role, text in t.turns or []]}


def transcripts_html(records: list[dict[str, Any]], step: int) -> str:
    colors = {"system": "#eee", "user": "#e8f0fe", "assistant": "#e6f4ea", "tool": "#fef7e0"}
    parts = [f"<html><head><meta charset='utf-8'><title>step {step}</title></head><body>",
             f"<h1>Transcripts at step {step}</h1>"]
    for r in records:
        parts.append(f"<h2>{html.escape(r['env'])} task {html.escape(str(r['task_id']))}: {r['status']}, "
                     f"reward {r['reward']:.3f} {html.escape(json.dumps(r['reward_components']))}</h2>")
        if r["error"]:
            parts.append(f"<p><b>error ({r['failure']}):</b> {html.escape(r['error'])}</p>")
        for turn in r["turns"]:
            parts.append(f"<div style='background:{colors.get(turn['role'], '#fff')};padding:6px;margin:4px'>"
                         f"<b>{turn['role']}</b><pre style='white-space:pre-wrap'>{html.escape(turn['text'])}"
                         "</pre></div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _finite(v: Any) -> bool:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return False
    return f == f and abs(f) != float("inf")
