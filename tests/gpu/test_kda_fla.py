"""fla's KDA kernels (through agentrl's dispatcher) against the naive fp64 recurrence on awkward shapes.

Run through the device tool with fla-core 0.6.0 carried as a wheel; skipped without CUDA or fla. fla's Triton tiles
multiply in TF32, so the tolerance is relative (≈3e-3 was measured on an H200).
"""

import pytest
import torch
import torch.nn.functional as F

from agentrl.model import kda_ops
from agentrl.model.kda_ops import GateParams, kda, naive_recurrent_kda, prologue

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kda_ops._import_fla_kda() is None,
                                reason="needs CUDA and fla")

RTOL = 1e-2


def make(T, N=1, g_low=-5.0, H=4, K=64):
    torch.manual_seed(T)
    q = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, K, dtype=torch.float64)
    g = g_low * torch.sigmoid(torch.randn(1, T, H, K, dtype=torch.float64) + 1)
    beta = torch.sigmoid(torch.randn(1, T, H, dtype=torch.float64))
    return [q, k, v, g, beta], torch.randn(N, H, K, K, dtype=torch.float64) * 0.1


def rel(a, b):
    return ((a.double().cpu() - b.double()).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T,cu,bounded,g_low", [
    (63, None, True, -5.0), (500, None, True, -5.0), (500, None, False, -20.0),
    (110, [0, 1, 17, 40, 103, 110], True, -5.0),
])
def test_fla_chunk_matches_naive_forward_backward_and_state(T, cu, bounded, g_low):
    xs, s0 = make(T, N=1 if cu is None else len(cu) - 1, g_low=g_low)
    cu_t = None if cu is None else torch.tensor(cu)
    ref = [x.clone().requires_grad_() for x in xs]
    s0_ref = s0.clone().requires_grad_()
    o_ref, s_ref = naive_recurrent_kda(*ref, initial_state=s0_ref, output_final_state=True, cu_seqlens=cu_t)
    dev = [x.to("cuda", torch.float32).requires_grad_() for x in xs]
    s0_dev = s0.to("cuda", torch.float32).requires_grad_()
    o_dev, s_dev = kda(*dev, initial_state=s0_dev, output_final_state=True,
                       cu_seqlens=None if cu_t is None else cu_t.cuda(), bounded=bounded, mode="chunk")
    assert rel(o_dev, o_ref) < RTOL and rel(s_dev, s_ref) < RTOL
    d_o, d_s = torch.randn_like(o_ref), torch.randn_like(s_ref)
    ((o_ref * d_o).sum() + (s_ref * d_s).sum()).backward()
    ((o_dev * d_o.cuda().float()).sum() + (s_dev * d_s.cuda().float()).sum()).backward()
    for name, a, b in zip(("q", "k", "v", "g", "beta", "s0"), dev + [s0_dev], ref + [s0_ref]):
        assert rel(a.grad, b.grad) < RTOL, name


