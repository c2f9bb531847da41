"""MLA's causal attention over packed sequences as Triton kernels that take its head dims as they are, on CUDA.

MLA attends with q/k head dim E+P (E = qk_nope_head_dim, P = qk_rope_head_dim) and value head dim V: the `small`
preset 64+64 / 64, Kimi Linear and K3 128+64 / 128. FlashAttention-2, the one varlen kernel torch ships, takes one
head dim for q, k and v, so `mla.varlen_causal_attention` zero-pads the narrower side: a quarter of the `small`
preset's attention FLOPs (256 per score against 192) and a sixth of Kimi Linear's (384 against 320) multiply zeros,
and the keys are first concatenated from their two parts, [k_nope | k_pe broadcast over heads], into a new
tensor.

These kernels read the parts where MLA's projections leave them:
    q     [T, H, E+P]   its columns [0, E) pair with k_nope, [E, E+P) with k_pe
    kv    [T, H, E+V]   kv_b_proj's output: k_nope = columns [0, E), v = columns [E, E+V)
    k_pe  [T, P]        one decoupled key per token, shared by every head
and give o [T, H, V]; the backward: ∂q, ∂kv (∂k_nope and ∂v in kv's layout) and ∂k_pe (summed over heads).
Each score is q_nope·k_nope + q_pe·k_pe, two matrix products over E and P columns, so both must be powers of two (and
V), ≥ 16: every preset but the CPU test sizes.

The algorithm is FlashAttention-2's (an online softmax over key tiles forward; the backward recomputes the
probabilities from the saved log-sum-exp, one kernel over key tiles for ∂k/∂v and one over query tiles for ∂q, so
nothing is accumulated atomically and the result is deterministic). Tiles run along the packed token axis and may
straddle a sequence boundary: each token's sequence start and end (from cu_seqlens, on the GPU, no host sync) mask
what crosses one. Each program runs its tiles in three ranges so that only the tiles on the diagonal or on a
sequence start pay for the mask.

Under context parallelism a rank's queries are the end of their sequences and the keys run further back (kv and k_pe
[S, ...], S ≥ T, with their own offsets): each query row's first key and own key position, and each key's first and
end query rows, come from `attention_bounds`, and the causal window aligns to the end of the keys (bottom right), as
`context_parallel.prefix_causal_attention`, the reference there.

`mla.py` keeps FlashAttention-2 with padding (and SDPA off CUDA) as the reference and as the path for other shapes;
tests/gpu/test_mla_kernels.py compares the two, forward and backward.
"""

from __future__ import annotations

import math
import os

import torch

from agentrl.model import layers

