"""KDA (Kimi Delta Attention) kernels: a naive recurrence, a chunked PyTorch form for CPU, a decode step, a dispatcher.

Kernels, and the elementwise prologue that turns the KDA layer's projections into their inputs (`prologue`: q and k
L2-normalised, the log-decay gate, β's sigmoid), which `kda` applies itself when handed the projections: fla's kernels
fuse it on CUDA. No parameters are held here. All kernels are stateless keyword functions returning
`(o, final_state)` in fla's conventions (state `[N, H, K, V]`, key-major; variable length through `cu_seqlens`).

Math (per sequence and head; S ∈ R^{K×V}, g_t ≤ 0 the per-channel log-decay, scale = K^-1/2 by default):
    S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ,        o_t = S_tᵀ (scale · q_t)

Chunked form (WY/UT transform) over tiles of C = 16 tokens; γ = inclusive cumsum of g inside a tile, S₀ the state
entering the tile, rows of Q, K, V the tile's tokens:
    A_ti = β_t Σ_c k_tc k_ic e^{γ_tc − γ_ic}   (i < t),      M_ti = scale Σ_c q_tc k_ic e^{γ_tc − γ_ic}   (i ≤ t)
    [U | W] = (I + A)⁻¹ diag(β) [V | K⊙e^γ]                     (no S₀ in it)
    u = U − W S₀,    o = scale (Q⊙e^γ) S₀ + M u,    S_C = Diag(e^{γ_C}) S₀ + (K⊙e^{γ_C−γ})ᵀ u
With Q' = scale (Q⊙e^γ) − M W, o = M U + Q' S₀. So A, M, (I + A)⁻¹, U, W, M U and Q' are computed for all tiles of
all sequences at once; only the chain over tiles runs sequentially, batched over sequences and heads, as two matmuls
per tile step: [u; o] = [U; M U] − [W; −Q'] S₀, then S_C from u.

The bounded decay (DESIGN.md: g = g_min·σ(·), g_min = −5) keeps every tile's cumulative log-decay in [−80, 0], so
e^{−γ} ≤ e^{80} is finite in fp32 and A, M are dense matmuls of K⊙e^{γ} and K⊙e^{−γ}, diagonal tiles included
(`bounded=True`). `bounded=False` is the comparison path for arbitrary g: it forms the pairwise decays e^{γ_t − γ_i}
(a [C, C, K] tensor per tile) with the future entries masked before the exponential, never e^{−γ} alone.

Where this departs from fla (fla-org/flash-linear-attention, fla-core 0.6.0):
- One tile level of 16 tokens (fla: 64-token chunks of 16-token sub-blocks, in Triton), and (I + A)⁻¹ from a batched
  triangular solve against the identity.
- Bounded tiles balance the two factors by a constant, e^{γ+40} and e^{−γ−40} = 1/e^{γ+40}, both within
  [e^{−40}, e^{40}], so they and their gradients (the reciprocal's is −1/x²) stay in fp32's normal range at the
  bound; unshifted, that gradient reaches e^{160} and turns to inf. fla shifts by the tile's first cumulative gate
  instead; a constant also keeps the rounding exactly causal.
- State math runs in fp32 whatever the input dtype (fp64 when the inputs are fp64, so tests can check gradients
  tightly); outputs come back in v's dtype. No grouped-value heads (v has the same H as q/k).

Tensor names carry their shape as a suffix:
    B batch, T tokens per batch row, H heads, K key/query head dim, V value head dim, N sequences,
    R flattened token rows (B·T), J tiles over all sequences, C tokens per tile,
    D = 2C rows (a tile's rows twice: u over o), x a batch of (tile, head) pairs inside the sequential pass.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from agentrl.model import static_shapes
from agentrl.model.layers import l2norm

__all__ = [
    "CHUNK_SIZE",
    "MAX_TILE_LOG_DECAY",
    "FLA_DECODE_MAX_LEN",
    "MODES",
    "naive_recurrent_kda",
    "chunk_kda_torch",
    "recurrent_kda_step",
    "GateParams",
    "kda_gate",
    "prologue",
    "kda",
]

CHUNK_SIZE = 16
# Most negative cumulative log-decay one bounded tile may reach: e^80 ≈ 5.5e34 is finite in fp32 and bf16.
MAX_TILE_LOG_DECAY = 80.0
# Constant that centres the bounded tile's factors e^{γ+shift}, e^{−γ−shift} inside [e^-40, e^40].
_TILE_SHIFT = MAX_TILE_LOG_DECAY / 2
# Tiles × heads per run of the chunked form's parallel part: [256, 16, 64] fp32 temporaries are 1 MiB.
_BLOCK_TILE_HEADS = 256
# Like fla's KDA layer: without autograd, up to this many tokens go to fla's fused recurrent kernel.
FLA_DECODE_MAX_LEN = 64
MODES = ("auto", "chunk", "recurrent", "naive")


# ----------------------------------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------------------------------


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None, cu_seqlens: Tensor | None
) -> int:
    """Checks shapes and dtypes (no device sync); returns N, the number of sequences."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    for name, x, want in (("k", k, (B, T, H, K)), ("g", g, (B, T, H, K)), ("beta", beta, (B, T, H))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)} to match q {list(q.shape)}, got {list(x.shape)}")
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V] to match q, got {list(v.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if cu_seqlens is None:
        N = B
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along T and B must be 1, got B={B}")
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor [N+1] of offsets, "
                f"got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
            )
        N = cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = {[N, H, K, v.shape[-1]]}, got {list(initial_state.shape)}"
        )
    return N


