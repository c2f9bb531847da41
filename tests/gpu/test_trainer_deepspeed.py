"""The trainer under real DeepSpeed on CUDA: a `small`-preset step on one GPU, and ZeRO-3 over two GPUs on NCCL.

Run through the device tool with DeepSpeed carried as a wheel; skipped without CUDA or DeepSpeed (the two-GPU test
also without a second GPU). The ranks of the ZeRO-3 test are plain processes with torchrun-style rendezvous (no Ray).
"""

import copy
import math
import re

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.types import Trajectory
from tests.zero_norms import record_both_norms

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.gpu_memory_heavy]

LENGTHS = (1500, 300, 900, 2100, 640, 1200, 80, 1700)  # 8.4K tokens in two GRPO groups
PACKED = sum(n - 1 for n in LENGTHS)  # each sequence trains on its tokens[:-1] → tokens[1:]


def make_batch(vocab: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    batch = []
    for i, length in enumerate(LENGTHS):
        t = Trajectory(trajectory_id=f"t{i}", task_id=f"g{i // 4}", group_id=f"g{i // 4}", env_id="toy",
                       reward=float(i % 3))
        t.append_prompt(rng.integers(0, vocab, 20).tolist())
        t.append_sampled(rng.integers(0, vocab, length - 20).tolist(), (-10.0 - rng.random(length - 20)).tolist(),
                         version=0)
        batch.append(t)
    return batch


def trainer_config(run_dir: str, zero_stage: int):
    from agentrl.trainer import TrainerConfig

    return TrainerConfig(run_dir=run_dir, zero_stage=zero_stage, dtype="bf16", lr=1e-4, micro_batch_tokens=4096,
                         zero3_param_persistence_threshold=0, dist_timeout_s=300.0)


def reference_loss(batch: list[Trajectory], loss_cfg) -> float:
    """The first step's loss of the same initial weights in one plain bf16 process on GPU (no DeepSpeed)."""
    from agentrl.trainer.batching import plan_step
    from agentrl.trainer.forward import PackedPolicy, micro_batch_loss
    from agentrl.trainer.losses import grpo_advantages

    torch.manual_seed(0)  # PolicyTrainer builds a model from a config with config.seed (0)
    model = HybridMoEForCausalLM(preset_config("small")).to("cuda", torch.bfloat16).train()
    model.gradient_checkpointing_enable()
    plan = plan_step(batch, grpo_advantages(batch, normalize_std=loss_cfg.normalize_adv_std), world_size=1,
                     token_budget=4096, aggregation=loss_cfg.aggregation, norm_constant=loss_cfg.norm_constant,
                     num_moe_layers=len(model.moe_layers))
    with torch.no_grad():
        return sum(micro_batch_loss(PackedPolicy(model), m, loss_cfg, device="cuda").loss.item()
                   for m in plan.per_rank[0])


def test_small_preset_deepspeed_step_on_one_gpu(tmp_path):
    from agentrl.trainer import PolicyTrainer

    trainer = PolicyTrainer(trainer_config(str(tmp_path), zero_stage=2), preset_config("small"))
    try:
        assert trainer.backend == "nccl" and trainer.device.type == "cuda"
        batch = make_batch(trainer.policy.config.vocab_size)
        probe = next(p for n, p in trainer.policy.named_parameters() if "q_proj" in n)
        before = probe.detach().float().clone()
        first = trainer.step(batch)
        second = trainer.step(batch)
        for m in (first, second):
            assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
            assert m["packed_tokens"] == PACKED and m["micro_batches"] >= 2
        assert not torch.equal(probe.detach().float(), before)  # the optimizer stepped the bf16 weights
        assert first["loss"] == pytest.approx(reference_loss(batch, trainer.config.loss), rel=2e-2, abs=1e-3)
        assert second["version"] == 2
    finally:
        trainer.close()


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_the_one_pass_gradient_norm_is_deepspeeds_on_cuda(tmp_path, zero_stage):
    """The multi-tensor kernel behind trainer/zero.py's gradient norm (CUDA's fast path, bf16 gradients accumulated
    in fp64) gives DeepSpeed's per-tensor norm for every parameter group of the `small` preset, ZeRO-2 and 3."""
    from agentrl.trainer import PolicyTrainer

    trainer = PolicyTrainer(trainer_config(str(tmp_path), zero_stage=zero_stage), preset_config("small"))
    try:
        seen = record_both_norms(trainer.engine.optimizer)
        trainer.step(make_batch(trainer.policy.config.vocab_size))
    finally:
        trainer.close()
    assert seen and all(fused > 0 for fused, _ in seen)
    assert [fused for fused, _ in seen] == pytest.approx([per for _, per in seen], rel=1e-7)


def _foreach_twin(optimizer):
    """A foreach AdamW over clones of `optimizer`'s parameters, gradients and state, with its hyperparameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    clones = {p: p.detach().clone().requires_grad_() for p in params}
    for p, c in clones.items():
        c.grad = p.grad.clone()
    twin = torch.optim.AdamW([{**{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")},
                               "params": [clones[p] for p in g["params"]]} for g in optimizer.param_groups],
                             foreach=True)
    for p, c in clones.items():  # the foreach path keeps its step counts on the host
        twin.state[c] = {k: v.clone().cpu() if k == "step" else v.clone() for k, v in optimizer.state[p].items()}
    return twin, clones


def test_on_cuda_the_optimizer_is_torchs_fused_adamw_and_steps_as_the_foreach_one(tmp_path):
    """PolicyTrainer asks for the fused AdamW on a GPU (the foreach one holds a temporary the size of ZeRO's flat
    fp32 partition in its step), and each of two ZeRO-2 steps of the `small` preset moves the fp32 master weights
    where the foreach AdamW moves them from the same weights, gradients and moments."""
    from agentrl.trainer import PolicyTrainer

    trainer = PolicyTrainer(trainer_config(str(tmp_path), zero_stage=2), preset_config("small"))
    try:
        inner = trainer.engine.optimizer.optimizer
        assert all(g["fused"] for g in inner.param_groups)
        fused_step, stepped = inner.step, []

        def step_beside_the_twin(*args, **kwargs):
            twin, clones = _foreach_twin(inner)
            out = fused_step(*args, **kwargs)
            twin.step()
            stepped.append([(p.detach().clone(), c.detach()) for p, c in clones.items()])
            return out

        inner.step = step_beside_the_twin
        batch = make_batch(trainer.policy.config.vocab_size)
        trainer.step(batch)
        trainer.step(batch)
    finally:
        trainer.close()
    assert len(stepped) == 4  # DeepSpeed steps the decay and no-decay groups one at a time, twice
    for pairs in stepped:
        for fused, foreach in pairs:
            torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-8)


def test_a_foreach_adamw_state_resumed_into_the_fused_kernel_steps_as_the_foreach_one():
    """A checkpoint of the foreach AdamW (a CPU run's, or one saved before the trainer chose the fused kernel) keeps
    its step counts on the host; torch's `load_state_dict` brings its flags along. After `keep_adamw_implementation`
    the GPU's optimizer is fused, its counts on the device in fp32 where the fused kernel reads them, and it steps
    from the loaded state where the foreach optimizer steps."""
    from agentrl.trainer.policy_trainer import keep_adamw_implementation

    torch.manual_seed(0)
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in (4096, 333, 1)]
    saving = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p)
    saving.step()
    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = torch.optim.AdamW(resumed_params, lr=1e-2, weight_decay=0.1, fused=True)
    resumed.load_state_dict(copy.deepcopy(saving.state_dict()))  # as from a file: no tensor shared
    assert resumed.param_groups[0]["fused"] is None  # the checkpoint's flag came with its state
    keep_adamw_implementation(resumed, torch.device("cuda"))
    assert resumed.param_groups[0]["fused"] is True
    counts = [resumed.state[p]["step"] for p in resumed_params]
    assert all(c.is_cuda and c.dtype == torch.float32 and c.item() == 1.0 for c in counts)
    for p, q in zip(params, resumed_params):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    saving.step()
    resumed.step()
    for p, q in zip(params, resumed_params):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


def test_under_zero3_fla_derives_its_chunk_indices_as_often_as_under_zero2(tmp_path):
    """fla caches the chunk indices it derives from cu_seqlens (with host syncs) by the tensor's identity; DeepSpeed's
    ZeRO-3 hooks hand each module an alias of its tensor arguments, and KDA maps them back (`layers.fla_offsets`). So
    fla's host syncs in a ZeRO-3 step are ZeRO-2's, not a pair for every layer and recomputation (session 31: 48
    under ZeRO-3 against 4)."""
    from agentrl.host_syncs import sync_sites
    from agentrl.trainer import PolicyTrainer

    fla_syncs = {}
    for stage in (2, 3):
        trainer = PolicyTrainer(trainer_config(str(tmp_path / f"zero{stage}"), zero_stage=stage),
                                preset_config("small"))
        try:
            batch = make_batch(trainer.policy.config.vocab_size)
            trainer.step(batch)  # the first step compiles and lets ZeRO-3 record its fetch order
            sites = sync_sites(lambda: trainer.step(batch))
        finally:
            trainer.close()
        fla_syncs[stage] = sum(n for site, n in sites.items() if site.caller.startswith("fla/"))
    assert fla_syncs[2] > 0, "fla's index construction no longer syncs: this test has nothing to compare"
    assert fla_syncs[3] == fla_syncs[2], fla_syncs


def test_the_zero2_step_waits_for_the_gpu_once_for_its_overflow_after_queuing_the_whole_step(tmp_path):
    """With the fused Adam on a GPU the step's skip is decided on the device (trainer/zero.py,
    `_overflow_read_after_the_step`): DeepSpeed's host tests of the norm (one before the optimizer, one in the clip
    for each parameter group) and the two of its masking helper in each group's norm are gone, and the step reads its
    overflow flag once, after its last launch."""
    from agentrl.host_syncs import sync_sites
    from agentrl.trainer import PolicyTrainer

    trainer = PolicyTrainer(trainer_config(str(tmp_path), zero_stage=2), preset_config("small"))
    try:
        batch = make_batch(trainer.policy.config.vocab_size)
        trainer.step(batch)
        sites = sync_sites(lambda: trainer.step(batch))
    finally:
        trainer.close()
    # DeepSpeed's own waits, and those of the norm, clip and step agentrl puts in its place (not the trainer's
    # metrics, read after the step: zero.py's all_reduce_sum)
    in_the_step = {re.sub(r":\d+ ", " ", site.caller): n for site, n in sites.items()  # without line numbers
                   if site.caller.startswith("deepspeed/runtime/") or site.caller.endswith(
                       (" step_then_read_overflow", " norm_and_found_inf", " clip_on_the_device", " _global_grad_norm"))}
    assert in_the_step == {"trainer/zero.py step_then_read_overflow": 1}, sites


def _fp32_master(optimizer) -> torch.Tensor:
    """ZeRO's fp32 master weights, flat, in one tensor (ZeRO-1/2 or ZeRO-3)."""
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_partitioned_groups_flat
    return torch.cat([f.detach().float().flatten() for f in flats])


