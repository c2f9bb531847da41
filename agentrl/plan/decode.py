"""Rollout throughput: a decode roofline of one inference replica (assumed efficiencies, not calibrated)."""

from __future__ import annotations

from dataclasses import dataclass

from agentrl.plan.calibration import (A2A_LATENCY_S, BYTES_WEIGHT, COLLECTIVE_EFFICIENCY, DECODE_HBM_EFFICIENCY,
                                        DECODE_MAX_SEQS_PER_GPU, DECODE_MFU, GiB)
from agentrl.plan.counts import ModelShape, count_parameters
from agentrl.plan.layout import Cluster


@dataclass(kw_only=True, slots=True)
class Decode:
    """One inference replica: the non-expert weights split over a node's GPUs (tensor parallel), the routed experts
    over all of the replica's GPUs (expert parallel)."""
    replica_gpus: int
    num_replicas: int
    weights_per_gpu: float
    state_bytes_per_seq: float  # KDA recurrent + conv states and the MLA latent cache at the context length
    seqs_per_replica: int
    step_s: float
    bound: str  # what sets the step time: "HBM", "compute" or "all-to-all"

    @property
    def tokens_per_s_replica(self) -> float:
        return self.seqs_per_replica / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_replicas * self.tokens_per_s_replica


def decode_state_bytes(cfg, context: int) -> float:
    """Per sequence: KDA [H, K, K] state and the convolution tail per KDA layer, MLA latent + key part per token."""
    cfg = ModelShape.of(cfg)
    kda = [i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)]
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    per_kda = BYTES_WEIGHT * (H * K * K + 3 * H * K * (cfg.kda_conv_size - 1))  # vLLM keeps them in the model dtype
    per_mla = BYTES_WEIGHT * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return len(kda) * per_kda + (cfg.num_hidden_layers - len(kda)) * per_mla


def decode_throughput(cfg, cluster: Cluster, context: int, replica_gpus: int | None = None) -> Decode:
    """Decode tokens/s at `context` tokens per sequence (a roofline with the assumed efficiencies above)."""
    cfg = ModelShape.of(cfg)
    counts = count_parameters(cfg)
    routed = counts.total["routed_experts"]
    dense = counts.num_total - routed
    gpn = cluster.gpus_per_node

    def weights(r: int) -> float:
        return BYTES_WEIGHT * (dense / min(r, gpn) + routed / r)

    if replica_gpus is None:
        sizes = [2**j for j in range(20) if 2**j < gpn] + [gpn * 2**j for j in range(20)]
        fitting = [r for r in sizes if r <= cluster.num_gpus and weights(r) <= 0.6 * cluster.usable_bytes]
        if not fitting:
            raise ValueError(f"the model's bf16 weights do not fit in 60% of {cluster.num_gpus} GPUs of "
                             f"{cluster.gpu_memory_gib} GiB for serving")
        replica_gpus = fitting[0]
    r = replica_gpus
    state = decode_state_bytes(cfg, context)
    free = r * (cluster.usable_bytes - weights(r))
    if free <= state:
        raise ValueError(f"a {r}-GPU replica has no room for one sequence's {state / GiB:.2f} GiB of state")
    seqs = int(min(DECODE_MAX_SEQS_PER_GPU * r, free // state))
    # HBM bytes read per step on one GPU: its weights (experts untouched by the batch are skipped) and the states
    kda_share = sum(cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers)) / cfg.num_hidden_layers
    touched = 1.0
    if cfg.num_experts:
        touched = 1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** seqs
    weight_read = BYTES_WEIGHT * (dense / min(r, gpn) + touched * routed / r)
    kda_state = decode_state_bytes(cfg, 0)  # the part that does not grow with the context
    state_read = seqs / r * (state + kda_state)  # the KDA states are also written back; the MLA cache only read
    hbm_s = (weight_read + state_read) / (cluster.hbm_tbytes_s * 1e12 * DECODE_HBM_EFFICIENCY)
    mla = cfg.num_hidden_layers - round(kda_share * cfg.num_hidden_layers)
    flops = seqs / r * (2 * counts.num_active
                        + mla * 4 * cfg.num_attention_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * context)
    compute_s = flops / (cluster.peak_tflops * 1e12 * DECODE_MFU)
    num_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    a2a_s = 0.0
    if r > 1:
        M = cfg.routed_expert_hidden_size or cfg.hidden_size
        per_layer = seqs / r * cfg.num_experts_per_token * M * BYTES_WEIGHT * 2 if cfg.num_experts else 0.0
        inter = max(0.0, 1 - gpn / r) * per_layer
        a2a_s = (num_moe * ((per_layer - inter) / (cluster.intra_node_gbytes_s * 1e9 * COLLECTIVE_EFFICIENCY)
                            + inter / (cluster.inter_node_bytes_s_per_gpu * COLLECTIVE_EFFICIENCY)
                            + 2 * A2A_LATENCY_S)
                 + cfg.num_hidden_layers * 2 * A2A_LATENCY_S)  # tensor-parallel all-reduces in the node
    parts = {"HBM": hbm_s, "compute": compute_s}
    bound = max(parts, key=parts.get)
    step = parts[bound] + a2a_s
    if a2a_s > parts[bound]:
        bound = "all-to-all"
    return Decode(replica_gpus=r, num_replicas=cluster.num_gpus // r, weights_per_gpu=weights(r),
                  state_bytes_per_seq=state, seqs_per_replica=seqs, step_s=step, bound=bound)
