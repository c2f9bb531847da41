"""KDA kernels against the naive recurrence: forward, backward and final states on awkward shapes.

Shape suffixes as in agentrl/model/kda_ops.py: B batch, T tokens, H heads, K key dim, V value dim, N sequences.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from agentrl.model import kda_ops
from agentrl.model.kda_ops import (GateParams, chunk_kda_torch, kda, kda_gate, naive_recurrent_kda, prologue,
                                   recurrent_kda_step)

torch.set_num_threads(1)

H, K, V = 2, 8, 16
F64 = torch.float64


def make_inputs(B, T, *, H=H, K=K, V=V, N=None, dtype=F64, g_low=-5.0, g_const=None, seed=0):
    """Inputs as the KDA layer hands them over: unit q/k, bounded gate g ∈ [g_low, 0], β ∈ (0, 1), an fp32/64 state."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q_BTHK = F.normalize(rnd(B, T, H, K), dim=-1)
    k_BTHK = F.normalize(rnd(B, T, H, K), dim=-1)
    v_BTHV = rnd(B, T, H, V)
    if g_const is None:
        g_BTHK = g_low * torch.sigmoid(rnd(B, T, H, K) + 1.0)
    else:
        g_BTHK = torch.full((B, T, H, K), g_const, dtype=F64)
    beta_BTH = torch.sigmoid(rnd(B, T, H))
    S0_NHKV = rnd(B if N is None else N, H, K, V)
    xs = [x.to(dtype) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)]
    return (*xs, S0_NHKV if dtype == F64 else S0_NHKV.float())


def leaves(xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def run_with_grads(fn, xs, *, use_state, seed=1, **kw):
    """Runs fn, backpropagates random cotangents on o and the final state; returns (o, S, grads)."""
    q, k, v, g, beta, S0 = leaves(xs)
    o, S = fn(q, k, v, g, beta, initial_state=S0 if use_state else None, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype)
    dS = torch.randn(S.shape, generator=gen, dtype=F64).to(S.dtype)
    ((o * do).sum() + (S * dS).sum()).backward()
    grads = [x.grad for x in (q, k, v, g, beta)] + ([S0.grad] if use_state else [])
    return o.detach(), S.detach(), grads


def assert_close_all(got, want, *, rtol, atol, what=""):
    for name, a, b in zip(("q", "k", "v", "g", "beta", "S0"), got, want):
        assert a is not None and b is not None, f"{what}: missing gradient for {name}"
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what} d{name}: {m}")


# ----------------------------------------------------------------------------------------------------------------------
# the reference itself
# ----------------------------------------------------------------------------------------------------------------------


def test_naive_matches_the_literal_matrix_recurrence():
    q, k, v, g, beta, S0 = make_inputs(2, 9)
    B, T = q.shape[:2]
    scale = 0.37
    o, S = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=S0, output_final_state=True)
    eye = torch.eye(K, dtype=F64)
    for b in range(B):
        for h in range(H):
            S_KV = S0[b, h].clone()
            for t in range(T):
                kt = k[b, t, h]
                S_KV = (eye - beta[b, t, h] * torch.outer(kt, kt)) @ torch.diag(g[b, t, h].exp()) @ S_KV
                S_KV = S_KV + beta[b, t, h] * torch.outer(kt, v[b, t, h])
                torch.testing.assert_close(o[b, t, h], S_KV.T @ (scale * q[b, t, h]), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(S[b, h], S_KV, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# chunked vs naive
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "unbounded"])
@pytest.mark.parametrize("use_state", [False, True], ids=["h0=0", "h0"])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 63])
def test_chunk_matches_naive_forward_and_backward(T, use_state, bounded):
    xs = make_inputs(2, T, seed=T)
    o_ref, S_ref, d_ref = run_with_grads(naive_recurrent_kda, xs, use_state=use_state)
    o, S, d = run_with_grads(chunk_kda_torch, xs, use_state=use_state, bounded=bounded)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    assert_close_all(d, d_ref, rtol=1e-9, atol=1e-9, what=f"T={T}")


