"""Small building blocks shared by the model's layers: norms, GLU activations, the dense MLP, the short convolution.

Legend: T = tokens (packed), N = sequences, C = channels, W = convolution width, D = hidden.

Sequences are packed along T and delimited by `cu_seqlens` ([N+1] offsets), as in FlashAttention and fla; nothing
here mixes tokens of different sequences.

On CUDA, RMSNorm runs as torch's fused kernel and, with fla importable (fla-core 0.6.0), the gated norm, l2norm and
the short convolution as fla's fused Triton kernels (`fla_op`); the PyTorch forms here stay the reference and the
CPU path, and tests/gpu compares the two. `set_fused(False)` turns the kernels off (scripts/bench_gpu.py measures
what they buy).
"""

from __future__ import annotations

import collections
import functools
import importlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.model import static_shapes

_FUSED = True
FLA_CONV_CHUNK = 64  # the chunk length of fla's short-convolution kernels (their default, which agentrl keeps)


def set_fused(enabled: bool) -> bool:
    """Turns the fused CUDA kernels (fla's, torch's RMSNorm) on or off for the whole model; returns the previous
    setting."""
    global _FUSED
    previous, _FUSED = _FUSED, enabled
    return previous


def fused_enabled() -> bool:
    """Whether the fused CUDA kernels are on (`set_fused`)."""
    return _FUSED


@functools.cache
def _import(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except Exception:  # fla missing, or no Triton on this machine
        return None


def fla_op(x: torch.Tensor, module: str) -> ModuleType | None:
    """fla's `module` when x lives on CUDA, the fused kernels are on and fla imports; else None."""
    if not (_FUSED and x.is_cuda):
        return None
    return _import(module)


# the offsets tensors fla_offsets has handed out, each with its version counter when first seen
_OFFSETS_SEEN: collections.deque = collections.deque(maxlen=4)


def fla_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """`cu_seqlens`, or the tensor it is an alias of, so that fla recognises offsets it has seen.

    fla caches what it derives from the offsets (the chunk indices, built with host syncs) by the tensor's
    identity, which holds while one `cu_seqlens` object reaches every layer of a forward. Under ZeRO-3 it does not:
    DeepSpeed's module hooks hand each module a fresh alias of every tensor argument (an autograd Function's detach:
    the same storage, a new object), so every KDA layer missed fla's cache and rebuilt the indices, two host syncs
    each (48 of the 88 per ZeRO-3 step of the `small` preset, docs/benchmarks.md). An alias has the storage,
    offset, shape, strides and dtype of an earlier tensor and no write since; that tensor is handed back instead.
    The entries are kept alive here (a few small tensors), so no other tensor can occupy their storage meanwhile.
    """
    if cu_seqlens.is_inference():  # serving: no version counter to compare, and no ZeRO-3 hooks
        return cu_seqlens
    for seen, version in tuple(_OFFSETS_SEEN):
        if seen is cu_seqlens:
            return seen
        if (seen.data_ptr() == cu_seqlens.data_ptr() and seen.device == cu_seqlens.device
                and seen.dtype == cu_seqlens.dtype and seen.shape == cu_seqlens.shape
                and seen.stride() == cu_seqlens.stride() and seen._version == version == cu_seqlens._version):
            return seen
    _OFFSETS_SEEN.append((cu_seqlens, cu_seqlens._version))
    return cu_seqlens


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as transformers' and vLLM's Kimi layers do), weight initialised to one."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _FUSED and x.is_cuda and x.dtype == self.weight.dtype:
            # torch's own fused kernel (fp32 inside, like fla's Triton rms_norm, which this used before): one aten
            # op's host cost instead of fla's Python wrapper (profiled ~0.3 ms fwd + ~0.5 ms bwd per call: 26 norms
            # were ~1/10 of the host time of the host-bound 4K step on H200, docs/benchmarks.md)
            return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        return rms_norm_torch(x, self.weight, self.variance_epsilon)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight ⊙ x / sqrt(mean(x²) + eps), normalised in fp32 (fp64 for fp64 inputs; the reference of RMSNorm's fused
    kernel)."""
    dtype = x.dtype
    x = x.to(compute_dtype(x))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What the reference ops compute in: fp32 for half-precision and fp32 inputs, fp64 for fp64 ones (tests compare
    paths that split the same sums differently, e.g. context parallelism, at fp64 tolerance)."""
    return torch.promote_types(x.dtype, torch.float32)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """weight ⊙ RMSNorm(x) ⊙ σ(gate) over the last dim, in fp32 (KDA's per-head output norm)."""
    fused = fla_op(x, "fla.modules.norm.fused_norm_gate")
    if fused is not None:
        return fused.rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=eps)
    return gated_rms_norm_torch(x, weight, gate, eps)


