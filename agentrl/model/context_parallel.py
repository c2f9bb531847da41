"""Context parallelism (CP): a packed micro-batch's tokens split over the ranks of a group, in sequence order.

Legend: T = this rank's tokens, N = its (pieces of) sequences, H = heads, K = KDA key dim, V = value dim, C = channels,
W = short-conv width, R = ranks in the group. Global positions index the whole packed micro-batch.

Rank r holds tokens [lo, hi) = [r·T, (r+1)·T) of the micro-batch (padded to R·T by the trainer). Everything per token
— embeddings, norms, projections, MoE, AttnRes, the log-prob head — runs on the slice alone. Two things cross ranks:

KDA (linear attention). The state a sequence carries into rank r is the state rank r−1 ended it with, which depends on
what rank r−2 handed over, and so on. Instead of a pipeline of hand-offs (rank r idle until ranks < r finish every
KDA layer: (R−1)/R of the KDA time, forward and backward), every rank runs its slice at once, from a zero state, with
the kernel's value columns widened by K columns whose initial state is the identity. The recurrence is linear in the
state, so those columns carry the transition: the last piece ends in [B | A] — S_end = A·S_in + B, A [K, K] — and
each token's extra output columns o_I give its output's dependence on S_in: o = o_0 + o_I·S_in. The ranks then
all-gather their (A, B) (a few K×(K+V) matrices), each composes the chain of ranks before it into its own S_in, and
corrects its outputs with one [T, K]×[K, V] product per head. The cost is the widened value columns (2× the state
chain when V = K, only for a slice whose first sequence came from an earlier rank) and one small all-gather; no rank
waits for another. Gradients flow back through the same ops (the all-gather's backward returns each rank's share).
A sequence that starts inside a slice never sees the identity columns, so no state crosses from one trajectory into
the next. The short convolution's W−1 inputs before a slice come from the previous rank the same way (all-gathered
tails, zeroed where they belong to another sequence).

MLA (softmax attention) sees the whole context: the ranks all-gather the compressed KV (kv_lora_rank + rope dims per
token, the smallest form of a token's keys and values) and each rank expands only the keys its sequences need —
from the first token of its first sequence to its own end — then attends its queries over them, causal with the
queries at the end of each sequence's keys (bottom-right), `prefix_causal_attention`. An all-gather of the latents
moves (R−1)·T·(R_kv + P) values per layer where a ring of full K/V would move 2·(R−1)·T·H·d, and it needs no
per-step overlap logic; its cost is that the last rank of a long sequence holds (expands) that sequence's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class ContextShard:
    """This rank's slice [lo, hi) of a packed micro-batch under context parallelism (see the module docstring)."""

    group: Any  # the CP ranks' torch.distributed process group
    rank: int  # within the group
    size: int
    lo: int
    hi: int
    cu_seqlens: torch.Tensor  # int32 [N+1]: the slice's pieces of sequences, local offsets
    continues: tuple[bool, ...]  # per group rank: its first sequence began on an earlier rank
    prev_tokens: int  # tokens of the first local sequence before lo (0 if it starts here)
    key_cu_seqlens: torch.Tensor  # int32 [N+1]: each local sequence's keys [its global start, its end in the slice)

    @property
    def key_lo(self) -> int:
        """Global position of the first key this rank's queries see: the start of its first sequence."""
        return self.lo - self.prev_tokens

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, *, rank: int, size: int, group: Any = None) -> ContextShard:
        """The slice of rank `rank` of `size` over a micro-batch with global offsets `cu_seqlens` whose token count
        is a multiple of `size` (`pad_to` makes it one)."""
        bounds = [int(b) for b in cu_seqlens]
        total = bounds[-1]
        if total % size:
            raise ValueError(f"{total} tokens do not split over {size} context-parallel ranks: pad them first")
        per = total // size

        def piece(r: int) -> tuple[list[int], int]:
            lo, hi = r * per, (r + 1) * per
            inner = [b - lo for b in bounds if lo < b < hi]
            start = max(b for b in bounds if b <= lo)  # the first local sequence's global start
            return [0, *inner, hi - lo], lo - start

        local, prev = piece(rank)
        continues = tuple(piece(r)[1] > 0 for r in range(size))
        keys = [0] + [b + prev for b in local[1:]]
        device = cu_seqlens.device
        return cls(group=group, rank=rank, size=size, lo=rank * per, hi=(rank + 1) * per,
                   cu_seqlens=torch.tensor(local, dtype=torch.int32, device=device), continues=continues,
                   prev_tokens=prev, key_cu_seqlens=torch.tensor(keys, dtype=torch.int32, device=device))

    @property
    def first_continues(self) -> bool:
        return self.continues[self.rank]

    def on(self, device: torch.device | str) -> ContextShard:
        """This shard with its offsets on `device` (the trainer slices on the host; the layers index on the GPU)."""
        return replace(self, cu_seqlens=self.cu_seqlens.to(device, non_blocking=True),
                       key_cu_seqlens=self.key_cu_seqlens.to(device, non_blocking=True))