def _steps_counting_host_waits(tmp_path, zero_stage: int, monkeypatch):
    """(the master weights' move over two steps, the steps' gradient norms, the device and stream synchronizes made
    inside the second step) of a fresh `small` trainer."""
    from agentrl.trainer import PolicyTrainer

    waits, counting = [], [False]
    device_sync, stream_sync = torch.cuda.synchronize, torch.cuda.Stream.synchronize

    def counted_device_sync(*args, **kwargs):
        waits.extend(["device"] if counting[0] else [])
        return device_sync(*args, **kwargs)

    def counted_stream_sync(stream):
        waits.extend(["stream"] if counting[0] else [])
        return stream_sync(stream)

    monkeypatch.setattr(torch.cuda, "synchronize", counted_device_sync)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", counted_stream_sync)
    trainer = PolicyTrainer(trainer_config(str(tmp_path), zero_stage=zero_stage), preset_config("small"))
    try:
        batch = make_batch(trainer.policy.config.vocab_size)
        before = _fp32_master(trainer.engine.optimizer)
        norms = [trainer.step(batch)["grad_norm"]]  # the first: ZeRO-3 records its fetch order
        counting[0] = True
        norms.append(trainer.step(batch)["grad_norm"])
        counting[0] = False
        moved = _fp32_master(trainer.engine.optimizer) - before
    finally:
        trainer.close()
    return moved, norms, waits


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_step_never_holds_the_host_until_the_gpu_is_idle_and_trains_as_with_deepspeeds_waits(
        tmp_path, zero_stage, monkeypatch):
    """DeepSpeed held the host until the GPU had run everything queued at each backward's end (ZeRO-2 synchronized
    the device, ZeRO-3 its reduction stream) and, under ZeRO-3 on one rank, at each module's parameter fetch, which
    gathers nothing there (trainer/zero.py: `_epilogue_without_a_host_wait`, `_unsharded_fetches_without_a_host_wait`).
    A step (two micro-batches) now makes no device or stream synchronize, and two steps move the fp32 master weights
    as with DeepSpeed's waits from the same weights and batch: a step that read its gradients before the last
    reduction landed would not."""
    from deepspeed.runtime.zero import partition_parameters

    from agentrl.trainer import zero

    moved, norms, waits = _steps_counting_host_waits(tmp_path / "queued", zero_stage, monkeypatch)
    assert waits == []
    monkeypatch.setattr(zero, "_epilogue_without_a_host_wait", lambda optimizer: None)
    monkeypatch.setattr(zero, "_unsharded_fetches_without_a_host_wait", lambda optimizer: None)
    for handle in (partition_parameters.NoGatherHandle, partition_parameters.NoGatherCoalescedHandle):
        monkeypatch.setattr(handle, "wait", getattr(handle.wait, "deepspeed_wait", handle.wait))
    moved_ds, norms_ds, waits_ds = _steps_counting_host_waits(tmp_path / "ds", zero_stage, monkeypatch)
    assert len(waits_ds) >= 2, "DeepSpeed no longer waits: this test has nothing to compare"
    assert norms == pytest.approx(norms_ds, rel=1e-2)
    # the backward's kernels are not bitwise deterministic (fla's atomics), and Adam's first steps move each weight
    # by about the learning rate whatever the gradient's size: compare the moves as vectors
    assert (moved - moved_ds).norm() <= 0.05 * moved_ds.norm()
    assert torch.nn.functional.cosine_similarity(moved, moved_ds, dim=0) > 0.99


