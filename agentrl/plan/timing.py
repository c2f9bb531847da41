"""Training step time (compute calibrated on the `small` preset, collectives, pipeline) and the weight gather."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from agentrl.plan.calibration import (A2A_LATENCY_S, BYTES_GRAD, BYTES_WEIGHT, CALIBRATION_PRESET, CHECKPOINTING_SPEED,
                                        COLLECTIVE_EFFICIENCY, H200_BF16_TFLOPS, H200_HBM_TBPS, KDA_CHUNK,
                                        SMALL_TRAIN_TOKENS_PER_S, WEIGHT_IPC_COPY_FRACTION)
from agentrl.plan.counts import ModelShape, count_parameters, layer_params
from agentrl.plan.layout import Cluster, Layout, Workload, stages
from agentrl.plan.memory import stage_params


def flops_per_token(cfg, context: int, layers: range | None = None, *, with_head: bool = True
                    ) -> tuple[float, float]:
    """Training FLOPs per token (forward + backward, no recomputation), split as (matmul work: 6·N_active + KDA's
    chunked delta rule + the head, MLA's causal softmax attention over `context` tokens)."""
    cfg = ModelShape.of(cfg)
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    dense = attention = 0.0
    for i in layers:
        p = layer_params(cfg, i)
        active = sum(p.values()) - p["routed_experts"]
        if cfg.num_experts and p["routed_experts"]:
            active += p["routed_experts"] * cfg.num_experts_per_token // cfg.num_experts
        dense += 6 * active
        if cfg.is_kda_layer(i):
            H, K = cfg.kda_num_heads, cfg.kda_head_dim
            dense += 3 * 2 * H * K * (4 * K + KDA_CHUNK)  # chunked delta rule: state updates + intra-chunk
        else:
            H = cfg.num_attention_heads
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            attention += 3 * 2 * H * (qk + cfg.v_head_dim) * context / 2  # causal: T/2 keys per token on average
    if with_head:
        dense += 6 * cfg.vocab_size * cfg.hidden_size
    return dense, attention


@functools.cache
def calibrated_efficiency() -> tuple[float, float]:
    """(matmul work, attention) fractions of peak that reproduce the `small` preset's two measured throughputs.

    1/tokens_per_s(T) = dense / (peak·e_dense) + attention(T) / (peak·e_attention) at each measured T: two
    equations, two unknowns. Gradient checkpointing is off in the measurement (CHECKPOINTING_SPEED covers it).
    """
    from agentrl.model.config import preset_config

    small = preset_config(CALIBRATION_PRESET)
    (t0, tps0), (t1, tps1) = sorted(SMALL_TRAIN_TOKENS_PER_S.items())
    peak = H200_BF16_TFLOPS * 1e12
    (d0, a0), (d1, a1) = flops_per_token(small, t0), flops_per_token(small, t1)
    assert d0 == d1 and a1 > a0
    inv_attention = peak * (1 / tps1 - 1 / tps0) / (a1 - a0)
    inv_dense = (peak / tps0 - a0 * inv_attention) / d0
    if inv_attention <= 0 or inv_dense <= 0:
        raise ValueError(f"SMALL_TRAIN_TOKENS_PER_S={SMALL_TRAIN_TOKENS_PER_S} gives no positive efficiencies: "
                         f"the longer context must be the slower per token")
    return 1 / inv_dense, 1 / inv_attention


def _collective_s(num_bytes: float, group: int, spans_nodes: bool, cluster: Cluster) -> float:
    """A ring reduce-scatter or all-gather of num_bytes (the full buffer) over group ranks."""
    if group <= 1:
        return 0.0
    bw = cluster.inter_node_bytes_s_per_gpu if spans_nodes else cluster.intra_node_gbytes_s * 1e9
    return num_bytes * (group - 1) / group / (bw * COLLECTIVE_EFFICIENCY)


@dataclass(kw_only=True, slots=True)
class StepTime:
    mfu: float  # model FLOPs (no recomputation) / (compute time · peak) on the slowest stage
    mfu_calibrated: bool  # False when given by the caller
    compute_s: float
    expert_all_to_all_s: float
    zero_collectives_s: float
    pipeline_send_s: float
    context_parallel_s: float
    bubble_s: float
    tokens_per_step: int

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.expert_all_to_all_s + self.zero_collectives_s + self.pipeline_send_s
                + self.context_parallel_s + self.bubble_s)


