"""Triton kernels for the log-prob head's elementwise work over bf16/fp16 logits, on CUDA.

The head (`modeling._ChunkedLogprobs`) makes each chunk's logits z = h Wᵀ / τ with a GEMM, then needs per token
logsumexp(z) and the entropy (forward), and ∂z from them (backward). In PyTorch that is a copy of the GEMM's
low-precision output to fp32 and ~6 more passes over it (logsumexp alone reads it several times): at Kimi Linear's
164K vocabulary those passes took 20 ms of the head's 22 ms forward in an 8K-token step on an H200
(docs/benchmarks.md, "Real widths"). Here each is one pass over the GEMM's own output, computing in fp32:

- `row_logsumexp_entropy(z, τ)`: an online softmax per row. Each program runs over one split of a row and keeps, per
  lane, the running max m, s = Σ e^{z−m} and t = Σ e^{z−m} z; the splits are merged in PyTorch ([rows, splits], tiny)
  into logsumexp = M + log S and the entropy H = logsumexp − T/S (= logsumexp − E_p[z]).
- `grad_logits_(z, ...)`: ∂z = g_lp·[j = target] − p ⊙ (g_lp + g_H (z − E_p[z])), divided by τ, written over z in
  place (z is not needed after it; the next GEMMs take ∂z in z's dtype, as the PyTorch path rounds it).

The PyTorch forms in `_ChunkedLogprobs` stay the reference and the path for CPU, fp32 and fp64; tests/gpu compares the
two. `layers.set_fused(False)` turns these kernels off with the others.

On by default since session 25, when they first ran on a GPU (an H100): tests/gpu/test_logprob_kernels.py passed
(32 tests), and at Kimi Linear's width with 4 layers they raised training throughput by 24% at 8K tokens and 20% at
32K (docs/benchmarks.md, "The log-prob head's elementwise passes as Triton kernels"). `set_enabled(False)` turns
them alone off.
"""

from __future__ import annotations

import functools

import torch

from agentrl.model import layers

__all__ = ["available", "set_enabled", "row_logsumexp_entropy", "grad_logits_"]

