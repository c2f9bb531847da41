"""Expert parallelism on CPU: gloo ranks spawned with torch.multiprocessing against the single-process MoE.

Each rank runs its own slice of the tokens (slices of unequal length) through a copy of the same MoE whose routed
experts are sharded over the ranks; outputs, input gradients, router and shared-expert gradients (summed over the
ranks, as data parallelism does) and the expert gradients (gathered) must equal the reference's. Assertions run
inside the ranks; a failure surfaces as the spawn's ProcessRaisedException.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrl.model.config import preset_config
from agentrl.model.expert_parallel import (
    ExpertParallelStats, all_to_all, apply_expert_parallel, gather_full_experts)
from agentrl.model.moe import SparseMoE
from agentrl.net import free_port

TOKENS = 61
TOL = dict(rtol=1e-5, atol=1e-5)  # float32 sums in a different order


def _spawn(fn, world: int, *args) -> None:
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _moe(latent: bool) -> SparseMoE:
    overrides = dict(routed_expert_hidden_size=16, latent_moe_use_norm=True) if latent else {}
    cfg = preset_config("tiny", hidden_size=32, num_experts=8, num_experts_per_token=3, **overrides)
    torch.manual_seed(0)
    moe = SparseMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe.train()


def _slices(world: int) -> list[slice]:
    """Unequal token slices, one per rank."""
    cuts = [0] + [TOKENS * (r + 1) // world + (r % 2) * 3 for r in range(world - 1)] + [TOKENS]
    return [slice(cuts[r], cuts[r + 1]) for r in range(world)]


def _sum_grad(p: torch.nn.Parameter) -> torch.Tensor:
    g = p.grad.clone()
    dist.all_reduce(g)
    return g


def _check_against_reference(world: int, latent: bool, forced: torch.Tensor | None) -> None:
    rank = dist.get_rank()
    ref = _moe(latent)
    torch.manual_seed(1)
    x = torch.randn(TOKENS, 32)
    upstream = torch.randn(TOKENS, 32)
    x_ref = x.clone().requires_grad_(True)
    out_ref, experts_ref = ref(x_ref, forced)
    (out_ref * upstream).sum().backward()

    moe = _moe(latent)
    stats = apply_expert_parallel(moe, None)
    assert moe.experts.w13_weight.shape[0] == 8 // world
    mine = _slices(world)[rank]
    x_mine = x[mine].clone().requires_grad_(True)
    out, experts = moe(x_mine, None if forced is None else forced[mine])
    (out * upstream[mine]).sum().backward()

    torch.testing.assert_close(experts, experts_ref[mine], rtol=0, atol=0)
    torch.testing.assert_close(out, out_ref[mine].detach(), **TOL)
    torch.testing.assert_close(x_mine.grad, x_ref.grad[mine], **TOL)
    replicated = dict(moe.named_parameters())
    for name, p in ref.named_parameters():
        if ".experts." in f".{name}":
            continue
        torch.testing.assert_close(_sum_grad(replicated[name]), p.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    full_grads = {}
    for pname in ("w13_weight", "w2_weight"):
        g = getattr(moe.experts, pname).grad
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g)
        full_grads[pname] = torch.cat(parts)
    torch.testing.assert_close(full_grads["w13_weight"], ref.experts.w13_weight.grad, **TOL)
    torch.testing.assert_close(full_grads["w2_weight"], ref.experts.w2_weight.grad, **TOL)
    full = gather_full_experts(moe, dst=None)
    torch.testing.assert_close(full["experts.w13_weight"], ref.experts.w13_weight.detach(), rtol=0, atol=0)
    assert stats.calls == 4  # dispatch and combine, forward and backward


def _ranks_match_reference(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    try:
        _check_against_reference(world, latent=False, forced=None)
        _check_against_reference(world, latent=True, forced=None)
        # routing replay: rows of −1 keep the layer's own choice
        g = torch.Generator().manual_seed(3)
        forced = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(TOKENS)])
        forced[::5] = -1
        _check_against_reference(world, latent=False, forced=forced)
        # tokens forced onto experts of ranks 0 and 1 only (2 ranks: rank 0 only): the others receive no rows
        chosen = torch.tensor([0, 1, 2] if world == 2 else [0, 1, 8 // world])
        forced = torch.stack([chosen[torch.randperm(3, generator=g)] for _ in range(TOKENS)])
        _check_against_reference(world, latent=False, forced=forced)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_the_single_process_moe(world):
    _spawn(_ranks_match_reference, world)


def _uneven_all_to_all(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    try:
        sends = [[2, 0], [3, 1]][rank]  # rank 0 sends nothing to rank 1
        recvs = [[2, 3], [0, 1]][rank]
        x = (torch.arange(sum(sends) * 2, dtype=torch.float64).view(-1, 2) + 100 * rank).requires_grad_(True)
        stats = ExpertParallelStats()
        y = all_to_all(x, recvs, sends, None, stats)
        want = {0: [[0, 1], [2, 3], [100, 101], [102, 103], [104, 105]], 1: [[106, 107]]}[rank]
        assert y.tolist() == want
        (y * (torch.arange(y.numel(), dtype=torch.float64).view_as(y) + 1)).sum().backward()
        # d/dx of Σ y·w is w routed back to where each row came from
        want_grad = {0: [[1, 2], [3, 4]], 1: [[5, 6], [7, 8], [9, 10], [1, 2]]}[rank]
        assert x.grad.tolist() == want_grad
        assert stats.calls == 2
    finally:
        dist.destroy_process_group()


def test_all_to_all_with_uneven_and_empty_splits_and_its_gradient():
    _spawn(_uneven_all_to_all, 2)
