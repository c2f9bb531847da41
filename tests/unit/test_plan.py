"""agentrl plan: counts against the built model, memory arithmetic by hand, layouts that fit or are refused."""

import json
import re

import pytest
import torch

from agentrl.cli import main
from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.plan import (
    COLLECTIVE_EFFICIENCY,
    BYTES_GRAD,
    BYTES_OPTIMIZER,
    BYTES_WEIGHT,
    COMPONENTS,
    H200_BF16_TFLOPS,
    SMALL_TRAIN_TOKENS_PER_S,
    Cluster,
    Layout,
    Workload,
    activation_scale,
    calibrated_efficiency,
    count_parameters,
    decode_state_bytes,
    decode_throughput,
    flops_per_token,
    make_plan,
    memory_by_stage,
    memory_per_gpu,
    smallest_cluster,
    step_time,
    weight_gather_s,
    weight_sync_s,
    trainer_supports,
)


def component_of(name: str, config) -> str:
    """Which plan component a parameter of HybridMoEForCausalLM belongs to, from its checkpoint name."""
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if "_res_norm." in name or "_res_proj." in name or name.startswith("model.output_attn_res"):
        return "attn_res"
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match and ".self_attn." in name:
        return "kda" if config.is_kda_layer(int(match.group(1))) else "mla"
    for part, comp in ((".mlp.", "dense_mlp"), (".block_sparse_moe.experts.", "routed_experts"),
                       (".block_sparse_moe.shared_experts.", "shared_experts"), (".block_sparse_moe.gate.", "router"),
                       (".block_sparse_moe.routed_expert_", "latent_proj")):
        if part in name:
            return comp
    assert "layernorm" in name or name == "model.norm.weight", name
    return "norms"


@pytest.mark.parametrize("preset,overrides", [
    ("tiny", {}),
    ("tiny", {"attn_res_block_size": None, "q_lora_rank": 16}),
    ("small", {}),
    ("kimi-linear-48b-a3b", {}),  # low-rank KDA gate, no output gate on MLA, no AttnRes
    ("k3", {}),
])
def test_counts_match_the_built_model_component_by_component(preset, overrides):
    config = preset_config(preset, **overrides)
    with torch.device("meta"):
        model = HybridMoEForCausalLM(config)
    built = dict.fromkeys(COMPONENTS, 0)
    for name, param in model.named_parameters():
        built[component_of(name, config)] += param.numel()
    counts = count_parameters(config)
    assert counts.total == built
    assert (counts.num_total, counts.num_active) == model.parameter_counts()


def test_k3_counts_are_the_published_totals():
    counts = count_parameters(preset_config("k3"))
    assert round(counts.num_total / 1e12, 2) == 2.78 and round(counts.num_active / 1e9, 1) == 104.2
    assert counts.active["routed_experts"] * 896 == counts.total["routed_experts"] * 16


# tiny without AttnRes, by hand: D=64, V=512; layers 0-2 KDA (2 heads of 16, conv 4), layer 3 MLA; layer 0 dense.
KDA = 3 * 64 * 32 + 3 * 32 * 4 + 64 * 16 + 16 * 32 + 2 + 32 + 64 * 2 + 64 * 32 + 16 + 32 * 64  # 12,338
MLA = 64 * 2 * 24 + 64 * 40 + 32 + 32 * 2 * 32 + 64 * 2 * 16 + 2 * 16 * 64  # 11,808
MOE_DENSE = 8 * 64 + 3 * 64 * 32  # router + one shared expert
EXPERTS = 8 * 3 * 32 * 64  # 8 routed experts: w13 [2·32, 64] and w2 [64, 32]
NORMS = 2 * 64
STAGE1_DENSE = (KDA + MOE_DENSE + NORMS) + (MLA + MOE_DENSE + NORMS) + 512 * 64 + 64  # layers 2, 3, lm_head, norm
STAGE1_EXPERTS = 2 * EXPERTS


def test_tiny_hand_count():
    counts = count_parameters(preset_config("tiny", attn_res_block_size=None))
    assert counts.total["kda"] == 3 * KDA and counts.total["mla"] == MLA
    assert counts.total["routed_experts"] == 3 * EXPERTS and counts.active["routed_experts"] == 3 * EXPERTS * 2 // 8


