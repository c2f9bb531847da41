"""Weight sync, trainer → vLLM engine: in memory (rollout.weight_sync.mode=memory) against through the disk (disk).

    python scripts/bench_weight_sync.py [--models tiny 50m 200m] [--repeats 3] [--bucket-mb 1024]

For each model: a trainer rank (ZeRO-2, fp32, this process) and a rollout worker whose vLLM engine (agentrl's plugin,
fp32, its engine core in a process of its own) serves the model. Each repeat perturbs the trainer's weights as a
step would, then syncs them both ways, one after the other:

- memory: `PolicyTrainer.sync_weights` streams the checkpoint tensors layer by layer through two /dev/shm buckets
  into the engine (vLLM's weight-transfer API, agentrl's backend), the engine commits the version;
- disk: `PolicyTrainer.publish_weights` gathers the state dict and writes weights/v{N} (safetensors, sha256
  checksums, fsync), then the engine reloads that directory in place.

After each sync the engine's log-probabilities of a fixed sequence are checked against the trainer's (fp32, 1e-4):
a figure for a sync that did not take is not a figure. Bytes are the checkpoint tensors moved (fp32); the disk
column counts what was written under weights/ during the memory syncs (goal: nothing). The memory path's first sync
is shown apart (a fresh /dev/shm buffer pays for its pages then), and its median split into the trainer's packing
(reading the layers, copying into the buffers) and the time it waited for the engine to read a buffer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from agentrl.init_model import init_model
from agentrl.report import markdown_table as table
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy_engine import EngineSpec, SamplingSpec
from agentrl.rollout.worker import LocalReceivers, RolloutWorker
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.policy_trainer import PolicyTrainer
from agentrl.types import Trajectory

_LAYOUT = dict(intermediate_size=1024, num_attention_heads=4, kv_lora_rank=128, qk_nope_head_dim=64,
               qk_rope_head_dim=32, v_head_dim=64)


def _kda(layers: int) -> dict:
    return dict(kda_layers=[i for i in range(1, layers + 1) if i % 4], num_heads=4, head_dim=64,
                full_attn_layers=[i for i in range(1, layers + 1) if i % 4 == 0], short_conv_kernel_size=4)


MODELS = {
    "tiny": {},
    "50m": dict(hidden_size=512, num_hidden_layers=8, num_experts=24, moe_intermediate_size=256,
                linear_attn_config=_kda(8), **_LAYOUT),
    "200m": dict(hidden_size=768, num_hidden_layers=12, num_experts=16, moe_intermediate_size=512,
                 linear_attn_config=_kda(12), **_LAYOUT),
}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) if os.path.isdir(
        path) else 0


def check(worker: RolloutWorker, run, trainer: PolicyTrainer, prompt: list[int]) -> float:
    """Largest |engine − trainer| log-prob over 24 tokens the engine samples after `prompt`."""
    engine = worker.engine
    gen = run(engine.generate(prompt, SamplingSpec(max_tokens=24, seed=1), []))
    t = Trajectory(trajectory_id="check", task_id="0", group_id="g", env_id="bench")
    t.append_prompt(prompt)
    t.append_sampled(gen.token_ids, gen.logprobs, gen.versions)
    ours = trainer.logprobs([t])[0][len(prompt):]
    return float(np.abs(np.asarray(gen.logprobs) - ours).max())


def one_model(name: str, args, rows: list) -> None:
    root = tempfile.mkdtemp(prefix=f"bench_sync_{name}_")
    ckpt = init_model(os.path.join(root, "ckpt"), preset="tiny", overrides=MODELS[name], vocab_size=1024)
    trainer = PolicyTrainer(TrainerConfig(run_dir=os.path.join(root, "run"), dtype="fp32", num_threads=2), ckpt)
    params = sum(p.numel() for p in trainer.policy.parameters())
    worker = RolloutWorker(EngineSpec(model=ckpt, max_model_len=1024, kv_cache_memory_bytes=64 << 20), ckpt,
                           RolloutConfig(env_isolation="thread"))
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    run(worker.ping())  # the engine is up before anything is timed
    prompt = list(range(5, 37))
    weights_dir = os.path.join(root, "run", "weights")
    memory, disk, publish, load, gaps, pack, wait = [], [], [], [], [], [], []
    moved = written_by_memory = 0
    g = torch.Generator().manual_seed(0)
    for _ in range(args.repeats):
        for mode in ("memory", "disk"):
            with torch.no_grad():  # new weights, as a training step makes them
                for p in trainer.policy.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
            trainer.version += 1
            before = dir_bytes(weights_dir)
            t0 = time.perf_counter()
            if mode == "memory":
                record = trainer.sync_weights(LocalReceivers(worker, run, (ckpt, 0)), bucket_bytes=args.bucket_mb << 20)
                memory.append(time.perf_counter() - t0)
                pack.append(record.pack_s)
                wait.append(record.wait_s)
                moved = record.num_bytes
                written_by_memory += dir_bytes(weights_dir) - before
            else:
                published = trainer.publish_weights()
                t1 = time.perf_counter()
                run(worker.update_weights(published.path, published.version))
                disk.append(time.perf_counter() - t0)
                publish.append(t1 - t0)
                load.append(time.perf_counter() - t1)
            assert run(worker.version()) == trainer.version
            gaps.append(check(worker, run, trainer, prompt))
    worker.shutdown()
    loop.close()
    trainer.close()
    if max(gaps) > 1e-4:
        raise RuntimeError(f"{name}: the engine's log-probs left the trainer's by {max(gaps):.2e} after a sync")
    m, d = statistics.median(memory), statistics.median(disk)
    rows.append([name, f"{params / 1e6:.1f}M", f"{moved / 2**20:,.0f}", f"{m:.3f}", f"{moved / m / 1e9:.2f}",
                 f"{written_by_memory}", f"{d:.3f}", f"{statistics.median(publish):.3f}",
                 f"{statistics.median(load):.3f}", f"{moved / d / 1e9:.2f}", f"{d / m:.1f}x", f"{max(gaps):.1e}",
                 f"{memory[0]:.3f}", f"{statistics.median(pack):.3f}", f"{statistics.median(wait):.3f}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--one", help="measure this model in this process and print its row as JSON (internal)")
    args = parser.parse_args()
    if args.one:
        rows: list = []
        one_model(args.one, args, rows)
        print("ROW " + json.dumps(rows[0]))
        return
    rows = []
    for name in args.models:  # each in a process of its own: an engine's ZMQ context left to the garbage collector
        # in a process that builds another engine can block forever (scripts/run_tests.py says more)
        out = subprocess.run([sys.executable, __file__, "--one", name, "--repeats", str(args.repeats),
                              "--bucket-mb", str(args.bucket_mb)], capture_output=True, text=True, check=True)
        rows.append(json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ROW "))[4:]))
        print(rows[-1], flush=True)
    print(f"\n### Weight sync, trainer -> engine ({args.repeats} of each, median; buckets of {args.bucket_mb} MB)\n")
    print(table(["model", "params", "MB moved", "memory s", "memory GB/s", "bytes written (memory)", "disk s",
                 "disk: publish s", "disk: engine load s", "disk GB/s", "disk / memory", "max |logp gap|",
                 "memory s, first sync", "memory: trainer packing s", "memory: waiting for the engine s"], rows))


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
