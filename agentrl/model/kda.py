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
fla on CUDA and the chunked PyTorch form on CPU. The layer hands it the projections (q, k before their L2 norm, z,
β's logits) with A_log and dt_bias: fla applies the norms, the gate and the sigmoid inside its kernels, as fla's own
KDA layer has it do; `kda_ops.prologue` is the same in PyTorch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from agentrl.model import context_parallel, kda_ops
from agentrl.model.cache import KDAState
from agentrl.model.context_parallel import ContextShard
from agentrl.model.config import HybridMoEConfig
from agentrl.model.layers import fla_offsets, gated_rms_norm, linear_many, short_conv


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

    @property
    def gate_params(self) -> kda_ops.GateParams:
        return kda_ops.GateParams(self.A_log, self.dt_bias)

    def forward(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor, state: KDAState | None = None,
                use_cache: bool = False, shard: ContextShard | None = None) -> tuple[torch.Tensor, KDAState | None]:
        """x_TD: packed tokens of N sequences; `state` continues them (decoding / chunked prefill).

        Returns the output [T, D] and, when `use_cache`, the state after the last token of each sequence.
        `shard`: this rank's slice under context parallelism (training; x_TD and cu_seqlens are the slice's): the
        states that cross ranks are exchanged as in context_parallel.py.
        """
        if shard is not None:
            if state is not None or use_cache:
                raise ValueError("context parallelism is for training: no decoding state")
            return self._forward_shard(x_TD, shard), None
        cu_seqlens = fla_offsets(cu_seqlens)  # the forward's own object under ZeRO-3 too: fla caches by identity
        num_tokens = x_TD.shape[0]
        q, k, v, z, b, gate, conv_state = self._inputs(x_TD, cu_seqlens,
                                                       None if state is None else state.conv_NCW, use_cache)
        initial = None if state is None else state.recurrent_NHKV
        num_seqs = cu_seqlens.numel() - 1
        if initial is not None and num_tokens == num_seqs:
            # one new token per sequence: the recurrent step
            q, k, g, beta = kda_ops.prologue(q, k, z, b, self.gate_params, self.lower_bound)
            o, final = kda_ops.recurrent_kda_step(q, k, v, g, beta, initial)
            o = o.to(v.dtype)
        else:
            o, final = self._kernel(q, k, v, z, b, initial, use_cache, cu_seqlens)
        new_state = KDAState(conv_NCW=conv_state, recurrent_NHKV=final) if use_cache else None
        return self._output(o, gate), new_state

    def _forward_shard(self, x_TD: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        """The layer on a context-parallel slice: the kernel runs from zero states with K identity-initialised value
        columns on the first sequence when it came from an earlier rank; the exchanged transitions give its
        incoming state, which corrects the outputs (context_parallel.py)."""
        num_tokens, H, K = x_TD.shape[0], self.num_heads, self.head_dim
        cu_seqlens = shard.cu_seqlens
        q, k, v, z, b, gate, _ = self._inputs(x_TD, cu_seqlens, lambda qkv: context_parallel.conv_tail(
            qkv, self.conv_size, shard), False)
        carried = shard.first_continues
        initial = None
        if carried:  # [S | X] with X = I: the extra columns carry the transition of the first sequence
            v = torch.cat([v, v.new_zeros(num_tokens, H, K)], dim=-1)
            initial = torch.zeros(cu_seqlens.numel() - 1, H, K, 2 * K, device=v.device,
                                  dtype=torch.promote_types(v.dtype, torch.float32))
            initial[0, :, :, K:] = torch.eye(K, dtype=initial.dtype, device=v.device)
        o, final = self._kernel(q, k, v, z, b, initial, True, cu_seqlens)
        last = final[-1]  # the last sequence's [B | A]: what this slice hands the next rank
        transition = last[..., K:] if carried else last.new_zeros(H, K, K)
        incoming = context_parallel.incoming_state(transition, last[..., :K], shard)
        if carried:
            o = o[..., :K] + torch.einsum("thk,hkv->thv", o[..., K:].to(incoming.dtype), incoming).to(o.dtype)
        else:  # nothing comes in; the exchange's backward is a collective all the same
            o = context_parallel.depend_on(o, incoming)
        return self._output(o, gate)

    def _inputs(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor, conv_state, final_conv_state: bool) -> tuple:
        """The kernel's inputs before its prologue (`kda_ops.prologue`): q, k (not yet normalised), v [T, H, K], the
        gate's input z [T, H, K], β's logits [T, H]; then the output gate's input [T, P] and the short convolution's
        final state (None unless `final_conv_state`). `conv_state`: the initial state [N, C, W−1], None, or a function
        of the pre-convolution inputs that returns it."""
        num_tokens, H, K = x_TD.shape[0], self.num_heads, self.head_dim
        qkv, fa, b, gate = self._projections(x_TD)
        conv_w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)
        initial = conv_state(qkv) if callable(conv_state) else conv_state
        qkv, final = short_conv(qkv, conv_w, cu_seqlens, initial, output_final_state=final_conv_state)
        q, k, v = (x.view(num_tokens, H, K) for x in qkv.split(H * K, dim=-1))
        if not hasattr(self, "g_proj"):  # Kimi Linear's low-rank gate: its second factor
            gate = self.g_b_proj(gate)
        return q, k, v, self.f_b_proj(fa).view(num_tokens, H, K), b, gate, final

    def _projections(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections of x, one GEMM: q|k|v [T, 3P], the decay's first factor [T, K], β's logits [T, H] and
        the output gate (K3's full-rank [T, P]; Kimi Linear's first factor [T, K])."""
        gate = self.g_proj if hasattr(self, "g_proj") else self.g_a_proj
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.f_a_proj.weight,
                   self.b_proj.weight, gate.weight)
        sizes = [3 * self.num_heads * self.head_dim, *(w.shape[0] for w in weights[3:])]
        return linear_many(x_TD, weights).split(sizes, dim=-1)

    def _kernel(self, q, k, v, z, b, initial, final_state: bool, cu_seqlens):
        """The KDA kernel with its prologue (fused into fla's kernels on CUDA) on the layer's projections."""
        o, final = kda_ops.kda(q[None], k[None], v[None], z[None], b[None], initial_state=initial,
                               output_final_state=final_state, cu_seqlens=cu_seqlens,
                               lower_bound=self.lower_bound if self.lower_bound is not None else -5.0,
                               bounded=self.lower_bound is not None, gate=self.gate_params)
        return o[0], final

    def _output(self, o_THK: torch.Tensor, gate_TP: torch.Tensor) -> torch.Tensor:
        """y = W_o [RMSNorm_head(o) ⊙ σ(gate)]."""
        num_tokens, H, K = o_THK.shape
        o = gated_rms_norm(o_THK, self.o_norm.weight, gate_TP.reshape(num_tokens, H, K), self.norm_eps)
        return self.o_proj(o.reshape(num_tokens, H * K))


class _HeadNorm(nn.Module):
    """Holds the per-head output-norm weight under the checkpoint name `o_norm.weight`."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