def test_chunk_matches_naive_long_sequence_T500():
    xs = make_inputs(1, 500, H=2, K=16, V=16, seed=5)
    o_ref, S_ref, d_ref = run_with_grads(naive_recurrent_kda, xs, use_state=True)
    o, S, d = run_with_grads(chunk_kda_torch, xs, use_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    assert_close_all(d, d_ref, rtol=1e-8, atol=1e-9, what="T=500")


@pytest.mark.parametrize("chunk_size", [1, 8, 32])
def test_other_tile_sizes(chunk_size):
    xs = make_inputs(2, 41, g_low=-80.0 / 32, seed=3)
    o_ref, S_ref = naive_recurrent_kda(*xs[:5], initial_state=xs[5], output_final_state=True)
    o, S = chunk_kda_torch(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------------------
# variable length
# ----------------------------------------------------------------------------------------------------------------------

CU = [0, 1, 17, 40, 40, 103, 110]  # lengths 1, 16, 23, 0, 63, 7


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "unbounded"])
def test_varlen_matches_naive_forward_and_backward(bounded):
    cu = torch.tensor(CU, dtype=torch.int32)
    xs = make_inputs(1, CU[-1], N=len(CU) - 1, seed=7)
    o_ref, S_ref, d_ref = run_with_grads(naive_recurrent_kda, xs, use_state=True, cu_seqlens=cu)
    o, S, d = run_with_grads(chunk_kda_torch, xs, use_state=True, cu_seqlens=cu, bounded=bounded)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    assert_close_all(d, d_ref, rtol=1e-9, atol=1e-9, what="varlen")
    # the empty sequence hands its initial state straight through
    torch.testing.assert_close(S[3], xs[5][3], rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["varlen", "batch"])
def test_runs_of_tiles_split_anywhere(monkeypatch, layout):
    """The chunked form computes its tile factors in runs of whole steps; runs of 3 tile slots cut through steps where
    sequences finish and through batch rows."""
    monkeypatch.setattr(kda_ops, "_BLOCK_TILE_HEADS", 3 * H)
    if layout == "varlen":
        cu, xs = torch.tensor(CU), make_inputs(1, CU[-1], N=len(CU) - 1, seed=19)
    else:
        cu, xs = None, make_inputs(3, 50, seed=19)
    o_ref, S_ref, d_ref = run_with_grads(naive_recurrent_kda, xs, use_state=True, cu_seqlens=cu)
    o, S, d = run_with_grads(chunk_kda_torch, xs, use_state=True, cu_seqlens=cu)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    assert_close_all(d, d_ref, rtol=1e-9, atol=1e-9, what=f"runs of tiles, {layout}")


def test_varlen_equals_each_sequence_alone():
    """Packing must not leak state: each packed sequence equals the same sequence run by itself."""
    cu = torch.tensor(CU)
    q, k, v, g, beta, S0 = make_inputs(1, CU[-1], N=len(CU) - 1, seed=8)
    o, S = chunk_kda_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    for n, (s, e) in enumerate(zip(CU[:-1], CU[1:])):
        o_n, S_n = chunk_kda_torch(
            q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=S0[n : n + 1],
            output_final_state=True,
        )
        torch.testing.assert_close(o[:, s:e], o_n, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(S[n : n + 1], S_n, rtol=1e-12, atol=1e-12)


def test_empty_input_passes_the_state_through():
    q, k, v, g, beta, S0 = make_inputs(2, 0)
    for fn in (naive_recurrent_kda, chunk_kda_torch):
        o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        assert o.shape == (2, 0, H, V)
        torch.testing.assert_close(S, S0, rtol=0, atol=0)


def test_varlen_without_initial_state_and_without_final_state():
    cu = torch.tensor([0, 5, 37])
    q, k, v, g, beta, _ = make_inputs(1, 37, seed=9)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu)
    o, S = chunk_kda_torch(q, k, v, g, beta, cu_seqlens=cu)
    assert S is None
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------------------
# the bound
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g_const", [None, -5.0], ids=["g~U", "g=-5"])
def test_bounded_fp32_near_the_bound_matches_fp64_naive(g_const):
    """At g = −5 per token a 16-token tile decays by e^-80: fp32 dense tiles must stay accurate, gradients too."""
    xs64 = make_inputs(2, 48, g_low=-5.0, g_const=g_const, seed=11)
    if g_const is None:  # push a few channels onto the bound itself
        xs64[3][:, :, :, :2] = -5.0
    o_ref, S_ref, d_ref = run_with_grads(naive_recurrent_kda, xs64, use_state=True)
    xs32 = [x.float() for x in xs64]
    o, S, d = run_with_grads(chunk_kda_torch, xs32, use_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert all(torch.isfinite(x).all() for x in [o, S, *d])
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S.double(), S_ref, rtol=1e-4, atol=1e-5)
    assert_close_all([x.double() for x in d], d_ref, rtol=1e-4, atol=1e-4, what="fp32 at the bound")


