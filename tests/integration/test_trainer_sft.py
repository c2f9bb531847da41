"""The plain PolicyTrainer without Ray: one rank, ZeRO-2: supervised warm start (SFT) on oracle trajectories, and
PPO mini-batches (several optimizer steps per batch against the recorded pre-step policy)."""

import numpy as np
import pytest
import torch

from agentrl.trainer import LossConfig, PolicyTrainer, TrainerConfig
from agentrl.types import Trajectory
from tests.integration.test_trainer import model_dir  # noqa: F401
from tests.zero_norms import record_both_norms


def oracle(i: int, rng: np.random.Generator) -> Trajectory:
    """A prompt of random tokens, then the 'answer' the oracle always gives: the prompt's first 6 tokens + 1."""
    t = Trajectory(trajectory_id=f"o{i}", task_id=f"o{i}", group_id=f"o{i}", env_id="oracle")
    prompt = rng.integers(0, 500, 8).tolist()
    t.append_prompt(prompt)
    t.append_sampled([x + 1 for x in prompt[:6]], [0.0] * 6, version=0)  # no behaviour policy: logprobs unused
    t.append_prompt([511])  # a tool/template token: never trained
    return t


def one_rank_trainer(model_path: str, run_dir, **overrides) -> PolicyTrainer:
    """A ZeRO-2 trainer on one rank, lr 3e-3, no checkpointing; `overrides` name what a test changes."""
    base = dict(run_dir=str(run_dir), zero_stage=2, lr=3e-3, micro_batch_tokens=128, num_threads=1,
                gradient_checkpointing=False)
    return PolicyTrainer(TrainerConfig(**{**base, **overrides}), model_path)


def test_sft_warm_start_lowers_the_nll_of_the_masked_tokens_only(model_dir, tmp_path):  # noqa: F811
    trainer = one_rank_trainer(model_dir, tmp_path)  # an RL trainer: the warm start passes the SFT loss per step
    sft = LossConfig(kind="sft")
    try:
        batch = [oracle(i, np.random.default_rng(i)) for i in range(16)]
        with pytest.raises(ValueError, match="reference"):
            trainer.step(batch, LossConfig(kind="sft", kl_coef=0.1))
        first = trainer.step(batch, sft)
        assert first["trained_tokens"] == 16 * 6  # the answers; never the prompt or the trailing tool token
        assert first["nll"] == pytest.approx(first["loss"] * 1.0, rel=1e-5)  # token-mean NLL is the SFT loss
        history = [first["nll"]] + [trainer.step(batch, sft)["nll"] for _ in range(24)]
        assert history[-1] < 0.5 * history[0], history
        assert trainer.version == 25
        # the driver's warm start trains at algorithm.sft_lr, then hands RL the trainer's lr
        assert first["lr"] == pytest.approx(3e-3)
        trainer.set_lr(1e-3)
        assert trainer.step(batch, sft)["lr"] == pytest.approx(1e-3)
        with pytest.raises(ValueError, match="lr"):
            trainer.set_lr(0.0)
        published = trainer.publish_weights()
        assert published.version == 26 and published.path.endswith("weights/v26")
    finally:
        trainer.close()


