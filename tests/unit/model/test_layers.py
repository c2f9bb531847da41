"""Building blocks against naive references: short convolution with carried state, varlen attention, AttnRes."""

import pytest
import torch
import torch.nn.functional as F

from agentrl.model.attn_res import BlockState, attn_res_mix, attn_res_query
from agentrl.model.layers import RMSNorm, fla_offsets, glu, linear_many, short_conv
from agentrl.model import mla_kernels
from agentrl.model.mla import mla_attention, varlen_causal_attention


def conv_reference(x_TC, w_C1W, prev_CW):
    """One sequence through nn.functional.conv1d with the carried inputs prepended."""
    ext = torch.cat([prev_CW.t(), x_TC])  # [W-1+T, C]
    y = F.conv1d(ext.t()[None], w_C1W, groups=w_C1W.shape[0])[0].t()
    return F.silu(y), ext[-(w_C1W.shape[-1] - 1):].t()


def test_short_conv_matches_conv1d_per_sequence_with_state():
    torch.manual_seed(0)
    C, W = 6, 4
    lengths = [1, 2, 5, 9]
    x = torch.randn(sum(lengths), C)
    w = torch.randn(C, 1, W)
    prev = torch.randn(len(lengths), C, W - 1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y, final = short_conv(x, w, cu, prev)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref_y, ref_state = conv_reference(x[s:e], w, prev[i])
        torch.testing.assert_close(y[s:e], ref_y, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(final[i], ref_state)
    # without a state: zeros before every sequence, so nothing leaks from the previous sequence
    y0, _ = short_conv(x, w, cu)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        torch.testing.assert_close(y0[s:e], conv_reference(x[s:e], w, torch.zeros(C, W - 1))[0], atol=1e-6,
                                   rtol=1e-5)
    # training asks for no final state: the same outputs, and no state computed
    for prev_or_none in (prev, None):
        y_only, nothing = short_conv(x, w, cu, prev_or_none, output_final_state=False)
        assert nothing is None and torch.equal(y_only, short_conv(x, w, cu, prev_or_none)[0])


def per_sequence_attention(q, k, v, cu, scale):
    """Causal softmax attention written out for each packed sequence: the naive reference."""
    refs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        scores = torch.einsum("thd,shd->hts", q[s:e], k[s:e]) * scale
        mask = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        refs.append(torch.einsum("hts,shv->thv", scores.masked_fill(~mask, float("-inf")).softmax(-1), v[s:e]))
    return torch.cat(refs)


@pytest.mark.parametrize("lengths", [[3, 1, 12], [127, 255, 640, 1, 300], [40]])  # masked, per-sequence, one
def test_varlen_attention_equals_per_sequence_attention(lengths):
    torch.manual_seed(0)
    T = sum(lengths)
    q, k = (torch.randn(T, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(T, 2, 5, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = varlen_causal_attention(q, k, v, cu, scale=0.3)
    ref = per_sequence_attention(q, k, v, cu, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-8)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-8)


def test_attn_res_with_zero_queries_averages_its_sources_uniformly():
    torch.manual_seed(0)
    sources = [torch.randn(7, 16) * scale for scale in (1.0, 5.0, 0.1)]
    norm, query = RMSNorm(16), attn_res_query(16)
    assert torch.count_nonzero(query.weight) == 0
    torch.testing.assert_close(attn_res_mix(sources, norm, query), sum(sources) / 3)
    with torch.no_grad():
        query.weight.fill_(1.0)
    assert not torch.allclose(attn_res_mix(sources, norm, query), sum(sources) / 3)


def test_block_state_follows_the_k3_block_layout():
    """Blocks of 2 layers: block 0 = embedding, block 1 = all outputs of layers 0-1, partial = layers 2.. ."""
    emb = torch.full((1, 1), 1.0)
    state = BlockState(emb, block_size=2)
    outs = {}
    for layer in range(3):
        srcs = state.before_attention(layer)
        outs[(layer, "attn_sources")] = [s.item() for s in srcs]
        attn = torch.full((1, 1), 10.0 ** (2 * layer + 1))
        srcs = state.after_attention(layer, attn)
        outs[(layer, "mlp_sources")] = [s.item() for s in srcs]
        state.after_mlp(torch.full((1, 1), 10.0 ** (2 * layer + 2)))
    assert outs[(0, "attn_sources")] == [1.0]
    assert outs[(0, "mlp_sources")] == [1.0, 10.0]
    assert outs[(1, "attn_sources")] == [1.0, 110.0]
    # layer 2 closes block 1 (everything layers 0-1 wrote); it is read once, as the last source
    assert outs[(2, "attn_sources")] == [1.0, 11110.0]
    assert outs[(2, "mlp_sources")] == [1.0, 11110.0, 1e5]  # layer 2's attention output starts block 2
    assert [s.item() for s in state.final_sources()] == [1.0, 11110.0, 1e5 + 1e6]


def test_situ_glu_formula():
    gate_up = torch.randn(5, 8)
    g, u = gate_up.chunk(2, -1)
    expected = 2.0 * torch.tanh(g / 2.0) * torch.sigmoid(g) * (3.0 * torch.tanh(u / 3.0))
    torch.testing.assert_close(glu(gate_up, "situ", 2.0, 3.0), expected)
    torch.testing.assert_close(glu(gate_up, "silu"), F.silu(g) * u)


def test_mla_attention_from_its_parts_equals_attention_over_concatenated_keys():
    """`mla_attention` takes kv_b_proj's output and the shared k_pe; off the Triton kernels' path (here: a CPU) it
    concatenates the keys itself. Against attention over [k_nope | k_pe per head] and v, written out per sequence."""
    torch.manual_seed(0)
    lengths, H, E, P, V = [5, 1, 30], 3, 8, 4, 6
    T = sum(lengths)
    q = torch.randn(T, H, E + P, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(T, H, E + V, dtype=torch.float64, requires_grad=True)
    k_pe = torch.randn(T, P, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    assert not mla_kernels.available(q, E, P, V)
    out = mla_attention(q, kv, k_pe, cu, scale=0.3)
    k = torch.cat([kv[..., :E], k_pe[:, None, :].expand(T, H, P)], dim=-1)
    ref = per_sequence_attention(q, k, kv[..., E:], cu, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-8)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, kv, k_pe), grad), torch.autograd.grad(ref, (q, kv, k_pe), grad)):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-8)


def test_attention_bounds_of_packed_tokens():
    """What the MLA kernels mask with: per query row its first and own key, per key its first and end query row;
    empty sequences own no token. Then context parallelism's case (3 keys of the first sequence precede this
    rank's queries) and a general one (each sequence's own prefix of keys)."""
    cu = torch.tensor([0, 3, 3, 4, 8])
    key_start, own_key, first_row, query_end = mla_kernels.attention_bounds(cu, cu, 8, 8)
    assert key_start.tolist() == [0, 0, 0, 3, 4, 4, 4, 4]
    assert own_key.tolist() == first_row.tolist() == list(range(8))
    assert query_end.tolist() == [3, 3, 3, 4, 8, 8, 8, 8]
    assert {t.dtype for t in (key_start, own_key, first_row, query_end)} == {torch.int32}
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 5, 8])  # queries 0-1 are keys 3-4 of the first sequence
    key_start, own_key, first_row, query_end = mla_kernels.attention_bounds(cu_q, cu_k, 5, 8)
    assert key_start.tolist() == [0, 0, 5, 5, 5] and own_key.tolist() == [3, 4, 5, 6, 7]
    assert first_row.tolist() == [0, 0, 0, 0, 1, 2, 3, 4] and query_end.tolist() == [2, 2, 2, 2, 2, 5, 5, 5]
    cu_q, cu_k = torch.tensor([0, 1, 3]), torch.tensor([0, 3, 7])  # 3 keys, 1 query; 4 keys, 2 queries
    key_start, own_key, first_row, query_end = mla_kernels.attention_bounds(cu_q, cu_k, 3, 7)
    assert key_start.tolist() == [0, 3, 3] and own_key.tolist() == [2, 5, 6]
    assert first_row.tolist() == [0, 0, 0, 1, 1, 1, 2] and query_end.tolist() == [1, 1, 1, 3, 3, 3, 3]


