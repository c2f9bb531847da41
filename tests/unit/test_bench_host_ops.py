"""scripts/bench_host_ops.py counts what the model dispatches in its CUDA form on CPU. The count is only worth
something if the stand-ins for the CUDA kernels compute what the CPU path computes (values and gradients: the
backward that is counted must be the real one) and if views and stand-in internals stay out of the count."""

import time

import pytest
import torch

from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM

from tests.scripts import load_script


def _script():
    return load_script("bench_host_ops")


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = -model(ids[:, :-1], target_ids=ids[:, 1:]).token_logprobs.mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_cuda_form_computes_what_the_cpu_path_computes():
    bench = _script()
    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config("tiny")).double().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    loss, grads = _loss_and_grads(model, ids)
    with bench.cuda_form():
        counter = bench.count_call(lambda: _loss_and_grads(model, ids))
        form_loss, form_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(form_loss, loss)
    assert form_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(form_grads[name], grad, msg=name)
    assert counter.fused > 0  # the stand-ins ran: fla's kernels, the fused norm, the grouped GEMM


def test_views_and_the_insides_of_a_fused_call_are_not_counted():
    bench = _script()
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)

    def step():
        y = (x * 2).view(24).view(4, 6).t()  # one mul; the views launch nothing
        return bench.fused(lambda a, b: torch.tanh(a @ b).exp(), y.t(), w).sum()

    fwd, bwd = bench.count(step)
    assert dict(fwd.ops) == {"mul": 1, "sum": 1} and fwd.fused == 1
    assert bwd.fused == 1 and "tanh" not in bwd.ops and "exp" not in bwd.ops
    assert x.grad is not None and w.grad is not None


def test_the_narrow_config_keeps_the_presets_structure_at_small_widths():
    """--host-time times the preset's structure: every parameter the preset has (name and rank), and no other, far
    fewer elements, and the layers' kinds unchanged; for a preset without latent MoE too."""
    bench = _script()
    for preset in ("small", "kimi-linear-tiny"):
        with torch.device("meta"):
            full = HybridMoEForCausalLM(preset_config(preset))
            narrow = HybridMoEForCausalLM(bench.narrow_config(preset))
        shapes = {n: p.dim() for n, p in full.named_parameters()}
        assert {n: p.dim() for n, p in narrow.named_parameters()} == shapes, preset
        assert [(layer.is_kda, layer.is_moe) for layer in narrow.model.layers] == \
            [(layer.is_kda, layer.is_moe) for layer in full.model.layers]
        assert narrow.config.moe_balancing_bins < full.config.moe_balancing_bins
        if preset == "small":
            assert sum(p.numel() for p in narrow.parameters()) < sum(p.numel() for p in full.parameters()) / 500


def test_host_time_leaves_out_what_runs_inside_the_stand_ins():
    """--host-time's "host" is the wall time less the stand-ins' reference compute (a GPU kernel's work)."""
    bench = _script()
    x = torch.randn(3, requires_grad=True)

    def reference(a):  # a slow kernel: its forward, and again in the stand-in's backward
        time.sleep(0.2)
        return a * 2

    def step():
        time.sleep(0.05)  # the host's own work
        bench.fused(reference, x).sum().backward()

    wall, host = bench.host_seconds(step)
    assert wall >= 0.45 and 0.05 <= host < 0.2, (wall, host)
    assert x.grad is not None


def test_the_phase_clock_times_each_wrapped_call_and_puts_every_attribute_back():
    """--phases: a wrapped method of an instance and of a class each record their own host time (nested calls
    counted in both), the wrappers return what the originals return, and afterwards the instance has no attribute
    of its own and the class has its original function."""
    bench = _script()

    class Engine:
        def backward(self):
            time.sleep(0.03)
            return "inner"

        def step(self):
            time.sleep(0.01)
            return self.backward() + "+step"

    engine, original = Engine(), Engine.backward
    with bench.phase_clock([(engine, "step", "step"), (Engine, "backward", "backward")]) as spent:
        assert engine.step() == "inner+step"
    assert 0.04 <= spent["step"] < 0.2 and 0.03 <= spent["backward"] < spent["step"], dict(spent)
    assert "step" not in vars(engine) and Engine.backward is original

    total = 0.1  # a DeepSpeed step's phases add up to its total
    phases = bench._phases_of(total, {"forward": 0.02, "autograd": 0.03, "engine.backward": 0.035,
                                      "engine.step": 0.01})
    assert phases == pytest.approx([0.02, 0.03, 0.005, 0.01, 0.035]) and sum(phases) == pytest.approx(total)
