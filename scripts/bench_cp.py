"""Context parallelism of one long sequence: R ranks against one, in one run, printed as Markdown tables.

    python scripts/bench_cp.py --tokens 131072 524288 1048576   # 2 GPUs: one rank per GPU over NCCL
    python scripts/bench_cp.py --cp 1 2 --tokens 65536 262144   # one GPU: the ranks share it over gloo (memory only:
                                                                # gloo stages every exchange through host memory)
    python scripts/bench_cp.py --device cpu --preset tiny --tokens 4096 --check-tokens 1024   # a dry run on the CPU

Two tables (agentrl/model/context_parallel.py says how the ranks split a sequence and what crosses between them):
1. Equality, at --check-tokens: the loss and every parameter's gradient of the sequence split over R ranks against
   one rank running all of it, as relative errors. The whole-sequence run's expert choices are replayed in the split
   one: the two take different kernel paths (the split one's widened KDA state, its prefix attention), and a
   near-tied router choice that flips changes a token's output by design rather than by error.
2. Per length and degree: seconds per forward + backward (the slowest rank; median of --repeats after a warm-up),
   tokens/s, peak memory above the weights on each rank, and with NCCL the share of the step the GPU spends in NCCL
   kernels: the collectives, including the time a rank waits in them for the other, i.e. the idle share of the KDA
   state hand-off and the MLA latents' all-gather. A length that does not fit says OOM; the longest that trains is
   the last that does not.

The `small` preset (or --preset) in bf16 on CUDA, fp32 on the CPU; gradient checkpointing on, as the trainer trains.
Each run is a fresh set of processes: an out-of-memory rank leaves its peer inside a collective, so the parent ends
them all.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrl.net import free_port  # noqa: E402
from agentrl.report import markdown_table as table  # noqa: E402


def _placement(rank: int, world: int, device: str) -> tuple[torch.device, str]:
    """(this rank's device, the process group's backend): one GPU per rank over NCCL when there are enough, else the
    ranks share GPU 0 over gloo (NCCL refuses two ranks on one GPU), or the CPU over gloo."""
    if device == "cpu":
        return torch.device("cpu"), "gloo"
    if torch.cuda.device_count() >= world:
        return torch.device("cuda", rank), "nccl"
    return torch.device("cuda", 0), "gloo"


def _model(preset: str, device: torch.device):
    from agentrl.model.config import preset_config
    from agentrl.model.modeling import HybridMoEForCausalLM

    torch.manual_seed(0)  # every rank builds the same weights
    model = HybridMoEForCausalLM(preset_config(preset))
    model = model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32).train()
    model.gradient_checkpointing_enable()
    return model


def _sequence(model, tokens: int, world: int) -> torch.Tensor:
    """One sequence of random tokens, padded so that it splits evenly with each rank holding at least the short
    convolution's W−1 inputs (as the trainer pads); the same on every rank. [total + 1]: inputs and next tokens."""
    from agentrl.model.context_parallel import pad_length

    total = tokens + pad_length(tokens, world, max(model.config.kda_conv_size - 1, 1))
    return torch.randint(0, model.config.vocab_size, (total + 1,), generator=torch.Generator().manual_seed(0))


def _step(model, ids: torch.Tensor, rank: int, world: int, forced: torch.Tensor | None = None):
    """Forward + backward of this rank's slice of one sequence (all of it at world 1); the loss is the slice's share
    of the sequence's mean negative log-likelihood. Returns (loss, the routed experts [slice, L, K])."""
    import torch.distributed as dist

    from agentrl.model.context_parallel import ContextShard
    from agentrl.model.modeling import chunked_token_logprobs

    total = ids.numel() - 1
    cu = torch.tensor([0, total], dtype=torch.int32)
    shard = ContextShard.of(cu, rank=rank, size=world, group=dist.group.WORLD) if world > 1 else None
    lo, hi = (shard.lo, shard.hi) if shard else (0, total)
    device = model.lm_head.weight.device
    hidden, routed = model.model(ids[lo:hi].to(device), (shard.cu_seqlens if shard else cu).to(device), None, False,
                                 None if forced is None else forced[lo:hi].to(device), shard)
    logp, _ = chunked_token_logprobs(hidden, model.lm_head.weight, ids[lo + 1:hi + 1].to(device))
    loss = -logp.float().sum() / total
    loss.backward()
    return loss.detach(), routed


def _check(rank: int, world: int, model, ids: torch.Tensor) -> dict | None:
    """Rank 0 runs the whole sequence alone, then every rank its slice with the whole run's routing; the losses and
    gradients summed over the ranks against the whole run's (rank 0 returns the figures)."""
    import torch.distributed as dist

    device = model.lm_head.weight.device
    config = model.config
    total = ids.numel() - 1
    routed = torch.empty(total, len(model.moe_layers), config.num_experts_per_token, dtype=torch.long, device=device)
    reference: dict[str, torch.Tensor] = {}  # rank 0's whole-sequence gradients
    if rank == 0:
        whole, routed_whole = _step(model, ids, 0, 1)
        routed.copy_(routed_whole)
        reference = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    dist.broadcast(routed, src=0)
    loss, _ = _step(model, ids, rank, world, forced=routed.cpu())
    dist.all_reduce(loss)
    errors = {}
    for name, p in model.named_parameters():  # every rank reduces every gradient, in the same order
        grad = p.grad.detach().float() if p.grad is not None else torch.zeros(p.shape, device=device)
        dist.all_reduce(grad)
        if name in reference:
            ref = reference[name]
            errors[name] = float((grad.cpu() - ref).norm() / ref.norm().clamp_min(1e-12))
    if rank != 0:
        return None
    worst = max(errors, key=errors.get)
    return dict(loss=float(whole), loss_error=abs(float(loss) - float(whole)) / abs(float(whole)),
                worst=worst, worst_error=errors[worst], median_error=statistics.median(errors.values()),
                params=len(errors))


