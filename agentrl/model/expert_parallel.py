"""Expert parallelism (EP): the routed experts of every MoE layer sharded over the ranks of a process group.

Legend: T = tokens on this rank, K = experts per token, S = T·K (token, expert) pairs, E = routed experts,
R = ranks in the expert-parallel group, L = experts per rank (E / R), N = rows received for the local experts,
M = expert width.

Rank r of the group holds experts [r·L, (r+1)·L) (the order DeepSpeed's MoE uses, so `group_name` checkpoints and
its expert-data-parallel groups line up). Everything else — router, shared experts, latent projections — stays
replicated; only `RoutedExperts` is swapped for `ExpertParallelExperts`, under the same parameter names, so the
model code (moe.py) is unchanged and the state dict differs only in the experts' first dimension.

One layer's forward on each rank:

    1. sort the S pairs by expert (so by owning rank) and count them per expert: counts_E
    2. exchange counts: one all-to-all of counts_E (L entries to each rank) → received_RL [source, local expert]
    3. dispatch: all-to-all of the sorted rows with uneven splits (rows per destination / per source)
    4. reorder the received rows from (source, expert) to (expert, source) and run the local experts grouped
    5. combine: reorder back, all-to-all back to the sources, and the gate-weighted sum on the token's own rank

The gate weights are applied after the combine, on the token's rank, so router gradients never cross ranks; the
all-to-alls are autograd Functions (the backward of an all-to-all is the all-to-all with the splits swapped), so
input and expert gradients are exact. Every rank of the group must run every MoE forward and backward in the same
order (training, evaluation and gradient-checkpoint recomputation alike): a rank with no tokens for the others still
takes part with zero-row splits.

Quantile Balancing needs nothing new: the router is replicated and routes this rank's tokens, and the trainer sums
the balancers' histograms over all ranks as before.

`gather_full_experts` rebuilds the [E, ...] tensors (weights publishing, checkpoints in the non-EP layout); the
all-to-all time is accumulated in `ExpertParallelStats` (on CUDA it synchronises around each exchange, so the figure
is the exchange itself and not the kernels queued before it).

Not the model's business: which process group to use and how expert gradients are averaged (trainer/zero.py).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from agentrl.model.moe import (RoutedExperts, SparseMoE, combine, dispatch, inverse_permutation, permute_rows,
                               sort_by_expert)

_EXPERT_NAME = re.compile(r"(.*\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


@dataclass(kw_only=True, slots=True)
class ExpertParallelStats:
    """Accumulated over the layers' forwards and backwards until `reset`."""

    all_to_all_s: float = 0.0  # wall time inside the token all-to-alls (dispatch and combine, both directions)
    count_exchange_s: float = 0.0  # the all-to-alls of the per-expert counts
    rows_sent: int = 0  # rows sent to other ranks by the forward dispatches
    rows_kept: int = 0  # rows whose expert lives on this rank
    calls: int = 0  # token all-to-alls

    def reset(self) -> None:
        self.all_to_all_s = self.count_exchange_s = 0.0
        self.rows_sent = self.rows_kept = self.calls = 0


