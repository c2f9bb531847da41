"""Short micro-batches replayed from CUDA graphs (trainer/cuda_graphs.py) against the eager forward and backward: the
log-probs, the gradients and the balancers' counts, a second micro-batch replayed from the first one's graph, and
two ZeRO-2 trainer steps. Skipped without CUDA (fla's graph mode and the capture need it)."""

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


def test_a_graphed_micro_batch_trains_as_the_eager_one_and_a_second_replays_the_same_graph():
    from agentrl.trainer.cuda_graphs import GraphedForward
    from agentrl.trainer.forward import PackedPolicy

    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config("small")).to("cuda", torch.bfloat16).train()
    vocab = model.config.vocab_size
    policy = PackedPolicy(model)
    graphs = GraphedForward(model, buckets=(2048, 4096), max_sequences=16)
    for seed, lengths in enumerate([(1500, 300, 900, 1200), (2000, 1000, 700, 40, 300)]):
        batch = _micro_batch(lengths, vocab, seed)
        eager = _pass(lambda i, c, t: policy(i, c, t), model, batch)
        graphed = _pass(lambda i, c, t: graphs(i, c, t, None, 1.0), model, batch)
        _close(graphed, eager)
        assert list(graphs.graphs) == [(4096, 1.0)]  # the second micro-batch replayed the first one's graph
    assert graphs.replays == 2
    # more sequences than a graph holds, or more tokens than the largest bucket: the caller runs it eagerly
    ids, cu, targets, _ = _micro_batch([100] * 15, vocab, 3)
    assert graphs(ids, cu, targets, None, 1.0) is None
    ids, cu, targets, _ = _micro_batch([5000], vocab, 4)
    assert graphs(ids, cu, targets, None, 1.0) is None


def _steps_recording_gradients(run_dir, buckets):
    """(each step's metrics, the fp32 gradients DeepSpeed hands AdamW, micro-batches replayed from graphs) of two
    ZeRO-2 steps of a fresh `small` trainer."""
    from agentrl.trainer import PolicyTrainer

    config = dataclasses.replace(trainer_config(str(run_dir), zero_stage=2), cuda_graph_tokens=buckets)
    trainer = PolicyTrainer(config, preset_config("small"))
    try:
        adamw, grads = trainer.optimizer, []
        adamw_step = adamw.step

        def recording_step(*args, **kwargs):
            grads.append(torch.cat([p.grad.detach().float().flatten() for group in adamw.param_groups
                                    for p in group["params"] if p.grad is not None]))
            return adamw_step(*args, **kwargs)

        adamw.step = recording_step
        batch = make_batch(trainer.policy.config.vocab_size)
        metrics = [trainer.step(batch) for _ in range(2)]
        graphs = trainer.module.graphs
        return metrics, grads, 0 if graphs is None else graphs.replays
    finally:
        trainer.close()


def test_zero2_steps_with_graphed_micro_batches_train_as_eager_ones(tmp_path):
    """Three micro-batches a step, each replayed from the 4K graph: the gradient DeepSpeed accumulates from the
    graph's buffers and hands the optimizer, the loss and the balancers' loads are the eager steps' (which recompute
    under checkpointing). The gradient, not the weights' move, is compared: Adam's first steps move each weight by
    about the learning rate whatever its gradient's size, so bf16 noise in near-zero gradients turns the move."""
    graphed, grads, replays = _steps_recording_gradients(tmp_path / "graphed", (4096,))
    eager, grads_e, _ = _steps_recording_gradients(tmp_path / "eager", ())
    # DeepSpeed steps AdamW once per parameter group: two gradients a step
    assert replays == sum(m["micro_batches"] for m in graphed) and len(grads) == len(grads_e) >= 2
    for g, e in zip(graphed, eager):
        assert g["loss"] == pytest.approx(e["loss"], rel=2e-2, abs=1e-3)
        assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=2e-2)
        assert g["packed_tokens"] == e["packed_tokens"]
        assert g["expert_load_max_over_mean"] == pytest.approx(e["expert_load_max_over_mean"], rel=5e-2)
    for grad, grad_e in zip(grads, grads_e):  # a micro-batch's gradient lost or counted twice would turn it
        assert (grad - grad_e).norm() <= 0.03 * grad_e.norm()
        assert torch.nn.functional.cosine_similarity(grad, grad_e, dim=0) > 0.999
