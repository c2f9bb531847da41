"""A run's learning curves as a table, read from its MLflow store (what `mlflow ui` plots), for notes and docs.

    .venv/bin/python scripts/run_report.py runs/quickstart [--every 5] [--keys eval/success_rate ...]

Rows: the SFT summary (first and last loss), then one row per RL step that logged any of the keys (every n-th step,
plus the steps with an evaluation and the last one). An `eval/` column is that step's evaluation; every other column
is the mean over the steps since the previous row (one step's rollout success is noisy: 64 episodes of 8 tasks).
"""

from __future__ import annotations

import argparse
import os

KEYS = ["eval/success_rate", "eval/tool_error_rate", "rollout/success_rate", "rollout/tool_error_rate",
        "train/entropy", "train/uniform_groups", "time/step_s"]


def history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--keys", nargs="+", default=KEYS)
    args = parser.parse_args()
    import mlflow

    db = os.path.join(args.run_dir, "mlflow.db")
    if not os.path.exists(db):
        raise SystemExit(f"no MLflow store at {db}: is {args.run_dir!r} a run directory?")
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    if not runs:
        raise SystemExit(f"{db} holds no run")
    run_id = runs[0].info.run_id
    sft = history(client, run_id, "sft/loss")
    if sft:
        print(f"SFT: {len(sft)} steps, loss {sft[min(sft)]:.3f} -> {sft[max(sft)]:.3f}\n")
    curves = {k: history(client, run_id, k) for k in args.keys}
    steps = sorted({s for c in curves.values() for s in c})
    evals = set(curves.get("eval/success_rate", {}))
    shown = [s for s in steps if s % args.every == 0 or s in evals or s == steps[-1]]
    print("| step | " + " | ".join(args.keys) + " |")
    print("|---:|" + "---:|" * len(args.keys))
    previous = -1
    for s in shown:
        cells = []
        for k in args.keys:
            window = [s] if k.startswith("eval/") else range(previous + 1, s + 1)
            values = [curves[k][i] for i in window if i in curves[k]]
            cells.append(f"{sum(values) / len(values):.3f}" if values else "")
        print(f"| {s} | " + " | ".join(cells) + " |")
        previous = s


if __name__ == "__main__":
    main()