def step_time(cfg, layout: Layout, cluster: Cluster, workload: Workload, mfu: float | None = None) -> StepTime:
    """One optimizer step on the slowest stage, micro-batch by micro-batch (see agentrl.plan's docstring)."""
    cfg = ModelShape.of(cfg)
    calibrated = mfu is None
    peak = cluster.peak_tflops * 1e12
    e_dense, e_attention = calibrated_efficiency() if calibrated else (mfu, mfu)
    speed = CHECKPOINTING_SPEED if workload.gradient_checkpointing and calibrated else 1.0
    gpn = cluster.gpus_per_node
    num_micro = max(1, math.ceil(workload.tokens_per_step / (workload.micro_batch_tokens * layout.dp)))
    tokens = workload.micro_batch_tokens / layout.cp  # per GPU per micro-batch
    passes = 3 if workload.gradient_checkpointing else 2  # forward, recompute, backward
    slowest = None
    for s, layers in enumerate(stages(cfg, layout.pp)):
        first, last = s == 0, s == layout.pp - 1
        dense_flops, attention_flops = flops_per_token(cfg, workload.context, layers, with_head=last)
        compute = tokens * (dense_flops / e_dense + attention_flops / e_attention) / (peak * speed)
        a2a = 0.0
        moe = [i for i in layers if cfg.is_moe_layer(i)]
        if moe and layout.ep > 1:
            M = cfg.routed_expert_hidden_size or cfg.hidden_size
            per_layer = tokens * cfg.num_experts_per_token * M * BYTES_WEIGHT * 2 * passes  # dispatch + combine
            leaving = per_layer * (layout.ep - 1) / layout.ep
            inter = max(0.0, 1 - gpn / layout.ep) * per_layer
            a2a = len(moe) * ((leaving - inter) / (cluster.intra_node_gbytes_s * 1e9 * COLLECTIVE_EFFICIENCY)
                              + inter / (cluster.inter_node_bytes_s_per_gpu * COLLECTIVE_EFFICIENCY)
                              + 3 * passes * A2A_LATENCY_S)  # counts, dispatch, combine
        cp_comm = 0.0
        if layout.cp > 1:
            mla = [i for i in layers if not cfg.is_kda_layer(i)]
            latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BYTES_WEIGHT * workload.micro_batch_tokens
            cp_comm = len(mla) * passes * _collective_s(latent, layout.cp, layout.cp > gpn, cluster)
        dense, expert, _ = stage_params(cfg, layers, first=first, last=last)
        # both ZeRO groups (all of a stage's ranks; every EP-th of them) leave the node when the stage does
        spans = layout.dp * layout.cp > gpn
        per_step = per_micro = 0.0
        for n, group in ((dense, layout.dp * layout.cp), (expert / layout.ep, layout.expert_dp)):
            grad = BYTES_GRAD * n
            if layout.zero >= 2:
                per_micro += _collective_s(grad, group, spans, cluster)  # reduce-scatter every backward
            else:
                per_step += 2 * _collective_s(grad, group, spans, cluster)  # one all-reduce at the step
            if layout.zero == 3:
                per_micro += passes * _collective_s(BYTES_WEIGHT * n, group, spans, cluster)
            elif layout.zero >= 1:
                per_step += _collective_s(BYTES_WEIGHT * n, group, spans, cluster)  # updated shards gathered
        send = 0.0
        if layout.pp > 1 and not last:
            sources = 1
            if cfg.attn_res_block_size is not None:
                sources = layers[-1] // cfg.attn_res_block_size + 2  # every completed block and the partial
            bw = (cluster.inter_node_bytes_s_per_gpu if layout.dp * layout.cp >= gpn
                  else cluster.intra_node_gbytes_s * 1e9)
            # activations forward, their gradients back; AttnRes sends every source, not one hidden state
            send = 2 * tokens * sources * cfg.hidden_size * BYTES_WEIGHT / (bw * COLLECTIVE_EFFICIENCY)
        per_micro_total = compute + a2a + cp_comm + per_micro + send
        stage = dict(mfu=tokens * (dense_flops + attention_flops) / (compute * peak),
                     compute=compute * num_micro, a2a=a2a * num_micro, cp=cp_comm * num_micro,
                     zero=per_micro * num_micro + per_step, send=send * num_micro, per_micro=per_micro_total,
                     total=per_micro_total * num_micro + per_step)
        if slowest is None or stage["total"] > slowest["total"]:
            slowest = stage
    bubble = (layout.pp - 1) * slowest["per_micro"]
    return StepTime(mfu=slowest["mfu"], mfu_calibrated=calibrated, compute_s=slowest["compute"],
                    expert_all_to_all_s=slowest["a2a"],
                    zero_collectives_s=slowest["zero"], pipeline_send_s=slowest["send"],
                    context_parallel_s=slowest["cp"], bubble_s=bubble, tokens_per_step=workload.tokens_per_step)


