"""One MLA attention fwd+bwd, packed as the trainer packs: SDPA's cuDNN and memory-efficient backends vs the flash
varlen kernel with v zero-padded to the qk head dim (what `varlen_causal_attention` runs on CUDA in bf16). One table.

The `small` preset's MLA shape (16 heads, q/k head dim 128, v head dim 64, bf16) on CUDA; the output gradient is
contiguous in [1, H, T, V] (the layout in which cuDNN ran clean, docs/benchmarks.md, issue 8). Median of 4 timed
runs after 2 warm-up.

    python3 scripts/bench_attention.py
"""
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrl.model.mla import _flash_varlen_causal_attention, _varlen_causal_attention  # noqa: E402

CASES = {"4 x 4095": [4095] * 4,
         "14 of 127..511": [255, 127, 383, 255, 127, 383, 255, 511, 127, 383, 255, 511, 127, 383],
         "14 of 511..2047": [1023, 511, 2047, 767, 1023, 511, 2047, 767, 1023, 2047, 767, 1023, 2047, 767],
         "1 x 32768": [32768], "1 x 131072": [131072]}
H, E, V = 16, 128, 64


def sdpa_only(backend):
    def attention(*args):
        with sdpa_kernel([backend]):
            return _varlen_causal_attention(*args)
    return attention


cudnn, memory_efficient = sdpa_only(SDPBackend.CUDNN_ATTENTION), sdpa_only(SDPBackend.EFFICIENT_ATTENTION)
print("| packing | tokens | cuDNN ms | memory-efficient ms | flash varlen, v padded ms | memory-efficient / flash |")
print("|---|---:|---:|---:|---:|---:|")
for name, lengths in CASES.items():
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k = (torch.randn(T, H, E, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(T, H, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, H, T, V, device="cuda", dtype=torch.bfloat16)[0].transpose(0, 1)  # dO: [1, H, T, V] contiguous
    row = []
    for attention in (cudnn, memory_efficient, _flash_varlen_causal_attention):
        times = []
        for i in range(6):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            attention(q, k, v, cu, E ** -0.5).backward(g)
            b.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(a.elapsed_time(b))
        row.append(sorted(times)[len(times) // 2])
    print(f"| {name} | {T} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} | {row[1] / row[2]:.2f} |", flush=True)