SPLIT = 8192  # columns per program of the forward: 20 programs per row at a 164K vocabulary, 4 at 32K
BLOCK = 1024  # columns per step inside a program (and per program of the backward)
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@functools.cache
def _kernels():
    """The compiled kernels, or None where Triton does not import (CPU-only installs)."""
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit
    def lse_partials(z_ptr, stride, cols, inv_tau, m_ptr, s_ptr, t_ptr, splits,
                     SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        row, part = tl.program_id(0), tl.program_id(1)
        base = z_ptr + row.to(tl.int64) * stride
        # a finite floor instead of −inf: e^{m − m'} of two −inf is NaN; lanes that never see a column keep it and
        # weigh e^{floor − M} = 0 in the merge below
        m = tl.full([BLOCK], -3.0e38, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, SPLIT, BLOCK):
            offs = part * SPLIT + start + tl.arange(0, BLOCK)
            inside = offs < cols
            z = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32) * inv_tau
            new_m = tl.where(inside, tl.maximum(m, z), m)
            rescale = tl.exp(m - new_m)
            p = tl.where(inside, tl.exp(z - new_m), 0.0)
            s = s * rescale + p
            t = t * rescale + p * z
            m = new_m
        top = tl.max(m, 0)
        weight = tl.exp(m - top)
        out = row.to(tl.int64) * splits + part
        tl.store(m_ptr + out, top)
        tl.store(s_ptr + out, tl.sum(s * weight, 0))
        tl.store(t_ptr + out, tl.sum(t * weight, 0))

    @triton.jit
    def grad_logits(z_ptr, stride, cols, inv_tau, lse_ptr, ent_ptr, glp_ptr, gent_ptr, col_ptr, inside_ptr,
                    HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row, block = tl.program_id(0), tl.program_id(1)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < cols
        ptr = z_ptr + row.to(tl.int64) * stride + offs
        z = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * inv_tau
        lse = tl.load(lse_ptr + row)
        p = tl.exp(z - lse)
        if HAS_LP:
            g_lp = tl.load(glp_ptr + row)
        if HAS_ENT:  # the coefficient of −p: g_lp + g_H (z − E_p[z]), E_p[z] = lse − H
            coef = (z - (lse - tl.load(ent_ptr + row))) * tl.load(gent_ptr + row)
            if HAS_LP:
                coef = coef + g_lp
        else:
            coef = g_lp
        grad = -p * coef
        if HAS_LP:
            grad = grad + tl.where(offs == tl.load(col_ptr + row), g_lp * tl.load(inside_ptr + row), 0.0)
        tl.store(ptr, (grad * inv_tau).to(z_ptr.dtype.element_ty), mask=mask)

    return lse_partials, grad_logits


_ENABLED = True


def set_enabled(enabled: bool) -> bool:
    """Turns these kernels alone on or off (scripts/bench_gpu.py measures what they buy); returns the previous
    setting. `layers.set_fused(False)` turns them off with every other fused kernel."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, enabled
    return previous


def available(z: torch.Tensor) -> bool:
    """Whether the kernels take logits like `z`: CUDA, bf16 or fp16, the fused kernels on, Triton importable."""
    return (z.is_cuda and z.dtype in _LOW_PRECISION and _ENABLED and layers.fused_enabled()
            and _kernels() is not None)


def row_logsumexp_entropy(z: torch.Tensor, temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp, entropy) per row of softmax(z / τ), both fp32 [rows]; z is [rows, V], contiguous rows. The entropy
    comes back as zeros when not asked for (its accumulator costs nothing extra; the merge's division does)."""
    lse_partials, _ = _kernels()
    rows, cols = z.shape
    assert z.stride(1) == 1
    splits = _cdiv(cols, SPLIT)
    m, s, t = (torch.empty(rows, splits, device=z.device, dtype=torch.float32) for _ in range(3))
    if rows:
        lse_partials[(rows, splits)](z, z.stride(0), cols, 1.0 / temperature, m, s, t, splits,
                                     SPLIT=SPLIT, BLOCK=BLOCK, num_warps=8)
    top = m.amax(1, keepdim=True)
    weight = torch.exp(m - top)
    total = (s * weight).sum(1)
    lse = top.squeeze(1) + torch.log(total)
    if not entropy:
        return lse, torch.zeros_like(lse)
    return lse, lse - (t * weight).sum(1) / total


def grad_logits_(z: torch.Tensor, temperature: float, lse: torch.Tensor, entropy: torch.Tensor,
                 grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                 column: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """∂z of a block of logits z [rows, W] (z = the GEMM's output before the 1/τ) written over z, and returned.

    Per row: logsumexp and entropy of the full distribution (fp32), the incoming gradients (either may be None),
    `column`, the target's column in this block (int64, clamped into it), and `inside`, 1.0 where the target lies in
    the block, else 0.0 (fp32)."""
    _, kernel = _kernels()
    rows, cols = z.shape
    assert z.stride(1) == 1 and (grad_logprobs is not None or grad_entropy is not None)
    dummy = lse  # any fp32 pointer for an argument the kernel's constexpr flags never read
    if rows and cols:
        kernel[(rows, _cdiv(cols, BLOCK))](
            z, z.stride(0), cols, 1.0 / temperature, lse, entropy,
            grad_logprobs if grad_logprobs is not None else dummy,
            grad_entropy if grad_entropy is not None else dummy, column, inside,
            HAS_LP=grad_logprobs is not None, HAS_ENT=grad_entropy is not None, BLOCK=BLOCK, num_warps=4)
    return z


def _cdiv(a: int, b: int) -> int:  # ceil(a / b)
    return -(-a // b)
