"""Expert parallelism on GPUs (NCCL): the bf16 layer (torch._grouped_mm on the received rows) against one GPU's MoE,
and a DeepSpeed trainer step with expert_parallel = number of GPUs against expert_parallel=1.

Run through the device tool on a kind with ≥ 2 GPUs; skipped otherwise (the trainer test also without DeepSpeed).
Ranks are processes spawned with torchrun-style rendezvous (no Ray). The CPU versions (gloo, fp32, exact to 1e-5)
are tests/unit/model/test_expert_parallel.py and tests/integration/test_trainer_expert_parallel.py.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrl.model.config import preset_config
from agentrl.model.expert_parallel import apply_expert_parallel
from agentrl.model.moe import SparseMoE
from agentrl.net import free_port
from agentrl.types import Trajectory

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
TOKENS = 4099  # odd, so the ranks' slices differ in length


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in fp32 (two bf16 computations that sum in different orders differ by ~0.4%)."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def _moe() -> SparseMoE:
    cfg = preset_config("small", num_experts=64, num_experts_per_token=4)
    torch.manual_seed(0)
    moe = SparseMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return moe.cuda().to(torch.bfloat16).train()


def _layer_rank(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        torch.manual_seed(1)
        x = torch.randn(TOKENS, 1024, device="cuda", dtype=torch.bfloat16)
        upstream = torch.randn_like(x)
        cuts = [TOKENS * r // world for r in range(world + 1)]
        mine = slice(cuts[rank], cuts[rank + 1])
        for forced_to_rank0 in (False, True):  # True: every token on rank 0's experts, the others receive no rows
            forced = None
            if forced_to_rank0:
                forced = torch.stack([torch.randperm(64 // world)[:4] for _ in range(TOKENS)]).cuda()
            ref = _moe()
            x_ref = x.clone().requires_grad_(True)
            out_ref, _ = ref(x_ref, forced)
            (out_ref.float() * upstream.float()).sum().backward()
            moe = _moe()
            stats = apply_expert_parallel(moe, None)
            x_mine = x[mine].clone().requires_grad_(True)
            out, _ = moe(x_mine, None if forced is None else forced[mine])
            (out.float() * upstream[mine].float()).sum().backward()
            assert _rel_err(out, out_ref[mine]) < 1e-2
            assert _rel_err(x_mine.grad, x_ref.grad[mine]) < 1e-2
            parts = [torch.empty_like(moe.experts.w2_weight.grad) for _ in range(world)]
            dist.all_gather(parts, moe.experts.w2_weight.grad)
            assert _rel_err(torch.cat(parts), ref.experts.w2_weight.grad) < 1e-2
            assert stats.calls == 4 and stats.all_to_all_s > 0
    finally:
        dist.destroy_process_group()


def test_expert_parallel_layer_on_nccl_matches_one_gpu():
    world = min(torch.cuda.device_count(), 8)
    mp.spawn(_layer_rank, args=(world, free_port()), nprocs=world, join=True)


def _batch(step: int, vocab: int) -> list[Trajectory]:
    """2 GRPO groups of 4 trajectories, 300 to 2100 tokens."""
    rng = np.random.default_rng(step)
    batch = []
    for i, length in enumerate((1500, 300, 900, 2100, 640, 1200, 400, 1700)):
        t = Trajectory(trajectory_id=f"{step}-{i}", task_id=f"g{i // 4}", group_id=f"{step}-g{i // 4}",
                       env_id="toy", reward=float(i % 3))
        t.append_prompt(rng.integers(0, vocab, 16).tolist())
        t.append_sampled(rng.integers(0, vocab, length - 16).tolist(), (-rng.random(length - 16) * 6).tolist(),
                         version=0)
        batch.append(t)
    return batch


def _trainer_rank(rank: int, world: int, port: int, expert_parallel: int, out: str) -> None:
    from agentrl.trainer import LossConfig, TrainerConfig
    from agentrl.trainer.policy_trainer import PolicyTrainer

    cfg = TrainerConfig(run_dir=os.path.dirname(out), zero_stage=2, lr=1e-4, micro_batch_tokens=4096,
                        expert_parallel=expert_parallel, loss=LossConfig(tis_cap=2.0))
    model = preset_config("small", num_experts=64, num_experts_per_token=4)
    trainer = PolicyTrainer(cfg, model, rank=rank, world_size=world, local_rank=rank, master_port=port)
    metrics = [trainer.step(_batch(s, model.vocab_size)) for s in range(2)]
    trainer.publish_weights()
    if rank == 0:
        torch.save(metrics, out)
    trainer.close()


@pytest.mark.gpu_memory_heavy
def test_trainer_step_with_experts_over_all_gpus_matches_data_parallel(tmp_path):
    pytest.importorskip("deepspeed")
    world = min(torch.cuda.device_count(), 8)
    results = {}
    for ep in (1, world):
        out = str(tmp_path / f"ep{ep}" / "metrics.pt")
        os.makedirs(os.path.dirname(out))
        mp.spawn(_trainer_rank, args=(world, free_port(), ep, out), nprocs=world, join=True)
        results[ep] = torch.load(out, weights_only=False)
    for dp, ep in zip(results[1], results[world]):
        assert ep["loss"] == pytest.approx(dp["loss"], rel=2e-2, abs=2e-3)
        # bf16: the two layouts' GEMMs round differently and near-tied routes of the random-init router flip, so the
        # grad norms differ by ~6% (0.0188 vs 0.0200 on the H200); exactness of the exchange is tested on CPU in fp32
        # (tests/integration/test_trainer_expert_parallel.py: grad norm within 1e-5)
        assert ep["grad_norm"] == pytest.approx(dp["grad_norm"], rel=0.15)
        assert 0 < ep["ep/all_to_all_share"] < 1
    print({k: v for k, v in results[world][-1].items() if k.startswith("ep/") or k == "tokens_per_s"})
