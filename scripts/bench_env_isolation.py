"""What running each env instance in its own process costs (rollout.env_isolation=process vs thread).

    .venv/bin/python scripts/bench_env_isolation.py [--envs 64] [--steps 200]

For Calc-v0 and PythonExec-v0 (whose tool starts a sandbox per call): the time to build `--envs` instances
(concurrently, as a worker starting that many episodes does), the latency of one reset + oracle step through the
pool (mean over `--steps`), and memory: the host's RSS and each env process's USS (the pages it does not share with
the host, from /proc/PID/smaps_rollup), against the worker's own RSS growth in thread mode.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time

from agentrl.rollout.agent_loop import EnvPool

ENVS = {"agentrl/Calc-v0": {}, "agentrl/PythonExec-v0": {}}


def uss_kib(pid: int) -> int:
    """Private (unshared) memory of a process, KiB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty", "Private_Hugetlb")
               if k in fields)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


async def measure(isolation: str, env_id: str, kwargs: dict, n_envs: int, steps: int) -> dict:
    from agentrl.envs import make

    pool = EnvPool(isolation=isolation)
    oracle_env = make(env_id, **kwargs)
    rss_before = rss_kib(os.getpid())
    t0 = time.perf_counter()
    envs = await asyncio.gather(*(pool.acquire(env_id, kwargs) for _ in range(n_envs)))
    build_s = time.perf_counter() - t0
    latencies = []
    for i in range(steps):
        env = envs[i % n_envs]
        t = time.perf_counter()
        await env.call("reset", seed=i, options={"task_index": i % 50})
        oracle_env.reset(seed=i, options={"task_index": i % 50})
        turn = oracle_env.oracle(oracle_env.state.task)[0]
        await env.call("step", turn)
        latencies.append(time.perf_counter() - t)
    row = {"isolation": isolation, "env": env_id.split("/")[1], "envs": n_envs, "build_s": build_s,
           "step_ms": 1000 * statistics.mean(latencies)}
    if isolation == "process":
        row["host_rss_mib"] = rss_kib(pool._host._proc.pid) / 1024
        row["uss_per_env_mib"] = statistics.mean(uss_kib(e.pid) for e in envs) / 1024
    else:
        row["host_rss_mib"] = float("nan")
        row["uss_per_env_mib"] = (rss_kib(os.getpid()) - rss_before) / 1024 / n_envs
    pool.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rows = [asyncio.run(measure(isolation, env_id, kwargs, args.envs, args.steps))
            for env_id, kwargs in ENVS.items() for isolation in ("thread", "process")]
    print(f"{'env':<14}{'isolation':<10}{'envs':>5}{'build s':>9}{'reset+step ms':>15}{'host RSS MiB':>14}"
          f"{'MiB per env':>13}")
    for r in rows:
        print(f"{r['env']:<14}{r['isolation']:<10}{r['envs']:>5}{r['build_s']:>9.2f}{r['step_ms']:>15.2f}"
              f"{r['host_rss_mib']:>14.0f}{r['uss_per_env_mib']:>13.1f}")
    print(f"(worker peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
