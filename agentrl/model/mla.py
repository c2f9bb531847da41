"""Gated multi-head latent attention (DeepSeek-V2 MLA under NoPE, with a sigmoid output gate).

Legend: T = packed tokens, N = sequences, D = hidden, H = heads, R = kv_lora_rank, E = qk_nope_head_dim,
P = qk_rope_head_dim (the decoupled key part), V = v_head_dim, L = cached tokens.

    q = W_q x  (or W_qb RMSNorm(W_qa x))                          [T, H, E+P]
    [c | k_pe] = W_dkv x,  c ← RMSNorm(c)                           c: [T, R] is what the decode cache keeps
    [k_nope | v] = W_ukv c                                           [T, H, E+V]
    k = [k_nope | k_pe broadcast over heads]   — k_pe is never rotated: the model is NoPE
    o = softmax(q kᵀ / √(E+P)) v,  causal within each sequence
    y = W_o [σ(W_g x) ⊙ o]   (output gate per head and channel when mla_use_output_gate)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from agentrl.model import context_parallel, mla_kernels
from agentrl.model.cache import MLAState
from agentrl.model.context_parallel import ContextShard
from agentrl.model.config import HybridMoEConfig
from agentrl.model.layers import RMSNorm, linear_many, sequence_ids

# A block-diagonal mask over all packed tokens costs T² scores; above this many tokens a loop over the sequences
# (each its own causal SDPA) is cheaper.
_MAX_MASKED_TOKENS = 1024

# SDPA backends for training attention: every one but cuDNN, torch 2.11's first choice on Hopper. Its backward failed
# on H200 (an illegal memory access mid-run, NaN gradients in bf16) on a packed micro-batch of 14 sequences of
# 127-511 tokens after other shapes had run in the process, and not when that micro-batch ran alone: see
# docs/benchmarks.md (issue 8). On CUDA in half precision the flash varlen kernel runs instead (below); this list is
# the fallback (fp32, CPU, a torch without varlen_attn).
_TRAIN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

try:  # torch >= 2.10: FlashAttention-2 over packed sequences, one kernel for the whole micro-batch
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None


def _use_flash_varlen(q_THE: torch.Tensor, v_THV: torch.Tensor) -> bool:
    head_dim = max(q_THE.shape[-1], v_THV.shape[-1])
    return (varlen_attn is not None and q_THE.is_cuda and q_THE.dtype in (torch.float16, torch.bfloat16)
            and head_dim <= 256 and head_dim % 8 == 0)


def varlen_causal_attention(q_THE: torch.Tensor, k_THE: torch.Tensor, v_THV: torch.Tensor,
                            cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention of packed sequences (no attention across sequences). Returns [T, H, V].

    On CUDA in bf16/fp16: flash varlen attention, one call for all sequences. Flash needs one head dim for q, k and v,
    and MLA's differ (the `small` preset: qk 128, v 64), so the narrower side is zero-padded: zero value channels give
    zero output channels (sliced off), zero q/k channels add nothing to the scores. Measured on H200
    (scripts/bench_attention.py): 2.2x the memory-efficient SDPA kernel on one 32K sequence, 2.8-3.4x on packed
    micro-batches. Elsewhere: SDPA without cuDNN (see _TRAIN_BACKENDS)."""
    if _use_flash_varlen(q_THE, v_THV):
        return _flash_varlen_causal_attention(q_THE, k_THE, v_THV, cu_seqlens, scale)
    with sdpa_kernel(_TRAIN_BACKENDS):
        return _varlen_causal_attention(q_THE, k_THE, v_THV, cu_seqlens, scale)


def _flash_varlen_causal_attention(q_THE: torch.Tensor, k_THE: torch.Tensor, v_THV: torch.Tensor,
                                   cu_seqlens: torch.Tensor, scale: float,
                                   cu_k: torch.Tensor | None = None) -> torch.Tensor:
    """`cu_k`: the keys' offsets when they differ from the queries' (context parallelism: a piece's queries at the
    end of its sequence's keys; flash aligns the causal window to the bottom right)."""
    v_dim = v_THV.shape[-1]
    q_THE, k_THE, v_THV = equal_head_dims(q_THE, k_THE, v_THV)
    cu = cu_seqlens.to(torch.int32)
    ck = cu if cu_k is None else cu_k.to(torch.int32)
    max_q, max_k = int((cu[1:] - cu[:-1]).max()), int((ck[1:] - ck[:-1]).max())
    # window (-1, 0): no limit to the left, nothing to the right, i.e. causal (torch 2.11 has no is_causal argument)
    out = varlen_attn(q_THE, k_THE, v_THV, cu, ck, max_q, max_k, scale=scale, window_size=(-1, 0))
    return out[..., :v_dim]