class _Alias(torch.autograd.Function):
    """What DeepSpeed's ZeRO-3 module hooks do to a tensor argument: the same storage as a new object."""

    @staticmethod
    def forward(x):
        return x.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_fla_offsets_maps_an_alias_back_and_nothing_else():
    offsets = torch.tensor([0, 5, 9, 16], dtype=torch.int32)
    assert fla_offsets(offsets) is offsets
    alias = _Alias.apply(offsets)
    assert alias is not offsets and alias.data_ptr() == offsets.data_ptr()
    assert fla_offsets(alias) is offsets
    equal_elsewhere = offsets.clone()  # equal values, its own storage: fla must see it as new
    assert fla_offsets(equal_elsewhere) is equal_elsewhere
    assert fla_offsets(offsets[1:]) is not offsets  # a view that is not the whole: different offsets
    assert fla_offsets(offsets.view(torch.float32)) is not offsets  # the same bytes as another dtype
    offsets.add_(1)  # written since it was seen: what fla derived from it is stale
    written = _Alias.apply(offsets)
    assert fla_offsets(written) is written
    assert fla_offsets(_Alias.apply(offsets)) is written  # and the new entry serves the next alias
    with torch.inference_mode():  # serving's tensors have no version counter: passed through as they are
        served = torch.tensor([0, 5], dtype=torch.int32)
        assert fla_offsets(served) is served


def test_linear_many_equals_each_linear_with_its_gradients():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 12, dtype=torch.float64, generator=gen, requires_grad=True)  # batch dims pass through
    weights = [torch.randn(n, 12, dtype=torch.float64, generator=gen, requires_grad=True) for n in (5, 1, 8)]
    weights[1].requires_grad_(False)  # a frozen part gets no gradient, the others theirs
    y = linear_many(x, tuple(weights))
    want = [x @ w.t() for w in weights]
    assert y.shape == (2, 7, 14)
    for got, expected in zip(y.split([5, 1, 8], dim=-1), want):
        torch.testing.assert_close(got, expected)
    grad = torch.randn(y.shape, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad(y, [x, weights[0], weights[2]], grad)
    expected = torch.autograd.grad(torch.cat(want, dim=-1), [x, weights[0], weights[2]], grad)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda x, w0, w2: linear_many(x, (w0, weights[1], w2)),
                                    (x[0, :3].detach().requires_grad_(), weights[0], weights[2]))
