"""Trainer benchmark on CPU: training tokens/s of the tiny model with 2 DeepSpeed ranks (ZeRO-2 vs ZeRO-3), and
weight-publish latency against model size (ZeRO-3 gather on 2 ranks + write of `<run>/weights/v{N}`).

Ranks are Ray actors exactly as in training (`create_trainer_group`), one CPU and one torch thread each.

    .venv/bin/python scripts/bench_trainer.py                 # both tables
    .venv/bin/python scripts/bench_trainer.py --skip-publish  # training only
    .venv/bin/python scripts/bench_trainer.py --large         # adds a ~450M-parameter publish row (~6 GB RAM)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import ray  # noqa: E402

from agentrl.model.config import preset_config  # noqa: E402
from agentrl.trainer import LossConfig, TrainerConfig, create_trainer_group  # noqa: E402
from agentrl.types import Trajectory  # noqa: E402

LENGTHS = (1024, 64, 256, 128, 512, 32, 96, 192)  # one long and many short trajectories per step

PUBLISH_SIZES = {
    "tiny": {},
    "10M": dict(hidden_size=256, vocab_size=8192, num_experts=16, moe_intermediate_size=128,
                intermediate_size=512),
    "86M": dict(hidden_size=512, vocab_size=32768, num_experts=16, moe_intermediate_size=256,
                intermediate_size=1024, num_hidden_layers=8,
                linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8], num_heads=4,
                                        head_dim=64)),
}
LARGE = {"454M": dict(hidden_size=1024, vocab_size=32768, num_experts=32, moe_intermediate_size=512,
                      intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                      linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8],
                                              num_heads=8, head_dim=64))}


def batch(step: int, num_groups: int, vocab: int) -> list[Trajectory]:
    rng = np.random.default_rng(step)
    out = []
    for g in range(num_groups):
        for m in range(4):
            length = LENGTHS[(g * 4 + m) % len(LENGTHS)]
            t = Trajectory(trajectory_id=f"{step}-{g}-{m}", task_id=str(g), group_id=f"{step}-{g}", env_id="bench",
                           reward=float(m % 2))
            t.append_prompt(rng.integers(0, vocab, 16).tolist())
            t.append_sampled(rng.integers(0, vocab, length - 16).tolist(), (-rng.random(length - 16) * 6).tolist(),
                             version=0)
            out.append(t)
    return out


def on_all(group, method, *args):
    return ray.get([getattr(r, method).remote(*args) for r in group.ranks])


def bench_training(stage: int, steps: int, num_groups: int, checkpointing: bool) -> dict:
    with tempfile.TemporaryDirectory() as run:
        cfg = TrainerConfig(run_dir=run, zero_stage=stage, lr=1e-5, micro_batch_tokens=1024,
                            zero3_param_persistence_threshold=0, gradient_checkpointing=checkpointing,
                            loss=LossConfig(tis_cap=2.0))
        start = time.perf_counter()
        group = create_trainer_group(cfg, preset_config("tiny"), num_ranks=2)
        startup = time.perf_counter() - start
        try:
            for s in range(2):  # warm-up
                on_all(group, "step", batch(s, num_groups, 512))
            times, tokens, micro = [], 0, 0
            for s in range(steps):
                trajs = ray.put(batch(100 + s, num_groups, 512))
                start = time.perf_counter()
                m = on_all(group, "step", trajs)[0]
                times.append(time.perf_counter() - start)
                tokens, micro = m["packed_tokens"], m["micro_batches"]
        finally:
            group.shutdown()
    return dict(stage=stage, checkpointing=checkpointing, startup_s=startup, tokens=tokens, micro=micro,
                step_s=statistics.median(times), tokens_per_s=tokens / statistics.median(times))


def bench_publish(name: str, overrides: dict, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as run:
        cfg = TrainerConfig(run_dir=run, zero_stage=3, zero3_param_persistence_threshold=0, keep_weight_versions=1)
        group = create_trainer_group(cfg, preset_config("tiny", **overrides), num_ranks=2)
        try:
            rows = []
            for _ in range(repeats):
                start = time.perf_counter()
                p = on_all(group, "publish_weights")[0]
                rows.append((time.perf_counter() - start, p.gather_s, p.write_s, p.num_bytes))
            params = on_all(group, "info")[0]["parameters"]
        finally:
            group.shutdown()
    total, gather, write, nbytes = (statistics.median(col) for col in zip(*rows))
    return dict(name=name, params=params, mb=nbytes / 2**20, gather_s=gather, write_s=write, total_s=total,
                mb_per_s=nbytes / 2**20 / total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8, help="GRPO groups of 4 per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-publish", action="store_true")
    parser.add_argument("--large", action="store_true")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = [bench_training(stage, args.steps, args.groups, ckpt) for stage in (2, 3) for ckpt in (True, False)]
        print("\nTraining, tiny model (0.31M params), 2 ranks x 1 CPU thread, fp32, gloo, "
              "token budget 1024/micro-batch")
        print("| ZeRO | grad. ckpt | tokens/step | micro-batches/rank | step (s, median) | tokens/s | start-up (s) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['stage']} | {'on' if r['checkpointing'] else 'off'} | {r['tokens']:.0f} | {r['micro']} | "
                  f"{r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['startup_s']:.1f} |")
        if not args.skip_publish:
            sizes = dict(PUBLISH_SIZES, **(LARGE if args.large else {}))
            pubs = [bench_publish(name, kw, args.repeats) for name, kw in sizes.items()]
            print("\nWeight publishing, ZeRO-3 on 2 ranks: gather (layer by layer) to rank 0, write "
                  "safetensors + checksums, fsync, rename")
            print("| model | params | size (MB, fp32) | gather (s) | write (s) | total (s) | MB/s |")
            print("|---|---|---|---|---|---|---|")
            for p in pubs:
                print(f"| {p['name']} | {p['params'] / 1e6:.1f}M | {p['mb']:.1f} | {p['gather_s']:.3f} | "
                      f"{p['write_s']:.3f} | {p['total_s']:.3f} | {p['mb_per_s']:.0f} |")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
