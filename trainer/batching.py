"""Packing trajectories into micro-batches: variable-length sequences concatenated with `cu_seqlens`.

Legend: T = tokens of a micro-batch, N = its sequences, L = MoE layers, K = experts per token.

A trajectory of n tokens becomes one packed sequence of n − 1 positions: inputs tokens[:-1], targets tokens[1:].
Position t predicts token t+1, so it is trained where `loss_mask[t+1]` is 1 and its log-probability is compared with
`logprobs[t+1]` (what the engine recorded when it sampled token t+1). Routing replay feeds `routed_experts[:-1]`:
the experts the engine chose while processing each *input* token.

A step's batch is planned identically on every rank from the same list of trajectories (no communication):
1. sequences without a trained target are left out; aggregation weights are computed over the whole batch;
2. sequences are spread over the data-parallel ranks by tokens, longest first to the least-loaded rank;
3. each rank packs its sequences into micro-batches of at most `token_budget` tokens (first-fit, longest first);
   a sequence longer than the budget is a micro-batch of its own, so one long trajectory and a hundred short ones
   train in the same step;
4. ranks with fewer micro-batches get padding micro-batches (two tokens, zero weight): ZeRO reduces gradients in
   every backward, so every rank must run the same number of them.
Under context parallelism "ranks" above are the data-parallel groups of CP ranks, the budget is the group's, and each
rank of a group trains its own slice of every micro-batch of the group (`context_slice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from agentrl.model.context_parallel import ContextShard
from agentrl.trainer.losses import aggregation_weights
from agentrl.types import Trajectory


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without holding up the host: a blocking copy to the GPU first waits for all the work
    queued before it (a host sync); a non-blocking one from pageable memory is staged at once and queued behind it."""
    return t.to(device, non_blocking=True)


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """Packed sequences; every per-token tensor is aligned with the targets."""

    input_ids_T: torch.Tensor  # long
    target_ids_T: torch.Tensor  # long
    cu_seqlens: torch.Tensor  # int32 [N+1]
    loss_mask_T: torch.Tensor  # bool: the target was sampled by the policy
    weights_T: torch.Tensor  # fp32 aggregation weights (0 where not trained)
    infer_logprobs_T: torch.Tensor  # fp32: the engine's log-probs of the targets
    advantages_T: torch.Tensor  # fp32: the sequence's advantage on each of its tokens
    seq_index_T: torch.Tensor  # long: sequence of each token within this micro-batch
    forced_experts_TLK: torch.Tensor | None  # long: routing replay
    trajectory_indices: list[int]  # positions in the step's trajectory list
    is_padding: bool = False
    shard: ContextShard | None = None  # context parallelism: this is one rank's slice (`context_slice`)
    # fp32: the trainer's log-probs of the targets before the step's first optimizer step, recorded when a step makes
    # several (PPO mini-batches); None: one optimizer step, they are the forward's own (detached)
    old_logprobs_T: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.numel())

    def forward_args(self, device: torch.device | str) -> tuple:
        """(input_ids_T, cu_seqlens, target_ids_T, forced_experts_TLK, shard) on `device`: what PackedPolicy
        takes (the shard's offsets stay on the host; the model moves them)."""
        forced = None if self.forced_experts_TLK is None else to_device(self.forced_experts_TLK, device)
        return (to_device(self.input_ids_T, device), to_device(self.cu_seqlens, device),
                to_device(self.target_ids_T, device), forced, self.shard)

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel()) - 1


@dataclass(kw_only=True, slots=True)
class StepPlan:
    """Micro-batches per rank (equal counts, padded) and what was left out."""

    per_rank: list[list[MicroBatch]]
    num_sequences: int
    num_trained_tokens: int
    skipped: list[int]  # trajectories without a trained target token


