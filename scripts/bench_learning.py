"""Does the quickstart learn on every seed? Runs it once per seed and prints what each run's MLflow store holds.

    .venv/bin/python scripts/bench_learning.py [--seeds 0 1 2 3 4] [--window 5] [--config configs/quickstart.yaml]
        [--warm-starts ROOT] [key=value ...]

Each seed is a full `agentrl train` of the config (SFT warm start, then RL) with `seed=S model.seed=S` (the tasks and
sampling, and the fresh model's initial weights) in a run directory of its own, in a process of its own, as a user
runs it; extra key=value arguments go to every run. Per seed: the training success rate's mean over the first and
the last five RL steps (sampled, temperature 1), the held-out greedy success before RL (step 0, right after the warm
start) and after it (the last step), the SFT steps the warm start took, the rollbacks the driver made (agentrl/
stall.py) and the run's wall time. The last rows are the mean and the smallest rise over the seeds, and each seed's
curve. Issue 24's goal: every seed
≥ +15 points, the mean ≥ +20, held-out after ≥ before + 10 on every seed.

`--warm-starts ROOT` measures an RL lever without paying for SFT again: each seed's RL starts from the weights its
warm start ended with in an earlier run of this script under ROOT (ROOT/seedS/weights/v<SFT steps>), with
`algorithm.sft_steps=0` and a fresh optimizer, so the seeds' RL phases compare with that run's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def warm_start(root: str, seed: int) -> str:
    """The weights seed `seed`'s warm start ended with in the earlier run under `root`."""
    from agentrl.tracking import read_metric_history

    run_dir = os.path.join(root, f"seed{seed}")
    steps = read_metric_history(run_dir, "sft/steps_run")
    if not steps:
        raise SystemExit(f"{run_dir}: no SFT phase on record to start from")
    path = os.path.join(run_dir, "weights", f"v{steps[-1][1]:.0f}")
    if not os.path.isdir(path):
        raise SystemExit(f"{path}: not there (the run publishes its weights right after SFT)")
    return path


def run_seed(config: str, seed: int, root: str, overrides: list[str], window: int) -> dict:
    from agentrl.tracking import read_metric_history, start_and_end

    run_dir = os.path.join(root, f"seed{seed}")
    cli = os.path.join(os.path.dirname(sys.executable), "agentrl")
    t0 = time.perf_counter()
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **os.environ}  # as scripts/quickstart.sh runs it
    with open(os.path.join(root, f"seed{seed}.log"), "w") as log:
        done = subprocess.run([cli, "train", config, f"seed={seed}", f"model.seed={seed}", f"run_dir={run_dir}",
                               *overrides],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"seed {seed}: agentrl train exited {done.returncode} ({root}/seed{seed}.log)")
    success = read_metric_history(run_dir, "rollout/success_rate")
    start, end = start_and_end(success, window)
    held_out = read_metric_history(run_dir, "eval/success_rate")
    sft_steps = read_metric_history(run_dir, "sft/steps_run")
    rollbacks = read_metric_history(run_dir, "train/rolled_back_to_step")  # agentrl/stall.py
    return {"start": start, "end": end, "before": held_out[0][1], "after": held_out[-1][1],
            "sft_steps": sft_steps[-1][1] if sft_steps else 0, "wall": wall,
            "rollbacks": ", ".join(f"{s} → {r:.0f}" for s, r in rollbacks) or "—",
            "curve": [value for _, value in success]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--window", type=int, default=5, help="RL steps in each of the first and last windows")
    parser.add_argument("--root", default=None, help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--warm-starts", default=None, help="an earlier run's --root: RL only, from each seed's warm "
                        "start there")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="bench_learning_")
    os.makedirs(root, exist_ok=True)
    rows = {}
    for seed in args.seeds:
        overrides = args.overrides
        if args.warm_starts:
            overrides = [f"model.checkpoint={warm_start(args.warm_starts, seed)}", "algorithm.sft_steps=0", *overrides]
        rows[seed] = r = run_seed(args.config, seed, root, overrides, args.window)
        print(f"seed {seed}: success {r['start']:.3f} -> {r['end']:.3f}, held-out {r['before']:.3f} -> "
              f"{r['after']:.3f}, {r['wall'] / 60:.1f} min", flush=True)
    print(f"\n{args.config} {' '.join(args.overrides)}, runs in {root}\n")
    w = args.window
    print(f"| seed | RL success, first {w} → last {w} steps | rise (points) | held-out greedy, before → "
          f"after RL | SFT steps | rollbacks (at step → to step) | wall time (min) |")
    print("|---:|---|---:|---|---:|---|---:|")
    for seed, r in rows.items():
        print(f"| {seed} | {r['start']:.3f} → {r['end']:.3f} | {100 * (r['end'] - r['start']):+.1f} | "
              f"{r['before']:.3f} → {r['after']:.3f} | {r['sft_steps']:.0f} | {r['rollbacks']} | "
              f"{r['wall'] / 60:.1f} |")
    rises = [100 * (r["end"] - r["start"]) for r in rows.values()]
    gains = [100 * (r["after"] - r["before"]) for r in rows.values()]
    print(f"\nrise: mean {statistics.mean(rises):+.1f}, smallest {min(rises):+.1f} points; held-out gain: mean "
          f"{statistics.mean(gains):+.1f}, smallest {min(gains):+.1f} points; wall time: mean "
          f"{statistics.mean(r['wall'] for r in rows.values()) / 60:.1f} min")
    print("\n| seed | `rollout/success_rate` per RL step |\n|---:|---|")
    for seed, r in rows.items():
        print(f"| {seed} | {' '.join(f'{v:.3f}'.lstrip('0') for v in r['curve'])} |")


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
