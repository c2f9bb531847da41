"""Benchmark the built-in tool envs and the sandbox; prints markdown tables.

    .venv/bin/python scripts/bench_envs.py [--episodes 20] [--sandbox-runs 100] [--context-tokens 32768]

Env throughput: oracle episodes (the gold turns, so every step does real tool work), timing only ``reset`` and
``step``; steps/s is per env instance on one core; tokens per episode are estimated from the characters of the
task, the turns and the results (/4), whatever chat format would render them. Sandbox start-up: the wall time of
running ``pass``, i.e. process start, isolation set-up and teardown, per isolation mode available here.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time

from agentrl.envs import Sandbox, SandboxError, SandboxLimits, list_envs, make
from agentrl.envs.sandbox import detect_isolation


def bench_env(env_id: str, episodes: int, kwargs: dict) -> dict:
    env = make(env_id, **kwargs)
    steps, seconds, chars, rewards = 0, 0.0, 0, []
    for seed in range(episodes):
        start = time.perf_counter()
        prompt, _ = env.reset(seed=seed)
        seconds += time.perf_counter() - start
        chars += len(prompt)
        for turn in env.oracle(env.task):
            start = time.perf_counter()
            obs, reward, terminated, truncated, _ = env.step(turn)
            seconds += time.perf_counter() - start
            turn_chars = (len(turn.content) + len(turn.answer or "")
                          + sum(len(json.dumps(c.arguments)) for c in turn.calls))
            steps, chars = steps + 1, chars + obs.num_chars + turn_chars
            if terminated or truncated:
                rewards.append(reward)
                break
    return {"env": env_id, "episodes": episodes, "steps": steps, "steps_per_s": steps / seconds,
            "steps_per_episode": steps / episodes, "tokens_per_episode": chars / 4 / episodes,
            "mean_reward": statistics.fmean(rewards)}


def bench_sandbox(isolation: str, runs: int, python: str = sys.executable) -> dict | None:
    sandbox = Sandbox(SandboxLimits(wall_s=10.0), isolation=isolation, python=python)
    try:
        sandbox.run("pass")  # warm the page cache and the isolation probe
    except SandboxError:
        return None
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        assert sandbox.run("pass").ok
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    label = isolation if python == sys.executable else f"{isolation} ({python})"
    return {"isolation": label, "runs": runs, "p50_ms": times[len(times) // 2],
            "p99_ms": times[min(len(times) - 1, round(0.99 * (len(times) - 1)))], "max_ms": times[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--sandbox-runs", type=int, default=100)
    parser.add_argument("--context-tokens", type=int, default=32_768, help="DocSearch-v0 trajectory length target")
    args = parser.parse_args()
    per_env = {"agentrl/DocSearch-v0": {"context_tokens": args.context_tokens, "num_tasks": args.episodes}}

    print(f"host: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"sandbox isolation available: {detect_isolation()[0]}\n")
    print("| env | episodes | steps | steps/s | steps/episode | tokens/episode (chars/4) | oracle reward |")
    print("|---|---|---|---|---|---|---|")
    for env_id in list_envs():
        r = bench_env(env_id, args.episodes, per_env.get(env_id, {"num_tasks": max(args.episodes, 20)}))
        print(f"| {r['env']} | {r['episodes']} | {r['steps']} | {r['steps_per_s']:,.0f} | "
              f"{r['steps_per_episode']:.1f} | {r['tokens_per_episode']:,.0f} | {r['mean_reward']:.2f} |")

    print("\n| sandbox isolation | runs | start-up p50 (ms) | p99 (ms) | max (ms) |")
    print("|---|---|---|---|---|")
    modes = ["namespaces", "rlimits"] if detect_isolation()[0] == "namespaces" else ["rlimits"]
    for isolation in modes:
        r = bench_sandbox(isolation, args.sandbox_runs)
        fallback = shutil.which("python3", path="/usr/bin:/bin")
        if r is None and fallback:
            # As root the sandbox uid cannot read an interpreter under /root; the system one it can.
            r = bench_sandbox(isolation, args.sandbox_runs, python=fallback)
        if r:
            print(f"| {r['isolation']} | {r['runs']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} |")


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
