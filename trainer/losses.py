"""Policy-gradient losses over packed tokens: PPO-clip / "GRPO", DAPO clip-higher, GSPO, SFT; TIS and IcePop.

Legend: T = target tokens of a packed micro-batch, N = its sequences. Every per-token tensor is aligned with the
*targets*: position t holds log π(y_{t+1} | y_≤t) for the token the trajectory sampled at t+1.

Per target token:
    logp_t   log π_θ from this forward (carries the gradient)
    infer_t  the log-probability the inference engine recorded when it sampled the token (behaviour policy)
    A_t      the sequence's advantage
    w_t      aggregation weight, 0 where the token is not trained (see `aggregation_weights`): the weights are
             normalised over the *whole* batch of one optimizer step (the step's batch, or one of its PPO
             mini-batches), so its loss is the plain sum of the micro-batches' losses on every rank, however the
             batch was packed or split.

PPO ratio: r_t = exp(logp_t − old_t). `old_logprobs="current"` takes old_t = the trainer's log-prob before the step's
first update: with one optimizer step per batch that is sg(logp_t), r is 1 in value and PPO-clip reduces to the
policy gradient A·∇logp (as GRPO with one update per batch does); with `mini_batches` > 1 the trainer records it in a
no-grad pass before the first mini-batch, and from the second mini-batch on r moves and the clip bounds the update.
`old_logprobs="inference"` takes old_t = infer_t, the behaviour policy: the ratio then also spans the policy lag of
asynchronous rollouts and the clip bounds it.

Training/inference mismatch: m_t = exp(pre_t − infer_t), the trainer's probability of the token under the
pre-step weights (pre_t: sg(logp_t), or the recorded old_t with mini-batches) over the engine's (kernels,
precision, MoE routing and policy lag all move it away from 1).
    TIS    (truncated importance sampling): each token's loss is weighted by min(m_t, C).
    IcePop: tokens with m_t outside [lo, hi] are dropped from the loss (masked, not weighted).
With `old_logprobs="inference"` the ratio already is π_θ/π_infer, so TIS on top would weight twice: rejected.

Token-level loss ("GRPO" as DeepSeekMath writes it, with DAPO's clip-higher when eps_high > eps_low):
    ℓ_t = −c_t · keep_t · min(r_t A_t, clip(r_t, 1 − eps_low, 1 + eps_high) A_t)
GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its kept tokens' ratios,
    s_i = exp(mean_{t∈i} (logp_t − old_t)),
    ℓ_i = −c_i · min(s_i A_i, clip(s_i, 1 − eps_low, 1 + eps_high) A_i),
    with the sequence-level TIS weight c_i = min(exp(mean_{t∈i}(sg(logp_t) − infer_t)), C)
    and the sequence's weight W_i = Σ_{t∈i} w_t.
    (GSPO's clip ranges are ~1e-3, not 0.2: set eps_low / eps_high accordingly.)
SFT: ℓ_t = −logp_t (cross-entropy on the loss-masked tokens).
Optional terms on every trained token: + kl_coef · k3(π_ref ‖ π_θ) with k3 = e^{ref−logp} − (ref − logp) − 1
(Schulman's unbiased, always-positive estimator), and − entropy_coef · H_t.

Advantages: `grpo_advantages` centres rewards within each group (GRPO); `normalize_std=False` leaves out the division
by the group's std (Dr.GRPO), which together with the "seq-mean-token-sum-norm" aggregation (a constant instead of
each sequence's length) removes both of Dr.GRPO's biases.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from agentrl.reward import group_advantages
from agentrl.types import Trajectory

LOSS_KINDS = ("ppo", "gspo", "sft")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
OLD_LOGPROBS = ("current", "inference")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """Which objective the trainer optimises (see the module docstring for the formulas).

    Args:
        kind: "ppo" (token-level PPO-clip / GRPO / DAPO), "gspo" (sequence-level ratio) or "sft" (cross-entropy).
        eps_low, eps_high: clip range [1 − eps_low, 1 + eps_high]; eps_high > eps_low is DAPO's clip-higher.
        aggregation: how token losses are averaged: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum" or
            "seq-mean-token-sum-norm" (divides by `norm_constant`, e.g. the max response length: Dr.GRPO).
        norm_constant: the constant of "seq-mean-token-sum-norm".
        normalize_adv_std: divide group-centred rewards by the group's std (GRPO); False is Dr.GRPO.
        old_logprobs: "current" (π_old = the pre-step trainer policy) or "inference" (the recorded behaviour policy).
        tis_cap: C of truncated importance sampling against the inference log-probs (None: off).
        icepop_band: (lo, hi): drop tokens whose π_train/π_infer is outside; (1/β, β) in IcePop's terms (None: off).
        mini_batches: PPO mini-batches: the step's batch is split, whole groups each, into this many parts with one
            optimizer step each (advantages are computed over the whole batch first). 1: one step per batch.
        kl_coef: weight of the k3 KL to the reference policy (the initial weights, or the warm-started ones after an
            SFT warm start: PolicyTrainer.reset_reference); 0 keeps no reference model.
        entropy_coef: weight of the entropy bonus.
    """

    kind: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    aggregation: str = "token-mean"
    norm_constant: float | None = None
    normalize_adv_std: bool = True
    old_logprobs: str = "current"
    tis_cap: float | None = None
    icepop_band: tuple[float, float] | None = None
    mini_batches: int = 1
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"trainer.loss.kind={self.kind!r} is not one of {LOSS_KINDS}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"trainer.loss.aggregation={self.aggregation!r} is not one of {AGGREGATIONS}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"trainer.loss.old_logprobs={self.old_logprobs!r} is not one of {OLD_LOGPROBS}")
        if self.eps_low < 0 or self.eps_high < 0:
            raise ValueError(f"trainer.loss.eps_low and eps_high must be >= 0, got eps_low={self.eps_low}, "
                             f"eps_high={self.eps_high}")
        if self.aggregation == "seq-mean-token-sum-norm" and not (self.norm_constant and self.norm_constant > 0):
            raise ValueError(f"trainer.loss.aggregation 'seq-mean-token-sum-norm' needs trainer.loss.norm_constant "
                             f"> 0, got {self.norm_constant}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"trainer.loss.tis_cap must be > 0, got {self.tis_cap}")
        if self.tis_cap is not None and self.old_logprobs == "inference":
            raise ValueError("trainer.loss.tis_cap with trainer.loss.old_logprobs='inference' would weight by "
                             "π/π_infer twice; use old_logprobs='current' with TIS")
        if self.icepop_band is not None:
            lo, hi = self.icepop_band
            if not 0 <= lo < 1 < hi:
                raise ValueError(f"trainer.loss.icepop_band must satisfy 0 <= lo < 1 < hi, got {self.icepop_band}")
        if self.mini_batches < 1:
            raise ValueError(f"trainer.loss.mini_batches must be >= 1, got {self.mini_batches}")
        if self.kl_coef < 0:
            raise ValueError(f"trainer.loss.kl_coef must be >= 0, got {self.kl_coef}")


@dataclass(kw_only=True, slots=True)
class LossOutput:
    """The micro-batch's loss and metric *sums* (add them over micro-batches and ranks; divide by the counts).

    The sums stay on the loss's device as 0-dim tensors: reading each back would stop the host until the GPU has
    caught up, ~10 times per micro-batch, in a step the host already bounds at short lengths. `read_sums` reads a
    whole dict of them in one transfer."""

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]

    def host_sums(self) -> dict[str, float]:
        return read_sums(self.sums)


def read_sums(sums: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """The values of `sums` (0-dim tensors, on any device, or numbers) as floats, with one copy per device."""
    out = {k: float(v) for k, v in sums.items() if not isinstance(v, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = defaultdict(list)
    for k, v in sums.items():
        if isinstance(v, torch.Tensor):
            by_device[v.device].append(k)
    for keys in by_device.values():
        values = torch.stack([sums[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist()
        out.update(zip(keys, values))
    return {k: out[k] for k in sums}


def grpo_advantages(trajectories: Sequence[Trajectory], *, normalize_std: bool) -> list[float | None]:
    """Per-trajectory advantages, centred within each group (group_id); None for failed ones (no advantage)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        groups[t.group_id].append(i)
    out: list[float | None] = [None] * len(trajectories)
    for members in groups.values():
        advs = group_advantages([trajectories[i].reward for i in members],
                                [trajectories[i].status.value for i in members], normalize_std=normalize_std)
        for i, a in zip(members, advs):
            out[i] = a
    return out


