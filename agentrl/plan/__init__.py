"""`agentrl plan`: parameter counts, memory per GPU, a parallel layout and time estimates for a model on a cluster.

Everything is arithmetic on the model config (`HybridMoEConfig`): no model is built and this module imports no
torch (resolving a preset or a checkpoint's config.json imports the config module, which does).

Conventions (see docs/scale.md for the formulas and what each rests on):
- A layout is PP × DP × CP = GPUs. PP splits the layers into contiguous stages (1F1B schedule); CP splits each
  sequence's tokens (MLA all-gathers its compressed latent, KDA passes its recurrent state); DP replicates. The
  ZeRO group of the non-expert parameters is DP·CP; the routed experts are split over EP ranks taken from the DP·CP
  ranks of a stage (EP divides DP·CP and the expert count), and their ZeRO group is the remaining DP·CP/EP ranks.
  No tensor parallelism. Ranks are placed CP and EP innermost (inside a node as far as they go), then DP, then PP.
- Training memory: bf16 weights (2 B), bf16 gradients (2 B), fp32 master weights + Adam moments (12 B) per parameter;
  ZeRO-1 shards the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also the weights (and then holds two layers
  gathered: the one computing and the one prefetched).
- Activations follow the trainer's code (sub-layer gradient checkpointing, `HybridMoEModel.forward`): per sub-layer
  the checkpoint keeps its bf16 input, and each AttnRes mix — run outside the checkpoint — keeps what its path saves
  (ATTN_RES_MIXES: fla's fused kernel on CUDA keeps little; the PyTorch reference keeps its sources stacked in fp32
  twice). With 1F1B the first stage holds PP micro-batches in flight. On top, one sub-layer's recomputation and
  backward is live (its activations, the MoE dispatch buffers, fla's per-chunk KDA states, MLA's gathered keys and
  values). The total is scaled by a factor measured on the `small` preset.
- Step time = compute + expert all-to-all + ZeRO collectives + pipeline sends, none overlapped (an upper bound in
  that respect), plus the 1F1B bubble. Compute runs the matmul work and MLA's attention each at the fraction of peak
  that reproduces the `small` preset's measured tokens/s at two context lengths, slowed by recomputation.
- Decode throughput is a roofline (HBM bytes per step, all-to-all, latencies) with assumed efficiencies: no GPU
  decode of this model has been measured yet.

Modules: `calibration` (the measured and the assumed numbers), `counts` (parameters), `layout` (cluster, layout,
workload), `memory`, `timing` (step time, weight gather), `decode` (rollout roofline), `search` (the plan), `report`.
"""

from agentrl.plan.calibration import (A2A_LATENCY_S, ATTN_RES_MIXES, BYTES_GRAD, BYTES_OPTIMIZER, BYTES_WEIGHT,
                                      CALIBRATION_PRESET, CHECKPOINTING_SPEED, COLLECTIVE_EFFICIENCY,
                                      DECODE_HBM_EFFICIENCY, DECODE_MAX_SEQS_PER_GPU, DECODE_MFU,
                                      DEFAULT_ATTN_RES_MIX, H200_BF16_TFLOPS, H200_HBM_TBPS, KDA_CHUNK,
                                      SMALL_ACTIVATION_ATTN_RES_MIX, SMALL_ACTIVATION_BYTES_PER_TOKEN,
                                      SMALL_TRAIN_TOKENS_PER_S, USABLE_MEMORY_FRACTION, GiB)
from agentrl.plan.counts import COMPONENTS, ModelShape, ParamCounts, count_parameters, layer_params
from agentrl.plan.decode import Decode, decode_state_bytes, decode_throughput
from agentrl.plan.layout import Cluster, Layout, Workload, check_layout, stages
from agentrl.plan.memory import (Memory, activation_scale, memory_by_stage, memory_per_gpu,
                                 stored_activation_bytes_per_token, transient_activation_bytes_per_token)
from agentrl.plan.report import format_plan
from agentrl.plan.search import Plan, candidate_layouts, make_plan, resolve_config, smallest_cluster, trainer_supports
from agentrl.plan.timing import (StepTime, calibrated_efficiency, flops_per_token, step_time, weight_gather_s,
                                 weight_sync_s)

__all__ = [
    "A2A_LATENCY_S", "ATTN_RES_MIXES", "BYTES_GRAD", "BYTES_OPTIMIZER", "BYTES_WEIGHT", "CALIBRATION_PRESET",
    "CHECKPOINTING_SPEED", "COLLECTIVE_EFFICIENCY", "DECODE_HBM_EFFICIENCY", "DECODE_MAX_SEQS_PER_GPU", "DECODE_MFU",
    "DEFAULT_ATTN_RES_MIX", "H200_BF16_TFLOPS", "H200_HBM_TBPS", "KDA_CHUNK", "SMALL_ACTIVATION_ATTN_RES_MIX",
    "SMALL_ACTIVATION_BYTES_PER_TOKEN", "SMALL_TRAIN_TOKENS_PER_S", "USABLE_MEMORY_FRACTION", "GiB",
    "COMPONENTS", "ModelShape", "ParamCounts", "count_parameters", "layer_params",
    "Decode", "decode_state_bytes", "decode_throughput",
    "Cluster", "Layout", "Workload", "check_layout", "stages",
    "Memory", "activation_scale", "memory_by_stage", "memory_per_gpu", "stored_activation_bytes_per_token",
    "transient_activation_bytes_per_token",
    "format_plan",
    "Plan", "candidate_layouts", "make_plan", "resolve_config", "smallest_cluster", "trainer_supports",
    "StepTime", "calibrated_efficiency", "flops_per_token", "step_time", "weight_gather_s", "weight_sync_s",
]
