"""Short micro-batches replayed from CUDA graphs (trainer/cuda_graphs.py) against the eager forward and backward: the
log-probs, the gradients and the balancers' counts, later micro-batches (one filling the bucket exactly) replayed from
the first one's graph, and two ZeRO-2 trainer steps. Skipped without CUDA (fla's graph mode and the capture need it)."""

import dataclasses

import pytest
import torch

from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM
from tests.gpu.test_trainer_deepspeed import make_batch, trainer_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _micro_batch(lengths, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    ids = torch.randint(0, vocab, (num,), generator=gen).cuda()
    targets = torch.randint(0, vocab, (num,), generator=gen).cuda()
    weights = torch.rand(num, generator=gen).cuda()
    return ids, cu, targets, weights


def _pass(forward, model, batch):
    """(log-probs, entropies, every parameter's gradient, each MoE layer's load) of one forward and backward."""
    ids, cu, targets, weights = batch
    model.zero_grad(set_to_none=True)
    for moe in model.moe_layers:
        moe.gate.balancer.reset()
    logp, entropy = forward(ids, cu, targets)
    ((logp * weights).sum() + 0.01 * entropy.sum()).backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    loads = [moe.gate.balancer.load_E.clone() for moe in model.moe_layers]
    return logp.detach().float(), entropy.detach().float(), grads, loads


def _close(graphed, eager):
    logp, entropy, grads, loads = graphed
    logp_e, entropy_e, grads_e, loads_e = eager
    torch.testing.assert_close(logp, logp_e, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(entropy, entropy_e, atol=5e-2, rtol=5e-2)
    assert grads.shape == grads_e.shape
    assert (grads - grads_e).norm() <= 0.02 * grads_e.norm()
    assert torch.nn.functional.cosine_similarity(grads, grads_e, dim=0) > 0.999
    for load, load_e in zip(loads, loads_e):  # bf16 scores may flip a near tie between two experts
        assert load.sum() == load_e.sum() and (load - load_e).abs().sum() <= 0.01 * load_e.sum()


@pytest.mark.gpu_memory_heavy  # its worker reserved 10.7 GiB at its peak on an H100 (session 44)
def test_a_graphed_micro_batch_trains_as_the_eager_one_and_later_ones_replay_the_same_graph():
    from agentrl.trainer.cuda_graphs import GraphedForward
    from agentrl.trainer.forward import PackedPolicy

    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config("small")).to("cuda", torch.bfloat16).train()
    vocab = model.config.vocab_size
    policy = PackedPolicy(model)
    graphs = GraphedForward(model, buckets=(2048, 4096), max_sequences=16)
    # the third fills the bucket exactly: its padding sequence is empty, like the spare ones after it
    for seed, lengths in enumerate([(1500, 300, 900, 1200), (2000, 1000, 700, 40, 300), (2048, 1000, 1048)]):
        batch = _micro_batch(lengths, vocab, seed)
        eager = _pass(lambda i, c, t: policy(i, c, t), model, batch)
        graphed = _pass(lambda i, c, t: graphs(i, c, t, None, 1.0), model, batch)
        _close(graphed, eager)
        assert list(graphs.graphs) == [(4096, 1.0)]  # the second micro-batch replayed the first one's graph
    assert graphs.replays == 3
    # more sequences than a graph holds, or more tokens than the largest bucket: the caller runs it eagerly
    ids, cu, targets, _ = _micro_batch([100] * 15, vocab, 3)
    assert graphs(ids, cu, targets, None, 1.0) is None
    ids, cu, targets, _ = _micro_batch([5000], vocab, 4)
    assert graphs(ids, cu, targets, None, 1.0) is None


def _serve_eagerly_at_the_graphs_shapes(graphs) -> None:
    """Makes a GraphedForward run each padded micro-batch eagerly instead of recording it: the graphs' arithmetic
    (the bucket's padding, the same bf16 GEMM shapes) without the graphs."""
    from agentrl.trainer.forward import PackedPolicy

    policy = PackedPolicy(graphs.policy)

    def eager_pass(args, temperature):
        return lambda ids, cu, targets, forced, counted: policy(ids, cu, targets, forced, temperature=temperature,
                                                                 counted_T=counted)

    graphs._capture = eager_pass


def _steps_recording_gradients(run_dir, buckets, replay=True):
    """(each step's metrics, the fp32 gradients DeepSpeed hands AdamW, the GraphedForward or None) of two ZeRO-2
    steps of a fresh `small` trainer; `replay=False` pads the micro-batches as the graphs do but runs them eagerly."""
    from agentrl.trainer import PolicyTrainer

    config = dataclasses.replace(trainer_config(str(run_dir), zero_stage=2), cuda_graph_tokens=buckets)
    trainer = PolicyTrainer(config, preset_config("small"))
    try:
        graphs = trainer.module.graphs
        if not replay:
            _serve_eagerly_at_the_graphs_shapes(graphs)
        adamw, grads = trainer.optimizer, []
        adamw_step = adamw.step

        def recording_step(*args, **kwargs):
            grads.append(torch.cat([p.grad.detach().float().flatten() for group in adamw.param_groups
                                    for p in group["params"] if p.grad is not None]))
            return adamw_step(*args, **kwargs)

        adamw.step = recording_step
        batch = make_batch(trainer.policy.config.vocab_size)
        metrics = [trainer.step(batch) for _ in range(2)]
        return metrics, grads, graphs
    finally:
        trainer.close()


@pytest.mark.gpu_memory_heavy
def test_zero2_steps_with_graphed_micro_batches_train_as_eager_ones(tmp_path):
    """Three micro-batches a step, each replayed from the 4K graph recorded at the first, over two steps (the
    second reads the weights the optimizer wrote in place): the gradient DeepSpeed accumulates from the replays and
    hands the optimizer is the one of the same padded micro-batches run eagerly.

    Against the eager steps on unpadded micro-batches only the loss, the gradient norm and the loads are compared:
    padding changes the bf16 GEMM shapes, and this batch's gradient, a sum over sequences with advantages of both
    signs, mostly cancels, so that rounding moved it by 46% of its norm on an H100 (with the same norm, loss and
    log-probs to 3e-4); the padding itself is exact (tests/unit/trainer/test_cuda_graphs.py, fp64)."""
    graphed, grads, graphs = _steps_recording_gradients(tmp_path / "graphed", (4096,))
    padded, grads_p, _ = _steps_recording_gradients(tmp_path / "padded", (4096,), replay=False)
    eager, _, _ = _steps_recording_gradients(tmp_path / "eager", ())
    assert graphs.recordings == 1 and graphs.replays == sum(m["micro_batches"] for m in graphed) == 6
    # DeepSpeed steps AdamW once per parameter group: two gradients a step
    assert len(grads) == len(grads_p) == 4
    for step, (grad, grad_p) in enumerate(zip(grads, grads_p)):  # a micro-batch lost or counted twice would turn it
        off = ((grad - grad_p).norm() / grad_p.norm()).item()
        assert off <= 1e-2, f"gradient {step}: {off:.4f} of its norm off the eager pass on the padded micro-batches"
    for g, p, e in zip(graphed, padded, eager):
        assert g["loss"] == pytest.approx(p["loss"], rel=1e-3, abs=1e-4)
        assert g["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-2)
        assert g["loss"] == pytest.approx(e["loss"], rel=2e-2, abs=1e-3)
        assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=2e-2)
        assert g["packed_tokens"] == e["packed_tokens"]
        assert g["expert_load_max_over_mean"] == pytest.approx(e["expert_load_max_over_mean"], rel=5e-2)