def _nccl_share(model, ids: torch.Tensor, rank: int, world: int, wall: float) -> float:
    """The share of one step's wall time that the GPU spent in NCCL kernels (one profiled step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model, ids, rank, world)
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    nccl_us = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == DeviceType.CUDA and "nccl" in e.key.lower())
    return nccl_us / 1e6 / wall


def _timings(rank: int, world: int, model, ids: torch.Tensor, repeats: int) -> dict:
    """This rank's seconds per step (after a warm-up), its peak memory above the weights, its NCCL share."""
    import torch.distributed as dist

    device = model.lm_head.weight.device
    cuda = device.type == "cuda"

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    _step(model, ids, rank, world)
    model.zero_grad(set_to_none=True)
    synchronize()
    weights = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        synchronize()
        started = time.perf_counter()
        _step(model, ids, rank, world)
        synchronize()
        seconds.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    peak = (torch.cuda.max_memory_allocated(device) - weights) / 2**30 if cuda else None
    nccl = (_nccl_share(model, ids, rank, world, statistics.median(seconds))
            if cuda and dist.get_backend() == "nccl" else None)
    return dict(seconds=seconds, peak_gib=peak, nccl_share=nccl)


def _rank(rank: int, world: int, port: int, job: dict, results) -> None:
    """One rank of one run: `job` is dict(what="check" | "time", tokens, preset, device, repeats). Puts (rank,
    figures) or (rank, "error: ...") (out of memory included), which makes the parent end every rank."""
    import torch.distributed as dist

    try:
        device, backend = _placement(rank, world, job["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(backend, rank=rank, world_size=world,
                                **({"device_id": device} if backend == "nccl" else {}))
        model = _model(job["preset"], device)
        ids = _sequence(model, job["tokens"], world)
        if job["what"] == "check":
            figures = _check(rank, world, model, ids)
        else:
            figures = _timings(rank, world, model, ids, job["repeats"])
            figures["backend"] = backend
        results.put((rank, figures))
        dist.barrier()
        dist.destroy_process_group()
    except torch.OutOfMemoryError:
        results.put((rank, "error: OOM"))
    except Exception:
        results.put((rank, "error: " + traceback.format_exc().strip().splitlines()[-1]))


def run(world: int, job: dict, timeout: float) -> list | str:
    """Every rank's figures in rank order, or why there are none ("OOM", an error, a timeout)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, job, results)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    failure = None
    while len(got) < world and failure is None:
        try:
            rank, figures = results.get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            failure = f"no result in {timeout:.0f} s"
            break
        if isinstance(figures, str):
            failure = figures.removeprefix("error: ")
        got[rank] = figures
    for p in procs:
        p.join(timeout=30 if failure is None else 1)
        if p.is_alive():  # a peer of a failed rank waits in a collective that will not come
            p.kill()
            p.join()
    return failure if failure is not None else [got[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072, 524288, 1048576])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="degrees to time at every length")
    parser.add_argument("--check-tokens", type=int, default=32768, help="the equality check's length (0: none)")
    parser.add_argument("--check-cp", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds per run before its ranks are ended")
    args = parser.parse_args()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "run through the device tool, or pass --device cpu for a dry run"
        where = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name()}"
    else:
        where = "the CPU"
    common = dict(preset=args.preset, device=args.device, repeats=args.repeats)

    if args.check_tokens:
        got = run(args.check_cp, dict(common, what="check", tokens=args.check_tokens), args.timeout)
        if isinstance(got, str):
            rows = [[f"{args.check_tokens:,}", args.check_cp, got, "", "", ""]]
        else:
            c = got[0]
            rows = [[f"{args.check_tokens:,}", args.check_cp, f"{c['loss']:.6f}", f"{c['loss_error']:.2e}",
                     f"{c['worst_error']:.2e} ({c['worst']})", f"{c['median_error']:.2e} over {c['params']}"]]
        print(f"### Context parallelism against one rank, `{args.preset}`, {where}: the split sequence's loss and "
              "gradients (summed over ranks; the whole run's routing replayed)\n", flush=True)
        print(table(["tokens", "CP", "loss, one rank", "loss: relative difference",
                     "gradients: largest relative error (parameter)", "median relative error"], rows))
        print(flush=True)

    rows = []
    for tokens in args.tokens:
        for world in args.cp:
            got = run(world, dict(common, what="time", tokens=tokens), args.timeout)
            if isinstance(got, str):
                rows.append([f"{tokens:,}", world, "", "", got, "", "", ""])
            else:
                step = statistics.median(max(per_rank) for per_rank in zip(*(g["seconds"] for g in got)))
                peaks = " / ".join(f"{g['peak_gib']:.1f}" for g in got) if got[0]["peak_gib"] is not None else ""
                nccl = (" / ".join(f"{g['nccl_share']:.0%}" for g in got)
                        if got[0]["nccl_share"] is not None else "")
                rows.append([f"{tokens:,}", world, got[0]["backend"] if world > 1 else "", f"{-(-tokens // world):,}",
                             f"{step:.2f}", f"{tokens / step:,.0f}", peaks, nccl])
            print(rows[-1], flush=True)
    print(f"\n### Context parallelism, `{args.preset}`, {where}: one sequence's forward + backward (gradient "
          f"checkpointing on; the slowest rank, median of {args.repeats})\n")
    print(table(["tokens", "CP", "backend", "tokens per rank", "s per step", "tokens/s",
                 "peak above weights per rank (GiB)", "NCCL kernels / step, per rank"], rows))
    print(flush=True)


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