def equal_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v zero-padded to one head dim, the flash kernels' condition (CUDA's and the CPU's: on this CPU a causal
    SDPA over 16K tokens took 12.5 s with MLA's unequal dims, on the math path with a T×T matrix, and 0.5 s padded).
    Zero q/k channels add nothing to the scores; zero v channels give output channels to slice off."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if qk_dim < v_dim:
        q, k = (F.pad(t, (0, v_dim - qk_dim)) for t in (q, k))
    elif v_dim < qk_dim:
        v = F.pad(v, (0, qk_dim - v_dim))
    return q, k, v


def mla_attention(q_THE: torch.Tensor, kv_SHC: torch.Tensor, k_pe_SP: torch.Tensor, cu_seqlens: torch.Tensor,
                  scale: float, key_cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's causal attention over packed sequences from its projections' outputs: q [T, H, E+P], kv_b_proj's
    [S, H, E+V] (k_nope | v) and the shared k_pe [S, P]. Returns [T, H, V]. Without `key_cu_seqlens` the keys are
    the queries' own tokens (S = T); with it, context parallelism's pieces: each sequence's keys from its start, the
    queries at their end (`context_parallel.prefix_causal_attention`).

    On CUDA in bf16/fp16 with E, P and V powers of two (every preset but the CPU test sizes): the Triton kernels of
    mla_kernels.py, which take the head dims as they are and the keys in their two parts. Elsewhere the keys are
    concatenated and `varlen_causal_attention` or `prefix_causal_attention` runs (flash with padding on CUDA): the
    reference."""
    nope_dim = q_THE.shape[-1] - k_pe_SP.shape[-1]
    if mla_kernels.available(q_THE, nope_dim, k_pe_SP.shape[-1], kv_SHC.shape[-1] - nope_dim):
        return mla_kernels.mla_causal_attention(q_THE, kv_SHC, k_pe_SP, cu_seqlens, scale, key_cu_seqlens)
    k, v = keys_and_values(kv_SHC, k_pe_SP, nope_dim)
    if key_cu_seqlens is None:
        return varlen_causal_attention(q_THE, k, v, cu_seqlens, scale)
    return context_parallel.prefix_causal_attention(q_THE, k, v, cu_seqlens, key_cu_seqlens, scale)


def keys_and_values(kv_THC: torch.Tensor, k_pe_TP: torch.Tensor, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys [T, H, E+P] = [k_nope | k_pe broadcast over heads] and values [T, H, V] from kv_b_proj's output
    [T, H, E+V] and k_pe [T, P]."""
    k_nope, v = kv_THC.split([nope_dim, kv_THC.shape[-1] - nope_dim], dim=-1)
    k_pe = k_pe_TP[:, None, :].expand(-1, kv_THC.shape[1], -1)
    return torch.cat([k_nope, k_pe], dim=-1), v


def _varlen_causal_attention(q_THE: torch.Tensor, k_THE: torch.Tensor, v_THV: torch.Tensor,
                             cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    num_tokens = q_THE.shape[0]
    num_seqs = cu_seqlens.numel() - 1
    v_dim = v_THV.shape[-1]
    q, k, v = (t.transpose(0, 1)[None] for t in equal_head_dims(q_THE, k_THE, v_THV))  # [1, H, T, *]
    if num_seqs == 1:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif num_tokens <= _MAX_MASKED_TOKENS:
        seq_T, _ = sequence_ids(cu_seqlens, num_tokens)
        idx = torch.arange(num_tokens, device=q.device)
        mask = (seq_T[:, None] == seq_T[None, :]) & (idx[:, None] >= idx[None, :])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        bounds = cu_seqlens.tolist()
        o = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                      scale=scale) for s, e in zip(bounds[:-1], bounds[1:])], dim=2)
    return o[0].transpose(0, 1)[..., :v_dim]