def test_bounded_rejects_g_below_the_tile_bound():
    q, k, v, g, beta, _ = make_inputs(1, 20)
    g[0, 3, 1, 2] = -5.01
    with pytest.raises(ValueError, match=r"g >= -80/chunk_size = -5"):
        chunk_kda_torch(q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"-2.5"):
        chunk_kda_torch(q, k, v, g.clamp(min=-3.0), beta, chunk_size=32)


def test_unbounded_handles_g_far_below_the_bound():
    """g = −50 per token (e^-800 over a tile): the pairwise path stays finite and matches the naive."""
    xs = make_inputs(2, 37, g_low=-50.0, seed=13)
    xs[3][:, 5:9] = -50.0
    with pytest.raises(ValueError, match="bounded=False"):
        chunk_kda_torch(*xs[:5])
    o_ref, S_ref, d_ref = run_with_grads(naive_recurrent_kda, xs, use_state=True)
    o, S, d = run_with_grads(chunk_kda_torch, xs, use_state=True, bounded=False)
    assert all(torch.isfinite(x).all() for x in [o, S, *d])
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    assert_close_all(d, d_ref, rtol=1e-9, atol=1e-9, what="g=-50")
    # and in fp32
    o32, S32 = chunk_kda_torch(*[x.float() for x in xs[:5]], initial_state=xs[5].float(), output_final_state=True,
                               bounded=False)
    assert torch.isfinite(o32).all() and torch.isfinite(S32).all()
    torch.testing.assert_close(o32.double(), o_ref, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# prefill / decode
# ----------------------------------------------------------------------------------------------------------------------


def test_recurrent_step_chained_equals_naive():
    q, k, v, g, beta, S0 = make_inputs(3, 20, seed=15)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    state = S0.clone()
    for t in range(q.shape[1]):
        before = state.clone()
        o_t, new_state = recurrent_kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        assert torch.equal(state, before), "recurrent_kda_step must not modify the state it is given"
        torch.testing.assert_close(o_t, o_ref[:, t], rtol=1e-12, atol=1e-12)
        state = new_state
    torch.testing.assert_close(state, S_ref, rtol=1e-12, atol=1e-12)


def test_chunked_prefill_then_rest_equals_one_pass():
    q, k, v, g, beta, S0 = make_inputs(2, 70, seed=17)
    o_all, S_all = chunk_kda_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    cut = 37
    o1, S1 = chunk_kda_torch(*(x[:, :cut] for x in (q, k, v, g, beta)), initial_state=S0, output_final_state=True)
    o2, S2 = chunk_kda_torch(*(x[:, cut:] for x in (q, k, v, g, beta)), initial_state=S1, output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_all, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S2, S_all, rtol=1e-10, atol=1e-10)
    # and decode the last tokens one at a time after a prefill
    o_p, state = chunk_kda_torch(*(x[:, :60] for x in (q, k, v, g, beta)), initial_state=S0, output_final_state=True)
    for t in range(60, 70):
        o_t, state = recurrent_kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        torch.testing.assert_close(o_t, o_all[:, t], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, S_all, rtol=1e-10, atol=1e-10)


def test_dtypes_bf16_in_fp32_state_out():
    q, k, v, g, beta, S0 = make_inputs(1, 33, dtype=torch.bfloat16)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o, S = chunk_kda_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(S, S_ref, rtol=1e-4, atol=1e-4)
    o_t, S_t = recurrent_kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
    assert o_t.dtype == torch.bfloat16 and S_t.dtype == torch.float32


# ----------------------------------------------------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, bad",
    [
        ("k", lambda x: x[..., :-1]),
        ("v", lambda x: x[:, :-1]),
        ("g", lambda x: x[:, :, :1]),
        ("beta", lambda x: x.unsqueeze(-1)),
        ("q", lambda x: x[0]),
        ("S0", lambda x: x[:1]),
    ],
)
@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda_torch, kda], ids=["naive", "chunk", "kda"])
def test_mismatched_shapes_raise(fn, field, bad):
    names = ("q", "k", "v", "g", "beta", "S0")
    xs = dict(zip(names, make_inputs(2, 10)))
    xs[field] = bad(xs[field])
    with pytest.raises(ValueError, match=rf"^{field if field != 'S0' else 'initial_state'} must"):
        fn(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], initial_state=xs["S0"])


