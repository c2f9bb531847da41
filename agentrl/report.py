"""A run's curves for a person: one self-contained HTML page, or a table for notes (`agentrl report RUN_DIR`).

The MLflow UI shows every metric (some sixty per step) in alphabetical panels; the few that say whether a run is
learning sit far down among them. The page shows those few, read from the run's MLflow store: success (training and
held-out), reward and its components, failures and tool errors, trajectory length, what each step trained, staleness,
step time by phase, and the SFT warm start. The charts are inline SVG: the page needs no server, no JavaScript and
no plotting library, and can be mailed or attached to an issue.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass

from agentrl.stall import STALLED_STEPS, restored_policy
from agentrl.tracking import RUN_ID_FILE, resolve_tracking_uri, run_page, start_and_end

COLORS = ("#1a73e8", "#e8710a", "#188038", "#d93025", "#9334e6", "#12b5cb", "#f9ab00", "#5f6368")
TABLE_KEYS = ("eval/success_rate", "eval/tool_error_rate", "rollout/success_rate", "rollout/tool_error_rate",
              "train/entropy", "train/uniform_groups", "time/step_s")


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # metric keys; a key ending in "/*" stands for every key under that prefix
    note: str = ""


PANELS = (
    Panel("Success rate", ("rollout/success_rate", "eval/success_rate"),
          "training episodes (sampled) and the held-out tasks (greedy)"),
    Panel("Reward", ("rollout/reward_mean", "rollout/reward/*"), "the total and each named component"),
    Panel("Failures and tool errors", ("rollout/failed_fraction", "rollout/tool_error_rate", "eval/tool_error_rate"),
          "failed: episodes an env, tool, sandbox or the engine broke; tool errors: calls answered with an error"),
    Panel("Failed episodes by boundary", ("rollout/failed/*",), "per step: model, env, tool, sandbox, worker"),
    Panel("Trajectory length", ("rollout/tokens_mean",), "tokens per finished episode"),
    Panel("Turns and tool calls", ("rollout/turns_mean", "rollout/tool_calls_mean"), "per finished episode"),
    Panel("What trained", ("train/groups_trained", "train/uniform_groups"),
          "groups trained per step, and groups left out because all their rewards were equal"),
    Panel("Staleness", ("store/last_batch_max_lag", "store/last_batch_mean_lag"),
          "policy versions between the sampling policy and the trained one"),
    Panel("Step time by phase (s)", ("time/rollout_s", "time/train_s", "time/sync_s", "time/log_s", "time/step_s")),
    Panel("SFT warm start", ("sft/loss", "sft/eval_success_rate"), "per SFT step (its own step axis)"),
)


class RunCurves:
    """The metric histories of the MLflow run that the job in `run_dir` logged to."""

    def __init__(self, run_dir: str, tracking_uri: str | None = None):
        from mlflow import MlflowClient

        id_file = os.path.join(run_dir, RUN_ID_FILE)
        if not os.path.exists(id_file):
            raise FileNotFoundError(f"{run_dir!r} holds no {RUN_ID_FILE}: is it the run_dir of an agentrl job?")
        self.run_dir = run_dir
        self.uri = resolve_tracking_uri(tracking_uri, run_dir)
        self.client = MlflowClient(self.uri)
        self.run = self.client.get_run(open(id_file).read().strip())
        self.keys = sorted(self.run.data.metrics)
        self._cache: dict[str, list[tuple[int, float]]] = {}

    def history(self, key: str) -> list[tuple[int, float]]:
        if key not in self._cache:
            self._cache[key] = sorted((m.step, m.value) for m in self.client.get_metric_history(self.run.info.run_id,
                                                                                                  key))
        return self._cache[key]

    def expand(self, keys: tuple[str, ...]) -> list[str]:
        out = []
        for key in keys:
            out += [k for k in self.keys if k.startswith(key[:-1])] if key.endswith("/*") else \
                [key] if key in self.keys else []
        return out


def html_report(curves: RunCurves) -> str:
    info = curves.run.info
    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>{html.escape(info.run_name or info.run_id)}</title>",
             "<style>body{font-family:system-ui,sans-serif;margin:24px;color:#202124}"
             ".grid{display:flex;flex-wrap:wrap;gap:16px}.panel{border:1px solid #dadce0;border-radius:8px;padding:8px}"
             "h2{font-size:15px;margin:4px 0}.note{font-size:12px;color:#5f6368;margin:0 0 4px}"
             "table{border-collapse:collapse;font-size:13px}td{padding:2px 10px}</style></head><body>",
             f"<h1>{html.escape(info.run_name or info.run_id)}</h1>", summary_html(curves), "<div class='grid'>"]
    for panel in PANELS:
        keys = curves.expand(panel.keys)
        if keys:
            parts.append(f"<div class='panel'><h2>{html.escape(panel.title)}</h2>"
                         f"<p class='note'>{html.escape(panel.note)}</p>"
                         + svg_chart({k: curves.history(k) for k in keys}) + "</div>")
    parts.append("</div></body></html>")
    return "\n".join(parts)


PHASES = (("set-up", ("phase/setup_s",)), ("SFT warm start", ("time/sft_s",)),
          ("RL rollout", ("time/rollout_s",)), ("RL training", ("time/train_s",)),
          ("weight sync", ("time/sync_s",)), ("held-out evaluation", ("time/eval_s",)),
          ("logging and checkpoints", ("time/log_s",)))


def summary_rows(curves: RunCurves) -> list[tuple[str, str]]:
    """What a run did, as (label, value) rows: status, where it is, success and reward first vs last steps, held-out
    success before vs after RL, wall time by phase and the newest weights."""
    from agentrl.trainer.publish import latest_weights

    info = curves.run.info
    rows = [("status", info.status), ("run directory", os.path.abspath(curves.run_dir)),
            ("MLflow", run_page(curves.uri, info.experiment_id, info.run_id))]
    success = curves.history("rollout/success_rate") if "rollout/success_rate" in curves.keys else []
    if success:
        rows.append(("RL steps", str(max(s for s, _ in success))))
        window = min(5, len(success) // 2)
        if window:
            for key, label in (("rollout/success_rate", "training success"), ("rollout/reward_mean", "reward")):
                if key in curves.keys and len(curves.history(key)) >= 2 * window:
                    start, end = start_and_end(curves.history(key), window)
                    change = f"{100 * (end - start):+.1f} points" if key.endswith("rate") else f"{end - start:+.3f}"
                    rows.append((f"{label}, first → last {window} steps", f"{start:.3f} → {end:.3f} ({change})"))
    held_out = curves.history("eval/success_rate") if "eval/success_rate" in curves.keys else []
    if held_out:
        label = "held-out success (greedy), " + ("before → after RL" if held_out[0][0] == 0 and len(held_out) > 1
                                                 else "first → last evaluation")
        rows.append((label, f"{held_out[0][1]:.3f} (step {held_out[0][0]}) → {held_out[-1][1]:.3f} "
                            f"(step {held_out[-1][0]})"))
    if "train/rolled_back_to_step" in curves.keys:
        rows.append(("rolled back", rollback_note(curves.history("train/rolled_back_to_step"))))
    stalled = stalled_note(curves, success)
    if stalled:
        rows.append(("stalled", stalled))
    spent = [(label, sum(v for k in keys if k in curves.keys for _, v in curves.history(k))) for label, keys in PHASES]
    spent = [(label, s) for label, s in spent if s > 0]
    if spent:
        rows.append(("wall time by phase", ", ".join(f"{label} {duration(s)}" for label, s in spent)))
    latest = latest_weights(curves.run_dir)
    if latest is not None:
        rows.append(("newest weights", f"{latest[1]} (version {latest[0]})"))
    return rows


def stalled_note(curves: RunCurves, success: list[tuple[int, float]]) -> str | None:
    """What to tell the user when the run's last STALLED_STEPS or more RL steps trained no group: every group's
    rewards were equal, so GRPO had no advantage to learn from and the policy stopped changing (a policy that
    collapsed to failing every episode stays there: docs/benchmarks.md, "Three times the RL steps"). The success
    curve alone shows a flat line, not why."""
    if not success or "train/groups_trained" not in curves.keys:
        return None
    trained = dict(curves.history("train/groups_trained"))
    idle = 0
    for step, _ in reversed(success):
        if trained.get(step, 1) > 0:  # a step without the metric is not taken as idle
            break
        idle += 1
    if idle < STALLED_STEPS:
        return None
    first_idle = success[-idle][0]
    policy = "the warm start's" if idle == len(success) else f"the one step {success[-idle - 1][0]} trained"
    return (f"nothing trained in the last {idle} RL steps (from step {first_idle}): every group's rewards were "
            f"equal (training success {success[-1][1]:.3f} at the last step), so the policy is still {policy}")


def rollback_note(rollbacks: list[tuple[int, float]]) -> str:
    """Where the driver undid an update that had stalled the run (agentrl/stall.py), from its (step, restored RL step)
    metric."""
    back = [f"at step {step} to {restored_policy(int(restored))}" for step, restored in rollbacks]
    return (f"{'; '.join(back)}: {'each time ' if len(back) > 1 else ''}its last {STALLED_STEPS} RL steps trained no "
            f"group (every group's rewards equal) and their success rate had fallen since the update before them")


def summary_html(curves: RunCurves) -> str:
    return "<table>" + "".join(f"<tr><td>{html.escape(k)}</td><td><b>{html.escape(v)}</b></td></tr>"
                               for k, v in summary_rows(curves)) + "</table>"


def summary_text(curves: RunCurves, *, prog: str = "agentrl", eval_command: str) -> str:
    """The summary `agentrl train` prints when a run ends: summary_rows (the MLflow row names the `mlflow ui` command
    that serves the run page), then the commands that report and evaluate the result."""
    rows = summary_rows(curves)
    width = max(len(k) for k, _ in rows)
    lines = ["", "run summary", *(f"  {k.ljust(width)}  {v}" for k, v in rows), "",
             f"  the curves on one page:  {prog} report {curves.run_dir}",
             f"  evaluate the weights:    {eval_command}"]
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """A length of time as the terminal shows it: seconds, minutes to a tenth, hours past 90 minutes."""
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min" if seconds >= 90 else \
        f"{seconds:.0f} s"


def svg_chart(series: dict[str, list[tuple[int, float]]], width: int = 420, height: int = 220) -> str:
    """Lines (a dot where a series has one point) over a shared step axis, the value range labelled, a legend below."""
    points = [p for values in series.values() for p in values]
    if not points:
        return ""
    left, right, top, bottom = 48, 10, 8, 24
    x0, x1 = min(s for s, _ in points), max(s for s, _ in points)
    y0, y1 = min(v for _, v in points), max(v for _, v in points)
    if y0 == y1:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1

    def xy(step: int, value: float) -> tuple[float, float]:
        return (left + (step - x0) / (x1 - x0) * (width - left - right),
                top + (y1 - value) / (y1 - y0) * (height - top - bottom))

    legend_h = 16 * len(series)
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height + legend_h}' "
           "font-size='11' font-family='system-ui,sans-serif'>",
           f"<rect x='{left}' y='{top}' width='{width - left - right}' height='{height - top - bottom}' "
           "fill='none' stroke='#dadce0'/>",
           f"<text x='{left - 4}' y='{top + 9}' text-anchor='end'>{_num(y1)}</text>",
           f"<text x='{left - 4}' y='{height - bottom}' text-anchor='end'>{_num(y0)}</text>",
           f"<text x='{left}' y='{height - 8}'>step {x0}</text>",
           f"<text x='{width - right}' y='{height - 8}' text-anchor='end'>{x1}</text>"]
    for i, (key, values) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = [xy(s, v) for s, v in values]
        if len(coords) == 1:
            out.append(f"<circle cx='{coords[0][0]:.1f}' cy='{coords[0][1]:.1f}' r='3' fill='{color}'/>")
        elif coords:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            out.append(f"<polyline points='{path}' fill='none' stroke='{color}' stroke-width='1.5'/>")
        last = f" (last {_num(values[-1][1])})" if values else ""
        y = height + 12 + 16 * i
        out.append(f"<rect x='{left}' y='{y - 8}' width='10' height='3' fill='{color}'/>"
                   f"<text x='{left + 16}' y='{y}'>{html.escape(key)}{last}</text>")
    out.append("</svg>")
    return "".join(out)


def table_report(curves: RunCurves, keys: tuple[str, ...] = TABLE_KEYS, every: int = 5, window: int = 5) -> str:
    """Markdown: the SFT summary, one row per `every`-th RL step (plus evaluation steps and the last; an `eval/`
    column is that step's value, any other the mean since the previous row), then the training success's rise
    between the first and the last `window` steps."""
    lines = []
    sft = dict(curves.history("sft/loss")) if "sft/loss" in curves.keys else {}
    if sft:
        lines.append(f"SFT: {len(sft)} steps, loss {sft[min(sft)]:.3f} -> {sft[max(sft)]:.3f}\n")
    series = {k: dict(curves.history(k)) if k in curves.keys else {} for k in keys}
    steps = sorted({s for c in series.values() for s in c})
    evals = set(series.get("eval/success_rate", {}))
    shown = [s for s in steps if s % every == 0 or s in evals or s == steps[-1]]
    lines += ["| step | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
    previous = -1
    for s in shown:
        cells = []
        for k in keys:
            span = [s] if k.startswith("eval/") else range(previous + 1, s + 1)
            values = [series[k][i] for i in span if i in series[k]]
            cells.append(f"{sum(values) / len(values):.3f}" if values else "")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
        previous = s
    success = curves.history("rollout/success_rate") if "rollout/success_rate" in curves.keys else []
    if len(success) >= 2 * window:
        start, end = start_and_end(success, window)
        lines.append(f"\nrollout/success_rate: {start:.3f} (mean of the first {window} RL steps) -> {end:.3f} (the "
                     f"last {window}): {100 * (end - start):+.1f} points")
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table of `rows` under `header` (the benchmark scripts print their tables with it)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_report(run_dir: str, out: str | None = None, tracking_uri: str | None = None) -> str:
    """Writes the HTML page (default `<run_dir>/report.html`) and returns its path."""
    path = out or os.path.join(run_dir, "report.html")
    text = html_report(RunCurves(run_dir, tracking_uri))
    with open(path, "w") as f:
        f.write(text)
    return path


def _num(value: float) -> str:
    return f"{value:.3g}"