def weight_gather_s(cfg, layout: Layout, cluster: Cluster) -> float:
    """Publishing's gather: the full bf16 weights onto one rank (`PolicyTrainer.full_state_dict`), link-bound.

    What that rank does not hold arrives over its link: the other stages' parameters, the routed experts of the other
    EP ranks, and under ZeRO-3 the other DP·CP shards (of the experts: the other expert-DP shards). Transfers into
    one GPU, at COLLECTIVE_EFFICIENCY of NVLink inside a node, of its NIC share across nodes. It leaves out the
    copies to host memory and the per-tensor overheads of an implementation.
    """
    cfg = ModelShape.of(cfg)
    counts = count_parameters(cfg)
    expert = counts.total["routed_experts"]
    dense = counts.num_total - expert
    sharded = layout.zero == 3
    held = (dense / layout.pp / (layout.dp * layout.cp if sharded else 1)
            + expert / layout.pp / layout.ep / (layout.expert_dp if sharded else 1))
    bw = (cluster.inter_node_bytes_s_per_gpu if layout.num_gpus > cluster.gpus_per_node
          else cluster.intra_node_gbytes_s * 1e9)
    return (counts.num_total - held) * BYTES_WEIGHT / (bw * COLLECTIVE_EFFICIENCY)



def weight_sync_s(engine_bytes_per_gpu: float, replica_gpus: int, cluster: Cluster) -> float:
    """The in-memory sync (trainer/weight_stream.py) with the engines on the trainer's GPUs: every GPU's engine
    receives its shard of the bf16 weights (`engine_bytes_per_gpu`, the rollout replica's split over `replica_gpus`),
    all GPUs at once.

    Per GPU: what the trainer's layout does not keep there arrives over its links (the layers' ZeRO-3 / EP gathers and
    the engine's other split: at most the engine shard itself, at COLLECTIVE_EFFICIENCY of NVLink, of the NIC share
    once a replica spans nodes), then moves into the engine's process by CUDA IPC at the measured fraction of the HBM
    copy rate (WEIGHT_IPC_COPY_FRACTION). The ~1-2 ms per bucket measured on one GPU is left out."""
    bw = (cluster.inter_node_bytes_s_per_gpu if replica_gpus > cluster.gpus_per_node
          else cluster.intra_node_gbytes_s * 1e9)
    copy_rate = H200_HBM_TBPS * 1e12 / 2 * WEIGHT_IPC_COPY_FRACTION  # a copy reads and writes each byte
    return engine_bytes_per_gpu / (bw * COLLECTIVE_EFFICIENCY) + engine_bytes_per_gpu / copy_rate
