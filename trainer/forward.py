"""One micro-batch through the policy: packed tokens → per-token log-probs and entropies → the configured loss.

`PackedPolicy` is the module DeepSpeed wraps. It calls the decoder (`policy.model`) and computes target log-probs
with the model's chunked, recomputed head (`chunked_token_logprobs`), so the [T, V] logits never exist at once, and it
returns plain tensors: ZeRO-3 attaches its pre-backward hooks to a module's output tensors, which it cannot find
inside the model's `HybridOutput` dataclass. The LM head weight is read directly by that function rather than through
`lm_head(...)`, so under ZeRO-3 it is registered as an external parameter of this wrapper (trainer/zero.py).

Nothing here imports DeepSpeed: unit tests run the same code on a plain model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from agentrl.model.context_parallel import ContextShard
from agentrl.model.modeling import HybridMoEForCausalLM, chunked_token_logprobs
from agentrl.trainer.batching import MicroBatch, to_device
from agentrl.trainer.losses import LossConfig, LossOutput, policy_loss

if TYPE_CHECKING:  # cuda_graphs records PackedPolicy's forward
    from agentrl.trainer.cuda_graphs import GraphedForward


class PackedPolicy(nn.Module):
    """forward(input_ids_T, cu_seqlens, target_ids_T, forced_experts_TLK, shard, temperature) → (logprobs_T,
    entropy_T), fp32.

    `shard` (context parallelism): the tokens are this rank's slice of a micro-batch (batching.context_slice).
    `temperature` overrides the sampling temperature given at construction for one call. `counted_T`: the tokens
    the MoE balancers count (None: all; a micro-batch padded for a CUDA graph leaves its padding out). `graphs`, set
    by a trainer with `cuda_graph_tokens`, serves training calls that fit one of its sizes from CUDA graphs
    (trainer/cuda_graphs.py); others, and every call in eval mode or without gradients, run eagerly here."""

    def __init__(self, policy: HybridMoEForCausalLM, temperature: float = 1.0):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.policy = policy
        self.temperature = temperature
        self.graphs: GraphedForward | None = None  # set by a trainer that replays short micro-batches from graphs

    def forward(self, input_ids_T: torch.Tensor, cu_seqlens: torch.Tensor, target_ids_T: torch.Tensor,
                forced_experts_TLK: torch.Tensor | None = None,
                shard: ContextShard | None = None,
                temperature: float | None = None,
                counted_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        temperature = self.temperature if temperature is None else temperature
        if self.graphs is not None and shard is None and self.training and torch.is_grad_enabled():
            replayed = self.graphs(input_ids_T, cu_seqlens, target_ids_T, forced_experts_TLK, temperature)
            if replayed is not None:
                return replayed
        hidden_TD, _ = self.policy.model(input_ids_T, cu_seqlens, None, False, forced_experts_TLK, shard, counted_T)
        return chunked_token_logprobs(hidden_TD, self.policy.lm_head.weight, target_ids_T, temperature,
                                      return_entropy=True)


Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def micro_batch_loss(forward: Forward, micro: MicroBatch, config: LossConfig,
                     reference: Forward | None = None, device: torch.device | str = "cpu") -> LossOutput:
    """Runs `forward` (a PackedPolicy or the DeepSpeed engine around one) on a micro-batch and applies the loss.

    `reference` (a frozen PackedPolicy) supplies the reference log-probs of the KL term when kl_coef > 0.

    The RL losses take log-probs at the sampling temperature (the engine recorded its log-probs of softmax(z/τ), and
    the policy being improved is that tempered one). SFT takes them at temperature 1: it fits the demonstrations
    themselves, and sampling at τ < 1 then sharpens that fit. Fitted at τ instead, sampling at τ gives back exactly
    the fit, as flat as sampling at 1 would without the temperature (docs/benchmarks.md, "Three more levers").
    """
    args = micro.forward_args(device)
    temperature = 1.0 if config.kind == "sft" else None
    logp, entropy = forward(*args, temperature=temperature)
    ref = None
    if reference is not None and config.kl_coef > 0:
        with torch.no_grad():
            ref, _ = reference(*args, temperature=temperature)
    return policy_loss(logp_T=logp.float(), entropy_T=entropy.float(),
                       infer_T=to_device(micro.infer_logprobs_T, device), adv_T=to_device(micro.advantages_T, device),
                       weights_T=to_device(micro.weights_T, device), mask_T=to_device(micro.loss_mask_T, device),
                       seq_T=to_device(micro.seq_index_T, device), num_seqs=micro.num_sequences, config=config,
                       ref_T=None if ref is None else ref.float(),
                       recorded_old_T=None if micro.old_logprobs_T is None else to_device(micro.old_logprobs_T, device))