def test_bad_cu_seqlens_raise():
    q, k, v, g, beta, _ = make_inputs(2, 10)
    with pytest.raises(ValueError, match="B must be 1, got B=2"):
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10, 20]))
    q1, k1, v1, g1, b1 = (x[:1] for x in (q, k, v, g, beta))
    for cu in ([0, 4, 9], [1, 4, 10], [0, 6, 4, 10]):
        with pytest.raises(ValueError, match="non-decreasing from 0 to T=10"):
            chunk_kda_torch(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor(cu))
        with pytest.raises(ValueError, match="non-decreasing from 0 to T=10"):
            naive_recurrent_kda(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match="integer"):
        chunk_kda_torch(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] = \[2,"):
        chunk_kda_torch(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0, 3, 10]), initial_state=torch.zeros(1, H, K, V))


def test_bad_step_inputs_and_options_raise():
    q, k, v, g, beta, S0 = make_inputs(2, 3)
    with pytest.raises(ValueError, match="state must be"):
        recurrent_kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0[:, :, :-1])
    with pytest.raises(ValueError, match="one token per sequence"):
        recurrent_kda_step(q, k, v, g, beta, S0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_torch(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="mode must be one of .* got 'fused'"):
        kda(q, k, v, g, beta, mode="fused")
    with pytest.raises(ValueError, match=r"lower_bound must lie in \[-5, 0\) .*got -6"):
        kda(q, k, v, g, beta, lower_bound=-6.0)


# ----------------------------------------------------------------------------------------------------------------------
# the dispatcher
# ----------------------------------------------------------------------------------------------------------------------


def test_kda_on_cpu_runs_the_torch_paths():
    xs = make_inputs(1, 40, seed=21)
    o_ref, S_ref = naive_recurrent_kda(*xs[:5], initial_state=xs[5], output_final_state=True)
    for mode in ("auto", "chunk", "recurrent", "naive"):
        for bounded in (True, False):
            o, S = kda(*xs[:5], initial_state=xs[5], output_final_state=True, mode=mode, bounded=bounded)
            torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="bounded=False"):  # the CPU chunk path checks the bound itself
        kda(*make_inputs(1, 40, g_low=-20.0)[:5])