def gated_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    dtype, compute = x.dtype, compute_dtype(x)
    x = x.to(compute)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    return (x * torch.sigmoid(gate.to(compute))).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps): fla's and transformers' form (eps inside the root, not F.normalize's max)."""
    fused = fla_op(x, "fla.modules.norm.l2norm")
    if fused is not None:
        return fused.l2norm(x, eps)
    return l2norm_torch(x, eps)


def l2norm_torch(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    wide = x.to(compute_dtype(x))
    return x / torch.sqrt((wide * wide).sum(-1, keepdim=True) + eps).to(x.dtype)


def glu(gate_up: torch.Tensor, act: str, situ_beta: float | None = None,
        situ_linear_beta: float | None = None) -> torch.Tensor:
    """Gated linear unit over [..., 2I] = [gate | up].

    silu: SwiGLU, silu(gate) · up.
    situ: K3's SiTU-GLU, β·tanh(gate/β)·σ(gate) · up, with up optionally soft-clipped as β'·tanh(up/β').
    """
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate) * up
    if act == "situ":
        beta = situ_beta or 1.0
        out_dtype = gate_up.dtype
        gate, up = gate.to(compute_dtype(gate)), up.to(compute_dtype(up))
        gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
        if situ_linear_beta is not None:
            up = situ_linear_beta * torch.tanh(up / situ_linear_beta)
        return (gate * up).to(out_dtype)
    raise ValueError(f"unknown activation {act!r}; expected 'silu' or 'situ'")


def linear_many(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x @ [W_1; …; W_n]ᵀ: one input through several weights as one GEMM, [..., ΣN_i] (split it for each part).

    A layer that projects one input several ways (KDA's q, k, v, gates and β; a GLU's gate and up) otherwise pays a
    GEMM forward, two backward and an add into the input's gradient for each: on a host-bound step every launch
    counts. The stacked weight is rebuilt in the backward instead of kept: it would hold a copy of all the weights
    from each layer's forward to its backward.
    """
    return _LinearMany.apply(x, *weights)


class _LinearMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grad_x = grad_y @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        grad_weights = [None] * len(weights)
        if any(ctx.needs_input_grad[1:]):
            grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            grad_weights = [g if needed else None for g, needed in
                            zip(grad_w.split([w.shape[0] for w in weights]), ctx.needs_input_grad[1:])]
        return grad_x, *grad_weights


class MLP(nn.Module):
    """Dense gated MLP: down(glu(gate(x), up(x)))."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu",
                 situ_beta: float | None = None, situ_linear_beta: float | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = act
        self.situ_beta = situ_beta
        self.situ_linear_beta = situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear_many(x, (self.gate_proj.weight, self.up_proj.weight))
        return self.down_proj(glu(gate_up, self.act, self.situ_beta, self.situ_linear_beta))


def sequence_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_T, pos_T): each packed token's sequence index and position inside its sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_T = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths,
                                    output_size=num_tokens)
    pos_T = torch.arange(num_tokens, device=cu_seqlens.device) - cu_seqlens[:-1][seq_T]
    return seq_T, pos_T