def _zero3_rank(rank: int, world_size: int, port: int, run_dir: str, results) -> None:
    import faulthandler

    from agentrl.trainer import PolicyTrainer

    faulthandler.dump_traceback_later(280, exit=True)  # a hung collective prints where each rank waits

    trainer = PolicyTrainer(trainer_config(run_dir, zero_stage=3), preset_config("small"), rank=rank,
                            world_size=world_size, master_port=port)
    batch = make_batch(trainer.policy.config.vocab_size)
    metrics = [trainer.step(batch), trainer.step(batch)]
    digest = trainer.replica_checksum()
    state = trainer.full_state_dict()
    info = trainer.info()
    trainer.close()
    results.put((rank, metrics, digest, info, None if state is None else len(state)))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_zero3_over_two_gpus_trains_as_one_batch(tmp_path):
    from agentrl.trainer import TrainerConfig
    from agentrl.net import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_zero3_rank, args=(r, 2, port, str(tmp_path), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, metrics, digest, info, num_keys = results.get(timeout=300)
            got[rank] = (metrics, digest, info, num_keys)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    (m0, d0, i0, k0), (m1, d1, i1, k1) = got[0], got[1]
    timing = ("step_s", "tokens_per_s")
    for a, b in zip(m0, m1):  # every rank reports the global metrics
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    assert d0 == d1  # the gathered full weights and QB biases agree across ranks
    assert i0["backend"] == "nccl" and i0["device"] == "cuda:0" and i1["device"] == "cuda:1"
    assert i0["parameters"] == i1["parameters"] > 0  # full sizes, not shards
    assert k0 is not None and k1 is None  # full state dict on rank 0 only
    assert m0[0]["packed_tokens"] == PACKED and math.isfinite(m0[1]["loss"])
    batch = make_batch(preset_config("small").vocab_size)
    loss_cfg = TrainerConfig(run_dir=str(tmp_path)).loss
    assert m0[0]["loss"] == pytest.approx(reference_loss(batch, loss_cfg), rel=2e-2, abs=1e-3)
