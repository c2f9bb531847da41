"""Fine-grained MoE with a sigmoid router, a selection-only bias, shared experts and optional latent experts.

Legend: T = tokens, D = hidden, M = expert width (D, or routed_expert_hidden_size for latent MoE), E = routed
experts, K = experts per token, I = expert intermediate size.

Routing: s = σ(W_r x) in fp32. The bias b (`e_score_correction_bias`, set by the load balancer) only *selects*:
T_i = top-K(s_i + b) (within the top groups when grouped). The gate weights never see it: p_ij = s_ij / Σ_{r∈T_i} s_ir
(when `moe_renormalize`), times `routed_scaling_factor`.

    y = up(norm(Σ_j p_ij · E_j(down(x))))  +  shared(x)      (latent MoE: down/up to width M; else identity)

Dispatch is grouped by expert: the K·T (token, expert) pairs are sorted by expert and each expert's rows go through
one matmul (`torch._grouped_mm` on CUDA: one kernel for all experts; on CPU a split over the experts present).

Expert parallelism (experts sharded over ranks, tokens exchanged by all-to-all) replaces `RoutedExperts` with the
subclass in expert_parallel.py, which reuses `sort_by_expert`, `dispatch`, `expert_ffn` and `combine`.

Routing replay: `forced_experts_TK` makes the layer use the given experts (e.g. those the inference engine chose)
instead of its own top-K; the gate weights are still computed from this forward's scores. A row of −1 leaves that
token's routing to the layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.model.balancing import ExpertBalancer, count_values
from agentrl.model.config import HybridMoEConfig
from agentrl.model.layers import MLP, RMSNorm, glu


class Router(nn.Module):
    """Sigmoid router with a selection bias updated by an ExpertBalancer (never by gradients)."""

    def __init__(self, config: HybridMoEConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.num_groups = config.num_expert_group if config.use_grouped_topk else 1
        self.topk_groups = config.topk_group if config.use_grouped_topk else 1
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        self.balancer = ExpertBalancer(num_experts=self.num_experts, top_k=self.top_k, method=config.moe_balancing,
                                       num_bins=config.moe_balancing_bins, sign_rate=config.moe_balancing_sign_rate)

    def _apply(self, fn, recurse=True):
        # the selection bias stays fp32 when the model is cast to bf16: bias differences of 1e-3 decide selections
        super()._apply(fn, recurse)
        self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self

    def select(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """Top-K experts of the biased scores, restricted to the best groups when grouped. [T, K]"""
        biased = scores_TE + self.e_score_correction_bias
        if self.num_groups > 1:
            per_group = self.num_experts // self.num_groups
            group_scores = biased.view(-1, self.num_groups, per_group).topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_groups, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            biased = biased.masked_fill(~group_mask.repeat_interleave(per_group, dim=1), float("-inf"))
        return biased.topk(self.top_k, dim=-1).indices

    def forward(self, x_TD: torch.Tensor, forced_experts_TK: torch.Tensor | None = None,
                counted_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (gate weights [T, K] fp32, expert ids [T, K]). `counted_T`: the tokens the balancer counts
        (None: all; `ExpertBalancer.observe`)."""
        compute = torch.promote_types(x_TD.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)
        scores = torch.sigmoid(F.linear(x_TD.to(compute), self.weight.to(compute)))
        with torch.no_grad():
            topk_idx = self.select(scores)
        if self.training:
            self.balancer.observe(scores.detach(), self.e_score_correction_bias, topk_idx, counted_T)
        if forced_experts_TK is not None:
            if forced_experts_TK.shape != topk_idx.shape:
                raise ValueError(f"forced experts have shape {tuple(forced_experts_TK.shape)}, "
                                 f"expected {tuple(topk_idx.shape)} (tokens, top_k)")
            forced = forced_experts_TK.to(device=scores.device, dtype=torch.long)
            # rows marked −1 (tokens the engine never ran through the MoE, e.g. the last sampled token) keep
            # this forward's own choice
            topk_idx = torch.where((forced >= 0).all(-1, keepdim=True), forced, topk_idx)
        weights = scores.gather(1, topk_idx)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, topk_idx

    @torch.no_grad()
    def update_bias(self, all_reduce=None) -> None:
        """Applies the balancer's bias for the next step (call after the optimizer step)."""
        new_bias = self.balancer.update(self.e_score_correction_bias, all_reduce)
        if new_bias is not None:
            self.e_score_correction_bias.copy_(new_bias)