def plan_step(trajectories: Sequence[Trajectory], advantages: Sequence[float | None], *, world_size: int,
              token_budget: int, aggregation: str, norm_constant: float | None = None,
              num_moe_layers: int | None = None) -> StepPlan:
    """Plans one optimizer step's micro-batches for every rank (see the module docstring).

    `advantages[i]` is None for trajectories that take no part (failed ones): they are skipped like empty ones.
    `num_moe_layers` checks the shape of routed experts when trajectories carry them.
    """
    if token_budget < 2:
        raise ValueError(f"token_budget must be >= 2 tokens, got {token_budget}")
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    kept, skipped = [], []
    for i, t in enumerate(trajectories):
        t.validate()
        (kept if is_trainable(t, advantages[i]) else skipped).append(i)
    if not kept:
        raise ValueError(f"none of the {len(trajectories)} trajectories has a trained token "
                         f"(loss_mask 1 after the first token, and an advantage)")
    routed = [trajectories[i].routed_experts is not None for i in kept]
    if any(routed) and not all(routed):
        raise ValueError(f"routing replay needs routed experts on every trajectory of a batch; "
                         f"{sum(routed)} of {len(routed)} carry them")
    if all(routed) and num_moe_layers is not None:
        for i in kept:
            shape = trajectories[i].routed_experts.shape
            if shape[1] != num_moe_layers:
                raise ValueError(f"trajectory {trajectories[i].trajectory_id} has routed experts for {shape[1]} "
                                 f"MoE layers; the model has {num_moe_layers}")
    trained = [int(np.count_nonzero(trajectories[i].loss_mask[1:])) for i in kept]
    weight_of = dict(zip(kept, aggregation_weights(trained, aggregation, norm_constant)))
    length_of = {i: len(trajectories[i].tokens) - 1 for i in kept}

    by_length = sorted(kept, key=lambda i: (-length_of[i], i))
    rank_load = [0] * world_size
    rank_seqs: list[list[int]] = [[] for _ in range(world_size)]
    for i in by_length:
        r = min(range(world_size), key=lambda r: (rank_load[r], r))
        rank_load[r] += length_of[i]
        rank_seqs[r].append(i)

    per_rank = []
    for seqs in rank_seqs:
        bins: list[list[int]] = []
        loads: list[int] = []
        for i in seqs:  # already longest first
            for b, load in enumerate(loads):
                if load + length_of[i] <= token_budget:
                    bins[b].append(i)
                    loads[b] += length_of[i]
                    break
            else:
                bins.append([i])
                loads.append(length_of[i])
        micro_batches = []
        for b in bins:
            order = sorted(b)  # trajectory order inside a micro-batch, whatever the packing order was
            micro_batches.append(pack([trajectories[i] for i in order], order, [advantages[i] for i in order],
                                      [weight_of[i] for i in order]))
        per_rank.append(micro_batches)
    most = max(len(m) for m in per_rank)
    for micro_batches in per_rank:
        while len(micro_batches) < most:
            micro_batches.append(padding_micro_batch(num_moe_layers if all(routed) else None,
                                                     trajectories[kept[0]]))
    return StepPlan(per_rank=per_rank, num_sequences=len(kept), num_trained_tokens=sum(trained), skipped=skipped)


def is_trainable(t: Trajectory, advantage: float | None) -> bool:
    """Whether the trajectory has a trained target token and an advantage (failed episodes have none)."""
    return advantage is not None and len(t.tokens) >= 2 and any(t.loss_mask[1:])