def test_fla_recurrent_decode_matches_naive():
    xs, s0 = make(110, N=5)
    cu = torch.tensor([0, 1, 17, 40, 103, 110])
    o_ref, s_ref = naive_recurrent_kda(*xs, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        o_dev, s_dev = kda(*[x.cuda().float() for x in xs], initial_state=s0.cuda().float(), output_final_state=True,
                           cu_seqlens=cu.cuda(), mode="recurrent")
    assert rel(o_dev, o_ref) < 1e-4 and rel(s_dev, s_ref) < 1e-4


def make_projections(T, N, bounded, H=4, K=64):
    """The KDA layer's projections before the prologue (q, k unnormalised, the gate's input z, β's logits) and gate
    parameters as each gate form initialises them, with some spread."""
    torch.manual_seed(T + bounded)
    q, k = (3 * torch.randn(1, T, H, K, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, K, dtype=torch.float64)
    z, b = torch.randn(1, T, H, K, dtype=torch.float64), torch.randn(1, T, H, dtype=torch.float64)
    if bounded:  # K3: A_log and dt_bias start at 0
        A_log, dt_bias = 0.3 * torch.randn(H, dtype=torch.float64), 0.5 * torch.randn(H * K, dtype=torch.float64)
    else:  # Kimi Linear: A ~ U(1, 16), softplus(dt_bias) ~ logU(1e-3, 1e-1)
        A_log = torch.empty(H, dtype=torch.float64).uniform_(1, 16).log()
        dt = torch.empty(H * K, dtype=torch.float64).uniform_(-6.9, -2.3).exp()
        dt_bias = dt + torch.log(-torch.expm1(-dt))
    return [q, k, v, z, b, A_log, dt_bias], torch.randn(N, H, K, K, dtype=torch.float64) * 0.1


@pytest.mark.parametrize("T,cu,bounded", [(500, None, True), (110, [0, 1, 17, 40, 103, 110], True),
                                          (300, None, False)])
def test_fla_applies_the_layers_prologue_in_its_kernels(T, cu, bounded):
    """`kda(..., gate=)` hands fla the layer's projections with the norms, the gate and the sigmoid to apply in its
    kernels; the reference applies `prologue` in fp64 and runs the naive recurrence."""
    xs, s0 = make_projections(T, N=1 if cu is None else len(cu) - 1, bounded=bounded)
    cu_t = None if cu is None else torch.tensor(cu)
    lower_bound = -5.0 if bounded else None
    ref = [x.clone().requires_grad_() for x in xs]
    s0_ref = s0.clone().requires_grad_()
    o_ref, s_ref = naive_recurrent_kda(*_finished(*ref, lower_bound), initial_state=s0_ref, output_final_state=True,
                                       cu_seqlens=cu_t)
    dev = [x.to("cuda", torch.float32).requires_grad_() for x in xs]
    s0_dev = s0.to("cuda", torch.float32).requires_grad_()
    q, k, v, z, b, A_log, dt_bias = dev
    o_dev, s_dev = kda(q, k, v, z, b, initial_state=s0_dev, output_final_state=True, bounded=bounded,
                       cu_seqlens=None if cu_t is None else cu_t.cuda(), mode="chunk", gate=GateParams(A_log, dt_bias))
    assert rel(o_dev, o_ref) < RTOL and rel(s_dev, s_ref) < RTOL
    d_o, d_s = torch.randn_like(o_ref), torch.randn_like(s_ref)
    ((o_ref * d_o).sum() + (s_ref * d_s).sum()).backward()
    ((o_dev * d_o.cuda().float()).sum() + (s_dev * d_s.cuda().float()).sum()).backward()
    for name, a, r in zip(("q", "k", "v", "z", "b", "A_log", "dt_bias", "s0"), dev + [s0_dev], ref + [s0_ref]):
        assert rel(a.grad, r.grad) < RTOL, name


def test_fla_recurrent_decode_applies_the_layers_prologue():
    xs, s0 = make_projections(110, N=5, bounded=True)
    cu = torch.tensor([0, 1, 17, 40, 103, 110])
    o_ref, s_ref = naive_recurrent_kda(*_finished(*xs, -5.0), initial_state=s0, output_final_state=True, cu_seqlens=cu)
    q, k, v, z, b, A_log, dt_bias = [x.cuda().float() for x in xs]
    with torch.no_grad():
        o_dev, s_dev = kda(q, k, v, z, b, initial_state=s0.cuda().float(), output_final_state=True,
                           cu_seqlens=cu.cuda(), mode="recurrent", gate=GateParams(A_log, dt_bias))
    assert rel(o_dev, o_ref) < 1e-4 and rel(s_dev, s_ref) < 1e-4


def _finished(q, k, v, z, b, A_log, dt_bias, lower_bound):
    """The kernel's inputs from the projections, by `prologue` (PyTorch, here in fp64 on the CPU)."""
    q, k, g, beta = prologue(q, k, z, b, GateParams(A_log, dt_bias), lower_bound)
    return q, k, v, g, beta