def test_kda_calls_fla_with_the_0_6_0_signature(monkeypatch):
    """With a stand-in for fla.ops.kda whose functions take exactly fla-core 0.6.0's parameters (no **kwargs, so a
    misspelt keyword fails here, where real fla would swallow it), check what the CUDA branch passes."""
    calls = []

    def in_kernel(q, k, g, beta, A_log, dt_bias, lower_bound, flags):
        """What fla applies itself under the three prologue flags (all or none, as agentrl passes them)."""
        if not any(flags):
            return q, k, g, beta
        assert all(flags)
        return prologue(q, k, g, beta, GateParams(A_log, dt_bias), lower_bound)

    # A_log and dt_bias: chunk_kda reads them from its **kwargs in 0.6.0 (`kwargs.get("A_log")`); named here
    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  cp_context=None, use_graph=False, max_num_seqs=None, A_log=None, dt_bias=None):
        calls.append(("chunk", locals().copy()))
        q, k, g, beta = in_kernel(q, k, g, beta, A_log, dt_bias, lower_bound,
                                  (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel))
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                            state_v_first=False, cu_seqlens=None):
        calls.append(("fused_recurrent", locals().copy()))
        q, k, g, beta = in_kernel(q, k, g, beta, A_log, dt_bias, lower_bound,
                                  (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel))
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    fake = types.SimpleNamespace(chunk_kda=chunk_kda, fused_recurrent_kda=fused_recurrent_kda)
    monkeypatch.setattr(kda_ops, "_fla_kda_for", lambda x: fake)

    q, k, v, g, beta, S0 = make_inputs(1, 100, dtype=torch.float32, seed=23)
    q = q.requires_grad_(True)
    o, S = kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, scale=0.5)
    kind, args = calls.pop()
    assert kind == "chunk"
    assert args["safe_gate"] is True and args["lower_bound"] == -5.0
    assert args["use_qk_l2norm_in_kernel"] is False and args["use_gate_in_kernel"] is False
    assert args["use_beta_sigmoid_in_kernel"] is False and args["state_v_first"] is False
    assert args["g"] is g and args["scale"] == 0.5 and args["initial_state"].dtype == torch.float32
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, scale=0.5)
    torch.testing.assert_close(o, o_ref)

    kda(q, k, v, g, beta, bounded=False)
    kind, args = calls.pop()
    assert kind == "chunk" and args["safe_gate"] is False and args["lower_bound"] is None

    # decode-length input without autograd goes to the fused recurrent kernel, with varlen offsets passed through
    cu = torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        kda(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], cu_seqlens=cu, initial_state=S0.expand(3, -1, -1, -1),
            output_final_state=True)
    kind, args = calls.pop()
    assert kind == "fused_recurrent" and args["cu_seqlens"] is cu and args["use_gate_in_kernel"] is False
    # ... but not when gradients are needed: fla 0.6.0's fused_recurrent_kda has no backward
    kda(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3])
    assert calls.pop()[0] == "chunk"
    with pytest.raises(ValueError, match="no backward"):
        kda(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], mode="recurrent")

    # the layer's projections with its gate parameters: the prologue goes to fla as its three in-kernel flags, the
    # bounded gate with its lower bound, the unbounded (softplus) one without
    z, b = torch.randn_like(g), torch.randn_like(beta)
    gate = GateParams(torch.randn(q.shape[2]), torch.randn(q.shape[2] * q.shape[3]))
    o = kda(q, k, v, z, b, initial_state=S0, gate=gate)
    kind, args = calls.pop()
    assert kind == "chunk" and args["safe_gate"] is True and args["lower_bound"] == -5.0
    assert args["use_qk_l2norm_in_kernel"] and args["use_gate_in_kernel"] and args["use_beta_sigmoid_in_kernel"]
    assert args["A_log"] is gate.A_log and args["dt_bias"] is gate.dt_bias and args["g"] is z and args["beta"] is b
    torch.testing.assert_close(o[0], naive_recurrent_kda(*_finished(q, k, v, z, b, gate, -5.0), initial_state=S0)[0])
    kda(q, k, v, z, b, gate=gate, bounded=False)
    kind, args = calls.pop()
    assert args["use_gate_in_kernel"] and args["safe_gate"] is False and args["lower_bound"] is None
    with torch.no_grad():
        kda(q[:, :3], k[:, :3], v[:, :3], z[:, :3], b[:, :3], cu_seqlens=cu, gate=gate)
    kind, args = calls.pop()
    assert kind == "fused_recurrent" and args["use_gate_in_kernel"] and args["lower_bound"] == -5.0
    assert args["A_log"] is gate.A_log
    # gradients wanted only by the gate's parameters still rule out the fused recurrent kernel
    trained = GateParams(gate.A_log.clone().requires_grad_(), gate.dt_bias)
    kda(q[:, :3].detach(), k[:, :3], v[:, :3], z[:, :3], b[:, :3], gate=trained)
    assert calls.pop()[0] == "chunk"