def _timed_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                      stats: ExpertParallelStats | None) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    if stats is not None:
        stats.all_to_all_s += time.perf_counter() - start
        stats.calls += 1
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, stats):
        ctx.splits, ctx.group, ctx.stats = (out_splits, in_splits), group, stats
        return _timed_all_to_all(x, out_splits, in_splits, group, stats)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _timed_all_to_all(grad, in_splits, out_splits, ctx.group, ctx.stats), None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None,
               stats: ExpertParallelStats | None = None) -> torch.Tensor:
    """Differentiable all_to_all_single: sends rows in_splits[r] to rank r, receives out_splits[r] from rank r."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, stats)


class ExpertParallelExperts(RoutedExperts):
    """This rank's L of the E routed experts, w13 [L, 2I, M] and w2 [L, M, I]; forward takes all T tokens' routing
    and returns their routed output [T, M] like `RoutedExperts` (see the module docstring)."""

    def __init__(self, experts: RoutedExperts, group, stats: ExpertParallelStats | None = None):
        nn.Module.__init__(self)  # not RoutedExperts.__init__: it would allocate all E experts
        self.num_ranks = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if experts.num_experts % self.num_ranks:
            raise ValueError(f"{experts.num_experts} routed experts cannot be split evenly over "
                             f"{self.num_ranks} expert-parallel ranks")
        self.num_experts = experts.num_experts
        self.num_local_experts = experts.num_experts // self.num_ranks
        self.first_expert = self.ep_rank * self.num_local_experts
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        self.w13_weight = nn.Parameter(experts.w13_weight.detach()[local].clone())
        self.w2_weight = nn.Parameter(experts.w2_weight.detach()[local].clone())
        self.act, self.situ_beta, self.situ_linear_beta = experts.act, experts.situ_beta, experts.situ_linear_beta
        self.group = group
        self.stats = stats

    def forward(self, x_TM: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        ranks, local = self.num_ranks, self.num_local_experts
        order = sort_by_expert(experts_TK, self.num_experts)
        received_RL = self._exchange_counts(order.counts_E).view(ranks, local)
        send = order.counts_E.view(ranks, local).sum(1).tolist()
        recv = received_RL.sum(1).tolist()
        if self.stats is not None:
            self.stats.rows_kept += send[self.ep_rank]
            self.stats.rows_sent += sum(send) - send[self.ep_rank]
        rows_NM = all_to_all(dispatch(x_TM, order), recv, send, self.group, self.stats)
        # received rows come grouped by source rank, then by local expert; the grouped matmul wants them by expert
        expert_of_N = torch.arange(local, device=x_TM.device).repeat(ranks).repeat_interleave(
            received_RL.reshape(-1), output_size=sum(recv))  # the size is known: no device sync
        by_expert_N = torch.argsort(expert_of_N, stable=True)
        back_N = inverse_permutation(by_expert_N)
        out_NM = self.expert_ffn(permute_rows(rows_NM, by_expert_N, back_N), received_RL.sum(0))
        out_NM = permute_rows(out_NM, back_N, by_expert_N)  # back to (source, expert) order
        out_SM = all_to_all(out_NM, send, recv, self.group, self.stats)
        return combine(out_SM, weights_TK, order)

    def _exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """counts_E sent in slices of L to their owners → [R·L]: rows from each source rank per local expert."""
        start = time.perf_counter()
        received = torch.empty_like(counts_E)
        dist.all_to_all_single(received, counts_E.contiguous(), group=self.group)
        if self.stats is not None:
            self.stats.count_exchange_s += time.perf_counter() - start
        return received

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
                f"{self.num_experts} (expert-parallel rank {self.ep_rank} of {self.num_ranks})")


def apply_expert_parallel(model: nn.Module, group, stats: ExpertParallelStats | None = None
                          ) -> ExpertParallelStats:
    """Shards the routed experts of every SparseMoE in `model` over `group` (in place; every rank of the group calls
    it on an identical model). Returns the stats object all layers accumulate into (`stats`, or a new one)."""
    stats = ExpertParallelStats() if stats is None else stats
    for module in list(model.modules()):
        if isinstance(module, SparseMoE) and not isinstance(module.experts, ExpertParallelExperts):
            module.experts = ExpertParallelExperts(module.experts, group, stats)
    return stats


def expert_parallel_layers(model: nn.Module) -> dict[str, ExpertParallelExperts]:
    """The sharded expert modules by their qualified name (e.g. `model.layers.1.block_sparse_moe.experts`)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Qualified names of the sharded parameters (the keys whose state-dict tensors hold only L experts)."""
    return {f"{name}.{p}" for name in expert_parallel_layers(model) for p in ("w13_weight", "w2_weight")}


@torch.no_grad()
def gather_full_experts(model: nn.Module, *, dst: int | None = 0,
                        layers: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The full [E, ...] expert tensors on CPU by state-dict name, gathered over each layer's group one tensor at a
    time. Collective over the group. `dst` is the group rank that receives them (others get {}); None: every rank.
    `layers` limits it to those expert modules (qualified names; default all), e.g. one decoder layer's.
    """
    out: dict[str, torch.Tensor] = {}
    for name, layer in expert_parallel_layers(model).items():
        if layers is not None and name not in layers:
            continue
        for pname in ("w13_weight", "w2_weight"):
            shard = getattr(layer, pname).detach().contiguous()
            parts = [torch.empty_like(shard) for _ in range(layer.num_ranks)]
            if dst is None:
                dist.all_gather(parts, shard, group=layer.group)
            else:
                dist.gather(shard, parts if layer.ep_rank == dst else None,
                            dst=dist.get_global_rank(layer.group, dst), group=layer.group)
                if layer.ep_rank != dst:
                    continue
            out[f"{name}.{pname}"] = torch.cat(parts).cpu()
    return out


def renumber_local_experts(named: dict[str, torch.Tensor], first_expert: int) -> dict[str, torch.Tensor]:
    """Checkpoint names of a shard (`...experts.{e}.w1.weight`, e local) → the global expert ids e + first_expert."""
    out = {}
    for name, tensor in named.items():
        m = _EXPERT_NAME.match(name)
        if m is None:
            raise ValueError(f"{name!r} is not a per-expert checkpoint name")
        out[f"{m[1]}.{int(m[2]) + first_expert}.{m[3]}.weight"] = tensor
    return out
