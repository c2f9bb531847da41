"""A run's learning curves as a table, read from its MLflow store (what `mlflow ui` plots), for notes and docs.

    .venv/bin/python scripts/run_report.py runs/quickstart [--every 5] [--keys eval/success_rate ...]

Rows: the SFT summary (first and last loss), then one row per RL step that logged any of the keys (every n-th step,
plus the steps with an evaluation and the last one). An `eval/` column is that step's evaluation; every other column
is the mean over the steps since the previous row (one step's rollout success is noisy). Last, the training success
rate's rise: the mean of the first `--window` RL steps against the mean of the last `--window`.
"""

from __future__ import annotations

import argparse

from agentrl.tracking import read_metric_history, start_and_end

KEYS = ["eval/success_rate", "eval/tool_error_rate", "rollout/success_rate", "rollout/tool_error_rate",
        "train/entropy", "train/uniform_groups", "time/step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--keys", nargs="+", default=KEYS)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--tracking-uri", default=None, help="where the run logged, if not to its run directory")
    args = parser.parse_args()

    def history(key: str) -> dict[int, float]:
        return dict(read_metric_history(args.run_dir, key, args.tracking_uri))

    try:
        sft = history("sft/loss")
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    if sft:
        print(f"SFT: {len(sft)} steps, loss {sft[min(sft)]:.3f} -> {sft[max(sft)]:.3f}\n")
    curves = {k: history(k) for k in args.keys}
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
    success = read_metric_history(args.run_dir, "rollout/success_rate", args.tracking_uri)
    if len(success) >= 2 * args.window:
        start, end = start_and_end(success, args.window)
        print(f"\nrollout/success_rate: {start:.3f} (mean of the first {args.window} RL steps) -> {end:.3f} (the last "
              f"{args.window}): {100 * (end - start):+.1f} points")


if __name__ == "__main__":
    main()