def test_after_a_warm_start_the_kl_reference_is_the_warm_started_policy(model_dir, tmp_path):  # noqa: F811
    trainer = one_rank_trainer(model_dir, tmp_path, loss=LossConfig(kl_coef=0.1))
    try:
        batch = [oracle(i, np.random.default_rng(i)) for i in range(8)]
        for t in batch:
            t.reward = float(int(t.trajectory_id[1:]) % 2)
            t.group_id = "g"  # one GRPO group with a reward spread
        assert trainer.step(batch)["kl"] == pytest.approx(0.0, abs=1e-6)  # still the initial weights
        for _ in range(5):
            trainer.step(batch, LossConfig(kind="sft"))
        assert trainer.step(batch)["kl"] > 1e-3  # measured against the initial weights, far from the SFT policy
        trainer.reset_reference()
        assert trainer.step(batch)["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the policy again
    finally:
        trainer.close()


def test_a_resumed_run_keeps_the_warm_started_kl_reference(model_dir, tmp_path):  # noqa: F811
    """The reference a warm start reset is saved with the run: a trainer resumed from a later checkpoint measures
    its KL against the SFT policy, as the uninterrupted one does, not against the weights it was built from."""
    batch = [oracle(i, np.random.default_rng(i)) for i in range(8)]
    for t in batch:
        t.reward = float(int(t.trajectory_id[1:]) % 2)
        t.group_id = "g"
    trainer = one_rank_trainer(model_dir, tmp_path, loss=LossConfig(kl_coef=0.1))
    try:
        for _ in range(5):
            trainer.step(batch, LossConfig(kind="sft"))
        trainer.reset_reference()
        trainer.step(batch)
        trainer.save_checkpoint({"rl_step": 1})
        uninterrupted = trainer.step(batch)["kl"]
    finally:
        trainer.close()
    resumed = one_rank_trainer(model_dir, tmp_path, loss=LossConfig(kl_coef=0.1))
    try:
        assert resumed.load_checkpoint()["rl_step"] == 1
        kl = resumed.step(batch)["kl"]
    finally:
        resumed.close()
    # (against the initial weights the resumed KL would be several times larger: the SFT moved the policy far)
    assert kl == pytest.approx(uninterrupted, rel=1e-3, abs=1e-7)


def test_mini_batches_step_several_times_against_the_recorded_pre_step_policy(model_dir, tmp_path):  # noqa: F811
    trainer = one_rank_trainer(model_dir, tmp_path, micro_batch_tokens=64, loss=LossConfig(mini_batches=2))
    try:
        batch = [oracle(i, np.random.default_rng(i)) for i in range(16)]
        for t in batch:
            t.reward = float(int(t.trajectory_id[1:]) % 3 == 0)
            t.group_id = f"g{int(t.trajectory_id[1:]) // 4}"  # four groups of four, rewards spread in each
        before = {tuple(t.tokens[:-1]): lp[1:] for t, lp in zip(batch, trainer.logprobs(batch))}
        recorded = []
        record = trainer._record_old_logprobs
        trainer._record_old_logprobs = lambda micro_batches: (record(micro_batches), recorded.extend(micro_batches))
        m = trainer.step(batch)
        assert m["optimizer_steps"] == 2 and m["version"] == 1 and m["num_sequences"] == 16
        assert m["micro_batches"] >= 2
        # π_old of every trained token is the policy before the first update, whichever mini-batch it trains in
        seen = 0
        for micro in recorded:
            cu = micro.cu_seqlens.tolist()
            for j in range(len(cu) - 1):
                want = before[tuple(micro.input_ids_T[cu[j]:cu[j + 1]].tolist())]
                assert micro.old_logprobs_T[cu[j]:cu[j + 1]].numpy() == pytest.approx(want, abs=1e-5)
                seen += 1
        assert seen == 16
        # the second mini-batch trains a moved policy: its ratios leave 1 (the one-update step's are exactly 1)
        assert abs(m["ratio_mean"] - 1.0) > 1e-4
        single = trainer.step(batch, LossConfig())
        assert single["optimizer_steps"] == 1 and single["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    finally:
        trainer.close()


def _step_and_weights(trainer: PolicyTrainer, batch) -> tuple[float, list[torch.Tensor]]:
    """One SFT step's loss, and the fp32 master weights after it."""
    loss = trainer.step(batch, LossConfig(kind="sft"))["loss"]
    return loss, [g.detach().clone() for g in trainer.engine.optimizer.single_partition_of_fp32_groups]


def _assert_same_step(got, want) -> None:
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for master, expected in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(master, expected, rtol=1e-5, atol=1e-7)


def test_a_resumed_run_steps_with_the_adamw_kernel_its_own_machine_chose(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """torch's `load_state_dict` takes the kernel flags with the optimizer's state. A run saved with CPU's default
    AdamW resumes with the fused kernel where that is the trainer's choice (a GPU's; CPU has the kernel too, so it is
    forced here), its step counts where that kernel reads them, and takes the step the saving kernel takes from the
    same state; a run saved with the fused kernel resumes with the default one the same way. (In bf16 the fused
    kernel also skips a non-finite step on the device, trainer/zero.py: its finite steps are the default's.)"""
    from agentrl.trainer import policy_trainer

    batch = [oracle(i, np.random.default_rng(i)) for i in range(8)]
    checkpoints = tmp_path / "checkpoints"

    def resume(tag: str, steps_taken: int):
        trainer = one_rank_trainer(model_dir, tmp_path, dtype="bf16")
        trainer.load_checkpoint(str(checkpoints / tag))
        groups = trainer.optimizer.param_groups
        wanted = policy_trainer.adamw_implementation(trainer.device).get("fused")
        assert [(g["fused"], g["foreach"]) for g in groups] == [(wanted, None)] * len(groups)
        counts = [trainer.optimizer.state[p]["step"] for g in groups for p in g["params"]]
        assert counts and all(c.dtype == torch.float32 and c.item() == steps_taken for c in counts)
        return trainer

    saving = one_rank_trainer(model_dir, tmp_path, dtype="bf16")
    try:
        _step_and_weights(saving, batch)
        saving.save_checkpoint({})
        assert not any(g["fused"] for g in saving.optimizer.param_groups)
        after_step1 = _step_and_weights(saving, batch)
    finally:
        saving.close()

    chosen = policy_trainer.adamw_implementation
    monkeypatch.setattr(policy_trainer, "adamw_implementation", lambda device: {"fused": True})
    fused = resume("step1", steps_taken=1)
    try:
        _assert_same_step(_step_and_weights(fused, batch), after_step1)
        fused.save_checkpoint({})  # saved with the fused flag
        after_step2 = _step_and_weights(fused, batch)
    finally:
        fused.close()

    monkeypatch.setattr(policy_trainer, "adamw_implementation", chosen)
    plain = resume("step2", steps_taken=2)
    try:
        _assert_same_step(_step_and_weights(plain, batch), after_step2)
    finally:
        plain.close()


@pytest.mark.parametrize("dtype, kernel", [("bf16", "default"), ("bf16", "fused"), ("fp32", "default")])
def test_a_step_whose_gradient_is_not_finite_changes_nothing_and_the_next_one_trains(model_dir, tmp_path,  # noqa: F811
                                                                                      monkeypatch, dtype, kernel):
    """One inf in one gradient: DeepSpeed skips the optimizer step (under bf16 agentrl leaves that test to the
    global norm alone, and with the fused Adam kernel, a GPU's, to the device: trainer/zero.py says why; CPU has the
    kernel too, so it is forced here), the weights, Adam's state and the learning-rate schedule stay, the metrics say
    so; the next step trains."""
    from agentrl.trainer import policy_trainer

    if kernel == "fused":
        monkeypatch.setattr(policy_trainer, "adamw_implementation", lambda device: {"fused": True})
    trainer = one_rank_trainer(model_dir, tmp_path, dtype=dtype, warmup_steps=10)
    sft = LossConfig(kind="sft")
    adam = trainer.optimizer
    try:
        assert all(bool(g["fused"]) == (kernel == "fused") for g in adam.param_groups)
        batch = [oracle(i, np.random.default_rng(i)) for i in range(8)]
        params = dict(trainer.policy.named_parameters())

        def poison(grad):
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        trainer.step(batch, sft)  # Adam's state exists from here on
        before = {name: p.detach().clone() for name, p in params.items()}
        adam_before = [{k: v.clone() for k, v in adam.state[p].items()} for g in adam.param_groups for p in g["params"]]
        lr_before = trainer.engine.get_lr()
        hook = params["model.layers.0.self_attn.q_proj.weight"].register_hook(poison)
        skipped = trainer.step(batch, sft)
        hook.remove()
        assert skipped["optimizer_steps_skipped"] == 1 and not np.isfinite(skipped["grad_norm"])
        assert all(torch.equal(p.detach(), before[name]) for name, p in params.items())
        adam_after = [adam.state[p] for g in adam.param_groups for p in g["params"]]
        for was, now in zip(adam_before, adam_after, strict=True):
            assert was.keys() == now.keys() and all(torch.equal(was[k], now[k]) for k in was)
        assert trainer.engine.get_lr() == lr_before  # the warm-up did not advance over the skipped step
        trained = trainer.step(batch, sft)
        assert trained["optimizer_steps_skipped"] == 0 and np.isfinite(trained["grad_norm"])
        assert trained["nll"] == pytest.approx(skipped["nll"], rel=1e-2)  # the skipped step left the weights
        assert not torch.equal(params["model.layers.0.self_attn.q_proj.weight"].detach(),
                               before["model.layers.0.self_attn.q_proj.weight"])
    finally:
        trainer.close()


@pytest.mark.parametrize("zero_stage, dtype", [(2, "bf16"), (2, "fp32"), (3, "bf16")])
def test_the_one_pass_gradient_norm_is_deepspeeds_per_tensor_norm(model_dir, tmp_path, zero_stage, dtype):  # noqa: F811
    """trainer/zero.py computes the global gradient norm with one multi-tensor kernel (ZeRO-2 and ZeRO-3): on the
    same gradients it gives what DeepSpeed's per-tensor method gives for each parameter group, finite and (one inf
    in one gradient) the -1 that marks an overflow."""
    trainer = one_rank_trainer(model_dir, tmp_path, dtype=dtype, zero_stage=zero_stage)
    sft = LossConfig(kind="sft")
    try:
        seen = record_both_norms(trainer.engine.optimizer)
        batch = [oracle(i, np.random.default_rng(i)) for i in range(8)]
        trainer.step(batch, sft)
        finite = list(seen)
        weight = dict(trainer.policy.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
        hook = weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("inf")))
        trainer.step(batch, sft)
        hook.remove()
    finally:
        trainer.close()
    assert finite and all(fused > 0 for fused, _ in finite)
    assert [fused for fused, _ in finite] == pytest.approx([per for _, per in finite], rel=1e-6)
    poisoned = seen[len(finite):]  # the group that holds the weight: -1 from both; the others agree as before
    assert [fused for fused, _ in poisoned] == pytest.approx([per for _, per in poisoned], rel=1e-6)
    assert (-1.0, -1.0) in poisoned


def test_under_zero3_every_kda_layer_hands_fla_one_offsets_object(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """fla caches the chunk indices it derives from cu_seqlens (host syncs) by the tensor's identity. DeepSpeed's
    ZeRO-3 hooks hand each module its own alias of every tensor argument, so each KDA layer had a new object and fla
    rebuilt the indices for every layer; KDA now maps an alias back to the offsets it stands for
    (`layers.fla_offsets`): one object for every layer of the forward and of its recomputation."""
    from agentrl.model import kda

    seen = []
    kernel = kda.KimiDeltaAttention._kernel

    def recording(self, q, k, v, g, beta, initial, use_cache, cu_seqlens):
        seen.append(cu_seqlens)  # kept alive, so no two distinct objects share an id
        return kernel(self, q, k, v, g, beta, initial, use_cache, cu_seqlens)

    monkeypatch.setattr(kda.KimiDeltaAttention, "_kernel", recording)
    trainer = one_rank_trainer(model_dir, tmp_path, zero_stage=3, gradient_checkpointing=True)
    try:
        kda_layers = sum(layer.is_kda for layer in trainer.policy.model.layers)
        trainer.step([oracle(i, np.random.default_rng(i)) for i in range(4)], LossConfig(kind="sft"))
    finally:
        trainer.close()
    assert len(seen) == 2 * kda_layers  # the forward and the recomputation under the backward
    assert len({id(offsets) for offsets in seen}) == 1


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_balancers_count_each_token_once_per_step(model_dir, tmp_path, checkpointing):  # noqa: F811
    """Gradient checkpointing runs every layer's forward again in the backward; the routers' balancers observe the
    forward only, so a step's load counts each packed token top_k times per MoE layer either way."""
    trainer = one_rank_trainer(model_dir, tmp_path, gradient_checkpointing=checkpointing)
    try:
        metrics = trainer.step([oracle(i, np.random.default_rng(i)) for i in range(4)], LossConfig(kind="sft"))
        top_k = trainer.policy.config.num_experts_per_token
        for moe in trainer.policy.moe_layers:
            assert moe.gate.balancer.last_stats.load_E.sum().item() == metrics["packed_tokens"] * top_k
    finally:
        trainer.close()


def test_under_zero3_no_parameter_is_found_only_on_access(model_dir, tmp_path):  # noqa: F811
    """ZeRO-3 gathers a module's parameters when its forward runs; a forward that reads a weight of another module's
    makes DeepSpeed gather that weight alone on access and register it as the reader's external parameter. The
    leaf modules and external parameters of `zero.prepare_zero3` cover every such read: after a step the only
    external parameters are the ones it registers (the log-prob head's weight, Block AttnRes's norms and queries)."""
    trainer = one_rank_trainer(model_dir, tmp_path, zero_stage=3, gradient_checkpointing=True,
                               zero3_param_persistence_threshold=0)
    try:
        trainer.step([oracle(i, np.random.default_rng(i)) for i in range(4)], LossConfig(kind="sft"))
        names = {id(p): n for n, p in trainer.engine.module.named_parameters()}
        found = sorted(names[id(p)] for m in trainer.engine.module.modules()
                       for p in getattr(m, "_external_params", {}).values())
    finally:
        trainer.close()
    assert found, "the registered external parameters are missing"
    assert all(n.endswith("lm_head.weight") or "_res_norm." in n or "_res_proj." in n for n in found), found


def test_zero3_on_one_rank_lifts_the_bound_its_fetches_put_on_the_host(model_dir, tmp_path):  # noqa: F811
    """At one rank a ZeRO-3 fetch gathers nothing (the partition is the parameter), so the bound DeepSpeed puts on
    fetches in flight (past two, the host waits for the oldest: a bound on gathered memory) only holds the host back;
    trainer/zero.py lifts it, and its fetch handles keep DeepSpeed's wait for a partition that lives elsewhere. This
    checks the DeepSpeed names it reaches into, which a DeepSpeed upgrade could rename (the waits themselves are CUDA's:
    tests/gpu/test_trainer_deepspeed.py counts them)."""
    import sys

    from deepspeed.runtime.zero import partition_parameters

    trainer = one_rank_trainer(model_dir, tmp_path, zero_stage=3, gradient_checkpointing=True)
    try:
        coordinator = trainer.engine.optimizer.parameter_offload.get_param_coordinator()
        assert coordinator._PartitionedParameterCoordinator__max_ongoing_fetch_events == sys.maxsize
        for handle in (partition_parameters.NoGatherHandle, partition_parameters.NoGatherCoalescedHandle):
            assert callable(handle.wait.deepspeed_wait) and handle.wait.deepspeed_wait is not handle.wait
        metrics = trainer.step([oracle(i, np.random.default_rng(i)) for i in range(4)], LossConfig(kind="sft"))
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    finally:
        trainer.close()