def mini_batch_indices(trajectories: Sequence[Trajectory], advantages: Sequence[float | None],
                       parts: int) -> list[list[int]]:
    """Splits a step's batch into at most `parts` PPO mini-batches of whole groups (positions in the list).

    Groups keep their order of first appearance and are cut into contiguous runs of nearly equal group counts;
    groups with no trainable member ride along in the first mini-batch (plan_step reports them as skipped), so no
    mini-batch is without a trained token and none is lost.
    """
    members: dict[str, list[int]] = {}
    for i, t in enumerate(trajectories):
        members.setdefault(t.group_id, []).append(i)
    trainable = [g for g in members.values() if any(is_trainable(trajectories[i], advantages[i]) for i in g)]
    idle = [i for g in members.values() if g not in trainable for i in g]
    n = max(1, min(parts, len(trainable)))
    bounds = [k * len(trainable) // n for k in range(n + 1)]
    out = [[i for g in trainable[bounds[k]:bounds[k + 1]] for i in g] for k in range(n)]
    out[0] = sorted(out[0] + idle)
    return out


def pack(trajectories: Sequence[Trajectory], indices: Sequence[int], advantages: Sequence[float],
         weights: Sequence[float]) -> MicroBatch:
    """Concatenates trajectories into one micro-batch; `weights[j]` is the weight of each trained token of j."""
    inputs, targets, masks, infer, advs, wts, seq_idx, forced = [], [], [], [], [], [], [], []
    for j, (t, adv, w) in enumerate(zip(trajectories, advantages, weights)):
        n = len(t.tokens) - 1
        tokens = np.asarray(t.tokens, dtype=np.int64)
        mask = np.asarray(t.loss_mask[1:], dtype=bool)
        inputs.append(tokens[:-1])
        targets.append(tokens[1:])
        masks.append(mask)
        infer.append(np.asarray(t.logprobs[1:], dtype=np.float64))
        advs.append(np.full(n, adv, dtype=np.float64))
        wts.append(np.where(mask, w, 0.0))
        seq_idx.append(np.full(n, j, dtype=np.int64))
        if t.routed_experts is not None:
            forced.append(np.asarray(t.routed_experts[:-1], dtype=np.int64))
    lengths = [len(x) for x in inputs]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return MicroBatch(
        input_ids_T=torch.from_numpy(np.concatenate(inputs)),
        target_ids_T=torch.from_numpy(np.concatenate(targets)),
        cu_seqlens=torch.from_numpy(cu),
        loss_mask_T=torch.from_numpy(np.concatenate(masks)),
        weights_T=torch.from_numpy(np.concatenate(wts)).float(),
        infer_logprobs_T=torch.from_numpy(np.concatenate(infer)).float(),
        advantages_T=torch.from_numpy(np.concatenate(advs)).float(),
        seq_index_T=torch.from_numpy(np.concatenate(seq_idx)),
        forced_experts_TLK=torch.from_numpy(np.concatenate(forced)) if forced else None,
        trajectory_indices=list(indices),
    )


def context_slice(micro: MicroBatch, *, rank: int, size: int, group, min_tokens: int) -> MicroBatch:
    """Rank `rank`'s slice of `micro` under context parallelism over `size` ranks (agentrl/model/context_parallel.py):
    the micro-batch is first padded with a zero-weight sequence so that it splits evenly with at least `min_tokens`
    per rank (the short convolution reads its W−1 predecessors from the previous rank)."""
    from agentrl.model.context_parallel import ContextShard, pad_length

    pad = pad_length(micro.num_tokens, size, min_tokens)
    if pad:
        def grow(t: torch.Tensor, value=0) -> torch.Tensor:
            return torch.cat([t, torch.full((pad, *t.shape[1:]), value, dtype=t.dtype)])

        micro = MicroBatch(
            input_ids_T=grow(micro.input_ids_T), target_ids_T=grow(micro.target_ids_T),
            cu_seqlens=torch.cat([micro.cu_seqlens, micro.cu_seqlens[-1:] + pad]),
            loss_mask_T=grow(micro.loss_mask_T, False), weights_T=grow(micro.weights_T),
            infer_logprobs_T=grow(micro.infer_logprobs_T), advantages_T=grow(micro.advantages_T),
            seq_index_T=grow(micro.seq_index_T, micro.num_sequences),
            forced_experts_TLK=None if micro.forced_experts_TLK is None else grow(micro.forced_experts_TLK),
            trajectory_indices=micro.trajectory_indices, is_padding=micro.is_padding,
            old_logprobs_T=None if micro.old_logprobs_T is None else grow(micro.old_logprobs_T))
    shard = ContextShard.of(micro.cu_seqlens, rank=rank, size=size, group=group)
    part = slice(shard.lo, shard.hi)
    return MicroBatch(
        input_ids_T=micro.input_ids_T[part], target_ids_T=micro.target_ids_T[part], cu_seqlens=shard.cu_seqlens,
        loss_mask_T=micro.loss_mask_T[part], weights_T=micro.weights_T[part],
        infer_logprobs_T=micro.infer_logprobs_T[part], advantages_T=micro.advantages_T[part],
        seq_index_T=micro.seq_index_T[part],
        forced_experts_TLK=None if micro.forced_experts_TLK is None else micro.forced_experts_TLK[part],
        trajectory_indices=micro.trajectory_indices, is_padding=micro.is_padding, shard=shard,
        old_logprobs_T=None if micro.old_logprobs_T is None else micro.old_logprobs_T[part])


def padding_micro_batch(num_moe_layers: int | None, like: Trajectory) -> MicroBatch:
    """Two tokens with zero weight: a rank with fewer micro-batches runs these so collectives stay matched."""
    forced = None
    if num_moe_layers is not None and like.routed_experts is not None:
        forced = torch.as_tensor(like.routed_experts[:2], dtype=torch.long)
    zeros = torch.zeros(2)
    return MicroBatch(input_ids_T=torch.zeros(2, dtype=torch.long), target_ids_T=torch.zeros(2, dtype=torch.long),
                      cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
                      loss_mask_T=torch.zeros(2, dtype=torch.bool), weights_T=zeros, infer_logprobs_T=zeros,
                      advantages_T=zeros, seq_index_T=torch.zeros(2, dtype=torch.long), forced_experts_TLK=forced,
                      trajectory_indices=[], is_padding=True)
