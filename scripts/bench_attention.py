"""MLA attention fwd+bwd, packed as the trainer packs: FlashAttention-2 with the narrower head dim zero-padded (the
keys first concatenated from k_nope and the shared k_pe, as `mla_attention` does off the kernels' path) against
agentrl's Triton kernels that take MLA's head dims as they are (agentrl/model/mla_kernels.py). One table.

Shapes: the `small` preset's MLA (16 heads, q/k 64+64, v 64) and Kimi Linear 48B's (32 heads, q/k 128+64, v 128),
bf16, on CUDA. Each cell: median of 4 timed fwd+bwd after 2 warm-ups (the first call autotunes the kernels); TFLOP/s
count the causal attention's useful FLOPs, 3.5 × 2·Σ L²/2·H·(d_qk + d_v), for both columns (flash's padding is
work it does, not work the model needs).

    python3 scripts/bench_attention.py [--shapes small kimi-linear] [--packings "1 x 32768" ...]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrl.model import mla_kernels  # noqa: E402
from agentrl.model.mla import keys_and_values, varlen_causal_attention  # noqa: E402
from agentrl.report import markdown_table as table  # noqa: E402

PACKINGS = {"4 x 4095": [4095] * 4,
            "14 of 127..511": [255, 127, 383, 255, 127, 383, 255, 511, 127, 383, 255, 511, 127, 383],
            "14 of 511..2047": [1023, 511, 2047, 767, 1023, 511, 2047, 767, 1023, 2047, 767, 1023, 2047, 767],
            "1 x 32768": [32768], "1 x 131072": [131072]}
SHAPES = {"small": (16, 64, 64, 64), "kimi-linear": (32, 128, 64, 128)}  # heads, E (nope), P (rope), V


def padded_flash(q, kv, k_pe, cu, scale):
    k, v = keys_and_values(kv, k_pe, q.shape[-1] - k_pe.shape[-1])
    return varlen_causal_attention(q, k, v, cu, scale)


def median_ms(attention, tensors, grad, cu, scale) -> float:
    times = []
    for i in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        attention(*tensors, cu, scale).backward(grad)
        b.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b))
    for t in tensors:
        t.grad = None
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--packings", nargs="+", default=list(PACKINGS), choices=list(PACKINGS))
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        H, E, P, V = SHAPES[shape]
        for packing in args.packings:
            lengths = PACKINGS[packing]
            T = sum(lengths)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
            q = torch.randn(T, H, E + P, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            kv = torch.randn(T, H, E + V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k_pe = torch.randn(T, P, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(T, H, V, device="cuda", dtype=torch.bfloat16)
            flops = 3.5 * 2 * sum(n * n / 2 for n in lengths) * H * (E + P + V)
            flash = median_ms(padded_flash, (q, kv, k_pe), grad, cu, (E + P) ** -0.5)
            kernels = median_ms(mla_kernels.mla_causal_attention, (q, kv, k_pe), grad, cu, (E + P) ** -0.5)
            rows.append([shape, packing, T, f"{flash:.2f}", f"{flops / flash / 1e9:.0f}", f"{kernels:.2f}",
                         f"{flops / kernels / 1e9:.0f}", f"{flash / kernels:.2f}×"])
            print(rows[-1], flush=True)
            del q, kv, k_pe, grad
            torch.cuda.empty_cache()
    print(f"\n### MLA attention fwd+bwd, bf16, one {torch.cuda.get_device_name()}\n")
    print(table(["shape", "packing", "tokens", "flash, padded: ms", "TFLOP/s", "Triton kernels: ms", "TFLOP/s",
                 "flash / kernels"], rows))


if __name__ == "__main__":
    main()