def aggregation_weights(num_masked_per_seq: Sequence[int], aggregation: str,
                        norm_constant: float | None = None) -> list[float]:
    """The weight of each trained token of each sequence, normalised over the whole batch of sequences.

    token-mean: 1/Σ_i L_i; seq-mean-token-mean: 1/(N·L_i); seq-mean-token-sum: 1/N;
    seq-mean-token-sum-norm: 1/(N·norm_constant). (L_i = trained tokens of sequence i, N = sequences.)
    """
    n = len(num_masked_per_seq)
    total = sum(num_masked_per_seq)
    if aggregation == "token-mean":
        return [1.0 / total] * n
    if aggregation == "seq-mean-token-mean":
        return [1.0 / (n * length) for length in num_masked_per_seq]
    if aggregation == "seq-mean-token-sum":
        return [1.0 / n] * n
    if aggregation == "seq-mean-token-sum-norm":
        return [1.0 / (n * norm_constant)] * n
    raise ValueError(f"aggregation {aggregation!r} is not one of {AGGREGATIONS}")


def mismatch_correction(pre_T: torch.Tensor, infer_T: torch.Tensor, mask_T: torch.Tensor,
                        config: LossConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level TIS weights c_t and IcePop keep-mask from m_t = exp(pre_t − infer_t), pre_t the trainer's log-prob
    before the step's first update. Both detached."""
    log_m = pre_T.detach() - infer_T
    m = log_m.exp()
    ones = torch.ones_like(m)
    tis = torch.clamp(m, max=config.tis_cap) if config.tis_cap is not None else ones
    if config.icepop_band is not None:
        lo, hi = config.icepop_band
        keep = ((m >= lo) & (m <= hi)).to(m.dtype)
    else:
        keep = ones
    sums = {"train_infer_abs_logp_diff": (log_m.abs() * mask_T).sum(),
            "tis_truncated": ((m > config.tis_cap) & mask_T).sum() if config.tis_cap is not None else m.new_zeros(()),
            "icepop_masked": ((keep == 0) & mask_T).sum()}
    return tis, keep, sums


def ppo_token_loss(logp_T: torch.Tensor, old_T: torch.Tensor, adv_T: torch.Tensor, weights_T: torch.Tensor,
                   mask_T: torch.Tensor, tis_T: torch.Tensor, keep_T: torch.Tensor, eps_low: float, eps_high: float
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_t w_t · (−c_t · keep_t · min(r_t A_t, clip(r_t, 1−eps_low, 1+eps_high) A_t)), r_t = e^{logp_t − old_t}."""
    ratio = torch.exp(logp_T - old_T)
    unclipped = ratio * adv_T
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv_T
    per_token = -torch.minimum(unclipped, clipped) * tis_T * keep_T
    loss = (weights_T * per_token).sum()
    r = ratio.detach()
    is_clipped = ((r > 1.0 + eps_high) & (adv_T > 0)) | ((r < 1.0 - eps_low) & (adv_T < 0))
    return loss, {"clipped": (is_clipped & mask_T).sum(), "ratio": (r * mask_T).sum()}


def gspo_loss(logp_T: torch.Tensor, old_T: torch.Tensor, infer_T: torch.Tensor, adv_T: torch.Tensor,
              weights_T: torch.Tensor, mask_T: torch.Tensor, keep_T: torch.Tensor, seq_T: torch.Tensor,
              num_seqs: int, eps_low: float, eps_high: float, tis_cap: float | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_i W_i · ℓ_i with GSPO's sequence ratio s_i (geometric mean over the kept tokens) and sequence-level TIS."""
    kept = mask_T.to(logp_T.dtype) * keep_T
    count_N = torch.zeros(num_seqs, dtype=logp_T.dtype, device=logp_T.device).index_add_(0, seq_T, kept)
    has_tokens = count_N > 0
    denom_N = count_N.clamp_min(1.0)

    def seq_mean(x_T):
        return torch.zeros(num_seqs, dtype=x_T.dtype, device=x_T.device).index_add_(0, seq_T, x_T * kept) / denom_N

    s = torch.exp(seq_mean(logp_T - old_T))
    # every token of a sequence carries the sequence's advantage: take it exactly (amax of equal values)
    adv_N = torch.zeros(num_seqs, dtype=adv_T.dtype, device=adv_T.device).scatter_reduce_(
        0, seq_T, adv_T, reduce="amax", include_self=False)
    weight_N = torch.zeros(num_seqs, dtype=weights_T.dtype, device=weights_T.device).index_add_(0, seq_T, weights_T)
    if tis_cap is not None:
        tis_N = torch.clamp(torch.exp(seq_mean(logp_T.detach() - infer_T)), max=tis_cap)
    else:
        tis_N = torch.ones_like(s)
    per_seq = -torch.minimum(s * adv_N, torch.clamp(s, 1.0 - eps_low, 1.0 + eps_high) * adv_N) * tis_N
    loss = (weight_N * per_seq * has_tokens).sum()
    sd = s.detach()
    is_clipped = (((sd > 1.0 + eps_high) & (adv_N > 0)) | ((sd < 1.0 - eps_low) & (adv_N < 0))) & has_tokens
    return loss, {"clipped_seqs": is_clipped.sum(), "sequences": has_tokens.sum(), "seq_ratio": (sd * has_tokens).sum()}


def k3_kl(logp_T: torch.Tensor, ref_T: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(π_θ ‖ π_ref) per token: e^{ref−logp} − (ref − logp) − 1 (≥ 0)."""
    d = ref_T - logp_T
    return torch.exp(d) - d - 1.0


def policy_loss(*, logp_T: torch.Tensor, entropy_T: torch.Tensor | None, infer_T: torch.Tensor,
                adv_T: torch.Tensor, weights_T: torch.Tensor, mask_T: torch.Tensor, seq_T: torch.Tensor,
                num_seqs: int, config: LossConfig, ref_T: torch.Tensor | None = None,
                recorded_old_T: torch.Tensor | None = None) -> LossOutput:
    """The configured objective on one micro-batch (all tensors [T], fp32; mask_T bool; seq_T long).

    `recorded_old_T`: the trainer's log-probs before the step's first update, recorded when the step makes several
    optimizer steps (mini-batches); None: the step makes one, and they are sg(logp_T).
    """
    weights_T = weights_T * mask_T
    sums: dict[str, torch.Tensor] = {"tokens": mask_T.sum()}
    if config.kind == "sft":
        loss = -(weights_T * logp_T).sum()
        sums["nll"] = -(logp_T.detach() * mask_T).sum()
    else:
        pre_T = logp_T.detach() if recorded_old_T is None else recorded_old_T
        tis_T, keep_T, mismatch = mismatch_correction(pre_T, infer_T, mask_T, config)
        sums.update(mismatch)
        old_T = pre_T if config.old_logprobs == "current" else infer_T
        if config.kind == "ppo":
            loss, extra = ppo_token_loss(logp_T, old_T, adv_T, weights_T, mask_T, tis_T, keep_T,
                                         config.eps_low, config.eps_high)
        else:
            loss, extra = gspo_loss(logp_T, old_T, infer_T, adv_T, weights_T, mask_T, keep_T, seq_T, num_seqs,
                                    config.eps_low, config.eps_high, config.tis_cap)
        sums.update(extra)
    sums["pg_loss"] = loss.detach()
    if ref_T is not None and config.kl_coef > 0:
        kl_T = k3_kl(logp_T, ref_T)
        loss = loss + config.kl_coef * (weights_T * kl_T).sum()
        sums["kl"] = (kl_T.detach() * mask_T).sum()
    if entropy_T is not None:
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * (weights_T * entropy_T).sum()
        sums["entropy"] = (entropy_T.detach() * mask_T).sum()
    return LossOutput(loss=loss, sums=sums)
