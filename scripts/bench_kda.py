"""CPU benchmark of the KDA kernels: naive recurrence vs chunked bounded (dense tiles) vs chunked unbounded (pairwise).

Prints a markdown table of forward tokens/s at several lengths and forward+backward tokens/s of the chunked forms.
Inputs look like the layer's: unit q/k, g = −5·σ(x) (the bounded gate), β = σ(x); fp32, B = 1.

    .venv/bin/python scripts/bench_kda.py                       # T = 1K, 4K, 16K; H = 4, K = V = 64; 2 threads
    .venv/bin/python scripts/bench_kda.py --lengths 512 --repeats 2   # quick look

Each figure is the best of `--repeats` timed runs after one warm-up (the naive one at the longest length runs fewer
times: see the `runs` column). Best-of rather than mean because the CI machines are shared.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from agentrl.model.kda_ops import chunk_kda_torch, naive_recurrent_kda


def make_inputs(T: int, H: int, K: int, V: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q_BTHK = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k_BTHK = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v_BTHV = torch.randn(1, T, H, V, generator=gen)
    g_BTHK = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, generator=gen))
    beta_BTH = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    return [q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH]


def best_time(fn: Callable[[], object], runs: int, warmup: bool = True) -> tuple[float, object]:
    """Best wall time of `runs` calls (after one untimed call if `warmup`), and the last call's result."""
    if warmup:
        fn()
    best, out = float("inf"), None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def forward_fn(kernel: Callable, xs: list[torch.Tensor], **kw) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return kernel(*xs, output_final_state=True, **kw)

    return run


def forward_backward_fn(xs: list[torch.Tensor], **kw) -> Callable[[], object]:
    leaves = [x.clone().requires_grad_(True) for x in xs]

    def run():
        for x in leaves:
            x.grad = None
        o, S = chunk_kda_torch(*leaves, output_final_state=True, **kw)
        (o.square().sum() + S.square().sum()).backward()

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64, help="K = V")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backward-length", type=int, default=4096)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    H, D = args.heads, args.dim
    load = os.getloadavg()[0]
    if args.threads > 1 and load + args.threads > (os.cpu_count() or 1) + 0.5:
        print(f"WARNING: load average {load:.1f} + {args.threads} threads exceeds {os.cpu_count()} cores: with more "
              "than one thread, the naive loop's many small BLAS calls stall on descheduled threads and the speedups "
              "below are inflated; use --threads 1 on a shared machine\n")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B=1, H={H}, K=V={D}, fp32, "
          f"g = -5*sigmoid(x); load average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")

    print("| T | naive tok/s (runs) | chunked bounded tok/s | speedup | chunked unbounded tok/s | speedup "
          "| bounded/unbounded | max abs err vs naive |")
    print("|---|---|---|---|---|---|---|---|")
    for T in args.lengths:
        xs = make_inputs(T, H, D, D)
        naive_runs = 1 if T >= 16384 else max(1, args.repeats // 2)
        # the naive loop has nothing to warm up beyond its first step: no untimed run for the single-run case
        t_naive, (o_ref, _) = best_time(forward_fn(naive_recurrent_kda, xs), naive_runs, warmup=naive_runs > 1)
        t_bounded, (o_b, _) = best_time(forward_fn(chunk_kda_torch, xs, bounded=True), args.repeats)
        t_unbounded, (o_u, _) = best_time(forward_fn(chunk_kda_torch, xs, bounded=False), max(1, args.repeats // 2))
        err = max((o_b - o_ref).abs().max().item(), (o_u - o_ref).abs().max().item())
        print(
            f"| {T} | {T / t_naive:,.0f} ({naive_runs}) | {T / t_bounded:,.0f} | {t_naive / t_bounded:.1f}x "
            f"| {T / t_unbounded:,.0f} | {t_naive / t_unbounded:.1f}x | {t_unbounded / t_bounded:.2f}x | {err:.1e} |",
            flush=True,
        )

    T = args.backward_length
    xs = make_inputs(T, H, D, D)
    t_fb_bounded, _ = best_time(forward_backward_fn(xs, bounded=True), max(1, args.repeats // 2))
    t_fb_unbounded, _ = best_time(forward_backward_fn(xs, bounded=False), max(1, args.repeats // 2))
    print(f"\n| forward+backward, T={T} | tok/s |\n|---|---|")
    print(f"| chunked bounded | {T / t_fb_bounded:,.0f} |")
    print(f"| chunked unbounded | {T / t_fb_unbounded:,.0f} |")
    print(f"| bounded/unbounded | {t_fb_unbounded / t_fb_bounded:.2f}x |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