def pad_length(num_tokens: int, size: int, minimum_per_rank: int = 1) -> int:
    """Tokens to append so that `num_tokens` splits evenly over `size` ranks with at least `minimum_per_rank` each."""
    per = max(-(-num_tokens // size), minimum_per_rank)
    return per * size - num_tokens


def gather(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """All ranks' `x` (equal shapes) concatenated along dim 0 in rank order. Differentiable: the backward sums the
    gradient over the ranks and hands each rank its own part — a collective, so every rank must use the result in
    its loss (`depend_on` ties in one that would not)."""
    return _Gather.apply(x.contiguous(), shard.group)


def depend_on(x: torch.Tensor, *gathered: torch.Tensor) -> torch.Tensor:
    """`x`, made to depend (with a zero gradient) on gathered tensors it does not otherwise use: a rank whose slice
    needs nothing from the others still takes part in the backward collectives of every gather, in the same order."""
    return x + sum(g.sum() for g in gathered) * 0


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.rows = group, x.shape[0]
        ctx.rank = dist.get_rank(group)
        staged = x.cpu() if x.is_cuda and dist.get_backend(group) == "gloo" else x  # gloo: host memory only
        out = staged.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, staged, group=group)
        return out.to(x.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            part = grad.new_empty(ctx.rows, *grad.shape[1:])
            dist.reduce_scatter_tensor(part, grad, group=ctx.group)
            return part, None
        total = grad.cpu() if grad.is_cuda else grad.clone()  # gloo has no reduce-scatter, and no CUDA tensors
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows].to(grad.device), None


def conv_tail(x_TC: torch.Tensor, width: int, shard: ContextShard) -> torch.Tensor:
    """The short convolution's initial states [N, C, W−1] of the local sequences: the previous rank's last W−1
    inputs for a first sequence that continues (zeros where they belong to an earlier sequence), zeros elsewhere.
    Every rank takes part in the all-gather."""
    if x_TC.shape[0] < width - 1:
        raise ValueError(f"a context-parallel slice of {x_TC.shape[0]} tokens is shorter than the short convolution "
                         f"({width}): pad the micro-batch")
    tails = gather(x_TC[-(width - 1):][None], shard)  # [R, W−1, C]
    keep = min(width - 1, shard.prev_tokens)  # inputs of the first sequence before this slice; older ones are not
    tail = tails[max(shard.rank - 1, 0)]
    mask = (torch.arange(width - 1, device=x_TC.device) >= width - 1 - keep).to(tail.dtype)[:, None]
    first = (tail * mask).t()[None]  # all zeros when nothing continues
    num_seqs = shard.cu_seqlens.numel() - 1
    return torch.cat([first, x_TC.new_zeros(num_seqs - 1, x_TC.shape[1], width - 1)])


def incoming_state(a_HKK: torch.Tensor, b_HKV: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """S_in [H, K, V] of this rank's first sequence from every rank's (A, B) of its last piece:
    S_in(0) = 0, S_in(r) = continues[r] · (A_{r−1} S_in(r−1) + B_{r−1})."""
    k = a_HKK.shape[-1]
    # one gather for both: each exchange is one collective, so every rank issues the backward ones in the same order
    ab_all = gather(torch.cat([a_HKK, b_HKV], dim=-1)[None], shard)  # [R, H, K, K+V]
    state = torch.zeros_like(b_HKV)
    for r in range(1, shard.rank + 1):
        a, b = ab_all[r - 1, ..., :k], ab_all[r - 1, ..., k:]
        state = a @ state + b if shard.continues[r] else torch.zeros_like(b_HKV)
    return depend_on(state, ab_all)


def prefix_causal_attention(q_THE: torch.Tensor, k_SHE: torch.Tensor, v_SHV: torch.Tensor,
                            cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of packed query pieces over their sequences' keys, causal with each piece's queries at the
    end of its keys (query j of a piece of n over m keys sits at key position m − n + j). Returns [T, H, V].

    On CUDA in half precision: FlashAttention-2's varlen kernel, whose causal window aligns to the bottom right when
    the query and key lengths differ. Elsewhere: each piece's queries are preceded by m − n zero queries, so that
    plain causal SDPA (top-left aligned, the CPU's flash kernel: memory linear in m) puts them in place; the zero
    rows are dropped (no gradient reaches them). That spends up to m/n times the attention a piece needs — ≤ 1.33×
    for the last of 2 ranks on one sequence — which on the CPU is still far less than a masked [n, m] matrix."""
    from agentrl.model.mla import _flash_varlen_causal_attention, _use_flash_varlen, equal_head_dims

    if _use_flash_varlen(q_THE, v_SHV):
        return _flash_varlen_causal_attention(q_THE, k_SHE, v_SHV, cu_q, scale, cu_k=cu_k)
    v_dim = v_SHV.shape[-1]
    q_THE, k_SHE, v_SHV = equal_head_dims(q_THE, k_SHE, v_SHV)
    outs = []
    qb, kb = cu_q.tolist(), cu_k.tolist()
    for qs, qe, ks, ke in zip(qb[:-1], qb[1:], kb[:-1], kb[1:]):
        n, m = qe - qs, ke - ks
        if n > m:
            raise ValueError(f"a query piece of {n} tokens over {m} keys: the keys must include the queries")
        q = torch.cat([q_THE.new_zeros(m - n, *q_THE.shape[1:]), q_THE[qs:qe]])
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k_SHE[ks:ke], v_SHV[ks:ke]))  # [1, H, m, *]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        outs.append(o[0, :, m - n:].transpose(0, 1))
    out = torch.cat(outs) if outs else q_THE.new_zeros(0, *q_THE.shape[1:])
    return out[..., :v_dim]
