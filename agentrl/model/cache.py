"""Decoding state of the hybrid model: KDA's convolution and recurrent states, MLA's compressed latent cache.

Legend: N = sequences in the batch, C = channels, W = convolution width, H = heads, K/V = key/value head dims,
L = cached tokens of one sequence, R = kv_lora_rank, P = decoupled key dim (qk_rope_head_dim).

A KDA layer's state is O(1) in the sequence length; an MLA layer caches the compressed latent c (rank R, after its
norm) and the decoupled key part, O(L·(R+P)) per sequence, and expands them to per-head keys and values on use.
Sequence i of every forward call continues sequence i of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True, slots=True)
class KDAState:
    conv_NCW: torch.Tensor  # the last W−1 inputs of the packed q|k|v convolution, fp32
    recurrent_NHKV: torch.Tensor  # S, fp32


@dataclass(kw_only=True, slots=True)
class MLAState:
    latent: list[torch.Tensor] = field(default_factory=list)  # per sequence [L, R]
    k_pe: list[torch.Tensor] = field(default_factory=list)  # per sequence [L, P]


@dataclass(kw_only=True, slots=True)
class HybridCache:
    """Per-layer decoding state for N sequences (layers[i] is None until layer i first runs)."""

    num_seqs: int
    layers: list[KDAState | MLAState | None]
    seq_lens: torch.Tensor  # tokens seen per sequence [N]

    @classmethod
    def empty(cls, num_layers: int, num_seqs: int) -> HybridCache:
        return cls(num_seqs=num_seqs, layers=[None] * num_layers, seq_lens=torch.zeros(num_seqs, dtype=torch.long))

    def select(self, index: torch.Tensor | list[int]) -> HybridCache:
        """The cache restricted (and reordered) to the given sequences, e.g. for beam pruning or finished rows."""
        index = torch.as_tensor(index, dtype=torch.long)
        layers: list[KDAState | MLAState | None] = []
        for state in self.layers:
            if isinstance(state, KDAState):
                layers.append(KDAState(conv_NCW=state.conv_NCW[index], recurrent_NHKV=state.recurrent_NHKV[index]))
            elif isinstance(state, MLAState):
                layers.append(MLAState(latent=[state.latent[i] for i in index.tolist()],
                                       k_pe=[state.k_pe[i] for i in index.tolist()]))
            else:
                layers.append(None)
        return HybridCache(num_seqs=len(index), layers=layers, seq_lens=self.seq_lens[index])