@pytest.mark.parametrize("zero,weights,grads,optim", [
    # PP 2 × DP 2, EP 2: the dense part's ZeRO group is 2 ranks, each GPU holds half the experts, expert DP 1
    (1, STAGE1_DENSE + STAGE1_EXPERTS / 2, STAGE1_DENSE + STAGE1_EXPERTS / 2, STAGE1_DENSE / 2 + STAGE1_EXPERTS / 2),
    (2, STAGE1_DENSE + STAGE1_EXPERTS / 2, STAGE1_DENSE / 2 + STAGE1_EXPERTS / 2,
     STAGE1_DENSE / 2 + STAGE1_EXPERTS / 2),
    (3, STAGE1_DENSE / 2 + STAGE1_EXPERTS / 2, STAGE1_DENSE / 2 + STAGE1_EXPERTS / 2,
     STAGE1_DENSE / 2 + STAGE1_EXPERTS / 2),
])
def test_memory_arithmetic_by_hand(zero, weights, grads, optim):
    config = preset_config("tiny", attn_res_block_size=None)
    workload = Workload(context=256, tokens_per_step=4096)
    mem = memory_per_gpu(config, Layout(pp=2, dp=2, cp=1, ep=2, zero=zero), workload)
    assert mem.stage == 1 and mem.layers == (2, 3)  # the last stage: lm_head and the logits chunk
    assert mem.weights == BYTES_WEIGHT * weights
    assert mem.gradients == BYTES_GRAD * grads
    assert mem.optimizer == BYTES_OPTIMIZER * optim
    # checkpointed bf16 inputs of 2 sub-layers × 2 layers, 256 tokens, one micro-batch in flight on the last stage
    assert mem.activations_stored == 2 * 2 * 2 * 64 * 256
    assert mem.logits == 3 * 4 * 256 * 512  # the whole 256-token micro-batch is one chunk of the head at V = 512


def test_first_pipeline_stage_holds_pp_micro_batches_and_cp_splits_them():
    config = preset_config("tiny", attn_res_block_size=None)
    work = Workload(context=256, tokens_per_step=8 * 256)  # 8 micro-batches
    per_layer = 2 * 2 * 64 * 256  # two checkpointed bf16 sub-layer inputs per token
    base = memory_by_stage(config, Layout(pp=4, dp=1, cp=1), work)
    assert [m.activations_stored for m in base] == [4 * per_layer, 3 * per_layer, 2 * per_layer, per_layer]
    split = memory_by_stage(config, Layout(pp=4, dp=1, cp=2), work)
    assert [m.activations_stored for m in split] == [m.activations_stored / 2 for m in base]
    assert memory_per_gpu(config, Layout(pp=4, dp=1, cp=1), work).total == max(m.total for m in base)


def test_attn_res_mix_paths_by_hand():
    config = preset_config("tiny")  # AttnRes blocks of 2 layers, D = 64
    kept = {mode: memory_per_gpu(config, Layout(), Workload(context=256, attn_res_mix=mode)).activations_stored
            for mode in ("torch", "fused", "recomputed")}
    # sources per mix (attention, MLP) for layers 0-3: (1, 2), (2, 2), (2, 3), (3, 3); the final mix reads 3 and sits
    # outside every checkpoint (PyTorch form under "torch", the fused kernel otherwise)
    sources = [1, 2, 2, 2, 2, 3, 3, 3]
    torch_path = sum(2 * 4 * 64 * n for n in sources) + 2 * 4 * 64 * 3  # fp32 values and keys of each stack
    # recomputed: each mix's partial sum (a checkpoint input) and the 2 completed blocks stay alive, final mix fused
    recomputed = 8 * 2 * 64 + 2 * 2 * 64 + (2 * 64 + 2 * 4 * 3 + 4)
    assert kept["torch"] - kept["recomputed"] == (torch_path - recomputed) * 256
    # fused: the same tensors alive, plus fp32 rstd and logit per source and the log-sum-exp per mix
    assert kept["fused"] - kept["recomputed"] == sum(2 * 4 * n + 4 for n in sources) * 256
    with pytest.raises(ValueError, match="attn_res_mix='stacked'"):
        Workload(attn_res_mix="stacked")


