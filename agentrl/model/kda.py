"""The KDA (Kimi Delta Attention) layer: projections, short convolutions, gates and output norm around the kernels.

Legend: T = packed tokens, N = sequences, D = hidden, H = KDA heads, K = head dim (keys and values share it).

    q, k = L2Norm(SiLU(ShortConv4(W x))),   v = SiLU(ShortConv4(W_v x)),   β = σ(W_β x)
    z = f_b(f_a(x)) + dt_bias                                   (low-rank decay projection, per channel)
    bounded (K3):        g = g_min · σ(e^{A_h} · z),  g_min = gate_lower_bound (−5), A_h = A_log initialised to 0
    unbounded (Kimi Linear): g = −e^{A_h} · softplus(z)
    S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ,   o_t = S_tᵀ q_t / √K
    y = W_o [RMSNorm_head(o) ⊙ σ(gate)],  gate = W_g x (full rank, K3) or g_b(g_a(x)) (low rank, Kimi Linear)

The decay carries position: there is no RoPE anywhere. Tensor names are those of the Kimi Linear / K3 checkpoints.
The kernel (chunked for training and prefill, one recurrent step for decoding) comes from `kda_ops`, which picks
fla on CUDA and the chunked PyTorch form on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.model import kda_ops
from agentrl.model.cache import KDAState
from agentrl.model.config import HybridMoEConfig
from agentrl.model.layers import fla_op, gated_rms_norm, l2norm, short_conv


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: HybridMoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.kda_num_heads
        self.head_dim = config.kda_head_dim
        self.conv_size = config.kda_conv_size
        self.lower_bound = config.gate_lower_bound
        self.norm_eps = config.kda_output_norm_eps
        hidden, proj = config.hidden_size, self.num_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        self.q_conv1d = nn.Conv1d(proj, proj, self.conv_size, groups=proj, bias=False)
        self.k_conv1d = nn.Conv1d(proj, proj, self.conv_size, groups=proj, bias=False)
        self.v_conv1d = nn.Conv1d(proj, proj, self.conv_size, groups=proj, bias=False)
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(proj, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(hidden, proj, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.o_norm = _HeadNorm(self.head_dim)
        self.o_proj = nn.Linear(proj, hidden, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        if self.lower_bound is not None:
            # K3: A_h = 0 (so e^A = 1) and no bias: the gate starts at g_min·σ(f(x)).
            self.A_log.zero_()
            self.dt_bias.zero_()
        else:
            # Kimi Linear / fla: A ~ U(1, 16), softplus(dt_bias) ~ logU(1e-3, 1e-1).
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def decay(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g [T, H, K] in fp32 (on CUDA through fla's fused gate kernel, the same formulas)."""
        z = self.f_b_proj(self.f_a_proj(x_TD))
        fused = fla_op(z, "fla.ops.kda.gate")
        if fused is not None:
            return fused.fused_kda_gate(z.view(-1, self.num_heads, self.head_dim), self.A_log, self.dt_bias,
                                        lower_bound=self.lower_bound)
        return self.decay_torch(z)

    def decay_torch(self, z_TP: torch.Tensor) -> torch.Tensor:
        z = z_TP.float() + self.dt_bias.float()
        z = z.view(-1, self.num_heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, -1, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * z)
        return -rate * F.softplus(z)

    def forward(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor, state: KDAState | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, KDAState | None]:
        """x_TD: packed tokens of N sequences; `state` continues them (decoding / chunked prefill).

        Returns the output [T, D] and, when `use_cache`, the state after the last token of each sequence.
        """
        num_tokens = x_TD.shape[0]
        H, K = self.num_heads, self.head_dim
        proj = H * K
        qkv = torch.cat([self.q_proj(x_TD), self.k_proj(x_TD), self.v_proj(x_TD)], dim=-1)
        conv_w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)
        qkv, conv_state = short_conv(qkv, conv_w, cu_seqlens, None if state is None else state.conv_NCW)
        q, k, v = qkv.split(proj, dim=-1)
        q = l2norm(q.view(num_tokens, H, K))
        k = l2norm(k.view(num_tokens, H, K))
        v = v.view(num_tokens, H, K)
        g = self.decay(x_TD)
        beta = torch.sigmoid(self.b_proj(x_TD).float())
        initial = None if state is None else state.recurrent_NHKV
        num_seqs = cu_seqlens.numel() - 1
        if initial is not None and num_tokens == num_seqs:
            # one new token per sequence: the recurrent step
            o, final = kda_ops.recurrent_kda_step(q, k, v, g, beta, initial)
            o = o.to(v.dtype)
        else:
            o, final = kda_ops.kda(q[None], k[None], v[None], g[None], beta[None], initial_state=initial,
                                   output_final_state=use_cache, cu_seqlens=cu_seqlens,
                                   lower_bound=self.lower_bound if self.lower_bound is not None else -5.0,
                                   bounded=self.lower_bound is not None)
            o = o[0]
        gate = self.g_proj(x_TD) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x_TD))
        o = gated_rms_norm(o, self.o_norm.weight, gate.view(num_tokens, H, K), self.norm_eps)
        y = self.o_proj(o.reshape(num_tokens, proj))
        new_state = KDAState(conv_NCW=conv_state, recurrent_NHKV=final) if use_cache else None
        return y, new_state


class _HeadNorm(nn.Module):
    """Holds the per-head output-norm weight under the checkpoint name `o_norm.weight`."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
