"""How long a short job takes to get going: `agentrl train` as a user runs it, timed from the command's start to the
lines it prints.

    .venv/bin/python scripts/bench_job_start.py [--repeats 3] [--sft-steps 3] [key=value ...]

Each run is a fresh process on the quickstart with a tiny workload (2 groups of 2, 3 RL steps, 2 held-out tasks), so
what is left is the start: the driver's imports, Ray, MLflow, the trainer ranks, the store, the rollout workers and
their vLLM engines. Per run: when the job said it was ready (trainer, store and workers placed), when the warm start's
last SFT step ended, when the first held-out evaluation began (the first generation: the engines are up), and when
the command exited. The table gives the median and range over runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["rollout.group_size=2", "rollout.groups_per_step=2", "env.eval_tasks=2", "env.kwargs.max_turns=2",
         "rollout.max_tokens_per_turn=16", "algorithm.sft_batch_episodes=4", "algorithm.sft_target_success=null",
         "algorithm.skip_uniform_groups=false", "algorithm.eval_every=0", "algorithm.steps=3",
         "cluster.trainer_cpus=0.5", "cluster.rollout_cpus=0.5", "trainer.num_threads=1"]
MARKS = {"job ready": "agentrl: job ready", "SFT ended": "agentrl: sft step {n}/{n}",
         "first evaluation": "agentrl: evaluating greedily"}


def one_run(sft_steps: int, overrides: list[str]) -> dict[str, float]:
    """Seconds from the command's start to each mark, and to its exit."""
    marks = {name: text.format(n=sft_steps) for name, text in MARKS.items()}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", "configs/quickstart.yaml",
                                 f"run_dir={tmp}/run", f"algorithm.sft_steps={sft_steps}", *SHORT, *overrides],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: dict[str, float] = {}
        tail: list[str] = []
        for line in proc.stdout:
            tail = (tail + [line])[-30:]
            for name, text in marks.items():
                if name not in seen and text in line:
                    seen[name] = time.perf_counter() - start
        if proc.wait() != 0:
            raise RuntimeError("the job failed:\n" + "".join(tail))
        seen["exit"] = time.perf_counter() - start
    missing = [name for name in marks if name not in seen]
    if missing:
        raise RuntimeError(f"the job never printed {missing}:\n" + "".join(tail))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sft-steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        runs.append(one_run(args.sft_steps, args.overrides))
        print(f"run {i + 1}: " + ", ".join(f"{name} {s:.1f} s" for name, s in runs[-1].items()), flush=True)
    print(f"\n`agentrl train` on the quickstart, {args.sft_steps} SFT steps, 3 RL steps "
          f"({args.repeats} runs; seconds from the command's start)\n")
    print("| mark | median (s) | range (s) |\n|---|---|---|")
    for name in [*MARKS, "exit"]:
        values = [run[name] for run in runs]
        print(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f}–{max(values):.1f} |")


if __name__ == "__main__":
    main()