def test_calibration_reproduces_the_measured_small_throughput():
    small = preset_config("small")
    for tokens, tokens_per_s in SMALL_TRAIN_TOKENS_PER_S.items():
        work = Workload(context=tokens, tokens_per_step=tokens, gradient_checkpointing=False)
        plan = make_plan(small, Cluster(num_gpus=1), work, with_decode=False)
        assert plan.time.tokens_per_step / plan.time.total_s == pytest.approx(tokens_per_s)
    e_dense, e_attention = calibrated_efficiency()
    assert 0 < e_dense < e_attention < 1  # the fused attention kernel runs nearer peak than the rest
    # with checkpointing every FLOP is done a third more often: 0.75 of the speed
    ckpt = make_plan(small, Cluster(num_gpus=1), Workload(context=32768, tokens_per_step=32768), with_decode=False)
    assert ckpt.time.tokens_per_step / ckpt.time.total_s == pytest.approx(0.75 * SMALL_TRAIN_TOKENS_PER_S[32768])


def test_step_time_accounting():
    small = preset_config("small")
    work = Workload(context=4096, tokens_per_step=2**20)
    one = step_time(small, Layout(), Cluster(num_gpus=1), work, mfu=0.1)
    eight = step_time(small, Layout(dp=8), Cluster(num_gpus=8), work, mfu=0.1)
    assert one.compute_s == pytest.approx(2**20 * sum(flops_per_token(small, 4096)) / (H200_BF16_TFLOPS * 1e12 * 0.1))
    assert one.mfu == pytest.approx(0.1) and not one.mfu_calibrated
    assert eight.compute_s == pytest.approx(one.compute_s / 8)
    assert one.expert_all_to_all_s == eight.expert_all_to_all_s == 0 and one.zero_collectives_s == 0
    ep = step_time(small, Layout(dp=8, ep=8), Cluster(num_gpus=8), work, mfu=0.1)
    assert ep.expert_all_to_all_s > 0 and ep.bubble_s == 0
    piped = step_time(small, Layout(pp=2, dp=4), Cluster(num_gpus=8), work, mfu=0.1)
    # 1F1B: 2^20 tokens / (4 replicas × 4096) = 64 micro-batches, the bubble is one more micro-batch per extra stage
    assert piped.bubble_s == pytest.approx(piped.compute_s / 64, rel=0.02)


def test_weight_gather_by_hand():
    small = preset_config("small", num_experts=64, num_experts_per_token=4)
    counts = count_parameters(small)
    expert = counts.total["routed_experts"]
    dense = counts.num_total - expert
    nvlink = Cluster(num_gpus=8).intra_node_gbytes_s * 1e9 * COLLECTIVE_EFFICIENCY
    assert weight_gather_s(small, Layout(dp=8, zero=2), Cluster(num_gpus=8)) == 0.0  # rank 0 holds it all
    # EP 8 under ZeRO-2: the other seven eighths of the routed experts arrive
    assert weight_gather_s(small, Layout(dp=8, ep=8, zero=2), Cluster(num_gpus=8)) == pytest.approx(
        expert * 7 / 8 * BYTES_WEIGHT / nvlink)
    # ZeRO-3 with EP 2: 1/8 of the dense weights and 1/2 · 1/4 of the experts are local
    assert weight_gather_s(small, Layout(dp=8, ep=2, zero=3), Cluster(num_gpus=8)) == pytest.approx(
        (dense * 7 / 8 + expert * 7 / 8) * BYTES_WEIGHT / nvlink)
    # across nodes the gathering GPU's NIC share bounds it
    two_nodes = Cluster(num_gpus=16)
    assert weight_gather_s(small, Layout(dp=16, ep=16, zero=2), two_nodes) == pytest.approx(
        expert * 15 / 16 * BYTES_WEIGHT / (two_nodes.inter_node_bytes_s_per_gpu * COLLECTIVE_EFFICIENCY))