def _seq_bounds(cu_seqlens: Tensor | None, B: int, T: int) -> list[tuple[int, int]]:
    """[start, end) of each sequence in the flattened [B·T] token rows; validates cu_seqlens' values."""
    if cu_seqlens is None:
        return [(b * T, (b + 1) * T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        shown = cu if len(cu) <= 10 else cu[:5] + ["..."] + cu[-3:]
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {shown}")
    return list(zip(cu[:-1], cu[1:]))


def _compute_dtype(*xs: Tensor | None) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


# ----------------------------------------------------------------------------------------------------------------------
# naive recurrence and the decode step
# ----------------------------------------------------------------------------------------------------------------------


def _delta_rule_step(
    qs_NHK: Tensor, k_NHK: Tensor, v_NHV: Tensor, g_NHK: Tensor, beta_NH: Tensor, S_NHKV: Tensor
) -> tuple[Tensor, Tensor]:
    """One token: decay, delta-rule write, read. qs is already scaled; all inputs in the compute dtype."""
    S_NHKV = S_NHKV * g_NHK.exp().unsqueeze(-1)
    pred_NHV = (k_NHK.unsqueeze(-2) @ S_NHKV).squeeze(-2)  # S'ᵀ k
    u_NHV = beta_NH.unsqueeze(-1) * (v_NHV - pred_NHV)
    S_NHKV = S_NHKV + k_NHK.unsqueeze(-1) * u_NHV.unsqueeze(-2)
    o_NHV = (qs_NHK.unsqueeze(-2) @ S_NHKV).squeeze(-2)
    return o_NHV, S_NHKV


def _naive_loop(
    q_BTHK: Tensor, k_BTHK: Tensor, v_BTHV: Tensor, g_BTHK: Tensor, beta_BTH: Tensor, S_BHKV: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    o_list = []
    # unbind, not x[:, t]: one backward node instead of a full-size zero gradient per token
    per_token = zip(*(x.unbind(1) for x in (q_BTHK * scale, k_BTHK, v_BTHV, g_BTHK, beta_BTH)))
    for qs_BHK, k_BHK, v_BHV, g_BHK, beta_BH in per_token:
        o_BHV, S_BHKV = _delta_rule_step(qs_BHK, k_BHK, v_BHV, g_BHK, beta_BH, S_BHKV)
        o_list.append(o_BHV)
    if not o_list:
        return v_BTHV.new_zeros(v_BTHV.shape), S_BHKV
    return torch.stack(o_list, dim=1), S_BHKV


def naive_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Reference KDA: the per-token recurrence, one Python step per token (batched over B, looped over sequences).

    Args:
        q, k: `[B, T, H, K]`, already L2-normalised by the caller.
        v: `[B, T, H, V]`.
        g: `[B, T, H, K]` per-channel log-decay (≤ 0); any magnitude.
        beta: `[B, T, H]`.
        scale: multiplies q; defaults to `K ** -0.5`.
        initial_state: `[N, H, K, V]`, N = B, or N = len(cu_seqlens) − 1 with cu_seqlens. Zeros when None.
        output_final_state: return the state after each sequence's last token.
        cu_seqlens: int `[N+1]` offsets of sequences packed along T (then B must be 1).

    Returns:
        o `[B, T, H, V]` in v's dtype, and the final state `[N, H, K, V]` in fp32 (fp64 for fp64 inputs) or None.
    """
    N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    q_, k_, v_, g_, beta_ = (x.to(dt) for x in (q, k, v, g, beta))
    S0_NHKV = q_.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(dt)
    if cu_seqlens is None:
        o_BTHV, S_NHKV = _naive_loop(q_, k_, v_, g_, beta_, S0_NHKV, scale)
    else:
        o_parts, S_parts = [], []
        for n, (s, e) in enumerate(_seq_bounds(cu_seqlens, B, T)):
            o_1LHV, S_1HKV = _naive_loop(
                q_[:, s:e], k_[:, s:e], v_[:, s:e], g_[:, s:e], beta_[:, s:e], S0_NHKV[n : n + 1], scale
            )
            o_parts.append(o_1LHV)
            S_parts.append(S_1HKV)
        o_BTHV = torch.cat(o_parts, dim=1)
        S_NHKV = torch.cat(S_parts, dim=0)
    return o_BTHV.to(v.dtype), (S_NHKV if output_final_state else None)


def recurrent_kda_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """One decoding token per sequence.

    Args:
        q, k, g: `[N, H, K]` (q, k L2-normalised; g the log-decay). v: `[N, H, V]`. beta: `[N, H]`.
        state: `[N, H, K, V]`, the cache entering this token (fp32).
        scale: multiplies q; defaults to `K ** -0.5`.

    Returns:
        o `[N, H, V]` in v's dtype and the new state `[N, H, K, V]` (fp32; fp64 for fp64 inputs). `state` is not
        modified: the caller stores the returned tensor (e.g. `cache.copy_(new_state)`) where it keeps its cache.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [N, H, K] (one token per sequence), got shape {list(q.shape)}")
    N, H, K = q.shape
    for name, x, want in (("k", k, (N, H, K)), ("g", g, (N, H, K)), ("beta", beta, (N, H))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)} to match q {list(q.shape)}, got {list(x.shape)}")
    if v.ndim != 3 or tuple(v.shape[:2]) != (N, H):
        raise ValueError(f"v must be [N, H, V] = [{N}, {H}, V], got {list(v.shape)}")
    if tuple(state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(f"state must be [N, H, K, V] = {[N, H, K, v.shape[-1]]}, got {list(state.shape)}")
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(q, k, v, g, beta, state)
    o_NHV, S_NHKV = _delta_rule_step(
        q.to(dt) * scale, k.to(dt), v.to(dt), g.to(dt), beta.to(dt), state.to(dt)
    )
    return o_NHV.to(v.dtype), S_NHKV


# ----------------------------------------------------------------------------------------------------------------------
# chunked form
# ----------------------------------------------------------------------------------------------------------------------


class _TileLayout:
    """Where each sequence's tiles sit, in step-major order.

    Sequences are ranked by tile count (descending) and tile slots are ordered (tile index j, rank r): the tiles that
    take part in inter-tile step j are then one contiguous block of `step_counts[j]` slots, the ranks 0..m_j−1, and the
    sequences still running at step j are a prefix of the ranking. Every sequence is padded to whole tiles with
    k = v = 0, g = 0, β = 0, an identity step.
    """

    def __init__(self, bounds: list[tuple[int, int]], num_rows: int, H: int, C: int, device: torch.device):
        N = len(bounds)
        lengths = [e - s for s, e in bounds]
        num_tiles = [-(-L // C) for L in lengths]
        order = sorted(range(N), key=lambda n: -num_tiles[n])  # rank -> sequence (stable)
        rank_of = [0] * N
        for r, n in enumerate(order):
            rank_of[n] = r
        self.rank_of_N = torch.tensor(rank_of, dtype=torch.long, device=device)
        self.order_N = torch.tensor(order, dtype=torch.long, device=device)
        nt_sorted = torch.tensor([num_tiles[n] for n in order], dtype=torch.long)
        max_tiles = int(nt_sorted[0]) if N else 0
        active = torch.arange(max_tiles)[:, None] < nt_sorted[None, :]  # [steps, ranks]
        self.step_counts = active.sum(1).tolist()
        j_J, r_J = active.nonzero(as_tuple=True)  # row-major, so step-major slots
        seq_J = torch.tensor(order, dtype=torch.long)[r_J]
        start_J = torch.tensor([s for s, _ in bounds], dtype=torch.long)[seq_J]
        len_J = torch.tensor(lengths, dtype=torch.long)[seq_J]
        pos_JC = j_J[:, None] * C + torch.arange(C)[None, :]
        valid_JC = pos_JC < len_J[:, None]
        row_JC = torch.where(valid_JC, start_J[:, None] + pos_JC, 0)
        J = row_JC.shape[0]
        h_H = torch.arange(H)
        # flat index into [R·H] (token row, head) for every tile slot, and back
        src_JHC = row_JC[:, None, :] * H + h_H[None, :, None]
        self.src_JHC = src_JHC.to(device)
        self.pad_J1C = (~valid_JC)[:, None, :].to(device) if not bool(valid_JC.all()) else None
        slot_JHC = torch.arange(J * H * C).view(J, H, C)
        dst_RH = torch.empty(num_rows * H, dtype=torch.long)
        valid_JHC = valid_JC[:, None, :].expand(J, H, C)
        dst_RH[src_JHC[valid_JHC]] = slot_JHC[valid_JHC]
        self.dst_RH = dst_RH.view(num_rows, H).to(device)

    def blocks(self, max_slots: int) -> list[tuple[int, int, list[int]]]:
        """Splits the steps into runs of whole steps of about `max_slots` tile slots: (first slot, end slot, counts)."""
        out, start, counts, filled = [], 0, [], 0
        for m in self.step_counts:
            if counts and filled + m > max_slots:
                out.append((start, start + filled, counts))
                start, counts, filled = start + filled, [], 0
            counts.append(m)
            filled += m
        if counts:
            out.append((start, start + filled, counts))
        return out

    def gather(self, x_RHD: Tensor) -> Tensor:
        """Token rows `[R, H, D]` → tiles `[J, H, C, D]` (one copy), zeros in the padding."""
        # index_select: ~3× faster than advanced indexing for whole rows on CPU
        D = x_RHD.shape[-1]
        x_JHCD = x_RHD.reshape(-1, D).index_select(0, self.src_JHC.reshape(-1)).view(*self.src_JHC.shape, D)
        if self.pad_J1C is not None:
            x_JHCD.masked_fill_(self.pad_J1C.unsqueeze(-1), 0.0)  # index_select's backward does not need its output
        return x_JHCD

    def scatter(self, x_JHCD: Tensor) -> Tensor:
        """Tiles `[J, H, C, D]` → token rows `[R, H, D]`, dropping the padding."""
        D = x_JHCD.shape[-1]
        return x_JHCD.reshape(-1, D).index_select(0, self.dst_RH.reshape(-1)).view(*self.dst_RH.shape, D)


_TileFactors = tuple[Tensor, Tensor, Tensor, Tensor, float, Tensor, Tensor]


def _tile_factors_bounded(
    q_JHCK: Tensor, k_JHCK: Tensor, g_JHCK: Tensor, beta_JHC: Tensor, scale: float
) -> _TileFactors:
    """The S₀-independent tile factors as dense matmuls; needs every tile's γ ∈ [−80, 0].

    Returns A `[J, H, C, C]` (strictly lower, β folded in), M `[J, H, C, C]` (lower incl. diagonal, scale folded in),
    Q⊙e^γ / c and K⊙e^γ / c `[J, H, C, K]` with their common factor c (a float), K⊙e^{γ_C−γ} `[J, H, C, K]` and
    e^{γ_C} `[J, H, K]`.
    """
    J, H, C, K = k_JHCK.shape
    # e^{γ+40} ∈ [e^-40, e^40], γ the inclusive cumsum over the tile, as one batched matmul with a ones triangle
    tril_xCC = torch.ones(C, C, dtype=g_JHCK.dtype, device=g_JHCK.device).tril().expand(J * H, C, C)
    shift = torch.tensor(_TILE_SHIFT, dtype=g_JHCK.dtype, device=g_JHCK.device)
    up_JHCK = torch.baddbmm(shift, tril_xCC, g_JHCK.reshape(J * H, C, K)).view(J, H, C, K).exp()
    kdown_JHCK = k_JHCK / up_JHCK  # k e^{−γ−40}
    qup_JHCK = q_JHCK * up_JHCK
    kup_JHCK = k_JHCK * up_JHCK
    incl_CC = torch.ones(C, C, dtype=torch.bool, device=k_JHCK.device).tril()
    M_JHCC = (qup_JHCK @ kdown_JHCK.transpose(-1, -2)).masked_fill(~incl_CC, 0.0) * scale
    A_JHCC = (kup_JHCK @ kdown_JHCK.transpose(-1, -2)).masked_fill(~incl_CC.tril(-1), 0.0) * beta_JHC.unsqueeze(-1)
    up_end_JHK = up_JHCK[:, :, -1]
    kend_JHCK = kdown_JHCK * up_end_JHK.unsqueeze(2)  # k e^{γ_C − γ} ≤ |k|
    unshift = math.exp(-_TILE_SHIFT)
    return A_JHCC, M_JHCC, qup_JHCK, kup_JHCK, unshift, kend_JHCK, up_end_JHK * unshift


def _tile_factors_pairwise(
    q_JHCK: Tensor, k_JHCK: Tensor, g_JHCK: Tensor, beta_JHC: Tensor, scale: float
) -> _TileFactors:
    """As `_tile_factors_bounded`, with A and M from masked pairwise decays e^{γ_t − γ_i} (t ≥ i): safe for any g."""
    C = g_JHCK.shape[2]
    incl_CC = torch.ones(C, C, dtype=torch.bool, device=k_JHCK.device).tril()
    gam_JHCK = incl_CC.to(g_JHCK.dtype) @ g_JHCK  # inclusive cumsum over the tile
    diff_JHCCK = gam_JHCK.unsqueeze(3) - gam_JHCK.unsqueeze(2)  # [.., t, i, K] = γ_t − γ_i
    decay_JHCCK = diff_JHCCK.masked_fill_(~incl_CC.unsqueeze(-1), float("-inf")).exp_()  # 0 above the diagonal
    ki_JHCCK = k_JHCK.unsqueeze(2) * decay_JHCCK  # k_i e^{γ_t − γ_i}
    # Σ_c x_tc (k_ic e^{γ_tc − γ_ic}) as a batched mat-vec per row t, without another [C, C, K] temporary
    M_JHCC = (ki_JHCCK @ q_JHCK.unsqueeze(-1)).squeeze(-1) * scale
    A_JHCC = (ki_JHCCK @ k_JHCK.unsqueeze(-1)).squeeze(-1).masked_fill(~incl_CC.tril(-1), 0.0) * beta_JHC.unsqueeze(-1)
    decay_JHCK = gam_JHCK.exp()
    gam_end_JHK = gam_JHCK[:, :, -1]
    kend_JHCK = k_JHCK * (gam_end_JHK.unsqueeze(2) - gam_JHCK).exp()
    return A_JHCC, M_JHCC, q_JHCK * decay_JHCK, k_JHCK * decay_JHCK, 1.0, kend_JHCK, gam_end_JHK.exp()


def _inter_tile_pass(
    X_JHDK: Tensor,
    Y_JHDV: Tensor,
    kend_JHCK: Tensor,
    decay_end_JHK: Tensor,
    S_NHKV: Tensor,
    step_counts: list[int],
    finished: list[Tensor],
) -> tuple[Tensor, Tensor]:
    """The sequential part over a run of tile steps, batched over the sequences still running at each step (a prefix
    of the ranks; `S_NHKV` holds their states).

    With X = [W; −Q'] and Y = [U; M U] stacked along the tile's rows (D = 2C), one matmul per step gives
    Y − X S = [u; o], then S ← Diag(e^{γ_C}) S + (K⊙e^{γ_C−γ})ᵀ u. States of sequences that run out of tiles are
    appended to `finished` (highest rank first).
    Returns o for the run's tile slots `[J, H, C, V]` and the states still running.
    """
    _, H, K, V = S_NHKV.shape
    C = kend_JHCK.shape[2]
    # One split per operand, not a slice per step: a slice's backward materialises a full-size zero gradient.
    sizes = [m * H for m in step_counts]
    steps = zip(
        step_counts,
        torch.split(X_JHDK.reshape(-1, 2 * C, K), sizes),
        torch.split(Y_JHDV.reshape(-1, 2 * C, V), sizes),
        torch.split(kend_JHCK.reshape(-1, C, K).transpose(-1, -2), sizes),
        torch.split(decay_end_JHK.reshape(-1, K, 1), sizes),
    )
    o_steps = []
    S_xKV = S_NHKV.reshape(-1, K, V)  # (sequence, head) pairs, sequence-major
    for m, X_xDK, Y_xDV, kendT_xKC, decay_end_xK1 in steps:
        if m * H < S_xKV.shape[0]:  # the lowest-ranked sequences ran out of tiles
            finished.append(S_xKV[m * H :].view(-1, H, K, V))
            S_xKV = S_xKV[: m * H]
        u_xCV, o_xCV = torch.baddbmm(Y_xDV, X_xDK, S_xKV, alpha=-1.0).split(C, dim=1)  # one backward node
        o_steps.append(o_xCV)
        S_xKV = torch.baddbmm(S_xKV * decay_end_xK1, kendT_xKC, u_xCV)
    return torch.cat(o_steps).view(-1, H, C, V), S_xKV.view(-1, H, K, V)


def chunk_kda_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    bounded: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA in pure PyTorch (differentiable by autograd): the CPU path for training and prefill.

    Args:
        q, k: `[B, T, H, K]`, already L2-normalised by the caller.
        v: `[B, T, H, V]`.
        g: `[B, T, H, K]` per-channel log-decay (≤ 0).
        beta: `[B, T, H]`.
        scale: multiplies q; defaults to `K ** -0.5`.
        initial_state: `[N, H, K, V]` (fp32), N = B, or N = len(cu_seqlens) − 1 with cu_seqlens. Zeros when None.
        output_final_state: return the state after each sequence's last token.
        cu_seqlens: int `[N+1]` offsets of sequences packed along T (then B must be 1); no state crosses sequences.
        bounded: dense tiles from e^{±γ}; requires every g ≥ −MAX_TILE_LOG_DECAY / chunk_size (−5 for 16-token
            tiles), else ValueError. `bounded=False` forms pairwise decays and accepts any g.
        chunk_size: tokens per tile.

    Returns:
        o `[B, T, H, V]` in v's dtype, and the final state `[N, H, K, V]` in fp32 (fp64 for fp64 inputs) or None.
    """
    N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    if bounded and g.numel() > 0:
        g_floor = -MAX_TILE_LOG_DECAY / C
        g_min = float(g.detach().amin())
        if g_min < g_floor:
            raise ValueError(
                f"bounded=True needs every g >= -{MAX_TILE_LOG_DECAY:g}/chunk_size = {g_floor:g} (so a {C}-token tile "
                f"decays by at most e^-{MAX_TILE_LOG_DECAY:g}), got min(g) = {g_min:.4g}; use the bounded gate "
                f"(lower_bound >= {g_floor:g}) or bounded=False"
            )
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    layout = _TileLayout(_seq_bounds(cu_seqlens, B, T), B * T, H, C, q.device)
    blocks = layout.blocks(max(1, _BLOCK_TILE_HEADS // H))
    # Gather once and split into runs (one backward node each); per-run gathers or slices would each materialise a
    # full-size zero gradient in the backward.
    tiles = [
        torch.split(layout.gather(x.to(dt).reshape(B * T, H, x.shape[-1])), [hi - lo for lo, hi, _ in blocks])
        for x in (q, k, v, g, beta.unsqueeze(-1))
    ]
    tile_factors = _tile_factors_bounded if bounded else _tile_factors_pairwise

    S_NHKV = q.new_zeros(N, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    S_NHKV = S_NHKV[layout.order_N]  # rank order
    finished: list[Tensor] = []
    o_blocks = []
    # The tiles go in runs of whole steps, each run's S₀-independent factors computed just before the sequential pass
    # reaches it: the temporaries stay ~1 MiB (cache-sized, and no fresh pages from the allocator per op).
    for (_, _, step_counts), q_JHCK, k_JHCK, v_JHCV, g_JHCK, beta_JHC1 in zip(blocks, *tiles):
        beta_JHC = beta_JHC1.squeeze(-1)
        A_JHCC, M_JHCC, qe_JHCK, ke_JHCK, e_scale, kend_JHCK, decay_end_JHK = tile_factors(
            q_JHCK, k_JHCK, g_JHCK, beta_JHC, scale
        )
        # (I + A)^-1 of the unit-triangular C×C matrix, then products: on CPU ~5× cheaper than one solve with V + K
        # right-hand sides. A's zero diagonal stands for I's ones.
        eye_CC = torch.eye(C, dtype=dt, device=q.device).expand_as(A_JHCC)
        Tinv_JHCC = torch.linalg.solve_triangular(A_JHCC, eye_CC, upper=False, unitriangular=True)
        # Z = [(I+A)^-1; M (I+A)^-1] (D = 2C rows): Z diag(β) V = [U; M U] and Z diag(β) (K⊙e^γ) = [W; M W], one
        # matmul each; β and the factor c scale Z's columns, which is cheaper than scaling V's and K's rows.
        Z_JHDC = torch.cat([Tinv_JHCC, M_JHCC @ Tinv_JHCC], dim=2)
        Y_JHDV = (Z_JHDC * beta_JHC.unsqueeze(-2)) @ v_JHCV
        X_JHDK = (Z_JHDC * (beta_JHC * e_scale).unsqueeze(-2)) @ ke_JHCK
        # M W − scale Q⊙e^γ = −Q' in the lower half; matmul's backward does not need its output
        X_JHDK[:, :, C:].sub_(qe_JHCK, alpha=scale * e_scale)
        o_JHCV, S_NHKV = _inter_tile_pass(
            X_JHDK, Y_JHDV, kend_JHCK, decay_end_JHK, S_NHKV, step_counts, finished
        )
        o_blocks.append(o_JHCV)
    finished.append(S_NHKV)
    S_end_NHKV = torch.cat(finished[::-1])  # back to rank order 0..N−1
    o_JHCV = torch.cat(o_blocks) if o_blocks else v.new_zeros(0, H, C, V, dtype=dt)
    o_BTHV = layout.scatter(o_JHCV).view(B, T, H, V).to(v.dtype)
    final = S_end_NHKV[layout.rank_of_N] if output_final_state else None
    return o_BTHV, final


# ----------------------------------------------------------------------------------------------------------------------
# dispatcher
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateParams:
    """The KDA layer's decay-gate parameters: A_log [H] and dt_bias [H·K] (both fp32; gradients flow to them)."""

    A_log: Tensor
    dt_bias: Tensor


def kda_gate(z: Tensor, gate: GateParams, lower_bound: float | None) -> Tensor:
    """The per-channel log-decay g [..., H, K] from the gate's input z [..., H, K], in fp32 (fp64 for fp64 z):
        bounded (K3, lower_bound set):   g = lower_bound · σ(e^{A_log_h} (z + dt_bias))     ∈ [lower_bound, 0)
        unbounded (Kimi Linear):         g = −e^{A_log_h} · softplus(z + dt_bias)
    fla's formulas, in its fused gate and in its KDA kernels' `use_gate_in_kernel`."""
    compute = torch.promote_types(z.dtype, torch.float32)
    H, K = z.shape[-2:]
    x = z.to(compute) + gate.dt_bias.to(compute).view(H, K)
    rate = gate.A_log.to(compute).exp().view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def prologue(q: Tensor, k: Tensor, z: Tensor, beta_logits: Tensor, gate: GateParams,
             lower_bound: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The KDA layer's projections → the kernels' inputs, in PyTorch: q and k L2-normalised over K (eps 1e-6 inside the
    root, fla's), g = `kda_gate(z)`, β = σ(logits) in fp32. Shapes as the kernels take them ([..., H, K] and [..., H]).
    """
    beta = torch.sigmoid(beta_logits.to(torch.promote_types(beta_logits.dtype, torch.float32)))
    return l2norm(q), l2norm(k), kda_gate(z, gate, lower_bound), beta


@lru_cache(maxsize=1)
def _import_fla_kda() -> ModuleType | None:
    try:
        return importlib.import_module("fla.ops.kda")
    except ImportError:
        return None


def _fla_kda_for(x: Tensor) -> ModuleType | None:
    """fla's KDA ops module when x lives on CUDA and fla imports, else None."""
    return _import_fla_kda() if x.device.type == "cuda" else None


def kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    lower_bound: float = -5.0,
    bounded: bool = True,
    mode: str = "auto",
    gate: GateParams | None = None,
) -> tuple[Tensor, Tensor | None]:
    """KDA with the kernel chosen by device and length; shapes and returns as in `chunk_kda_torch`.

    With `gate`, the inputs are the layer's projections instead: q and k not yet normalised, g the gate's input z
    and beta its logits; the `prologue` (with the bounded gate when `bounded`, at `lower_bound`) is applied first, by
    fla's kernels on CUDA (`use_qk_l2norm_in_kernel`, `use_gate_in_kernel` with A_log and dt_bias,
    `use_beta_sigmoid_in_kernel`: one autograd node for what is otherwise four, and the gate fused into the kernel's
    cumulative sum) and in PyTorch elsewhere.

    On CUDA with fla importable (fla-core 0.6.0), it calls
        fla.ops.kda.chunk_kda(q, k, v, g, beta, scale=, initial_state=, output_final_state=,
                              use_qk_l2norm_in_kernel=F, use_gate_in_kernel=F, use_beta_sigmoid_in_kernel=F,
                              [A_log=, dt_bias=,] safe_gate=bounded, lower_bound=lower_bound if bounded else None,
                              state_v_first=False, cu_seqlens=[, use_graph=True, max_num_seqs=N])
    (the graph-mode pair inside `static_shapes()`, for CUDA graph capture) with F = whether `gate` is given, or, for
    `mode="recurrent"` (and for `"auto"` with T ≤ FLA_DECODE_MAX_LEN when nothing needs gradients, as fla's own KDA
    layer does), `fla.ops.kda.fused_recurrent_kda` with the same
    q/k/v/g/beta/state and prologue arguments and no safe_gate. fla 0.6.0's fused recurrent kernel has no backward, so
    it is never used for inputs that need gradients.

    What g is for fla: with `use_gate_in_kernel=False` fla takes g as the finished per-channel log-decay (the same g
    as every function here), and `safe_gate=True` tells it the caller's gates already lie in [lower_bound, 0], so it
    may use its dense 16×16 sub-block path; chunk_kda then reads lower_bound for nothing else. With
    `use_gate_in_kernel=True` it computes `kda_gate`'s formulas itself: `lower_bound · σ(e^{A_log}(g + dt_bias))` when
    given lower_bound, else `−e^{A_log} softplus(g + dt_bias)`. The state is key-major `[N, H, K, V]` (fla's own layer
    uses state_v_first=True; we do not).
    Checked on an H200 with fla-core 0.6.0 (torch 2.11), without `gate`: chunk_kda through this call matches the fp64
    naive recurrence to ~3e-3 relative in o, state and all gradients (fp32 inputs; fla's kernels round through
    tf32/bf16 dots), the fused recurrent kernel to ~1e-7, with varlen batches; lower_bound −5 vs −1 changed chunk_kda's
    output by 0.0. With `gate`: tests/gpu/test_kda_fla.py checks the same against `prologue` and the fp64 recurrence.

    Elsewhere (CPU, or CUDA without fla): "chunk" is `chunk_kda_torch(bounded=bounded)`, "recurrent" and "naive"
    are `naive_recurrent_kda`; "auto" is the per-token recurrence for T == 1 and the chunked form otherwise.

    Args:
        lower_bound: the per-token floor of the bounded gate; must lie in [−MAX_TILE_LOG_DECAY/CHUNK_SIZE, 0)
            = [−5, 0) when bounded (fla's safe range, and what a 16-token CPU tile can represent).
        bounded: whether g comes from the bounded gate (dense tiles); False for the unbounded comparison path (and,
            with `gate`, for the unbounded softplus gate).
        mode: "auto", "chunk", "recurrent" or "naive".
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    floor = -MAX_TILE_LOG_DECAY / CHUNK_SIZE
    if bounded and not (floor <= lower_bound < 0):
        raise ValueError(f"lower_bound must lie in [{floor:g}, 0) for the bounded gate, got {lower_bound!r}")
    common = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens
    )
    fla_kda = None if mode == "naive" else _fla_kda_for(q)
    if gate is not None and fla_kda is None:
        q, k, g, beta = prologue(q, k, g, beta, gate, lower_bound if bounded else None)
        gate = None
    if mode == "naive":
        return naive_recurrent_kda(q, k, v, g, beta, **common)

    T = q.shape[1]
    inputs = (q, k, v, g, beta, initial_state) + (() if gate is None else (gate.A_log, gate.dt_bias))
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    if fla_kda is None:
        if mode == "recurrent" or (mode == "auto" and T == 1):
            return naive_recurrent_kda(q, k, v, g, beta, **common)
        return chunk_kda_torch(q, k, v, g, beta, bounded=bounded, **common)

    if mode == "auto":
        mode = "recurrent" if (T <= FLA_DECODE_MAX_LEN and not needs_grad) else "chunk"
    if initial_state is not None:
        initial_state = initial_state.float()  # fla asserts an fp32 state
    fused = gate is not None
    fla_args = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=fused,
        use_gate_in_kernel=fused,
        use_beta_sigmoid_in_kernel=fused,
        state_v_first=False,
        cu_seqlens=cu_seqlens,
    )
    if fused:  # chunk_kda reads these from its **kwargs; fused_recurrent_kda names them
        fla_args.update(A_log=gate.A_log, dt_bias=gate.dt_bias)
    if mode == "recurrent":
        if needs_grad:
            raise ValueError(
                "mode='recurrent' on CUDA runs fla's fused_recurrent_kda, which has no backward; use mode='chunk' "
                "for inputs that need gradients"
            )
        o, final = fla_kda.fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta,
                                               lower_bound=lower_bound if bounded and fused else None, **fla_args)
    else:
        if cu_seqlens is not None and static_shapes.active():
            # fla's graph mode: the chunk list from the offsets on the GPU, with a row count fixed by their number
            fla_args.update(use_graph=True, max_num_seqs=cu_seqlens.numel() - 1)
        o, final = fla_kda.chunk_kda(
            q=q, k=k, v=v, g=g, beta=beta, safe_gate=bounded, lower_bound=lower_bound if bounded else None, **fla_args
        )
    return o.to(v.dtype), final