class RoutedExperts(nn.Module):
    """E gated experts as stacked weights: w13 = [gate; up] [E, 2I, M], w2 = down [E, M, I]."""

    def __init__(self, num_experts: int, width: int, intermediate: int, act: str,
                 situ_beta: float | None = None, situ_linear_beta: float | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, width))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, width, intermediate))
        self.act, self.situ_beta, self.situ_linear_beta = act, situ_beta, situ_linear_beta

    def forward(self, x_TM: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        """Σ_k weights[t, k] · E_{experts[t, k]}(x_t) for every token. [T, M]"""
        order = sort_by_expert(experts_TK, self.num_experts)
        out_SM = self.expert_ffn(dispatch(x_TM, order), order.counts_E)
        return combine(out_SM, weights_TK, order)

    def expert_ffn(self, x_SM: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Each expert's GLU on its rows: x sorted by expert, counts_E[e] rows for expert e. [S, M]

        The expert-parallel layer (expert_parallel.py) calls this on the rows it received for its local experts.
        """
        ends_E = group_ends(x_SM, counts_E)
        h = grouped_matmul(x_SM, self.w13_weight, counts_E, ends_E)
        h = glu(h, self.act, self.situ_beta, self.situ_linear_beta)
        return grouped_matmul(h, self.w2_weight, counts_E, ends_E)


class ExpertOrder(NamedTuple):
    """The S = T·K (token, expert) pairs sorted by expert; pair p = t·K + k is token t's k-th choice."""
    pair_of_row_S: torch.Tensor  # the pair in each sorted row [S]
    row_of_pair_TK: torch.Tensor  # the sorted row of each pair [T, K]: the inverse permutation
    counts_E: torch.Tensor  # rows per expert [E]


def sort_by_expert(experts_TK: torch.Tensor, num_experts: int) -> ExpertOrder:
    flat = experts_TK.reshape(-1)
    pair_of_row = torch.argsort(flat, stable=True)
    row_of_pair = inverse_permutation(pair_of_row).view(experts_TK.shape)
    return ExpertOrder(pair_of_row, row_of_pair, count_values(flat, num_experts))


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """inv with inv[index[i]] = i."""
    return torch.empty_like(index).scatter_(0, index, torch.arange(index.numel(), device=index.device))


def dispatch(x_TM: torch.Tensor, order: ExpertOrder) -> torch.Tensor:
    """Each token's row once per chosen expert, grouped by expert. [S, M]"""
    return _Dispatch.apply(x_TM, order.pair_of_row_S, order.row_of_pair_TK)


def combine(out_SM: torch.Tensor, weights_TK: torch.Tensor, order: ExpertOrder) -> torch.Tensor:
    """The gate-weighted sum of each token's expert outputs (rows in `sort_by_expert` order). [T, M]

    The rows go back to (token, choice) order by a gather and the K terms are summed per token in a fixed order,
    in fp32 inside the reduction (a scatter-add would add in bf16, in whatever order the atomics land).
    """
    out_TKM = permute_rows(out_SM, order.row_of_pair_TK.reshape(-1), order.pair_of_row_S)
    out_TKM = out_TKM.view(*weights_TK.shape, out_SM.shape[-1])
    return (out_TKM * weights_TK.to(out_SM.dtype)[..., None]).sum(1)


class _Dispatch(torch.autograd.Function):
    """x[token of each sorted row]; the backward gathers each token's K row gradients and sums them, instead of
    autograd's accumulating index_put (on CUDA a sort of all S indices every backward, and an order-dependent sum)."""

    @staticmethod
    def forward(ctx, x_TM: torch.Tensor, pair_of_row_S: torch.Tensor, row_of_pair_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(row_of_pair_TK)
        return x_TM.index_select(0, pair_of_row_S // row_of_pair_TK.shape[1])

    @staticmethod
    def backward(ctx, grad_SM: torch.Tensor):
        (row_of_pair_TK,) = ctx.saved_tensors
        grad_TKM = grad_SM.index_select(0, row_of_pair_TK.reshape(-1))
        return grad_TKM.view(*row_of_pair_TK.shape, grad_SM.shape[-1]).sum(1), None, None


def permute_rows(rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """rows[index] for a permutation `index` whose inverse is `inverse`: forward and backward are both gathers
    (autograd's backward of index_select is an atomic index_add into zeros)."""
    return _Permute.apply(rows, index, inverse)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def group_ends(x_SK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor | None:
    """Where each expert's rows end (int32 [E]), as `torch._grouped_mm` takes them, when `grouped_matmul` will call
    it on x; else None. Computed once for both of an expert FFN's GEMMs."""
    if x_SK.is_cuda and hasattr(torch, "_grouped_mm") and x_SK.dtype == torch.bfloat16 and x_SK.shape[0]:
        return torch.cumsum(counts_E, 0).to(torch.int32)
    return None


def grouped_matmul(x_SK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor,
                   ends_E: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of x sorted by expert, times each expert's weight transposed: y[rows of e] = x[rows of e] @ w[e]ᵀ.

    On CUDA (bf16) one `torch._grouped_mm` call (`ends_E`: `group_ends`' result, when the caller has it);
    elsewhere a split over the experts that received rows (its backward on CPU rejects the broadcast gradients
    autograd produces, and the split is as fast there).
    """
    if x_SK.shape[0] == 0:  # no rows (an expert-parallel rank that received none): keep the weights in the graph,
        return x_SK @ w_ENK[0].t()  # so they get a zero gradient like every other rank's and DeepSpeed reduces all
    if ends_E is None:
        ends_E = group_ends(x_SK, counts_E)
    if ends_E is not None:
        return torch._grouped_mm(x_SK, w_ENK.transpose(1, 2), offs=ends_E)
    parts = torch.split(x_SK, counts_E.tolist())
    return torch.cat([part @ w_ENK[e].t() for e, part in enumerate(parts) if part.shape[0]])


class SparseMoE(nn.Module):
    """Router + routed experts (optionally latent) + shared experts. Checkpoint name: `block_sparse_moe`."""

    def __init__(self, config: HybridMoEConfig):
        super().__init__()
        hidden = config.hidden_size
        width = config.routed_expert_hidden_size or hidden
        self.gate = Router(config)
        self.experts = RoutedExperts(config.num_experts, width, config.moe_intermediate_size, config.hidden_act,
                                     config.activation_situ_beta, config.activation_situ_linear_beta)
        self.shared_experts = (MLP(hidden, config.moe_intermediate_size * config.num_shared_experts,
                                   config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta)
                               if config.num_shared_experts else None)
        self.latent = config.routed_expert_hidden_size is not None
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(hidden, width, bias=False)
            self.routed_expert_norm = RMSNorm(width, config.rms_norm_eps) if config.latent_moe_use_norm else None
            self.routed_expert_up_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x_TD: torch.Tensor, forced_experts_TK: torch.Tensor | None = None,
                counted_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the output [T, D] and the experts used [T, K] (for routing capture). `counted_T`: the tokens
        the load balancer counts (None: all)."""
        weights, experts = self.gate(x_TD, forced_experts_TK, counted_T)
        routed_in = self.routed_expert_down_proj(x_TD) if self.latent else x_TD
        routed = self.experts(routed_in, weights, experts)
        if self.latent:
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x_TD)
        return routed, experts
