"""Block Attention Residuals (AttnRes, arXiv:2603.15031) in the layout of vLLM's Kimi K3 model.

Legend: S = sources, T = tokens, D = hidden.

Instead of one residual stream, each sub-layer reads a softmax-weighted mix of *sources*: the embedding, the summed
outputs of each completed block of layers, and the running sum of the current (partial) block:

    h = Σ_i softmax_i(w · RMSNorm(v_i)) · v_i,   w a per-sub-layer vector initialised to zero (uniform mix)

A block is `attn_res_block_size` layers (each an attention and an MLP sub-layer). Block 0 is the embedding alone;
a layer whose index is a multiple of the block size closes the running block (it becomes a source) and its attention
output starts the next one. A final mix before the last norm reads all completed blocks and the last partial one.
With block size 1 every layer's summed outputs are a separate source (the finest layout K3's serving path runs).
"""

from __future__ import annotations

import torch
from torch import nn

from agentrl.model.layers import RMSNorm, compute_dtype, fla_op


def attn_res_query(hidden_size: int) -> nn.Linear:
    """A sub-layer's query vector w as vLLM stores it (`*_res_proj.weight`, [1, D]), initialised to zero."""
    proj = nn.Linear(hidden_size, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return proj


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, query: nn.Linear) -> torch.Tensor:
    """Σ_i softmax_i(w · RMSNorm(v_i)) · v_i over the sources, computed in fp32.

    On CUDA, fla's fused AttnRes kernel (`fla.ops.attnres.fused_attnres`, the same function) reads each source once
    instead of materialising the [S, T, D] fp32 stack and its norms.
    """
    fused = fla_op(sources[0], "fla.ops.attnres")
    if fused is not None:
        return fused.fused_attnres(query=query.weight[0], residuals=sources, rms_weight=norm.weight,
                                   rms_eps=norm.variance_epsilon)
    return attn_res_mix_torch(sources, norm, query)


def attn_res_mix_torch(sources: list[torch.Tensor], norm: RMSNorm, query: nn.Linear) -> torch.Tensor:
    values_STD = torch.stack(sources)
    compute = compute_dtype(values_STD)
    values_STD = values_STD.to(compute)
    keys = values_STD * torch.rsqrt(values_STD.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    logits_ST = (keys * (norm.weight.to(compute) * query.weight[0].to(compute))).sum(-1)
    weights_ST = torch.softmax(logits_ST, dim=0)
    return (weights_ST[..., None] * values_STD).sum(0).to(sources[0].dtype)


class BlockState:
    """The completed blocks and the running partial sum, threaded through the layers of one forward."""

    def __init__(self, embedding_TD: torch.Tensor, block_size: int):
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = []
        self.partial = embedding_TD
        self.pending: torch.Tensor | None = None  # the previous MLP output, not yet added

    def before_attention(self, layer_idx: int) -> list[torch.Tensor]:
        if self.pending is not None:
            self.partial = self.partial + self.pending
            self.pending = None
        if layer_idx % self.block_size == 0:
            # the running sum is a completed block; it is still read as "the partial" by this attention sub-layer
            self.blocks.append(self.partial)
            return self.blocks[:-1] + [self.partial]
        return self.blocks + [self.partial]

    def after_attention(self, layer_idx: int, attn_out_TD: torch.Tensor) -> list[torch.Tensor]:
        self.partial = attn_out_TD if layer_idx % self.block_size == 0 else self.partial + attn_out_TD
        return self.blocks + [self.partial]

    def after_mlp(self, mlp_out_TD: torch.Tensor) -> None:
        self.pending = mlp_out_TD

    def final_sources(self) -> list[torch.Tensor]:
        if self.pending is not None:
            self.partial = self.partial + self.pending
            self.pending = None
        return self.blocks + [self.partial]