class GatedMLA(nn.Module):
    def __init__(self, config: HybridMoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.pe_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        qk_dim = self.nope_dim + self.pe_dim
        self.scale = qk_dim ** -0.5
        hidden = config.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.pe_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.g_proj = (nn.Linear(hidden, self.num_heads * self.v_dim, bias=False)
                       if config.mla_use_output_gate else None)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=False)

    def _projections(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The projections of x, one GEMM: the queries (their low-rank first factor when q_lora_rank is set), the
        latent [T, R], k_pe [T, P] and the output gate's logits (None without the gate)."""
        q_first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        weights = (q_first.weight, self.kv_a_proj_with_mqa.weight) + (
            () if self.g_proj is None else (self.g_proj.weight,))
        sizes = [q_first.weight.shape[0], self.kv_rank, self.pe_dim, *[w.shape[0] for w in weights[2:]]]
        parts = linear_many(x_TD, weights).split(sizes, dim=-1)
        return parts[0], parts[1], parts[2], parts[3] if self.g_proj is not None else None

    def _kv(self, latent_LR: torch.Tensor) -> torch.Tensor:
        """kv_b_proj's output per head, [L, H, E+V]: k_nope | v."""
        return self.kv_b_proj(latent_LR).view(-1, self.num_heads, self.nope_dim + self.v_dim)

    def _expand(self, latent_LR: torch.Tensor, k_pe_LP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [L, H, E+P] and values [L, H, V] from the cached latent."""
        return keys_and_values(self._kv(latent_LR), k_pe_LP, self.nope_dim)

    def forward(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor, state: MLAState | None = None,
                use_cache: bool = False, shard: ContextShard | None = None) -> tuple[torch.Tensor, MLAState | None]:
        """`shard`: this rank's slice under context parallelism (training; x_TD and cu_seqlens are the slice's):
        the queries attend over their sequences' keys on every rank (context_parallel.py)."""
        num_tokens = x_TD.shape[0]
        qk_dim = self.nope_dim + self.pe_dim
        q, latent, k_pe, gate = self._projections(x_TD)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(num_tokens, self.num_heads, qk_dim)
        latent = self.kv_a_layernorm(latent)
        if shard is not None:
            if state is not None or use_cache:
                raise ValueError("context parallelism is for training: no decoding cache")
            compressed = context_parallel.gather(torch.cat([latent, k_pe], dim=-1), shard)[shard.key_lo:shard.hi]
            latent_S, k_pe_S = compressed.split([self.kv_rank, self.pe_dim], dim=-1)
            o = mla_attention(q, self._kv(latent_S), k_pe_S, shard.cu_seqlens, self.scale,
                              key_cu_seqlens=shard.key_cu_seqlens)
            new_state = None
        elif state is None:
            o = mla_attention(q, self._kv(latent), k_pe, cu_seqlens, self.scale)
            new_state = None
            if use_cache:
                bounds = cu_seqlens.tolist()
                new_state = MLAState(latent=[latent[s:e] for s, e in zip(bounds[:-1], bounds[1:])],
                                     k_pe=[k_pe[s:e] for s, e in zip(bounds[:-1], bounds[1:])])
        else:
            o, new_state = self._attend_with_cache(q, latent, k_pe, cu_seqlens, state)
        if gate is not None:
            o = o * torch.sigmoid(gate).view(num_tokens, self.num_heads, self.v_dim)
        return self.o_proj(o.reshape(num_tokens, self.num_heads * self.v_dim)), new_state if use_cache else None

    def _attend_with_cache(self, q_THE: torch.Tensor, latent_TR: torch.Tensor, k_pe_TP: torch.Tensor,
                           cu_seqlens: torch.Tensor, state: MLAState) -> tuple[torch.Tensor, MLAState]:
        """Appends each sequence's new latents to its cache and attends its new queries over the whole sequence."""
        bounds = cu_seqlens.tolist()
        outs, latents, k_pes = [], [], []
        for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            latent = torch.cat([state.latent[i], latent_TR[s:e]])
            k_pe = torch.cat([state.k_pe[i], k_pe_TP[s:e]])
            latents.append(latent)
            k_pes.append(k_pe)
            k, v = self._expand(latent, k_pe)
            new, total = e - s, latent.shape[0]
            # query j (0-based among the new tokens) sits at position total − new + j and sees keys up to it
            visible = (torch.arange(total, device=q_THE.device)[None, :]
                       <= (total - new + torch.arange(new, device=q_THE.device))[:, None])
            o = F.scaled_dot_product_attention(q_THE[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], attn_mask=visible, scale=self.scale)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs), MLAState(latent=latents, k_pe=k_pes)