def test_in_memory_sync_moves_each_gpus_engine_shard_in_parallel():
    """Every engine GPU gets its shard over its own link, then through CUDA IPC at the measured copy fraction."""
    from agentrl.plan.calibration import H200_HBM_TBPS, WEIGHT_IPC_COPY_FRACTION

    node = Cluster(num_gpus=8)
    shard = 40 * 2**30
    ipc = H200_HBM_TBPS * 1e12 / 2 * WEIGHT_IPC_COPY_FRACTION
    nvlink = node.intra_node_gbytes_s * 1e9 * COLLECTIVE_EFFICIENCY
    assert weight_sync_s(shard, 8, node) == pytest.approx(shard / nvlink + shard / ipc)
    many = Cluster(num_gpus=64)  # a replica over 16 GPUs spans two nodes: the NIC share is the link
    assert weight_sync_s(shard, 16, many) == pytest.approx(
        shard / (many.inter_node_bytes_s_per_gpu * COLLECTIVE_EFFICIENCY) + shard / ipc)
    # at K3 scale the stream costs seconds where gathering the weights onto one GPU cannot even fit
    k3 = make_plan(preset_config("k3"), Cluster(num_gpus=1024), Workload(context=1 << 17))
    assert k3.weight_sync_s < 10 < k3.weight_gather_s


def test_a_cp_rank_holds_the_whole_sequences_mla_keys_as_measured():
    """The last CP rank's MLA layer works over the whole sequence's keys: calibrated on the `small` preset at 256K
    tokens, CP = 2 (27.9 GiB above the weights measured on one H200), that term does not shrink with more ranks."""
    from agentrl.plan.calibration import CP_MLA_KV_FACTOR

    small = preset_config("small")
    work = Workload(context=262144, micro_batch_tokens=262144, tokens_per_step=262144)

    def above_weights(cp: int) -> float:
        m = memory_per_gpu(small, Layout(cp=cp), work, activation_scale())
        return (m.activations_stored + m.activations_transient + m.logits) / 2**30 + 0.59  # + the bf16 gradients

    assert above_weights(2) == pytest.approx(27.87, rel=0.01)
    kv = 2 * 16 * (64 + 64 + 64)  # bf16 × heads × (nope + rope + v)
    whole = CP_MLA_KV_FACTOR * kv * 262144 * activation_scale() / 2**30
    assert whole < above_weights(8) < above_weights(2)  # more ranks shrink the rest, never the whole-sequence term


def test_decode_state_by_hand():
    config = preset_config("tiny")
    # 3 KDA layers: [2, 16, 16] state + conv tail 3·32 channels × 3; 1 MLA layer: 100 tokens × (32 + 8), all bf16
    assert decode_state_bytes(config, 100) == 2 * (3 * (2 * 16 * 16 + 3 * 32 * 3) + 100 * 40)


