"""Context parallelism on CPU: one trajectory's forward and backward split over CP ranks (gloo), per rank.

    python scripts/bench_context_parallel.py [--tokens 65536] [--cp 1 2 4] [--layout tiny|kda] [--cores 2]

For each length and CP degree, `cp` processes each build the same model (fp32, gradient checkpointing on, as a long
trajectory trains), take their slice of one packed sequence (agentrl/model/context_parallel.py) and run the log-prob
loss forward and backward once. Per run: the slowest rank's seconds, each rank's peak resident memory above what it
held before the step (sampled every 5 ms), and the loss summed over the ranks (equal for every CP degree of a length:
the sum of the same per-token log-probs).

`--layout tiny` is the tiny preset (3 KDA layers, 1 MLA); `kda` the same model with every layer KDA, whose cost is
linear in the length (MLA's attention is quadratic: on this CPU's flash kernel ~50 GFLOP/s, a 1M-token causal
attention layer is hours). More CP ranks than cores share the cores: their seconds are not a speed-up measure.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrl.model.config import preset_config
from agentrl.model.context_parallel import ContextShard, pad_length
from agentrl.model.modeling import HybridMoEForCausalLM, chunked_token_logprobs
from agentrl.net import free_port
from agentrl.report import markdown_table as table

LAYOUTS = {
    "tiny": {},
    "kda": dict(linear_attn_config=dict(kda_layers=[1, 2, 3, 4], full_attn_layers=[], num_heads=2, head_dim=16,
                                        short_conv_kernel_size=4, gate_lower_bound=-5.0)),
}


def _rank(rank: int, world: int, port: int, tokens: int, layout: str, cores: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, cores // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config("tiny", **LAYOUTS[layout])).float().train()
    model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(1)
    total = tokens + pad_length(tokens, world, 4)
    ids = torch.randint(0, model.config.vocab_size, (total + 1,), generator=g)
    cu = torch.tensor([0, total], dtype=torch.int32)
    shard = ContextShard.of(cu, rank=rank, size=world, group=dist.group.WORLD) if world > 1 else None
    lo, hi = (shard.lo, shard.hi) if shard else (0, total)
    me = psutil.Process()
    base = peak = me.memory_info().rss
    running = [True]

    def watch():
        nonlocal peak
        while running[0]:
            peak = max(peak, me.memory_info().rss)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    dist.barrier()
    t0 = time.perf_counter()
    hidden, _ = model.model(ids[lo:hi], shard.cu_seqlens if shard else cu, shard=shard)
    logp, _ = chunked_token_logprobs(hidden, model.lm_head.weight, ids[lo + 1:hi + 1])
    loss = logp.sum() / tokens
    loss.backward()
    seconds = time.perf_counter() - t0
    running[0] = False
    watcher.join()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    results.put((rank, seconds, (peak - base) / 2**20, float(summed)))
    dist.destroy_process_group()


def run(tokens: int, cp: int, layout: str, cores: int) -> tuple[float, list[float], float]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ctx_procs = mp.start_processes(_rank, args=(cp, free_port(), tokens, layout, cores, results), nprocs=cp,
                                   join=False, start_method="spawn")
    rows = sorted(results.get() for _ in range(cp))
    ctx_procs.join()
    return max(r[1] for r in rows), [r[2] for r in rows], rows[0][3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layout", choices=list(LAYOUTS), default="tiny")
    parser.add_argument("--cores", type=int, default=2, help="torch threads shared out over the ranks")
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        for cp in args.cp:
            seconds, peaks, loss = run(tokens, cp, args.layout, args.cores)
            rows.append([f"{tokens:,}", cp, f"{seconds:.1f}", " / ".join(f"{p:,.0f}" for p in peaks),
                         f"{max(peaks) / (tokens / cp) * 1024:.1f}", f"{loss:.6f}"])
            print(rows[-1], flush=True)
    print(f"\n### One trajectory's forward + backward under context parallelism (`{args.layout}` layout, fp32, "
          f"gradient checkpointing, gloo, {args.cores} CPU threads shared by the ranks)\n")
    print(table(["tokens", "CP", "seconds (slowest rank)", "peak RSS growth per rank (MiB)",
                 "KiB per token of the largest slice", "loss (summed over ranks)"], rows))


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
