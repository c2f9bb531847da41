"""The log-prob head's Triton kernels (agentrl.model.logprob_kernels) against the head's PyTorch path.

Each kernel on ragged shapes (one row, widths not a multiple of its blocks, several forward splits), bf16 and fp16,
at τ = 1 and τ ≠ 1, with the reference computed in fp32 from the same low-precision logits; then the whole head,
`chunked_token_logprobs` forward and backward, with the kernels on and off (`layers.set_fused`), in both backward
orientations. Skipped without CUDA or Triton.
"""

import pytest
import torch

from agentrl.model import layers, logprob_kernels
from agentrl.model.modeling import chunked_token_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or logprob_kernels._kernels() is None,
                                reason="needs CUDA and Triton")
DTYPES = [torch.bfloat16, torch.float16]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def reference_stats(z, temperature):
    zf = z.float() / temperature
    lse = torch.logsumexp(zf, -1)
    return lse, lse - (torch.softmax(zf, -1) * zf).sum(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 1000), (257, 8193), (64, 3 * 8192 + 5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_logsumexp_entropy(dtype, rows, cols, temperature):
    torch.manual_seed(0)
    z = (torch.randn(rows, cols, device="cuda") * 4 + torch.randn(rows, 1, device="cuda") * 10).to(dtype)
    lse, ent = logprob_kernels.row_logsumexp_entropy(z, temperature, entropy=True)
    ref_lse, ref_ent = reference_stats(z, temperature)
    assert lse.dtype == ent.dtype == torch.float32 and lse.shape == ent.shape == (rows,)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-4, atol=2e-4)
    lse_only, zeros = logprob_kernels.row_logsumexp_entropy(z, temperature, entropy=False)
    assert torch.equal(lse_only, lse) and not zeros.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("incoming", ["both", "logprobs", "entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grad_logits(dtype, incoming, temperature):
    torch.manual_seed(0)
    rows, cols = 129, 3000
    z = (torch.randn(rows, cols, device="cuda") * 4).to(dtype)
    lse, ent = reference_stats(z, temperature)
    g_lp = torch.randn(rows, device="cuda") if incoming != "entropy" else None
    g_ent = torch.randn(rows, device="cuda") if incoming != "logprobs" else None
    column = torch.randint(0, cols, (rows,), device="cuda")
    inside = (torch.rand(rows, device="cuda") > 0.3).float()  # targets outside the block add nothing
    # the head's formula in fp32: ∂z = g_lp·onehot − p ⊙ (g_lp + g_H (z − E_p[z])), over τ
    zf = z.float() / temperature
    coef = torch.zeros(rows, 1, device="cuda")
    if g_lp is not None:
        coef = coef + g_lp[:, None]
    if g_ent is not None:
        coef = coef + g_ent[:, None] * (zf - (lse - ent)[:, None])
    ref = -torch.exp(zf - lse[:, None]) * coef
    if g_lp is not None:
        ref.scatter_add_(1, column[:, None], (g_lp * inside)[:, None])
    ref = (ref / temperature).to(dtype)
    got = logprob_kernels.grad_logits_(z.clone(), temperature, lse, ent, g_lp, g_ent, column, inside)
    assert got.dtype == dtype
    assert rel(got, ref) < 2e-3  # both round an fp32 value to the same dtype: ulps apart at most
    if g_lp is not None:  # the target's entries, where the one-hot term lands
        rows_in = inside.bool()
        torch.testing.assert_close(got[rows_in, column[rows_in]].float(), ref[rows_in, column[rows_in]].float(),
                                   rtol=1e-2, atol=1e-3)


def head(hidden, weight, targets, fused):
    previous = layers.set_fused(fused), logprob_kernels.set_enabled(fused)
    try:
        assert logprob_kernels.available(hidden) == fused  # the path under test is the one taken
        h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
        lp, ent = chunked_token_logprobs(h, w, targets, 0.8, return_entropy=True, chunk_tokens=700)
        # a mean's backward hands the head a stride-0 gradient: the kernels must take it
        (lp.mean() + (ent * torch.linspace(-1, 1, ent.numel(), device="cuda")).sum()).backward()
        return lp, ent, h.grad, w.grad
    finally:
        layers.set_fused(previous[0])
        logprob_kernels.set_enabled(previous[1])


@pytest.mark.parametrize("tokens, vocab", [(2500, 9000), (3000, 1500)], ids=["by-vocabulary", "by-tokens"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_with_kernels_matches_pytorch_path(tokens, vocab, dtype):
    torch.manual_seed(0)
    hidden = (torch.randn(tokens, 256, device="cuda") * 2).to(dtype)
    weight = (torch.randn(vocab, 256, device="cuda") / 16).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), device="cuda")
    fused, reference = head(hidden, weight, targets, True), head(hidden, weight, targets, False)
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), fused, reference):
        assert a.dtype == b.dtype, name
        assert rel(a, b) < 3e-3, name
