"""The host's share of a training step, counted on CPU: the aten operations each kind of layer dispatches in its
forward and its backward, in the form the model takes on CUDA.

On a GPU the `small` preset's 4K step is host-bound (docs/benchmarks.md, issue 26: 1,944 kernel launches for 24 ms
of kernels, 145 ms of wall time), so what it costs is roughly the number of operations the host dispatches. Every
aten operation that is not a view is one (or a few) kernel launches on CUDA; this counts them without a GPU. The model
branches on the device in a few places (fla's Triton kernels for KDA, its gate, norms and short convolution; torch's
fused RMSNorm; the grouped GEMM; MLA's attention kernels): here those calls run through stand-ins that take the CUDA
branch's place, compute with the PyTorch reference, and count as one fused call each instead of their reference's
operations. What runs inside such a call on CUDA (fla's wrappers launch several kernels, and copy a strided input to
a contiguous one) is not seen. The counts are exact and repeatable: no timing is involved, so one run per tree is the
whole measurement.

    .venv/bin/python scripts/bench_host_ops.py                  # the `small` preset, 512 tokens
    .venv/bin/python scripts/bench_host_ops.py --checkpointing  # with activation checkpointing (forward runs twice)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrl.model import kda, kda_ops, layers, mla, moe  # noqa: E402
from agentrl.model.config import preset_config  # noqa: E402
from agentrl.model.modeling import HybridMoEForCausalLM  # noqa: E402

# operations that make no kernel: views and metadata
_NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "permute", "select", "slice", "narrow", "detach", "alias",
              "unsqueeze", "squeeze", "expand", "split", "split_with_sizes", "unbind", "chunk", "as_strided",
              "reshape", "promote_types", "lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Counts the aten operations that would launch kernels, and the stand-in fused calls, while active."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.fused = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


_COUNTER: list[OpCounter] = []


@contextlib.contextmanager
def _uncounted(as_fused_call: bool = True):
    for counter in _COUNTER:
        counter.paused += 1
    try:
        yield
    finally:
        for counter in _COUNTER:
            counter.paused -= 1
            counter.fused += as_fused_call


class _Fused(torch.autograd.Function):
    """A CUDA kernel's stand-in: `fn`'s PyTorch reference, counted as one call forward and one backward."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with _uncounted(), torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with _uncounted(), torch.enable_grad():
            outputs = ctx.fn(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            wanted = [x for x in inputs if x.requires_grad]
            got = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
        return (None, *[next(got) if x.requires_grad else None for x in inputs])


def fused(fn, *inputs):
    return _Fused.apply(fn, *inputs)


def _reference(fn, *args, **kwargs):
    """`fn` with agentrl's own CUDA branches off (the stand-ins call the PyTorch forms)."""
    previous = layers.set_fused(False)
    try:
        return fn(*args, **kwargs)
    finally:
        layers.set_fused(previous)


def _conv(x_BTC, weight, activation, cu_seqlens):
    return fused(lambda x, w: _reference(layers.short_conv, x[0], w[:, None], cu_seqlens, None, activation)[0][None],
                 x_BTC, weight), None


_FLA = {
    "fla.ops.kda.gate": SimpleNamespace(fused_kda_gate=lambda z, A_log, dt_bias, lower_bound=None: fused(
        lambda z, a, dt: _gate_reference(z, a, dt, lower_bound), z, A_log, dt_bias)),
    "fla.modules.norm.fused_norm_gate": SimpleNamespace(
        rms_norm_gated=lambda x, gate, weight, bias, activation, eps: fused(
            lambda x, g, w: layers.gated_rms_norm_torch(x, w, g, eps), x, gate, weight)),
    "fla.modules.norm.l2norm": SimpleNamespace(l2norm=lambda x, eps: fused(
        lambda x: layers.l2norm_torch(x, eps), x)),
    "fla.modules.causal_conv1d.ops": SimpleNamespace(
        causal_conv1d=lambda x, weight, activation, cu_seqlens: _conv(x, weight, activation, cu_seqlens)),
}


def _gate_reference(z_THK, A_log, dt_bias, lower_bound):
    z = z_THK.float() + dt_bias.float().view(z_THK.shape[1:])
    rate = A_log.float().exp().view(1, -1, 1)
    return lower_bound * torch.sigmoid(rate * z) if lower_bound is not None else -rate * torch.nn.functional.softplus(z)


def _fla_op(x, module):
    return _FLA.get(module) if layers.fused_enabled() else None


def _kda_kernel(q, k, v, g, beta, *, output_final_state, **kwargs):
    o = fused(lambda *t: _cpu_kda(*t, output_final_state=False, **kwargs)[0], q, k, v, g, beta)
    final = None
    if output_final_state:  # the final state has no gradient: computed outside the stand-in, uncounted
        with _uncounted(as_fused_call=False), torch.no_grad():
            final = _cpu_kda(q, k, v, g, beta, output_final_state=True, **kwargs)[1]
    return o, final


_cpu_kda = kda_ops.kda


def _group_ends(x_SK, counts_E):
    return torch.cumsum(counts_E, 0).to(torch.int32) if x_SK.shape[0] else None  # the CUDA branch's operations


def _grouped_matmul(x_SK, w_ENK, counts_E, ends_E=None):
    if ends_E is None:  # a caller that did not compute the ends (or a tree from before `group_ends`)
        _group_ends(x_SK, counts_E)
    return fused(lambda x, w: _reference(_cpu_grouped_matmul, x, w, counts_E), x_SK, w_ENK)


_cpu_grouped_matmul = moe.grouped_matmul


def _mla_attention(q, kv, k_pe, cu_seqlens, scale, **kwargs):
    return fused(lambda q, kv, k_pe: _reference(_cpu_mla_attention, q, kv, k_pe, cu_seqlens, scale, **kwargs),
                 q, kv, k_pe)


_cpu_mla_attention = mla.mla_attention


@contextlib.contextmanager
def cuda_form():
    """The model's CUDA branches, taken on CPU through the stand-ins."""
    saved = (layers.fla_op, kda.fla_op, kda_ops.kda, moe.grouped_matmul, getattr(moe, "group_ends", None),
             mla.mla_attention, layers.RMSNorm.forward)
    layers.fla_op = kda.fla_op = _fla_op
    kda_ops.kda = _kda_kernel
    moe.grouped_matmul = _grouped_matmul
    moe.group_ends = _group_ends
    mla.mla_attention = _mla_attention
    layers.RMSNorm.forward = lambda self, x: fused(
        lambda x, w: layers.rms_norm_torch(x, w, self.variance_epsilon), x, self.weight)
    try:
        yield
    finally:
        (layers.fla_op, kda.fla_op, kda_ops.kda, moe.grouped_matmul, moe.group_ends, mla.mla_attention,
         layers.RMSNorm.forward) = saved


def count(step) -> tuple[OpCounter, OpCounter]:
    """The operations of `step()`'s forward (it returns a scalar loss) and of its backward."""
    forward, backward = OpCounter(), OpCounter()
    for counter, run in ((forward, step), (backward, None)):
        _COUNTER.append(counter)
        try:
            with counter:
                if run is not None:
                    loss = run()
                else:
                    loss.backward()
        finally:
            _COUNTER.pop()
    return forward, backward


def parts(model, tokens: int):
    """(name, layers of that kind, a fwd-loss function for one of them) for the layer kinds of the model."""
    config = model.config
    hidden = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    kinds = [("KDA attention (with its norm)", lambda layer: layer.is_kda,
              lambda layer, h: layer.attention(h, cu_seqlens, None, False)),
             ("MLA attention (with its norm)", lambda layer: not layer.is_kda,
              lambda layer, h: layer.attention(h, cu_seqlens, None, False)),
             ("MoE feed-forward (with its norm)", lambda layer: layer.is_moe,
              lambda layer, h: layer.feed_forward(h, None)[0]),
             ("dense MLP (with its norm)", lambda layer: not layer.is_moe,
              lambda layer, h: layer.feed_forward(h, None)[0])]
    for name, chosen, forward in kinds:
        matching = [layer for layer in model.model.layers if chosen(layer)]
        if matching:
            yield name, len(matching), (lambda f=forward, layer=matching[0]:
                                        f(layer, hidden.detach().requires_grad_()).float().sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--checkpointing", action="store_true", help="the layer's forward recomputed in backward")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config(args.preset)).to(torch.bfloat16).train()
    rows = []
    with cuda_form():
        for name, num_layers, step in parts(model, args.tokens):
            if args.checkpointing:
                plain = step
                step = lambda plain=plain: torch.utils.checkpoint.checkpoint(plain, use_reentrant=False)  # noqa: E731
            count(step)  # a first call: lazily built state (the balancer's counters) is not a step's cost
            model.zero_grad(set_to_none=True)
            fwd, bwd = count(step)
            model.zero_grad(set_to_none=True)
            ops = sum(fwd.ops.values()) + sum(bwd.ops.values())
            rows.append([name, num_layers, sum(fwd.ops.values()), sum(bwd.ops.values()), fwd.fused, bwd.fused,
                         ops + fwd.fused + bwd.fused, num_layers * (ops + fwd.fused + bwd.fused)])
            top = (fwd.ops + bwd.ops).most_common(8)
            print(f"  {name}: most frequent: " + ", ".join(f"{op} {n}" for op, n in top), flush=True)
    head = ["part", "layers", "aten ops fwd", "aten ops bwd", "fused calls fwd", "fused calls bwd",
            "dispatches per layer", "× layers"]
    print(f"\n### Host dispatches per layer, `{args.preset}` preset, {args.tokens} tokens, bf16, CPU in the CUDA form"
          + (", activation checkpointing" if args.checkpointing else "") + "\n")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    print(f"| all layers | {sum(r[1] for r in rows)} | | | | | | {sum(r[7] for r in rows)} |")


if __name__ == "__main__":
    main()
