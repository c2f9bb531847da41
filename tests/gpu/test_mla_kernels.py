"""MLA's Triton attention kernels (agentrl.model.mla_kernels) against the reference path they replace.

The reference: the keys concatenated, [k_nope | k_pe broadcast], and `varlen_causal_attention` (FlashAttention-2 with
the narrower head dim zero-padded), on the same bf16 inputs, and both against fp64 attention of the same values. The
kernels must be as close to fp64 as flash is (within 1.5× of flash's error, plus a little), forward and every
gradient, over packings whose sequences start and end inside tiles, one-token sequences, empty ones, and tiles past
the last token; deterministic; and taken by the model's MLA layer. Skipped without CUDA or Triton.
"""

import pytest
import torch

from agentrl.model import layers, mla_kernels
from agentrl.model.config import preset_config
from agentrl.model.context_parallel import prefix_causal_attention
from agentrl.model.mla import GatedMLA, keys_and_values, varlen_causal_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or mla_kernels._kernels() is None,
                                reason="needs CUDA and Triton")

# (E, P, V): the small preset's, Kimi Linear's and K3's, and one with v wider than q/k's parts
DIMS = {"small": (64, 64, 64), "kimi-linear": (128, 64, 128), "wide-v": (32, 16, 128)}
PACKINGS = {"ragged": [255, 127, 383, 1, 64, 300], "one": [1000], "single tokens": [1, 1, 129, 63, 1, 2],
            "tile-aligned": [128, 64, 256]}


def rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)


def inputs(lengths, dims, heads=4, dtype=torch.bfloat16, seed=0, key_lengths=None):
    """q, kv and k_pe's source for packed sequences of `lengths` queries, and of `key_lengths` keys when these run
    further back (context parallelism's pieces), the output gradient, and the offsets (cu_q, cu_k)."""
    E, P, V = dims
    T, S = sum(lengths), sum(key_lengths or lengths)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, heads, E + P, device="cuda", generator=g)
    kv = torch.randn(S, heads, E + V, device="cuda", generator=g)
    latent = torch.randn(S, 32 + P, device="cuda", generator=g)  # k_pe as MLA leaves it: a column slice
    grad = torch.randn(T, heads, V, device="cuda", generator=g)
    cu_q = offsets(lengths)
    cu_k = cu_q if key_lengths is None else offsets(key_lengths)
    return [t.to(dtype).requires_grad_() for t in (q, kv, latent)], grad.to(dtype), (cu_q, cu_k)


def run(path, q, kv, latent, grad, cu):
    """(o, ∂q, ∂kv, ∂latent) of one path: "kernels", "flash" (the reference) or "fp64" (SDPA's math, fp64).
    `cu`: (cu_q, cu_k), or one tensor for both."""
    cu_q, cu_k = cu if isinstance(cu, tuple) else (cu, cu)
    E = q.shape[-1] - (latent.shape[-1] - 32)
    k_pe = latent[:, 32:]
    scale = q.shape[-1] ** -0.5
    if path == "kernels":
        o = mla_kernels.mla_causal_attention(q, kv, k_pe, cu_q, scale, key_cu_seqlens=cu_k)
    else:
        k, v = keys_and_values(kv, k_pe, E)
        o = (varlen_causal_attention(q, k, v, cu_q, scale) if cu_k is cu_q
             else prefix_causal_attention(q, k, v, cu_q, cu_k, scale))
    o.backward(grad)
    out = [o.detach(), q.grad, kv.grad, latent.grad]
    for t in (q, kv, latent):
        t.grad = None
    return out


@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("packing", sorted(PACKINGS))
def test_kernels_match_fp64_as_closely_as_flash(dims, packing):
    tensors, grad, cu = inputs(PACKINGS[packing], DIMS[dims])
    assert mla_kernels.available(tensors[0], DIMS[dims][0], DIMS[dims][1], DIMS[dims][2])
    kernels = run("kernels", *tensors, grad, cu)
    flash = run("flash", *tensors, grad, cu)
    exact = run("fp64", *(t.detach().double().requires_grad_() for t in tensors), grad.double(), cu)
    for name, got, ref, fp64 in zip(("o", "dq", "dkv", "dk_pe"), kernels, flash, exact):
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        assert torch.isfinite(got).all(), name
        assert rel(got, fp64) <= 1.5 * rel(ref, fp64) + 1e-3, (name, rel(got, fp64), rel(ref, fp64))


