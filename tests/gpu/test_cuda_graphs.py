"""Short micro-batches replayed from CUDA graphs (trainer/cuda_graphs.py) against the eager forward and backward: the
log-probs, the gradients and the balancers' counts, and a second micro-batch replayed from the first one's graph.
Skipped without CUDA (fla's graph mode and the capture need it)."""

import pytest
import torch

from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM

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