def test_decode_replica_is_the_smallest_that_holds_the_weights():
    k3 = preset_config("k3")
    counts = count_parameters(k3)
    routed = counts.total["routed_experts"]
    dense = counts.num_total - routed
    cluster = Cluster(num_gpus=512)
    decode = decode_throughput(k3, cluster, 32768)
    # non-expert weights tensor-parallel over a node, experts over the replica; at most 60% of a GPU
    assert decode.weights_per_gpu == 2 * (dense / 8 + routed / 128) <= 0.6 * cluster.usable_bytes
    assert 2 * (dense / 8 + routed / 64) > 0.6 * cluster.usable_bytes
    assert decode.replica_gpus == 128 and decode.num_replicas == 4
    assert decode.seqs_per_replica == int(128 * (cluster.usable_bytes - decode.weights_per_gpu)
                                          // decode_state_bytes(k3, 32768))
    with pytest.raises(ValueError, match="do not fit in 60% of 64 GPUs"):
        decode_throughput(k3, Cluster(num_gpus=64), 32768)


def test_k3_plan_fits_the_gpus_it_names():
    config = preset_config("k3")
    plan = smallest_cluster(config, Workload())
    layout, cluster = plan.layout, plan.cluster
    assert layout.num_gpus == cluster.num_gpus and 896 % layout.ep == 0 and (layout.dp * layout.cp) % layout.ep == 0
    assert plan.memory.total <= cluster.usable_bytes
    # model states alone (16 bytes per parameter) need at least this many GPUs
    assert cluster.num_gpus >= 16 * 2.778e12 / cluster.usable_bytes
    stage_totals = [m.total for m in memory_by_stage(config, layout, Workload(), activation_scale())]
    assert len(stage_totals) == layout.pp and max(stage_totals) == plan.memory.total
    assert plan.decode is not None and plan.decode.tokens_per_s > 0


def test_impossible_layouts_are_refused_with_the_reason():
    k3 = preset_config("k3")
    with pytest.raises(ValueError, match=r"nothing fits in 64 .*needs \d+\.\d GiB per GPU"):
        make_plan(k3, Cluster(num_gpus=64), Workload())
    with pytest.raises(ValueError, match="ep=3 must divide"):
        make_plan(preset_config("small"), Cluster(num_gpus=8), Workload(), dict(pp=1, dp=8, cp=1, ep=3))
    with pytest.raises(ValueError, match="mfu=0 must lie"):
        make_plan(preset_config("small"), Cluster(num_gpus=1), Workload(), mfu=0)
    with pytest.raises(ValueError, match="does not use the cluster's 8 GPUs"):
        make_plan(preset_config("small"), Cluster(num_gpus=8), Workload(), dict(pp=1, dp=4, cp=1, ep=1))
    with pytest.raises(ValueError, match="not a whole number of 8-GPU nodes"):
        Cluster(num_gpus=12)


def test_supported_only_keeps_to_what_the_trainer_runs():
    small = make_plan(preset_config("small"), Cluster(num_gpus=8), Workload(context=8192), supported_only=True)
    assert trainer_supports(small.layout) and small.layout.pp == small.layout.cp == 1
    assert not trainer_supports(Layout(dp=8, ep=8, zero=3)) and not trainer_supports(Layout(dp=8, zero=1))
    # K3 with the trainer's layouts: a ZeRO-3 layer gathers all 896 experts (2 × 60 GB) and under ZeRO-2 the 55.5B
    # non-expert parameters are replicated, so data and expert parallelism alone fit nowhere; context parallelism
    # (without EP) shards the activations and the rest enough to fit, just
    with pytest.raises(ValueError, match=r"nothing fits in 4096 .*gathered layers 112\.6"):
        make_plan(preset_config("k3"), Cluster(num_gpus=4096), Workload(context=4096), dict(cp=1),
                  supported_only=True)
    k3 = make_plan(preset_config("k3"), Cluster(num_gpus=4096), Workload(context=4096), supported_only=True)
    assert trainer_supports(k3.layout) and k3.layout.cp > 1 and k3.layout.ep == 1 and k3.layout.zero == 3


def test_cli_k3_prints_the_published_counts_and_a_fitting_layout(capsys):
    main(["plan", "--preset", "k3"])
    out = capsys.readouterr().out
    assert "2,778.286B" in out and "104.165B" in out
    used, usable = re.search(r"total\s+([\d.]+)\s+of ([\d.]+) usable", out).groups()
    assert float(used) <= float(usable)


def test_cli_small_with_a_fixed_expert_parallel_layout(capsys):
    main(["plan", "--preset", "small", "--gpus", "8", "--ep", "8", "--pp", "1", "--dp", "8", "--cp", "1",
          "--zero", "2", "--context", "4096", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"] == {"pp": 1, "dp": 8, "cp": 1, "ep": 8, "zero": 2}
    with torch.device("meta"):
        total, active = HybridMoEForCausalLM(preset_config("small")).parameter_counts()
    assert (plan["params"]["num_total"], plan["params"]["num_active"]) == (total, active)
    assert plan["time"]["expert_all_to_all_s"] > 0 and plan["memory"]["total"] < 139 * 2**30


def test_cli_refuses_what_does_not_fit(capsys):
    with pytest.raises(SystemExit, match="agentrl plan: nothing fits in 64"):
        main(["plan", "--preset", "k3", "--gpus", "64"])
    with pytest.raises(SystemExit, match="--overrides must be a JSON object"):
        main(["plan", "--preset", "small", "--overrides", "[1]"])


def test_cli_reads_a_checkpoint_config(tmp_path, capsys):
    preset_config("tiny").save_pretrained(str(tmp_path))
    main(["plan", "--config", str(tmp_path), "--gpus", "1", "--context", "1024"])
    out = capsys.readouterr().out
    assert f"model {tmp_path}" in out and "PP 1 × DP 1 × CP 1 = 1 GPUs" in out
