"""Expert-parallel training benchmark: N trainer steps per expert-parallel degree, one table row each.

Columns: training tokens/s per rank, step time, the all-to-all time (dispatch + combine, forward + backward and
checkpoint recomputation, rank mean) and its share of the step, the count exchanges, the fraction of token rows
that crossed ranks, Quantile Balancing's max/mean load per expert and per expert-parallel rank (worst MoE layer, last
step), and the weight-gather time (`full_state_dict`: the experts gathered to rank 0, what publishing pays).

Ranks are PolicyTrainer processes (no Ray): spawned here with gloo on CPU, or launched by torchrun (NCCL on GPUs).

    # CPU, 2 ranks (spawned), EP 1 vs 2 on the tiny hybrid with 64 experts:
    .venv/bin/python scripts/bench_ep.py --nproc 2 --ep 1 2
    # 8 GPUs, one node:
    torchrun --nproc-per-node 8 scripts/bench_ep.py --preset small --experts 64 --top-k 4 --ep 1 8 \\
        --steps 5 --groups 16 --length 4096 --micro-batch-tokens 16384

Each degree builds a fresh trainer from the same seed; the first two steps are warm-up. `--store RUN_DIR` trains on
the trajectories a run stored (e.g. `agentrl run` of a built-in env) instead of synthetic ones.

On GPUs a second table sets each row beside `agentrl plan`'s prediction for the same layout (DP = ranks, the EP
degree, ZeRO-2, one node of H200s, the run's micro-batch and tokens per step, gradient checkpointing on as the
trainer here runs it): tokens/s per GPU, the all-to-all share, Quantile Balancing's load per EP rank (the plan
assumes 1.00) and the weight gather. `--plan-compare` prints it on CPU too (the plan is calibrated on H200s: the
figures are then not comparable). The plan prices every sequence at the longest length (`--length`), an upper
bound on attention for this mix of lengths.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrl.model.config import preset_config  # noqa: E402
from agentrl.net import free_port  # noqa: E402
from agentrl.types import Trajectory  # noqa: E402

WARMUP = 2
LENGTH_MIX = (1.0, 0.0625, 0.25, 0.125, 0.5, 0.03125, 0.09375, 0.1875)  # fractions of --length per trajectory


def batch(step: int, num_groups: int, length: int, vocab: int) -> list[Trajectory]:
    rng = np.random.default_rng(step)
    out = []
    for g in range(num_groups):
        for m in range(4):
            n = max(32, int(length * LENGTH_MIX[(g * 4 + m) % len(LENGTH_MIX)]))
            t = Trajectory(trajectory_id=f"{step}-{g}-{m}", task_id=str(g), group_id=f"{step}-{g}", env_id="bench",
                           reward=float(m % 2))
            t.append_prompt(rng.integers(0, vocab, 16).tolist())
            t.append_sampled(rng.integers(0, vocab, n - 16).tolist(), (-rng.random(n - 16) * 6).tolist(), version=0)
            out.append(t)
    return out


def stored_batches(run_dir: str, num_groups: int, vocab: int) -> list[list[Trajectory]]:
    """Batches of `num_groups` complete GRPO groups from a run's trajectory store (agentrl.store), in arrival order;
    routed experts dropped (they index the serving model's experts, not this benchmark's)."""
    from agentrl.store import TrajectoryStore

    groups: dict[str, list[Trajectory]] = {}
    for row in TrajectoryStore.read_trajectories(run_dir):
        row.pop("seq")
        if row.pop("kind") == "partial":
            continue
        t = Trajectory.from_row(row)
        if max(t.tokens) >= vocab:
            raise ValueError(f"stored trajectory {t.trajectory_id} has token id {max(t.tokens)} >= the model's "
                             f"vocabulary {vocab}: pass --vocab")
        t.routed_experts = None
        groups.setdefault(t.group_id, []).append(t)
    members = list(groups.values())
    out = [sum(members[i:i + num_groups], []) for i in range(0, len(members) - num_groups + 1, num_groups)]
    if not out:
        raise ValueError(f"{run_dir} holds {len(members)} trajectory groups, fewer than --groups {num_groups}")
    return out


def bench_one(args, ep: int, rank: int, world: int, local_rank: int, port: int) -> dict | None:
    from agentrl.trainer import LossConfig, TrainerConfig
    from agentrl.trainer.policy_trainer import PolicyTrainer

    overrides = {"vocab_size": args.vocab} if args.vocab else {}
    model = preset_config(args.preset, num_experts=args.experts, num_experts_per_token=args.top_k, **overrides)
    stored = stored_batches(args.store, args.groups, model.vocab_size) if args.store else None
    with tempfile.TemporaryDirectory() as run:
        cfg = TrainerConfig(run_dir=run, zero_stage=2, lr=1e-5, micro_batch_tokens=args.micro_batch_tokens,
                            expert_parallel=ep, loss=LossConfig(tis_cap=2.0), routing_replay=False,
                            num_threads=1 if not torch.cuda.is_available() else None)
        trainer = PolicyTrainer(cfg, model, rank=rank, world_size=world, local_rank=local_rank,
                                master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), master_port=port)
        rows = []
        for s in range(WARMUP + args.steps):
            trajectories = (stored[s % len(stored)] if stored else
                            batch(s, args.groups, args.length, model.vocab_size))
            m = trainer.step(trajectories)
            if s >= WARMUP:
                rows.append(m)
        dist.barrier()
        start = time.perf_counter()
        trainer.full_state_dict()
        gather_s = time.perf_counter() - start
        gather = torch.tensor([gather_s], dtype=torch.float64, device=trainer.device)  # NCCL reduces GPU tensors
        dist.all_reduce(gather, op=dist.ReduceOp.MAX)
        gather_s = gather.item()
        del trainer
    if rank != 0:
        return None
    mean = lambda key: statistics.mean(r.get(key, float("nan")) for r in rows)  # noqa: E731
    last = rows[-1]
    return {"ep": ep, "ranks": world, "tokens/s/rank": mean("tokens_per_s") / world, "step_s": mean("step_s"),
            "a2a_s": mean("ep/all_to_all_s") if ep > 1 else 0.0,
            "a2a_share": mean("ep/all_to_all_share") if ep > 1 else 0.0,
            "counts_s": mean("ep/count_exchange_s") if ep > 1 else 0.0,
            "rows_sent": mean("ep/rows_sent_frac") if ep > 1 else 0.0,
            "qb_expert": last.get("expert_load_max_over_mean", float("nan")),
            "qb_rank": last.get("ep/rank_load_max_over_mean", float("nan")) if ep > 1 else 1.0,
            "gather_s": gather_s, "tokens/step": mean("packed_tokens")}


def print_table(results: list[dict], args, world: int) -> None:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    data = f"trajectories of {args.store}" if args.store else "synthetic trajectories"
    print(f"\n{args.preset} preset, {args.experts} experts top-{args.top_k}, {world} ranks on {device}, {data}, "
          f"{args.steps} steps after {WARMUP} warm-up, ZeRO-2, micro-batch {args.micro_batch_tokens} tokens")
    print("| EP | tokens/s/rank | step s | all-to-all s | all-to-all share | count exchange s | rows sent to "
          "other ranks | QB max/mean per expert | QB max/mean per EP rank | weight gather s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['ep']} | {r['tokens/s/rank']:.0f} | {r['step_s']:.3f} | {r['a2a_s']:.3f} | "
              f"{100 * r['a2a_share']:.1f}% | {r['counts_s']:.3f} | {100 * r['rows_sent']:.0f}% | "
              f"{r['qb_expert']:.2f} | {r['qb_rank']:.2f} | {r['gather_s']:.3f} |")


def plan_prediction(args, ep: int, world: int, tokens_per_step: float) -> dict:
    """`agentrl plan`'s figures for the layout and workload this benchmark ran."""
    from agentrl import plan

    model = preset_config(args.preset, num_experts=args.experts, num_experts_per_token=args.top_k,
                          **({"vocab_size": args.vocab} if args.vocab else {}))
    layout = plan.Layout(dp=world, ep=ep, zero=2)
    cluster = plan.Cluster(num_gpus=world, gpus_per_node=max(world, 8))
    workload = plan.Workload(context=args.length, micro_batch_tokens=args.micro_batch_tokens,
                             tokens_per_step=max(1, round(tokens_per_step)), gradient_checkpointing=True)
    plan.check_layout(model, layout, cluster, workload)
    t = plan.step_time(model, layout, cluster, workload)
    return {"tokens/s/gpu": t.tokens_per_step / t.total_s / world, "a2a_share": t.expert_all_to_all_s / t.total_s,
            "gather_s": plan.weight_gather_s(model, layout, cluster)}