def _finished(q, k, v, z, b, gate, lower_bound):
    q, k, g, beta = prologue(q, k, z, b, gate, lower_bound)
    return q, k, v, g, beta


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_the_gate_per_head_and_channel(lower_bound):
    """`kda_gate` against its formula written out per head h and channel c: dt_bias is laid out [H·K] head-major,
    A_log is per head; bounded gates lie in [lower_bound, 0)."""
    gen = torch.Generator().manual_seed(3)
    T, H_, K_ = 5, 3, 4
    z = torch.randn(T, H_, K_, generator=gen, dtype=F64)
    A_log, dt_bias = torch.randn(H_, generator=gen, dtype=F64), torch.randn(H_ * K_, generator=gen, dtype=F64)
    g = kda_gate(z, GateParams(A_log, dt_bias), lower_bound)
    for h in range(H_):
        for c in range(K_):
            x = A_log[h].exp() * (z[:, h, c] + dt_bias[h * K_ + c]) if lower_bound is not None else \
                z[:, h, c] + dt_bias[h * K_ + c]
            want = lower_bound * torch.sigmoid(x) if lower_bound is not None else -A_log[h].exp() * F.softplus(x)
            torch.testing.assert_close(g[:, h, c], want)
    if lower_bound is not None:
        assert g.min() >= lower_bound and g.max() < 0
    assert kda_gate(z.float(), GateParams(A_log.float(), dt_bias.float()), lower_bound).dtype == torch.float32
    assert kda_gate(z.bfloat16(), GateParams(A_log.float(), dt_bias.float()), lower_bound).dtype == torch.float32


def test_kda_with_the_gate_on_cpu_applies_the_prologue_and_trains_the_gate():
    """On CPU `kda(..., gate=)` is `prologue` then the kernel, and the gate's parameters get their gradients."""
    q, k, v, g, beta, S0 = make_inputs(1, 40, seed=31)
    gen = torch.Generator().manual_seed(4)
    q_raw, k_raw = 3 * torch.randn(q.shape, generator=gen, dtype=F64), torch.randn(k.shape, generator=gen, dtype=F64)
    z, b = torch.randn(g.shape, generator=gen, dtype=F64), torch.randn(beta.shape, generator=gen, dtype=F64)
    A_log = torch.zeros(q.shape[2], dtype=F64, requires_grad=True)
    dt_bias = torch.zeros(q.shape[2] * q.shape[3], dtype=F64, requires_grad=True)
    gate = GateParams(A_log, dt_bias)
    o, S = kda(q_raw, k_raw, v, z, b, initial_state=S0, output_final_state=True, gate=gate)
    o_ref, S_ref = naive_recurrent_kda(*_finished(q_raw, k_raw, v, z, b, gate, -5.0), initial_state=S0,
                                       output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    grad_A, grad_dt = torch.autograd.grad(o.square().sum(), [A_log, dt_bias])
    ref_A, ref_dt = torch.autograd.grad(o_ref.square().sum(), [A_log, dt_bias])
    torch.testing.assert_close(grad_A, ref_A, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(grad_dt, ref_dt, rtol=1e-8, atol=1e-10)
    assert grad_A.abs().sum() > 0 and grad_dt.abs().sum() > 0