def short_conv(x_TC: torch.Tensor, weight_C1W: torch.Tensor, cu_seqlens: torch.Tensor,
               initial_state_NCW: torch.Tensor | None = None, activation: str | None = "silu",
               output_final_state: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution over packed sequences, with a carried state.

    Args:
        x_TC: packed inputs.
        weight_C1W: nn.Conv1d depthwise weight [C, 1, W].
        cu_seqlens: [N+1] sequence offsets into T.
        initial_state_NCW: the W−1 inputs that precede each sequence (oldest first), [N, C, W−1]; zeros if None.
        activation: "silu" or None.
        output_final_state: whether to return the final state (decoding and chunked prefill carry it; training does
            not, and gathering it is a dozen small kernels per layer on a host-bound step).

    Returns:
        y_TC, and the final state [N, C, W−1] (each sequence's last W−1 inputs, drawn from the initial state for
        sequences shorter than W−1), or None. Computed in fp32 (fp64 for fp64 inputs), returned in x's dtype (the
        state in the computing dtype).

    Without a carried state (training, prefill from scratch) on CUDA, y comes from fla's Triton causal_conv1d.
    """
    num_tokens, channels = x_TC.shape
    width = weight_C1W.shape[-1]
    num_seqs = cu_seqlens.numel() - 1
    fused = fla_op(x_TC, "fla.modules.causal_conv1d.ops") if initial_state_NCW is None else None
    if fused is not None and activation in ("silu", None) and num_tokens:
        # under capture the chunk list comes from the offsets on the GPU: fla builds its own with a host read
        chunks = ({"chunk_indices": static_shapes.conv_chunk_indices(cu_seqlens, FLA_CONV_CHUNK, num_tokens)}
                  if static_shapes.active() else {})
        y, _ = fused.causal_conv1d(x_TC[None], weight=weight_C1W.reshape(channels, width).to(x_TC.dtype),
                                   activation=activation, cu_seqlens=cu_seqlens, **chunks)
        if not output_final_state:
            return y[0], None
        zeros = x_TC.new_zeros(num_seqs, channels, width - 1, dtype=torch.float32)
        return y[0], _final_conv_state(x_TC, zeros.transpose(1, 2), cu_seqlens, width)
    compute = torch.promote_types(x_TC.dtype, torch.float32)  # fp64 inputs stay fp64: tests check gradients tightly
    w_CW = weight_C1W.reshape(channels, width).to(compute)
    x = x_TC.to(compute)
    if initial_state_NCW is None:
        initial_state_NCW = x.new_zeros(num_seqs, channels, width - 1)
    state_NWC = initial_state_NCW.to(compute).transpose(1, 2)  # [N, W-1, C]
    seq_T, pos_T = sequence_ids(cu_seqlens, num_tokens)
    y = x * w_CW[:, width - 1]
    for shift in range(1, width):
        shifted = F.pad(x, (0, 0, shift, 0))[:num_tokens]  # x[t - shift]
        # tokens within `shift` of their sequence start read the carried state instead
        from_state = state_NWC[seq_T, (width - 1 - shift + pos_T).clamp(0, width - 2)]
        src = torch.where((pos_T >= shift)[:, None], shifted, from_state)
        y = y + src * w_CW[:, width - 1 - shift]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unknown conv activation {activation!r}")
    final = _final_conv_state(x, state_NWC, cu_seqlens, width) if output_final_state else None
    return y.to(x_TC.dtype), final


def _final_conv_state(x: torch.Tensor, state_NWC: torch.Tensor, cu_seqlens: torch.Tensor, width: int
                      ) -> torch.Tensor:
    """The last W−1 entries of [state | sequence] of each sequence, [N, C, W−1] in the state's dtype."""
    num_tokens, channels = x.shape
    num_seqs = cu_seqlens.numel() - 1
    lengths_N = cu_seqlens[1:] - cu_seqlens[:-1]
    ext_NW = lengths_N[:, None] + torch.arange(width - 1, device=x.device)  # positions in [state | seq] coordinates
    from_seq = ext_NW >= width - 1
    tok_NW = (cu_seqlens[:-1, None] + ext_NW - (width - 1)).clamp(0, max(num_tokens - 1, 0))
    seq_vals = x[tok_NW].to(state_NWC.dtype) if num_tokens else state_NWC.new_zeros(num_seqs, width - 1, channels)
    state_vals = state_NWC[torch.arange(num_seqs, device=x.device)[:, None], ext_NW.clamp(max=width - 2)]
    final_NWC = torch.where(from_seq[..., None], seq_vals, state_vals)
    return final_NWC.transpose(1, 2).contiguous()