def print_plan_comparison(results: list[dict], args, world: int) -> None:
    print(f"\nmeasured against `agentrl plan` for the same layout (DP {world}, ZeRO-2, "
          f"{'H200s' if torch.cuda.is_available() else 'H200s; this run was on CPU: not comparable'})")
    print("| EP | tokens/s/GPU measured | plan | measured / plan | all-to-all share measured | plan | "
          "QB max/mean per EP rank measured | plan | weight gather s measured | plan |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        p = plan_prediction(args, r["ep"], world, r["tokens/step"])
        print(f"| {r['ep']} | {r['tokens/s/rank']:.0f} | {p['tokens/s/gpu']:.0f} | "
              f"{r['tokens/s/rank'] / p['tokens/s/gpu']:.2f} | {100 * r['a2a_share']:.1f}% | "
              f"{100 * p['a2a_share']:.1f}% | {r['qb_rank']:.2f} | 1.00 | {r['gather_s']:.3f} | {p['gather_s']:.4f} |")


def run_all(rank: int, world: int, local_rank: int, port: int, args) -> None:
    results = [bench_one(args, ep, rank, world, local_rank, port) for ep in args.ep]
    if rank == 0:
        print_table(results, args, world)
        if args.plan_compare or torch.cuda.is_available():
            print_plan_comparison(results, args, world)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    run_all(rank, world, rank, port, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2], help="expert-parallel degrees to compare")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4, help="GRPO groups of 4 trajectories per step")
    parser.add_argument("--length", type=int, default=1024, help="longest trajectory; the others are fractions")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's; stored tokens must fit)")
    parser.add_argument("--store", help="a run directory whose trajectory store supplies the batches (cycled)")
    parser.add_argument("--plan-compare", action="store_true",
                        help="print the comparison with `agentrl plan` on CPU too (always on GPUs)")
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        run_all(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)),
                int(os.environ["MASTER_PORT"]), args)
        return
    torch.multiprocessing.spawn(_spawned, args=(args.nproc, free_port(), args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
