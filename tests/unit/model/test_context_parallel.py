"""Context parallelism on CPU: gloo ranks spawned with torch.multiprocessing against the single-process model.

Each rank runs its slice of a packed micro-batch (agentrl/model/context_parallel.py) through a copy of the same model
in fp64; the per-token log-probabilities, the loss (summed over the ranks) and every parameter's gradient (summed over
the ranks, as data parallelism sums them) must equal one process running the whole micro-batch. Batches where
sequences cross the rank boundaries, start right at one, and where one sequence spans every rank; bounded and
unbounded KDA gates; with and without Block AttnRes. Assertions run inside the ranks; a failure surfaces as the
spawn's ProcessRaisedException.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrl.model.config import preset_config
from agentrl.model.context_parallel import ContextShard, pad_length, prefix_causal_attention
from agentrl.model.modeling import HybridMoEForCausalLM, chunked_token_logprobs
from agentrl.net import free_port

# packed sequence lengths (tokens, inputs and targets alike): pieces across every boundary of 2 and 4 ranks, a
# sequence starting exactly at one (64 = 2·32 = 4·16 after 13+19+...), and a single sequence over all ranks
BATCHES = {"crossing": [13, 37, 3, 19, 24, 32], "one_sequence": [128]}
TOL = dict(rtol=1e-9, atol=1e-10)


def _model(bounded: bool, attn_res: bool) -> HybridMoEForCausalLM:
    lac = dict(kda_layers=[1, 3], full_attn_layers=[2, 4], num_heads=2, head_dim=8, short_conv_kernel_size=4)
    lac["gate_lower_bound"] = -5.0 if bounded else None
    cfg = preset_config("tiny", vocab_size=97, linear_attn_config=lac, attn_res_block_size=2 if attn_res else None)
    torch.manual_seed(0)
    model = HybridMoEForCausalLM(cfg).double().train()
    with torch.no_grad():  # away from the init (zero AttnRes queries, A_log = 0): every path carries signal
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    total = sum(lengths)
    ids = torch.randint(0, 97, (total,), generator=g)
    targets = torch.randint(0, 97, (total,), generator=g)
    weights = torch.rand(total, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, targets, weights, cu


def _loss(model, ids, targets, weights, cu, shard=None):
    hidden, _ = model.model(ids, cu, shard=shard)
    logp, _ = chunked_token_logprobs(hidden, model.lm_head.weight, targets)
    return logp, (logp * weights).sum()


def _rank(rank: int, world: int, port: int, cases: list[tuple[str, bool, bool]]) -> None:
    """Every case (batch, bounded gate, AttnRes) in one process group: a spawn of the ranks costs seconds, a case
    a fraction of one."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for batch, bounded, attn_res in cases:
        _check(rank, world, BATCHES[batch], bounded, attn_res, f"{batch}, bounded={bounded}, attn_res={attn_res}")
    dist.destroy_process_group()


def _check(rank: int, world: int, lengths: list[int], bounded: bool, attn_res: bool, case: str) -> None:
    ids, targets, weights, cu = _batch(lengths)
    assert pad_length(len(ids), world, 4) == 0  # the batches split evenly

    reference = _model(bounded, attn_res)
    ref_logp, ref_loss = _loss(reference, ids, targets, weights, cu)
    ref_loss.backward()

    model = _model(bounded, attn_res)
    shard = ContextShard.of(cu, rank=rank, size=world, group=dist.group.WORLD)
    part = slice(shard.lo, shard.hi)
    logp, loss = _loss(model, ids[part], targets[part], weights[part], shard.cu_seqlens, shard)
    loss.backward()
    torch.testing.assert_close(logp, ref_logp[part].detach(), **TOL, msg=lambda m: f"{case}, log-probs: {m}")
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), **TOL, msg=lambda m: f"{case}, loss: {m}")
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref.grad, **TOL, msg=lambda m, name=name: f"{case}, {name}: {m}")


# (batch, bounded KDA gate, Block AttnRes) per world size: every batch with the K3 layers, and on two ranks the
# unbounded gate and plain residuals
CASES = {2: [("crossing", True, True), ("one_sequence", True, True), ("crossing", False, True),
             ("crossing", True, False)],
         4: [("crossing", True, True), ("one_sequence", True, True)]}


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_equals_one_rank(world):
    mp.spawn(_rank, args=(world, free_port(), CASES[world]), nprocs=world, join=True)


def test_shards_cover_the_batch_and_know_which_sequence_continues():
    cu = torch.tensor([0, 13, 50, 53, 72, 96, 128], dtype=torch.int32)
    shards = [ContextShard.of(cu, rank=r, size=4) for r in range(4)]
    assert [(s.lo, s.hi) for s in shards] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert shards[0].continues == (False, True, True, False)  # 50-53 ends at 53 < 64; 72-96 ends exactly at 96
    assert shards[1].cu_seqlens.tolist() == [0, 18, 21, 32] and shards[1].prev_tokens == 19
    assert shards[1].key_cu_seqlens.tolist() == [0, 37, 40, 51] and shards[1].key_lo == 13
    assert shards[3].prev_tokens == 0 and shards[3].key_lo == 96
    with pytest.raises(ValueError, match="do not split over 3"):
        ContextShard.of(cu, rank=0, size=3)


def test_prefix_attention_puts_the_queries_at_the_end_of_their_keys():
    """Against full causal attention over each whole sequence, keeping the last rows."""
    g = torch.Generator().manual_seed(0)
    lengths, kept = [9, 40, 5], [4, 40, 1]  # keys per sequence, queries (its last rows) per sequence
    k = torch.randn(sum(lengths), 2, 6, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lengths), 2, 3, generator=g, dtype=torch.float64)
    q_full = torch.randn(sum(lengths), 2, 6, generator=g, dtype=torch.float64)
    starts = [0, 9, 49]
    q = torch.cat([q_full[s + n - m:s + n] for s, n, m in zip(starts, lengths, kept)])
    cu_q = torch.tensor([0, 4, 44, 45], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 49, 54], dtype=torch.int32)
    got = prefix_causal_attention(q, k, v, cu_q, cu_k, 0.3)
    expected = []
    for s, n, m in zip(starts, lengths, kept):
        o = torch.nn.functional.scaled_dot_product_attention(
            q_full[s:s + n].transpose(0, 1)[None], k[s:s + n].transpose(0, 1)[None], v[s:s + n].transpose(0, 1)[None],
            is_causal=True, scale=0.3)[0].transpose(0, 1)
        expected.append(o[n - m:])
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-12, atol=1e-12)