# context parallelism's pieces: each sequence's queries are the last of its keys. A rank's layout (the first
# sequence begun on an earlier rank, the others starting here) and a general one (every sequence its own prefix).
PREFIXES = {"rank": ([120, 700, 1, 64], [380, 700, 1, 64]), "general": ([120, 1024, 1], [300, 1024, 77])}


@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("layout", sorted(PREFIXES))
def test_prefix_attention_matches_fp64_as_closely_as_flash(dims, layout):
    queries, keys = PREFIXES[layout]
    tensors, grad, cu = inputs(queries, DIMS[dims], key_lengths=keys)
    kernels = run("kernels", *tensors, grad, cu)
    flash = run("flash", *tensors, grad, cu)
    exact = run("fp64", *(t.detach().double().requires_grad_() for t in tensors), grad.double(), cu)
    for name, got, ref, fp64 in zip(("o", "dq", "dkv", "dk_pe"), kernels, flash, exact):
        assert got.shape == ref.shape, name
        assert rel(got, fp64) <= 1.5 * rel(ref, fp64) + 1e-3, (name, rel(got, fp64), rel(ref, fp64))


def test_empty_sequences_in_the_packing():
    """Zero-length sequences (cu_seqlens repeating an offset) change nothing for the others: against fp64 alone."""
    tensors, grad, cu = inputs([0, 40, 0, 1, 200, 0], DIMS["small"])
    kernels = run("kernels", *tensors, grad, cu)
    exact = run("fp64", *(t.detach().double().requires_grad_() for t in tensors), grad.double(),
                offsets([40, 1, 200]))
    for name, got, fp64 in zip(("o", "dq", "dkv", "dk_pe"), kernels, exact):
        assert rel(got, fp64) < 1e-2, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernels_are_deterministic(dtype):
    tensors, grad, cu = inputs(PACKINGS["ragged"], DIMS["kimi-linear"], dtype=dtype)
    first, second = run("kernels", *tensors, grad, cu), run("kernels", *tensors, grad, cu)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_long_sequence_with_many_tiles():
    """One 8K sequence at the small preset's dims: thousands of tiles per row, against flash."""
    tensors, grad, cu = inputs([8192], DIMS["small"], heads=2)
    for name, got, ref in zip(("o", "dq", "dkv", "dk_pe"), run("kernels", *tensors, grad, cu),
                              run("flash", *tensors, grad, cu)):
        assert rel(got, ref.double()) < 2e-2, name


def test_the_mla_layer_takes_the_kernels_and_matches_the_padded_path(monkeypatch):
    config = preset_config("small", num_attention_heads=4)
    torch.manual_seed(0)
    layer = GatedMLA(config, layer_idx=3).to("cuda", torch.bfloat16)
    x = torch.randn(700, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 200, 201, 700], device="cuda", dtype=torch.int32)
    calls = []
    original = mla_kernels.mla_causal_attention
    monkeypatch.setattr(mla_kernels, "mla_causal_attention", lambda *a: calls.append(1) or original(*a))
    results = []
    for fused in (True, False):
        previous = mla_kernels.set_enabled(fused)
        try:
            y, _ = layer(x, cu)
            y.float().square().mean().backward()
        finally:
            mla_kernels.set_enabled(previous)
        results.append([y.detach(), x.grad, layer.kv_b_proj.weight.grad, layer.kv_a_proj_with_mqa.weight.grad])
        x.grad = None
        layer.zero_grad()
    assert len(calls) == 1  # the fused run, and only it
    for name, got, ref in zip(("y", "dx", "d kv_b_proj", "d kv_a_proj"), *results):
        assert rel(got, ref.double()) < 2e-2, name


def test_off_without_fused_kernels_or_for_other_dims():
    q = torch.empty(4, 2, 128, device="cuda", dtype=torch.bfloat16)
    assert mla_kernels.available(q, 64, 64, 64)
    assert not mla_kernels.available(q.float(), 64, 64, 64)
    assert not mla_kernels.available(q, 16, 8, 16)  # the tiny preset's: below tl.dot's 16
    assert not mla_kernels.available(q, 96, 32, 64)  # not a power of two
    previous = layers.set_fused(False)
    try:
        assert not mla_kernels.available(q, 64, 64, 64)
    finally:
        layers.set_fused(previous)