__all__ = ["available", "set_enabled", "attention_bounds", "mla_causal_attention"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_LOG2E = math.log2(math.e)


try:  # CPU-only installs have no Triton: `available` says no and mla.py keeps its other paths
    import triton
    import triton.language as tl
except Exception:
    triton = None


def _kernels():
    """(cdiv, forward, key_grads, query_grads), or None without Triton."""
    return None if triton is None else (triton.cdiv, forward, key_grads, query_grads)


if triton is not None:
    # (outer tile, inner tile, warps, stages); under Triton's interpreter (TRITON_INTERPRET=1, checks on a CPU)
    # one config of small tiles, which has no GPU to autotune on and makes short sequences span several tiles
    _TILES = ([(32, 16, 4, 1)] if os.environ.get("TRITON_INTERPRET") == "1" else
              [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 32, 4, 4), (128, 128, 8, 2)])

    def configs(outer: str, inner: str):
        return [triton.Config({outer: a, inner: b}, num_warps=w, num_stages=s) for a, b, w, s in _TILES]

    @triton.jit
    def load_rows(base, rows, stride, cols, T):
        """A [len(rows), len(cols)] tile; rows past T read as 0."""
        return tl.load(base + rows.to(tl.int64)[:, None] * stride + cols[None, :], mask=(rows < T)[:, None],
                       other=0.0)

    @triton.jit
    def load_cols(base, rows, stride, cols, T):
        """The transposed tile, [len(cols), len(rows)]."""
        return tl.load(base + rows.to(tl.int64)[None, :] * stride + cols[:, None], mask=(rows < T)[None, :],
                       other=0.0)

    @triton.jit
    def tile_ranges(starts, ends, first, last, BLOCK: tl.constexpr, END_INCLUSIVE: tl.constexpr):
        """The tiles the entries [first, last] of a program reach, each entry from starts[i] to ends[i] (+1 when
        END_INCLUSIVE): from the first entry's start to the last entry's end, split at a and b: tiles starting in
        [a, b) lie after every entry's start and end before the first entry's end, and need no mask; [lo, a) and
        [b, hi) do (a = b when none is whole). Tiles start at multiples of BLOCK. Both bounds are nondecreasing
        along the entries. For query rows: their sequences' first keys and their own keys (inclusive); for keys:
        the first query rows that see them and their sequences' query ends."""
        lo = tl.load(starts + first) // BLOCK * BLOCK
        hi = tl.load(ends + last) + END_INCLUSIVE
        full_lo = tl.cdiv(tl.load(starts + last), BLOCK) * BLOCK
        full_hi = (tl.load(ends + first) + END_INCLUSIVE) // BLOCK * BLOCK
        a = tl.minimum(full_lo, hi)
        return lo, a, tl.maximum(full_hi, a), hi

    @triton.jit
    def forward_tiles(acc, l_i, m_i, q_a, q_b, kv, stride_kt, k_pe, stride_pt, row_start, row_own, lo, hi, S,
                      qk_scale, E: tl.constexpr, P: tl.constexpr, V: tl.constexpr, BLOCK_N: tl.constexpr,
                      MASK: tl.constexpr):
        """The online softmax over key tiles starting in [lo, hi) (multiples of BLOCK_N but for hi); `MASK` keeps
        each row's keys from its sequence's first (row_start) to its own (row_own)."""
        cols_e, cols_p, cols_v = tl.arange(0, E), tl.arange(0, P), E + tl.arange(0, V)
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            s = tl.dot(q_a, load_cols(kv, keys, stride_kt, cols_e, S))
            s = tl.dot(q_b, load_cols(k_pe, keys, stride_pt, cols_p, S), s)
            s = s * qk_scale  # log2 units: the softmax in exp2
            if MASK:
                keep = (keys[None, :] <= row_own[:, None]) & (keys[None, :] >= row_start[:, None])
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = load_rows(kv, keys, stride_kt, cols_v, S)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        return acc, l_i, m_i

    @triton.autotune(configs=configs("BLOCK_M", "BLOCK_N"), key=["E", "P", "V"])
    @triton.jit
    def forward(q, stride_qt, stride_qh, kv, stride_kt, stride_kh, k_pe, stride_pt, o, stride_ot, stride_oh,
                lse, key_start, own_key, T, S, qk_scale, E: tl.constexpr, P: tl.constexpr, V: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        first, h = tl.program_id(0) * BLOCK_M, tl.program_id(1)
        rows = first + tl.arange(0, BLOCK_M)
        last = tl.minimum(first + BLOCK_M, T) - 1
        row_start = tl.load(key_start + rows, mask=rows < T, other=0)
        row_own = tl.load(own_key + rows, mask=rows < T, other=0)
        q_h, kv_h = q + h.to(tl.int64) * stride_qh, kv + h.to(tl.int64) * stride_kh
        q_a = load_rows(q_h, rows, stride_qt, tl.arange(0, E), T)
        q_b = load_rows(q_h, rows, stride_qt, E + tl.arange(0, P), T)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: e^(m − m') of two −inf would be NaN
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, V], tl.float32)
        lo, a, b, hi = tile_ranges(key_start, own_key, first, last, BLOCK_N, 1)
        acc, l_i, m_i = forward_tiles(acc, l_i, m_i, q_a, q_b, kv_h, stride_kt, k_pe, stride_pt, row_start, row_own,
                                      lo, a, S, qk_scale, E, P, V, BLOCK_N, True)
        acc, l_i, m_i = forward_tiles(acc, l_i, m_i, q_a, q_b, kv_h, stride_kt, k_pe, stride_pt, row_start, row_own,
                                      a, b, S, qk_scale, E, P, V, BLOCK_N, False)
        acc, l_i, m_i = forward_tiles(acc, l_i, m_i, q_a, q_b, kv_h, stride_kt, k_pe, stride_pt, row_start, row_own,
                                      b, hi, S, qk_scale, E, P, V, BLOCK_N, True)
        inside = rows < T
        tl.store(lse + h.to(tl.int64) * T + rows, m_i + tl.math.log2(l_i), mask=inside)
        out = acc / l_i[:, None]
        o_h = o + h.to(tl.int64) * stride_oh
        tl.store(o_h + rows.to(tl.int64)[:, None] * stride_ot + tl.arange(0, V)[None, :],
                 out.to(o.dtype.element_ty), mask=inside[:, None])

    @triton.jit
    def key_grad_tiles(dk_a, dk_b, dv, k_a, k_b, v, key_first, key_end, q_h, stride_qt, do_h, stride_dt, lse_h,
                       delta_h, lo, hi, T, qk_scale, E: tl.constexpr, P: tl.constexpr, V: tl.constexpr,
                       BLOCK_M: tl.constexpr, MASK: tl.constexpr):
        """∂k and ∂v of one key tile from the query tiles starting in [lo, hi), in the transposed form (scores as
        [keys, queries]); `MASK` keeps each key's query rows [key_first, key_end): those of its sequence whose own
        key is at or after it."""
        for start in range(lo, hi, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            inside = rows < T
            q_a = load_rows(q_h, rows, stride_qt, tl.arange(0, E), T)
            q_b = load_rows(q_h, rows, stride_qt, E + tl.arange(0, P), T)
            lse = tl.load(lse_h + rows, mask=inside, other=0.0)
            s_t = tl.dot(k_a, tl.trans(q_a))
            s_t = tl.dot(k_b, tl.trans(q_b), s_t)
            p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])
            if MASK:
                keep = (rows[None, :] >= key_first[:, None]) & (rows[None, :] < key_end[:, None])
                p_t = tl.where(keep, p_t, 0.0)
            do = load_rows(do_h, rows, stride_dt, tl.arange(0, V), T)
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dp_t = tl.dot(v, tl.trans(do))
            delta = tl.load(delta_h + rows, mask=inside, other=0.0)
            ds_t = (p_t * (dp_t - delta[None, :])).to(q_a.dtype)
            dk_a = tl.dot(ds_t, q_a, dk_a)
            dk_b = tl.dot(ds_t, q_b, dk_b)
        return dk_a, dk_b, dv

    @triton.autotune(configs=configs("BLOCK_N", "BLOCK_M"), key=["E", "P", "V"])
    @triton.jit
    def key_grads(q, stride_qt, stride_qh, kv, stride_kt, stride_kh, k_pe, stride_pt, do, stride_dt, stride_dh,
                  lse, delta, first_row, query_end, dkv, dk_pe, T, S, qk_scale, sm_scale, E: tl.constexpr,
                  P: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """∂k_nope and ∂v (into dkv, kv's layout) and this head's ∂k_pe (dk_pe [H, S, P]) for one key tile."""
        first, h = tl.program_id(0) * BLOCK_N, tl.program_id(1)
        keys = first + tl.arange(0, BLOCK_N)
        last = tl.minimum(first + BLOCK_N, S) - 1
        key_first = tl.load(first_row + keys, mask=keys < S, other=0)
        key_end = tl.load(query_end + keys, mask=keys < S, other=0)
        kv_h = kv + h.to(tl.int64) * stride_kh
        k_a = load_rows(kv_h, keys, stride_kt, tl.arange(0, E), S)
        k_b = load_rows(k_pe, keys, stride_pt, tl.arange(0, P), S)
        v = load_rows(kv_h, keys, stride_kt, E + tl.arange(0, V), S)
        dk_a = tl.zeros([BLOCK_N, E], tl.float32)
        dk_b = tl.zeros([BLOCK_N, P], tl.float32)
        dv = tl.zeros([BLOCK_N, V], tl.float32)
        q_h, do_h = q + h.to(tl.int64) * stride_qh, do + h.to(tl.int64) * stride_dh
        lse_h, delta_h = lse + h.to(tl.int64) * T, delta + h.to(tl.int64) * T
        lo, a, b, hi = tile_ranges(first_row, query_end, first, last, BLOCK_M, 0)
        dk_a, dk_b, dv = key_grad_tiles(dk_a, dk_b, dv, k_a, k_b, v, key_first, key_end, q_h, stride_qt, do_h,
                                        stride_dt, lse_h, delta_h, lo, a, T, qk_scale, E, P, V, BLOCK_M, True)
        dk_a, dk_b, dv = key_grad_tiles(dk_a, dk_b, dv, k_a, k_b, v, key_first, key_end, q_h, stride_qt, do_h,
                                        stride_dt, lse_h, delta_h, a, b, T, qk_scale, E, P, V, BLOCK_M, False)
        dk_a, dk_b, dv = key_grad_tiles(dk_a, dk_b, dv, k_a, k_b, v, key_first, key_end, q_h, stride_qt, do_h,
                                        stride_dt, lse_h, delta_h, b, hi, T, qk_scale, E, P, V, BLOCK_M, True)
        inside = (keys < S)[:, None]
        dkv_rows = dkv + h.to(tl.int64) * stride_kh + keys.to(tl.int64)[:, None] * stride_kt
        tl.store(dkv_rows + tl.arange(0, E)[None, :], (dk_a * sm_scale).to(dkv.dtype.element_ty), mask=inside)
        tl.store(dkv_rows + E + tl.arange(0, V)[None, :], dv.to(dkv.dtype.element_ty), mask=inside)
        dpe_rows = dk_pe + (h.to(tl.int64) * S + keys.to(tl.int64))[:, None] * P
        tl.store(dpe_rows + tl.arange(0, P)[None, :], (dk_b * sm_scale).to(dk_pe.dtype.element_ty), mask=inside)

    @triton.jit
    def query_grad_tiles(dq_a, dq_b, q_a, q_b, do, lse, delta, row_start, row_own, kv_h, stride_kt, k_pe, stride_pt,
                         lo, hi, S, qk_scale, E: tl.constexpr, P: tl.constexpr, V: tl.constexpr,
                         BLOCK_N: tl.constexpr, MASK: tl.constexpr):
        """∂q of one query tile from the key tiles starting in [lo, hi); `MASK` as in forward_tiles."""
        cols_e, cols_p, cols_v = tl.arange(0, E), tl.arange(0, P), E + tl.arange(0, V)
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            k_a_t = load_cols(kv_h, keys, stride_kt, cols_e, S)
            k_b_t = load_cols(k_pe, keys, stride_pt, cols_p, S)
            s = tl.dot(q_a, k_a_t)
            s = tl.dot(q_b, k_b_t, s)
            p = tl.math.exp2(s * qk_scale - lse[:, None])
            if MASK:
                keep = (keys[None, :] <= row_own[:, None]) & (keys[None, :] >= row_start[:, None])
                p = tl.where(keep, p, 0.0)
            dp = tl.dot(do, load_cols(kv_h, keys, stride_kt, cols_v, S))
            ds = (p * (dp - delta[:, None])).to(q_a.dtype)
            dq_a = tl.dot(ds, tl.trans(k_a_t), dq_a)
            dq_b = tl.dot(ds, tl.trans(k_b_t), dq_b)
        return dq_a, dq_b

    @triton.autotune(configs=configs("BLOCK_M", "BLOCK_N"), key=["E", "P", "V"])
    @triton.jit
    def query_grads(q, stride_qt, stride_qh, kv, stride_kt, stride_kh, k_pe, stride_pt, do, stride_dt, stride_dh,
                    lse, delta, key_start, own_key, dq, T, S, qk_scale, sm_scale, E: tl.constexpr,
                    P: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """∂q (dq, q's layout) for one query tile."""
        first, h = tl.program_id(0) * BLOCK_M, tl.program_id(1)
        rows = first + tl.arange(0, BLOCK_M)
        inside = rows < T
        last = tl.minimum(first + BLOCK_M, T) - 1
        row_start = tl.load(key_start + rows, mask=inside, other=0)
        row_own = tl.load(own_key + rows, mask=inside, other=0)
        q_h, kv_h = q + h.to(tl.int64) * stride_qh, kv + h.to(tl.int64) * stride_kh
        q_a = load_rows(q_h, rows, stride_qt, tl.arange(0, E), T)
        q_b = load_rows(q_h, rows, stride_qt, E + tl.arange(0, P), T)
        do_h = do + h.to(tl.int64) * stride_dh
        d_o = load_rows(do_h, rows, stride_dt, tl.arange(0, V), T)
        lse_r = tl.load(lse + h.to(tl.int64) * T + rows, mask=inside, other=0.0)
        delta_r = tl.load(delta + h.to(tl.int64) * T + rows, mask=inside, other=0.0)
        dq_a = tl.zeros([BLOCK_M, E], tl.float32)
        dq_b = tl.zeros([BLOCK_M, P], tl.float32)
        lo, a, b, hi = tile_ranges(key_start, own_key, first, last, BLOCK_N, 1)
        dq_a, dq_b = query_grad_tiles(dq_a, dq_b, q_a, q_b, d_o, lse_r, delta_r, row_start, row_own, kv_h,
                                      stride_kt, k_pe, stride_pt, lo, a, S, qk_scale, E, P, V, BLOCK_N, True)
        dq_a, dq_b = query_grad_tiles(dq_a, dq_b, q_a, q_b, d_o, lse_r, delta_r, row_start, row_own, kv_h,
                                      stride_kt, k_pe, stride_pt, a, b, S, qk_scale, E, P, V, BLOCK_N, False)
        dq_a, dq_b = query_grad_tiles(dq_a, dq_b, q_a, q_b, d_o, lse_r, delta_r, row_start, row_own, kv_h,
                                      stride_kt, k_pe, stride_pt, b, hi, S, qk_scale, E, P, V, BLOCK_N, True)
        dq_rows = dq + h.to(tl.int64) * stride_qh + rows.to(tl.int64)[:, None] * stride_qt
        tl.store(dq_rows + tl.arange(0, E)[None, :], (dq_a * sm_scale).to(dq.dtype.element_ty),
                 mask=inside[:, None])
        tl.store(dq_rows + E + tl.arange(0, P)[None, :], (dq_b * sm_scale).to(dq.dtype.element_ty),
                 mask=inside[:, None])


_ENABLED = True


def set_enabled(enabled: bool) -> bool:
    """Turns these kernels alone on or off (scripts/bench_attention.py and bench_gpu.py measure what they buy);
    returns the previous setting. `layers.set_fused(False)` turns them off with every other fused kernel."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, enabled
    return previous


def _power_of_two(n: int) -> bool:
    return 16 <= n <= 256 and n & (n - 1) == 0


def available(q: torch.Tensor, nope_dim: int, pe_dim: int, v_dim: int) -> bool:
    """Whether the kernels take MLA attention of these head dims on q's device and dtype: CUDA, bf16 or fp16, the
    fused kernels on, Triton importable, and E, P and V powers of two in [16, 256]."""
    return (q.is_cuda and q.dtype in _LOW_PRECISION and _ENABLED and layers.fused_enabled()
            and all(_power_of_two(d) for d in (nope_dim, pe_dim, v_dim)) and _kernels() is not None)


def attention_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor, num_queries: int, num_keys: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernels mask with, from the queries' and the keys' packed offsets (equal without context
    parallelism), on their device (no host sync), int32: per query row its sequence's first key and its own key
    (each sequence's queries are the last of its keys), per key its sequence's first query row that sees it and the
    sequence's query end. All four are nondecreasing."""
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    shift = cu_k[1:] - cu_q[1:]  # per sequence: own key − query row
    rows = torch.arange(num_queries, device=cu_q.device, dtype=torch.int32)
    keys = torch.arange(num_keys, device=cu_k.device, dtype=torch.int32)
    seq_of_row = torch.searchsorted(cu_q[1:], rows, right=True)
    seq_of_key = torch.searchsorted(cu_k[1:], keys, right=True)
    key_start = cu_k[seq_of_row]
    own_key = rows + shift[seq_of_row]
    first_row = torch.maximum(keys - shift[seq_of_key], cu_q[seq_of_key])
    query_end = cu_q[seq_of_key + 1]
    return tuple(t.to(torch.int32).contiguous() for t in (key_start, own_key, first_row, query_end))


class _MLAAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, k_pe, cu_q, cu_k, scale, nope_dim):
        cdiv, forward, _, _ = _kernels()
        (num_queries, heads, qk_dim), num_keys = q.shape, kv.shape[0]
        pe_dim, v_dim = qk_dim - nope_dim, kv.shape[-1] - nope_dim
        # contiguous q and kv (as MLA's projections leave them): ∂q and ∂kv are written in the same strides
        q, kv = q.contiguous(), kv.contiguous()
        k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
        bounds = attention_bounds(cu_q, cu_k, num_queries, num_keys)
        o = q.new_empty(num_queries, heads, v_dim)
        lse = q.new_empty(heads, num_queries, dtype=torch.float32)  # log2 units
        qk_scale = scale * _LOG2E
        if num_queries:
            forward[lambda meta: (cdiv(num_queries, meta["BLOCK_M"]), heads)](
                q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.stride(1), k_pe, k_pe.stride(0),
                o, o.stride(0), o.stride(1), lse, bounds[0], bounds[1], num_queries, num_keys, qk_scale,
                E=nope_dim, P=pe_dim, V=v_dim)
        ctx.save_for_backward(q, kv, k_pe, o, lse, *bounds)
        ctx.scale, ctx.nope_dim = scale, nope_dim
        return o

    @staticmethod
    def backward(ctx, do):
        cdiv, _, key_grads, query_grads = _kernels()
        q, kv, k_pe, o, lse, key_start, own_key, first_row, query_end = ctx.saved_tensors
        (num_queries, heads, qk_dim), num_keys = q.shape, kv.shape[0]
        nope_dim = ctx.nope_dim
        pe_dim, v_dim = qk_dim - nope_dim, kv.shape[-1] - nope_dim
        do = do if do.stride(-1) == 1 else do.contiguous()
        # Δ = rowsum(∂o ⊙ o), the softmax backward's per-row term, [H, T]
        delta = (do.float() * o.float()).sum(-1).transpose(0, 1).contiguous()
        dq, dkv = torch.empty_like(q), torch.empty_like(kv)
        dk_pe_heads = q.new_empty(heads, num_keys, pe_dim)  # each head's ∂k_pe, summed below
        qk_scale = ctx.scale * _LOG2E
        common = (q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.stride(1), k_pe, k_pe.stride(0),
                  do, do.stride(0), do.stride(1), lse, delta)
        sizes = (num_queries, num_keys, qk_scale, ctx.scale)
        if num_queries:
            key_grads[lambda meta: (cdiv(num_keys, meta["BLOCK_N"]), heads)](
                *common, first_row, query_end, dkv, dk_pe_heads, *sizes, E=nope_dim, P=pe_dim, V=v_dim)
            query_grads[lambda meta: (cdiv(num_queries, meta["BLOCK_M"]), heads)](
                *common, key_start, own_key, dq, *sizes, E=nope_dim, P=pe_dim, V=v_dim)
        else:
            dkv.zero_()
            dk_pe_heads.zero_()
        dk_pe = dk_pe_heads.sum(0, dtype=torch.float32).to(k_pe.dtype)
        return dq, dkv, dk_pe, None, None, None, None


def mla_causal_attention(q_THE: torch.Tensor, kv_SHC: torch.Tensor, k_pe_SP: torch.Tensor,
                         cu_seqlens: torch.Tensor, scale: float,
                         key_cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v, causal within each packed sequence, with k = [kv[..., :E] | k_pe] and
    v = kv[..., E:], E = q's head dim − k_pe's width. Returns o [T, H, V]. Check `available` first.

    `key_cu_seqlens`: the keys' offsets when a sequence's keys run further back than its queries (context
    parallelism: a rank's piece of a sequence attends over the keys from the sequence's start), each sequence's
    queries being its last keys (bottom-right causal, as `context_parallel.prefix_causal_attention`). None: the
    queries' own tokens."""
    nope_dim = q_THE.shape[-1] - k_pe_SP.shape[-1]
    cu_k = cu_seqlens if key_cu_seqlens is None else key_cu_seqlens
    return _MLAAttention.apply(q_THE, kv_SHC, k_pe_SP, cu_seqlens, cu_k, scale, nope_dim)
