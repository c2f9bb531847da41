"""Expert load balancing without an auxiliary loss: Quantile Balancing and the sign rule.

Legend: T = tokens, E = routed experts, K = experts per token (top-k), B = histogram bins.

The router selects experts by the *biased* scores s + b and weights them by the unbiased s, so the bias b steers
load without entering the gradient or the gate weights. Each optimizer step the bias is recomputed:

**Quantile Balancing** (Kimi K3 §2.3.3; J. Su, "MoE环游记 6"). Token i picks expert j when s_ij + b_j beats the
best score among the *other* experts that would still make the top-K: α_ij = the K-th largest biased score of the
other experts, which from the token's top-(K+1) biased scores is the (K+1)-th when j is selected and the K-th when it
is not. For every expert to be chosen by the fraction K/E of the tokens, b̂_j = −quantile_{1−K/E}(s_{:,j} − α_{:,j})
over the step's tokens, and b = b̂ − mean(b̂). The update has no learning rate; the new bias applies from the next step
and is frozen at inference.

(DESIGN.md states α_i = the (K+1)-th biased score for every expert. For an unselected expert that threshold is too
low: to enter the top-K it must displace the K-th, not the (K+1)-th, which is often itself. With that form the
closed-form update overshoots and, on a strongly skewed router, oscillates at max/mean load ≈ 2; with the per-expert
threshold it settles near 1.05 in a few steps (tests/unit/model/test_moe_and_balancing.py).)

Across ranks the quantile comes from per-expert histograms of s_ij − α_i over a fixed range, summed by one
all-reduce (a sum of histograms is the histogram of the union). The quantile is read from the cumulative histogram by
linear interpolation inside a bin, so it is exact to within one bin width.

**Sign rule** (the simpler variant, as in DeepSeek-V3): b_j −= η · sign(load_j − median(load)).

Activation checkpointing reruns the router in the backward pass and so adds every token twice: both the quantiles
and the load ratios are invariant to that uniform doubling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from agentrl.model import static_shapes

BALANCING_METHODS = ("quantile", "sign", "none")


@dataclass(kw_only=True, slots=True)
class BalancingStats:
    """What one layer's balancer saw since its last update (for logging)."""

    load_E: torch.Tensor  # tokens routed to each expert
    max_over_mean: float  # max_j load_j / mean_j load_j; 1.0 is perfect balance


