"""The trajectory data path of one RL step: what passing the trajectories through the driver costs it.

    python scripts/bench_data_path.py [--trajectories 64] [--tokens 32768] [--workers 2] [--steps 3]

Stand-in rollout workers (Ray actors) make `--trajectories` synthetic trajectories of `--tokens` tokens per step (an
assistant/tool mix, log-probs, versions and routed experts [T, L, K]), and a stand-in trainer rank takes the batch.
Two paths, each in its own driver process so that its peak RSS is its own:

- `driver`: the data path before issue 21 — the workers return the trajectories to the driver, which puts them
  into the store actor, takes the training batch from it with ray.get and passes it to the trainer rank;
- `reference`: agentrl's — the workers put the trajectories into the store (agentrl.rollout.worker.put_results)
  and return summaries; the store hands the batch to the trainer rank as an object reference
  (TrajectoryStore.take_training_batch with num_returns=2).

Both persist every trajectory to Parquet in the store, as a job does. Reports the driver's peak RSS above its
baseline (sampled every 5 ms), the bytes that reached it, and the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from agentrl.report import markdown_table as table


def synthetic(trajectory_id: str, group_id: str, tokens: int, layers: int, top_k: int, seed: int):
    """A trajectory of `tokens` tokens: turns of 200 sampled tokens after 300-token observations."""
    from agentrl.types import Episode, Trajectory

    rng = np.random.default_rng(seed)
    t = Trajectory(trajectory_id=trajectory_id, task_id="0", group_id=group_id, env_id="bench",
                   episode=Episode(task_index=0, seed=seed))
    t.append_prompt(rng.integers(0, 150_000, 1024).tolist())
    while len(t.tokens) < tokens:
        n = min(200, tokens - len(t.tokens))
        t.append_sampled(rng.integers(0, 150_000, n).tolist(), (-rng.random(n)).tolist(), 3)
        n = min(300, tokens - len(t.tokens))
        if n:
            t.append_prompt(rng.integers(0, 150_000, n).tolist())
    t.routed_experts = rng.integers(0, 256, (len(t.tokens), layers, top_k), dtype=np.int16)
    t.reward = float(rng.random() < 0.5)
    return t


def run_mode(args) -> dict:
    import ray

    from agentrl.rollout.worker import put_results
    from agentrl.store import StoreConfig, TrajectoryStoreActor

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, store):
            self.store = store

        async def generate(self, step: int, ids: list[tuple[str, str]], to_store: bool):
            trajectories = [synthetic(tid, gid, args.tokens, args.layers, args.top_k, seed=hash((step, tid)) & 0xFFFF)
                            for tid, gid in ids]
            if not to_store:
                return trajectories
            await put_results(self.store, trajectories)
            return [t.summary() for t in trajectories]

    @ray.remote(num_cpus=0)
    class Trainer:
        def step(self, batch) -> dict:
            return {"tokens": sum(len(t.tokens) for t in batch)}

    run_dir = tempfile.mkdtemp(prefix="bench_data_path_")
    group_size = 8
    store = TrajectoryStoreActor.remote(StoreConfig(run_dir=run_dir, group_size=group_size))
    workers = [Worker.remote(store) for _ in range(args.workers)]
    trainer = Trainer.remote()
    import psutil

    me = psutil.Process()
    peak = [0]
    sampling = [True]

    def watch():
        while sampling[0]:
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.005)

    received = [0]
    real_get = ray.get

    def get(refs, *a, **k):  # what reaches the driver, by its pickled size
        value = real_get(refs, *a, **k)
        received[0] += len(pickle.dumps(value, protocol=5))
        return value

    ray.get = get
    ray.get(trainer.step.remote([]))  # the actors are up before the baseline
    ray.get([w.generate.remote(-1, [], True) for w in workers])
    baseline = me.memory_info().rss
    threading.Thread(target=watch, daemon=True).start()
    times = []
    for step in range(args.steps):
        ids = [(f"s{step}-g{i // group_size}-{i}", f"s{step}-g{i // group_size}") for i in range(args.trajectories)]
        # a group's members on one worker, as RolloutPool places them
        shares = [[x for x in ids if int(x[1].split("-g")[1]) % args.workers == w] for w in range(args.workers)]
        t0 = time.perf_counter()
        if args.mode == "driver":
            sampled = [t for part in ray.get([w.generate.remote(step, s, False) for w, s in zip(workers, shares)])
                       for t in part]
            ray.get(store.put.remote(sampled))
            batch = ray.get(store.take_batch.remote(args.trajectories // group_size, 3, 0))
            trained = ray.get(trainer.step.remote(batch.trajectories))
            del sampled, batch
        else:
            summaries = [s for part in ray.get([w.generate.remote(step, s, True) for w, s in zip(workers, shares)])
                         for s in part]
            selected, batch = store.take_training_batch.options(num_returns=2).remote(
                args.trajectories // group_size, 3, 0)
            assert len(summaries) == args.trajectories and ray.get(selected).taken
            trained = ray.get(trainer.step.remote(batch))
            del summaries, batch
        assert trained["tokens"] == args.trajectories * args.tokens, trained
        times.append(time.perf_counter() - t0)
    sampling[0] = False
    ray.shutdown()
    return {"mode": args.mode, "peak_rss_mb": (peak[0] - baseline) / 2**20, "received_kb": received[0] / 2**10 /
            args.steps, "step_s": sorted(times)[len(times) // 2], "first_step_s": times[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4, help="MoE layers in the routed-experts record")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--mode", choices=("driver", "reference"), help="run one path in this process (internal)")
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    rows = []
    for mode in ("driver", "reference"):
        cmd = [sys.executable, __file__, "--mode", mode] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                           if k != "mode"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ}).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rows.append([mode, f"{r['peak_rss_mb']:.0f}", f"{r['received_kb']:,.0f}", f"{r['step_s']:.2f}",
                     f"{r['first_step_s']:.2f}"])
    print(f"{args.trajectories} trajectories x {args.tokens} tokens per step (routed experts {args.layers}x"
          f"{args.top_k}), {args.workers} workers, {args.steps} steps, median step\n")
    print(table(["path", "driver peak RSS above baseline (MB)", "received by the driver per step (KiB)",
                 "step (s)", "first step (s)"], rows))


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