def count_values(values: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n−1 occurs in the int64 `values`, all in [0, n): `torch.bincount(values, minlength=n)`
    without its host syncs. On CUDA bincount reads the values' minimum and maximum back to the host to size its
    output, two syncs per call, and the MoE layer counts three times per forward (its expert order, and the load and
    margin histogram of Quantile Balancing). A scatter-add of ones into n counters needs no sizing; integer adds are
    exact in any order."""
    return add_counts(torch.zeros(n, dtype=torch.long, device=values.device), values)


def add_counts(counts: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """counts[v] += 1 (or the int64 weight beside v) for every v in `values` (int64, each a valid index), in place;
    returns `counts`. One kernel: without weights the ones are a single cached element, expanded."""
    return counts.scatter_add_(0, values, _one(values.device).expand_as(values) if weights is None else weights)


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.long, device=device)
    return one


def competitor_threshold(biased_scores_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """α_ij: the K-th largest biased score among the experts other than j, shape [T, E].

    From the top-(K+1) biased scores: the (K+1)-th for the experts in the top K, the K-th for the others. An expert
    counts as in the top K when its score reaches the K-th: one that only ties it (and which topk left out) gets
    the (K+1)-th, which then equals the K-th, so ties cannot change α.
    """
    num_experts = biased_scores_TE.shape[-1]
    if top_k >= num_experts:
        raise ValueError(f"top_k={top_k} must be smaller than the number of experts {num_experts}")
    top = biased_scores_TE.topk(top_k + 1, dim=-1).values
    kth = top[:, top_k - 1, None]
    return torch.where(biased_scores_TE >= kth, top[:, top_k, None], kth)


def exact_quantile_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """The centred Quantile Balancing bias computed from the exact quantile (the reference for the histograms)."""
    margins_TE = scores_TE - competitor_threshold(scores_TE + bias_E, top_k)
    q = 1.0 - top_k / scores_TE.shape[-1]
    b_hat_E = -torch.quantile(margins_TE.double(), q, dim=0, interpolation="linear").to(scores_TE.dtype)
    return b_hat_E - b_hat_E.mean()


def histogram_quantile(hist_EB: torch.Tensor, lo, hi, q: float) -> torch.Tensor:
    """The q-quantile of each row's distribution from its histogram over [lo, hi] with equal-width bins.

    Linear interpolation inside the bin that crosses q·count; exact to within one bin width. `lo` and `hi`: floats,
    or fp64 [E, 1] tensors for a range per row (several layers' histograms at once).
    """
    num_bins = hist_EB.shape[-1]
    width = (hi - lo) / num_bins
    counts = hist_EB.double()
    cdf_EB = counts.cumsum(-1)
    total_E = cdf_EB[:, -1:]
    target_E1 = q * total_E
    # first bin whose cumulative count reaches the target
    idx_E1 = torch.searchsorted(cdf_EB.contiguous(), target_E1).clamp_max(num_bins - 1)
    before_E1 = torch.where(idx_E1 > 0, cdf_EB.gather(-1, (idx_E1 - 1).clamp_min(0)), torch.zeros_like(target_E1))
    in_bin_E1 = counts.gather(-1, idx_E1).clamp_min(1e-12)
    frac_E1 = ((target_E1 - before_E1) / in_bin_E1).clamp(0.0, 1.0)
    return (lo + (idx_E1.double() + frac_E1) * width).squeeze(-1)


class ExpertBalancer:
    """Accumulates one MoE layer's routing statistics over a step and computes the next selection bias.

    Args:
        num_experts: routed experts E.
        top_k: experts per token K.
        method: "quantile", "sign" or "none".
        num_bins: histogram resolution for Quantile Balancing.
        sign_rate: η of the sign rule.

    The owning router calls `observe` in training forwards; the trainer calls `update(bias_E, all_reduce)` after the
    optimizer step, which returns the bias for the next step (or None when there is nothing to change).
    """

    def __init__(self, *, num_experts: int, top_k: int, method: str = "quantile", num_bins: int = 4096,
                 sign_rate: float = 1e-3):
        if method not in BALANCING_METHODS:
            raise ValueError(f"balancing method {method!r} is not one of {BALANCING_METHODS}")
        if not 0 < top_k < num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.method = method
        self.num_bins = num_bins
        self.sign_rate = sign_rate
        self.hist_EB: torch.Tensor | None = None  # this step's margin histogram [E, B], int64 counts
        self.load_E: torch.Tensor | None = None  # this step's tokens per expert [E], int64
        self._binning_cache: tuple | None = None
        self.last_stats: BalancingStats | None = None  # global statistics of the last completed step

    @torch.no_grad()
    def observe(self, scores_TE: torch.Tensor, bias_E: torch.Tensor, topk_idx_TK: torch.Tensor,
                counted_T: torch.Tensor | None = None) -> None:
        """Adds one forward's router scores (unbiased sigmoid scores) and chosen experts.

        `counted_T`: which tokens count (bool or 0/1 [T]; None: all). A micro-batch padded to a CUDA graph's size
        routes its padding tokens like any others, and they must not steer the bias (cuda_graphs.py).

        A dozen kernels a call (the short step is host-bound, and every MoE layer calls this once per forward and
        once more per recomputation): the counts go straight into this step's integer counters, and the
        histogram's range, which depends only on the bias, is computed once per bias. The counters live from the
        first forward on and are zeroed in place by `reset`: a captured forward keeps adding into them.
        """
        if self.method == "none":
            return
        if self.load_E is None:  # the first forward
            self.load_E = torch.zeros(self.num_experts, dtype=torch.long, device=scores_TE.device)
            if self.method == "quantile":
                self.hist_EB = torch.zeros(self.num_experts, self.num_bins, dtype=torch.long, device=scores_TE.device)
        counted = None if counted_T is None else counted_T.to(torch.long)[:, None]
        add_counts(self.load_E, topk_idx_TK.reshape(-1),
                   None if counted is None else counted.expand_as(topk_idx_TK).reshape(-1))
        if self.method != "quantile":
            return
        lo, scale, offsets_E = self._binning(bias_E)
        scores_TE = scores_TE.float()
        margins_TE = scores_TE - competitor_threshold(scores_TE + bias_E.float(), self.top_k)
        bins_TE = ((margins_TE - lo) * scale).long().clamp_(0, self.num_bins - 1)
        add_counts(self.hist_EB.view(-1), (bins_TE + offsets_E).reshape(-1),
                   None if counted is None else counted.expand_as(bins_TE).reshape(-1))

    def _binning(self, bias_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lo, bins per unit of margin, each expert's first bin in the flat histogram) for this bias; 0-dim fp64
        tensors and [E] int64, kept on the device (a host read here would stall every MoE layer's forward) and
        recomputed when the bias is another tensor or has been written since."""
        if static_shapes.active():  # a captured forward replays with whatever bias is current: no cache
            return self._binning_of(bias_E)
        key = (bias_E, bias_E._version)
        cached = self._binning_cache
        if cached is None or cached[0] is not key[0] or cached[1] != key[1]:
            self._binning_cache = cached = (*key, self._binning_of(bias_E))
        return cached[2]

    def _binning_of(self, bias_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lo, hi = margin_range(bias_E.max().double(), bias_E.min().double())
        return lo, self.num_bins / (hi - lo), torch.arange(self.num_experts, device=bias_E.device) * self.num_bins

    def stats(self) -> BalancingStats | None:
        """This rank's statistics since the last update (None when it counted nothing)."""
        if self.load_E is None or not bool(self.load_E.any()):
            return None
        return _stats(self.load_E.double())

    def update(self, bias_E: torch.Tensor,
               all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Returns the next step's bias and resets the statistics (`update_biases` for this layer alone).

        `all_reduce` sums a tensor across data-parallel ranks in place (e.g. torch.distributed.all_reduce).
        """
        return update_biases([self], [bias_E], all_reduce)[0]

    def _packed(self, device: torch.device) -> torch.Tensor:
        """This step's statistics as one float64 vector ([E·B histogram,] E loads); zeros when nothing was observed,
        so that a rank that only ran padding micro-batches still joins the step's collective."""
        return torch.cat(self._counts(device)).double()

    def _counts(self, device: torch.device) -> list[torch.Tensor]:
        """([the flat histogram,] the loads), int64; zeros of those sizes when nothing was observed."""
        if self.load_E is None:
            size = self.num_experts * (self.num_bins + 1 if self.method == "quantile" else 1)
            return [torch.zeros(size, dtype=torch.long, device=device)]
        return [self.hist_EB.reshape(-1), self.load_E] if self.method == "quantile" else [self.load_E]

    def reset(self) -> None:
        """Forgets what was observed since the last update (last_stats stays): the counters are zeroed in place."""
        for counts in (self.load_E, self.hist_EB):
            if counts is not None:
                counts.zero_()


@torch.no_grad()
def update_biases(balancers: Sequence[ExpertBalancer], biases_E: Sequence[torch.Tensor],
                  all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor | None]:
    """Every MoE layer's next selection bias (None where no rank routed a token this step), from one all-reduce of
    all layers' statistics and one read of their load figures; resets each balancer.

    Per layer this would be a collective and four host syncs, ~60 of each per step at K3's depth. Every rank calls
    `all_reduce` exactly once per update, with zeros for what it did not observe (a rank whose micro-batches were
    all padding): ranks that skipped it would pair their next collectives with the wrong tensors.
    """
    if len(balancers) != len(biases_E):
        raise ValueError(f"{len(balancers)} balancers but {len(biases_E)} biases")
    new_biases: list[torch.Tensor | None] = [None] * len(balancers)
    active = [i for i, b in enumerate(balancers) if b.method != "none"]
    for b in balancers:
        if b.method == "none":
            b.reset()
    if not active:
        return new_biases
    parts = [balancers[i]._counts(biases_E[i].device) for i in active]
    packed = torch.cat([t for part in parts for t in part]).double()
    if all_reduce is not None:
        all_reduce(packed)
    pieces = packed.split([sum(t.numel() for t in part) for part in parts])
    # the layers' statistics side by side, one group per shape (a model's MoE layers share theirs): the figures
    # and quantiles of all layers come from a few operations, not a few dozen per layer
    by_experts: dict[int, list[int]] = {}
    for j, i in enumerate(active):
        by_experts.setdefault(balancers[i].num_experts, []).append(j)
    loads_of: dict[int, torch.Tensor] = {}
    figures_of: list[torch.Tensor] = []
    order: list[int] = []
    for num_experts, members in by_experts.items():
        loads_LE = torch.stack([pieces[j][-num_experts:] for j in members])  # a copy: the stats keep its rows
        bias_LE = torch.stack([biases_E[active[j]] for j in members]).double()
        figures_of.append(torch.stack([loads_LE.sum(-1), loads_LE.amax(-1), loads_LE.mean(-1), bias_LE.amax(-1),
                                       bias_LE.amin(-1)], dim=1))
        loads_of.update({j: row for j, row in zip(members, loads_LE)})
        order += members
    # one host read for every layer: total load (zero: nothing routed), max and mean load, and the bias's extremes
    # (the margin range of a layer this rank did not observe: it depends only on the bias, the same on every rank)
    figures = dict(zip(order, torch.cat(figures_of).tolist()))
    quantile_groups: dict[tuple[int, int, int, torch.dtype], list[int]] = {}  # (E, B, K, bias dtype) → layers
    for j, i in enumerate(active):
        balancer, bias = balancers[i], biases_E[i]
        total, most, mean, _, _ = figures[j]
        balancer.reset()
        if total == 0:
            continue
        balancer.last_stats = BalancingStats(load_E=loads_of[j], max_over_mean=most / mean)
        if balancer.method == "quantile":
            key = (balancer.num_experts, balancer.num_bins, balancer.top_k, bias.dtype)
            quantile_groups.setdefault(key, []).append(j)
        else:
            load_E = loads_of[j]
            new_biases[i] = (bias.double() - balancer.sign_rate * torch.sign(load_E - load_E.median())).to(bias.dtype)
    for (num_experts, num_bins, top_k, dtype), members in quantile_groups.items():
        hist_RB = torch.stack([pieces[j][:-num_experts].view(num_experts, num_bins) for j in members]).view(
            -1, num_bins)
        ranges = [margin_range(figures[j][3], figures[j][4]) for j in members]
        lo_R1, hi_R1 = (torch.tensor(bound, dtype=torch.float64, device=hist_RB.device).repeat_interleave(
            num_experts)[:, None] for bound in zip(*ranges))
        b_hat_LE = -histogram_quantile(hist_RB, lo_R1, hi_R1, 1.0 - top_k / num_experts).view(len(members), -1)
        new_LE = (b_hat_LE - b_hat_LE.mean(-1, keepdim=True)).to(dtype)
        for j, new_E in zip(members, new_LE):
            new_biases[active[j]] = new_E
    return new_biases


def margin_range(bias_max, bias_min):
    """The histogram's range of s − α: s ∈ (0, 1) and α ∈ (min b, 1 + max b), so s − α lies in (−1 − max b, 1 − min b).
    The bias is identical on every rank, hence so is the range, and the histograms can be summed. Floats (the update
    reads them) or 0-dim fp64 tensors (`observe`, without a host read): the same IEEE operations, the same range."""
    return (-1.0 - bias_max - 1e-3, 1.0 - bias_min + 1e-3)


def _stats(load_E: torch.Tensor) -> BalancingStats:
    mean = float(load_E.mean())
    return BalancingStats(load_E=load_E.clone(), max_over_mean=float(load_E.max()) / mean if mean > 0 else 1.0)
