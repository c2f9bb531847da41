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
  that reproduces the `small` preset's measured tokens/s at two context lengths, slowed by recomputation. Decode throughput is a roofline (HBM bytes per step, all-to-all, latencies) with assumed efficiencies: no
  GPU decode of this model has been measured yet.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

GiB = 1024**3

# ------------------------------------------------------------------------------------------------------------------
# Calibration: the measured numbers the estimates use, all from docs/benchmarks.md ("The whole model", "GPU (H200)",
# measured 2026-11-30, fla's fused kernels on). Change them here when the benchmarks are re-measured.
# ------------------------------------------------------------------------------------------------------------------
CALIBRATION_PRESET = "small"
# bf16 forward+backward tokens/s of the `small` preset on one H200, B = 1, gradient checkpointing off ("same run,
# before and after": fused kernels on). The 4K figure (28,311) is left out: the host bounds it (kernel launches).
# Two lengths fit two efficiencies: of the matmul work and of MLA's T² attention (see `calibrated_efficiency`).
SMALL_TRAIN_TOKENS_PER_S = {32768: 128_253, 131072: 83_420}
# Peak memory above the weights with gradient checkpointing on (fused kernels): marginal bytes per token between
# 128K and 256K tokens, and the AttnRes path that measurement ran.
SMALL_ACTIVATION_BYTES_PER_TOKEN = (36.97 - 18.55) * GiB / (262144 - 131072)
SMALL_ACTIVATION_ATTN_RES_MIX = "fused"

# ------------------------------------------------------------------------------------------------------------------
# Assumptions (not measured here): the H200's datasheet figures and efficiencies of collectives and decoding.
# ------------------------------------------------------------------------------------------------------------------
H200_BF16_TFLOPS = 989.0  # dense bf16 peak (docs/benchmarks.md rounds it to 990)
H200_HBM_TBPS = 4.8
USABLE_MEMORY_FRACTION = 0.92  # CUDA context, NCCL buffers, allocator fragmentation take the rest
BYTES_WEIGHT, BYTES_GRAD, BYTES_OPTIMIZER = 2, 2, 12  # bf16 weights and gradients; fp32 master + Adam m, v
COLLECTIVE_EFFICIENCY = 0.7  # achieved / link bandwidth for NCCL rings and all-to-all
A2A_LATENCY_S = 30e-6  # fixed cost of one all-to-all (decode is latency-bound)
DECODE_HBM_EFFICIENCY = 0.6  # achieved / peak HBM bandwidth in a decode step
DECODE_MFU = 0.3  # achieved / peak FLOP/s of the expert matmuls in a decode step
DECODE_MAX_SEQS_PER_GPU = 256  # scheduler cap on concurrent sequences per GPU
KDA_CHUNK = 64  # fla's chunk: one [H, K, K] fp32 state per chunk is saved for the backward pass
# Gradient checkpointing recomputes each forward once: (1 forward + 2 backward) / (2 + 2) of the speed. Before the
# fused kernels the `small` preset measured 52-54K tokens/s with it against 70K without (0.76).
CHECKPOINTING_SPEED = 0.75

# What each Block AttnRes mix keeps for the backward pass. The mixes run outside the sub-layer checkpoints.
ATTN_RES_MIXES = {
    "torch": "the PyTorch reference (CPU) stacks its sources in fp32 and keeps values and keys",
    "fused": "fla's fused_attnres (CUDA) keeps only references to its sources and per-source fp32 statistics",
    "recomputed": "recomputed inside the checkpoint (not in the trainer yet)",
}
DEFAULT_ATTN_RES_MIX = "fused"  # the model's CUDA path (agentrl/model/attn_res.py)


# --- parameter counts ---------------------------------------------------------------------------------------------
COMPONENTS = ("embedding", "lm_head", "kda", "mla", "dense_mlp", "routed_experts", "shared_experts", "latent_proj",
              "router", "attn_res", "norms")


def _glu(width: int, intermediate: int) -> int:
    return 3 * width * intermediate


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The fields of a `HybridMoEConfig` that sizes depend on, under the same names (plain attributes: the layout
    search reads them millions of times, and transformers' config attribute access is slow)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    kda_layers: frozenset[int]  # 0-based
    moe_layers: frozenset[int]
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_size: int
    use_full_rank_gate: bool
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    num_experts: int | None
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None
    latent_moe_use_norm: bool
    attn_res_block_size: int | None

    @classmethod
    def of(cls, cfg) -> ModelShape:
        if isinstance(cfg, cls):
            return cfg
        layers = range(cfg.num_hidden_layers)
        names = [f for f in cls.__dataclass_fields__ if f not in ("kda_layers", "moe_layers")]
        return cls(kda_layers=frozenset(i for i in layers if cfg.is_kda_layer(i)),
                   moe_layers=frozenset(i for i in layers if cfg.is_moe_layer(i)),
                   **{f: getattr(cfg, f) for f in names})

    def is_kda_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.kda_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.moe_layers


def layer_params(cfg, layer_idx: int) -> dict[str, int]:
    """Parameters of one decoder layer by component (as `HybridDecoderLayer` builds them)."""
    return dict(_layer_params(ModelShape.of(cfg), layer_idx))


@functools.lru_cache(maxsize=4096)
def _layer_params(cfg, layer_idx: int) -> dict[str, int]:
    D = cfg.hidden_size
    out = dict.fromkeys(COMPONENTS, 0)
    if cfg.is_kda_layer(layer_idx):
        H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        P = H * K
        gate = D * P if cfg.use_full_rank_gate else D * K + K * P
        # q, k, v; their depthwise convolutions; decay f_b(f_a(x)), A_log, dt_bias; β; output gate; o_norm; o_proj
        out["kda"] = 3 * D * P + 3 * P * W + D * K + K * P + H + P + D * H + gate + K + P * D
    else:
        H, R = cfg.num_attention_heads, cfg.kv_lora_rank
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = D * H * qk if cfg.q_lora_rank is None else D * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * H * qk
        gate = D * H * cfg.v_head_dim if cfg.mla_use_output_gate else 0
        out["mla"] = (q + D * (R + cfg.qk_rope_head_dim) + R + R * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                      + gate + H * cfg.v_head_dim * D)
    if cfg.is_moe_layer(layer_idx):
        M = cfg.routed_expert_hidden_size or D
        out["router"] = cfg.num_experts * D
        out["routed_experts"] = cfg.num_experts * _glu(M, cfg.moe_intermediate_size)
        out["shared_experts"] = _glu(D, cfg.moe_intermediate_size * cfg.num_shared_experts)
        if cfg.routed_expert_hidden_size is not None:
            out["latent_proj"] = 2 * D * M + (M if cfg.latent_moe_use_norm else 0)
    else:
        out["dense_mlp"] = _glu(D, cfg.intermediate_size)
    out["norms"] = 2 * D
    if cfg.attn_res_block_size is not None:
        out["attn_res"] = 4 * D  # two RMSNorm weights and two query vectors
    return out


@dataclass(kw_only=True, slots=True)
class ParamCounts:
    total: dict[str, int]  # by component
    active: dict[str, int]  # per token: top-K of the routed experts

    @property
    def num_total(self) -> int:
        return sum(self.total.values())

    @property
    def num_active(self) -> int:
        return sum(self.active.values())


def count_parameters(cfg) -> ParamCounts:
    """Total and active parameters by component; equals `HybridMoEForCausalLM.parameter_counts()` in sum."""
    cfg = ModelShape.of(cfg)
    total = dict.fromkeys(COMPONENTS, 0)
    for i in range(cfg.num_hidden_layers):
        for name, n in layer_params(cfg, i).items():
            total[name] += n
    total["embedding"] = total["lm_head"] = cfg.vocab_size * cfg.hidden_size
    total["norms"] += cfg.hidden_size
    if cfg.attn_res_block_size is not None:
        total["attn_res"] += 2 * cfg.hidden_size
    active = dict(total)
    if cfg.num_experts:
        active["routed_experts"] = total["routed_experts"] * cfg.num_experts_per_token // cfg.num_experts
    return ParamCounts(total=total, active=active)


# --- cluster, layout, workload ------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class Cluster:
    num_gpus: int
    gpu_memory_gib: float = 139.0  # what torch reports on an H200
    gpus_per_node: int = 8
    intra_node_gbytes_s: float = 900.0  # NVLink per GPU
    inter_node_gbits_s: float = 400.0  # per NIC
    nics_per_node: int = 8
    peak_tflops: float = H200_BF16_TFLOPS
    hbm_tbytes_s: float = H200_HBM_TBPS

    def __post_init__(self):
        for name in ("num_gpus", "gpus_per_node", "nics_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"Cluster.{name}={getattr(self, name)} must be >= 1")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"{self.num_gpus} GPUs is not a whole number of {self.gpus_per_node}-GPU nodes")

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gib * GiB * USABLE_MEMORY_FRACTION

    @property
    def inter_node_bytes_s_per_gpu(self) -> float:
        return self.inter_node_gbits_s / 8 * 1e9 * self.nics_per_node / self.gpus_per_node


@dataclass(kw_only=True, slots=True)
class Layout:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1

    @property
    def num_gpus(self) -> int:
        return self.pp * self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        return self.dp * self.cp // self.ep

    def describe(self) -> str:
        return (f"PP {self.pp} × DP {self.dp} × CP {self.cp} = {self.num_gpus} GPUs; EP {self.ep} "
                f"(expert DP {self.expert_dp}); ZeRO-{self.zero}")


@dataclass(kw_only=True, slots=True)
class Workload:
    context: int = 32768  # tokens per sequence
    micro_batch_tokens: int | None = None  # tokens per micro-batch before CP splits it (default: one sequence)
    tokens_per_step: int = 16 * 2**20  # global batch of one optimizer step
    gradient_checkpointing: bool = True
    attn_res_mix: str = DEFAULT_ATTN_RES_MIX  # what an AttnRes mix keeps for backward: see ATTN_RES_MIXES

    def __post_init__(self):
        if self.micro_batch_tokens is None:
            self.micro_batch_tokens = self.context
        for name in ("context", "micro_batch_tokens", "tokens_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name}={getattr(self, name)} must be >= 1")
        if self.attn_res_mix not in ATTN_RES_MIXES:
            raise ValueError(f"Workload.attn_res_mix={self.attn_res_mix!r} must be one of {sorted(ATTN_RES_MIXES)}")


def check_layout(cfg, layout: Layout, cluster: Cluster, workload: Workload) -> None:
    """Raises ValueError naming the degree that cannot work for this model and cluster."""
    cfg = ModelShape.of(cfg)
    if layout.num_gpus != cluster.num_gpus:
        raise ValueError(f"layout {layout.describe()} does not use the cluster's {cluster.num_gpus} GPUs")
    if not 1 <= layout.pp <= cfg.num_hidden_layers:
        raise ValueError(f"pp={layout.pp}: needs 1 <= pp <= {cfg.num_hidden_layers} layers")
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={layout.zero}: ZeRO stage must be 0, 1, 2 or 3")
    if (layout.dp * layout.cp) % layout.ep:
        raise ValueError(f"ep={layout.ep} must divide dp·cp={layout.dp * layout.cp} (experts split over a stage's "
                         f"data-parallel ranks)")
    num_experts = cfg.num_experts or 1
    if num_experts % layout.ep:
        raise ValueError(f"ep={layout.ep} must divide the {num_experts} routed experts")
    if workload.micro_batch_tokens % layout.cp or workload.micro_batch_tokens // layout.cp < KDA_CHUNK:
        raise ValueError(f"cp={layout.cp} must divide the {workload.micro_batch_tokens}-token micro-batch into "
                         f"pieces of at least {KDA_CHUNK} tokens")


# --- memory ---------------------------------------------------------------------------------------------------------
def stages(cfg, pp: int) -> list[range]:
    """Contiguous layer ranges, the first stages one layer longer when pp does not divide the layers."""
    base, extra = divmod(cfg.num_hidden_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def attn_res_sources(cfg, layer_idx: int) -> tuple[int, int]:
    """Sources read by the attention and the MLP mix of a layer (as `BlockState` hands them out)."""
    bs = cfg.attn_res_block_size
    blocks = layer_idx // bs + 1  # the embedding is block 0
    return (blocks if layer_idx % bs == 0 else blocks + 1), blocks + 1


def stored_activation_bytes_per_token(cfg, layers: range, workload: Workload, *, last_stage: bool) -> float:
    """Bytes per token kept between forward and backward for these layers (sub-layer checkpointing)."""
    cfg = ModelShape.of(cfg)
    D = cfg.hidden_size
    if not workload.gradient_checkpointing:  # every layer's activations (the transient figure counts grads too)
        return sum(transient_activation_bytes_per_token(cfg, i, context=workload.context) / 2 for i in layers)
    def mix(num_sources: int, mode: str) -> float:
        if mode == "torch":  # fp32 values and normalised keys of the stacked sources (copies: nothing else kept)
            return 2 * 4 * D * num_sources
        if mode == "fused":  # the running partial sum it keeps alive, fp32 rstd and logit per source, the lse
            return 2 * D + 2 * 4 * num_sources + 4
        return 2 * D  # recomputed in the checkpoint: its inputs, the running partial sum among them, stay alive

    total = 0.0
    for i in layers:
        total += 2 * 2 * D  # each sub-layer checkpoint keeps its bf16 input
        if cfg.attn_res_block_size is not None:
            total += sum(mix(n, workload.attn_res_mix) for n in attn_res_sources(cfg, i))
    if cfg.attn_res_block_size is not None and workload.attn_res_mix != "torch":
        # the completed blocks (embedding included) stay alive as saved sources: those received from earlier stages
        # and those completed here
        total += 2 * D * (layers[-1] // cfg.attn_res_block_size + 1)
    if last_stage and cfg.attn_res_block_size is not None:  # the final mix is outside every checkpoint
        final = (cfg.num_hidden_layers - 1) // cfg.attn_res_block_size + 2
        total += mix(final, "torch" if workload.attn_res_mix == "torch" else "fused")
    return total


def transient_activation_bytes_per_token(cfg, layer_idx: int, *, context: int) -> float:
    """Bytes per token live while one layer is recomputed and back-propagated (its full activations, bf16)."""
    cfg = ModelShape.of(cfg)
    D = cfg.hidden_size
    if cfg.is_kda_layer(layer_idx):
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        P = H * K
        # q, k, v before and after conv, normed q, k, decay (fp32), gate, o and its normed form: ~13 P bf16
        # words, plus the per-chunk [H, K, K] fp32 states fla keeps (two K×K per chunk: states and their grads)
        attn = 2 * (13 * P + 2 * D) + 2 * 4 * H * K * K / KDA_CHUNK
    else:
        H = cfg.num_attention_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        # q, expanded k and v (the whole sequence under CP), gate, o; the softmax is flash-style (no T² scores)
        attn = 2 * (H * qk + H * (qk + cfg.v_head_dim) + 2 * H * cfg.v_head_dim + cfg.kv_lora_rank + 2 * D)
    if cfg.is_moe_layer(layer_idx):
        M = cfg.routed_expert_hidden_size or D
        K_, I = cfg.num_experts_per_token, cfg.moe_intermediate_size
        # router scores (fp32); per (token, expert) pair: gathered input, [gate; up], GLU out, expert out
        ffn = 4 * cfg.num_experts + 2 * K_ * (2 * M + 3 * I) + 2 * (3 * I * cfg.num_shared_experts + 2 * M + D)
    else:
        ffn = 2 * (3 * cfg.intermediate_size + D)
    # the backward pass holds gradients of about the same size as the activations it consumes
    return 2 * max(attn, ffn)


def activation_scale() -> float:
    """Measured / modelled activation bytes per token on the calibration preset (one GPU, 64K tokens)."""
    from agentrl.model.config import preset_config

    cfg_small = ModelShape.of(preset_config(CALIBRATION_PRESET))
    work = Workload(context=65536, attn_res_mix=SMALL_ACTIVATION_ATTN_RES_MIX)
    layers = range(cfg_small.num_hidden_layers)
    modelled = (stored_activation_bytes_per_token(cfg_small, layers, work, last_stage=True)
                + max(transient_activation_bytes_per_token(cfg_small, i, context=65536) for i in layers))
    return SMALL_ACTIVATION_BYTES_PER_TOKEN / modelled


@dataclass(kw_only=True, slots=True)
class Memory:
    """Bytes per GPU on the heaviest pipeline stage."""
    stage: int
    layers: tuple[int, int]  # first, last (0-based, inclusive)
    weights: float
    gradients: float
    optimizer: float
    zero3_gather: float
    activations_stored: float
    activations_transient: float
    logits: float
    # parts of activations_transient, for the report: fla's per-chunk KDA states of one layer (forward and
    # gradient), one MLA layer's expanded keys and values of the whole sequence (all CP ranks' tokens)
    kda_states: float = 0.0
    mla_kv: float = 0.0

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.zero3_gather + self.activations_stored
                + self.activations_transient + self.logits)


def _stage_params(cfg, layers: range, *, first: bool, last: bool) -> tuple[int, int, tuple[int, int]]:
    """(non-expert, routed-expert) parameters of a stage, and those of its largest layer."""
    cfg = ModelShape.of(cfg)
    dense = expert = 0
    biggest = (0, 0)
    for i in layers:
        p = layer_params(cfg, i)
        e = p["routed_experts"]
        dense += sum(p.values()) - e
        expert += e
        biggest = max(biggest, (sum(p.values()) - e, e), key=sum)
    D = cfg.hidden_size
    if first:
        dense += cfg.vocab_size * D
    if last:
        dense += cfg.vocab_size * D + D + (2 * D if cfg.attn_res_block_size is not None else 0)
    return dense, expert, biggest


def memory_per_gpu(cfg, layout: Layout, workload: Workload, act_scale: float = 1.0) -> Memory:
    """Memory of the heaviest stage's GPUs."""
    return max(memory_by_stage(cfg, layout, workload, act_scale), key=lambda m: m.total)


def memory_by_stage(cfg, layout: Layout, workload: Workload, act_scale: float = 1.0) -> list[Memory]:
    """Memory per GPU of each pipeline stage (see the module docstring for the accounting)."""
    cfg = ModelShape.of(cfg)
    g_dense, g_expert = layout.dp * layout.cp, layout.expert_dp
    out = []
    micro_tokens = workload.micro_batch_tokens / layout.cp
    num_micro = max(1, math.ceil(workload.tokens_per_step / (workload.micro_batch_tokens * layout.dp)))
    for s, layers in enumerate(stages(cfg, layout.pp)):
        first, last = s == 0, s == layout.pp - 1
        dense, expert, biggest = _stage_params(cfg, layers, first=first, last=last)
        expert_local = expert / layout.ep

        def sharded(n_bytes: int, stage_from: int) -> float:
            d = dense / (g_dense if layout.zero >= stage_from else 1)
            e = expert_local / (g_expert if layout.zero >= stage_from else 1)
            return n_bytes * (d + e)

        in_flight = min(layout.pp - s, num_micro)  # 1F1B: stage s holds pp − s micro-batches
        stored = stored_activation_bytes_per_token(cfg, layers, workload, last_stage=last)
        # under CP an MLA layer also holds the other ranks' expanded keys and values (the whole sequence's)
        kv = BYTES_WEIGHT * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        transient = max(transient_activation_bytes_per_token(cfg, i, context=workload.context)
                        + (0 if cfg.is_kda_layer(i) else kv * (layout.cp - 1)) for i in layers)
        # ZeRO-3 holds two layers gathered (computing, prefetched): all their non-expert weights, their expert shard
        gather = 2 * BYTES_WEIGHT * (biggest[0] + biggest[1] / layout.ep) if layout.zero == 3 else 0.0
        logits = 3 * 4 * 1024 * cfg.vocab_size if last else 0.0  # one 1024-token fp32 chunk, its softmax, grad
        kda_states = mla_kv = 0.0
        if any(cfg.is_kda_layer(i) for i in layers):
            kda_states = 2 * 4 * cfg.kda_num_heads * cfg.kda_head_dim**2 / KDA_CHUNK * micro_tokens
        if not all(cfg.is_kda_layer(i) for i in layers):
            mla_kv = kv * workload.micro_batch_tokens
        mem = Memory(stage=s, layers=(layers[0], layers[-1]), kda_states=kda_states, mla_kv=mla_kv,
                     weights=sharded(BYTES_WEIGHT, 3), gradients=sharded(BYTES_GRAD, 2),
                     optimizer=sharded(BYTES_OPTIMIZER, 1), zero3_gather=gather,
                     activations_stored=act_scale * stored * micro_tokens * in_flight,
                     activations_transient=act_scale * transient * micro_tokens, logits=logits)
        out.append(mem)
    return out


# --- time -------------------------------------------------------------------------------------------------------------
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
    """One optimizer step on the slowest stage, micro-batch by micro-batch (see the module docstring)."""
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
        dense, expert, _ = _stage_params(cfg, layers, first=first, last=last)
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


# --- rollout (decode) -------------------------------------------------------------------------------------------------
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


# --- the plan ---------------------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class Plan:
    params: ParamCounts
    cluster: Cluster
    workload: Workload
    layout: Layout
    memory: Memory
    time: StepTime
    weight_gather_s: float  # publishing: the full weights gathered onto one rank (weight_gather_s)
    decode: Decode | None
    activation_scale: float  # measured / modelled activation memory on the calibration preset
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {name: asdict(getattr(self, name)) for name in ("params", "cluster", "workload", "layout", "memory",
                                                              "time")}
        out["params"].update(num_total=self.params.num_total, num_active=self.params.num_active)
        out["memory"]["total"] = self.memory.total
        out["time"]["total_s"] = self.time.total_s
        out["weight_gather_s"] = self.weight_gather_s
        out["decode"] = None if self.decode is None else dict(asdict(self.decode),
                                                              tokens_per_s=self.decode.tokens_per_s)
        out["activation_scale"] = self.activation_scale
        out["notes"] = self.notes
        return out


def trainer_supports(layout: Layout) -> bool:
    """Whether agentrl's trainer runs this layout today (trainer/config.py): data parallelism under ZeRO-2 or -3,
    expert parallelism under ZeRO-2 only; no pipeline or context parallelism yet."""
    return layout.pp == 1 and layout.cp == 1 and layout.zero in (2, 3) and (layout.ep == 1 or layout.zero == 2)


def candidate_layouts(cfg, cluster: Cluster, workload: Workload, fixed: dict[str, int] | None = None,
                      supported_only: bool = False) -> list[Layout]:
    """Every valid layout of the cluster's GPUs that agrees with the fixed degrees (searched: any pp dividing the
    GPUs, cp a power of two, ep any divisor, ZeRO 1-3), only those the trainer runs today if `supported_only`."""
    cfg = ModelShape.of(cfg)
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    world = cluster.num_gpus
    out = []
    pps = [fixed["pp"]] if "pp" in fixed else [p for p in range(1, min(cfg.num_hidden_layers, world) + 1)
                                                if world % p == 0]
    for pp in pps:
        rest = world // pp
        cps = [fixed["cp"]] if "cp" in fixed else [2**j for j in range(rest.bit_length()) if rest % 2**j == 0]
        for cp in cps:
            dp = rest // cp
            if "dp" in fixed and fixed["dp"] != dp:
                continue
            eps = [fixed["ep"]] if "ep" in fixed else range(1, dp * cp + 1)
            for ep in eps:
                for zero in ([fixed["zero"]] if "zero" in fixed else (1, 2, 3)):
                    layout = Layout(pp=pp, dp=dp, cp=cp, ep=ep, zero=zero)
                    try:
                        check_layout(cfg, layout, cluster, workload)
                    except ValueError:
                        continue
                    if supported_only and not trainer_supports(layout):
                        continue
                    out.append(layout)
    return out


def make_plan(cfg, cluster: Cluster, workload: Workload, fixed: dict[str, int] | None = None,
              mfu: float | None = None, with_decode: bool = True, supported_only: bool = False) -> Plan:
    """The fastest layout that fits (or the fixed one). Raises ValueError when nothing fits, with the closest miss."""
    cfg = ModelShape.of(cfg)
    act_scale = activation_scale()
    if mfu is not None and not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu} must lie in (0, 1]")
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    if fixed.keys() >= {"pp", "dp", "cp", "ep"}:
        check_layout(cfg, Layout(**{"zero": 1, **fixed}), cluster, workload)  # names the bad degree
    layouts = candidate_layouts(cfg, cluster, workload, fixed, supported_only)
    if not layouts:
        raise ValueError(f"no valid layout of {cluster.num_gpus} GPUs with {fixed or 'no fixed degrees'} "
                         f"(ep must divide dp·cp and the {cfg.num_experts} experts, pp ≤ "
                         f"{cfg.num_hidden_layers} layers, cp must split the micro-batch"
                         + ("; the trainer runs today only pp = cp = 1, ZeRO-2 or -3, ep > 1 under ZeRO-2 only)"
                            if supported_only else ")"))
    best = closest = None
    for layout in layouts:
        mem = memory_per_gpu(cfg, layout, workload, act_scale)
        if mem.total > cluster.usable_bytes:
            if closest is None or mem.total < closest[1].total:
                closest = (layout, mem)
            continue
        t = step_time(cfg, layout, cluster, workload, mfu)
        if best is None or t.total_s < best[2].total_s:
            best = (layout, mem, t)
    if best is None:
        layout, mem = closest
        parts = dict(weights=mem.weights, gradients=mem.gradients, optimizer=mem.optimizer,
                     gathered_layers=mem.zero3_gather, activations=mem.activations_stored + mem.activations_transient,
                     logits=mem.logits)
        breakdown = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f}" for k, v in parts.items() if v)
        raise ValueError(
            f"nothing fits in {cluster.num_gpus} × {cluster.gpu_memory_gib} GiB GPUs "
            f"({cluster.usable_bytes / GiB:.1f} GiB usable each): the closest, {layout.describe()}, needs "
            f"{mem.total / GiB:.1f} GiB per GPU ({breakdown}). Add GPUs, shorten the context or the micro-batch, "
            f"or raise ZeRO / CP / EP / PP.")
    layout, mem, t = best
    notes = []
    if not trainer_supports(layout):
        notes.append("agentrl's trainer does not run this layout yet (today: pp = cp = 1, ZeRO-2 or -3, ep > 1 under "
                     "ZeRO-2; --supported-only restricts the search to that)")
    if cfg.attn_res_block_size is not None:
        notes.append(f"AttnRes mixes: {ATTN_RES_MIXES[workload.attn_res_mix]} (--attn-res-mix)")
    decode = None
    if with_decode:
        try:
            decode = decode_throughput(cfg, cluster, workload.context)
        except ValueError as exc:
            notes.append(f"rollout: {exc}")
    return Plan(params=count_parameters(cfg), cluster=cluster, workload=workload, layout=layout, memory=mem, time=t,
                weight_gather_s=weight_gather_s(cfg, layout, cluster), decode=decode, activation_scale=act_scale,
                notes=notes)


def smallest_cluster(cfg, workload: Workload, fixed: dict[str, int] | None = None, mfu: float | None = None,
                     max_gpus: int = 2**16, supported_only: bool = False, **cluster_kwargs) -> Plan:
    """The plan on the fewest GPUs (1, 2, 4, ... up to a node, then whole nodes in powers of two) that fit."""
    cfg = ModelShape.of(cfg)
    gpn = cluster_kwargs.get("gpus_per_node", 8)
    sizes = [2**j for j in range(20) if 2**j < gpn] + [gpn * 2**j for j in range(20)]
    last_error = None
    for n in sizes:
        if n > max_gpus:
            break
        try:
            return make_plan(cfg, Cluster(num_gpus=n, **cluster_kwargs), workload, fixed, mfu,
                             supported_only=supported_only)
        except ValueError as exc:
            last_error = exc
    raise ValueError(f"no cluster of up to {max_gpus} GPUs fits: {last_error}")


def resolve_config(preset: str | None = None, path: str | None = None, overrides: dict[str, Any] | None = None):
    """A preset by name, or the config.json of a checkpoint directory (or the file itself)."""
    from agentrl.model.config import HybridMoEConfig, preset_config

    if (preset is None) == (path is None):
        raise ValueError("give exactly one of a preset name or a config path")
    if preset is not None:
        return preset_config(preset, **(overrides or {}))
    return HybridMoEConfig.from_pretrained(path, **(overrides or {}))


# --- the report ---------------------------------------------------------------------------------------------------
def _b(n: float) -> str:
    return f"{n / 1e9:,.3f}B" if n >= 1e8 else f"{n / 1e6:,.3f}M"


def format_plan(plan: Plan, name: str) -> str:
    """The text `agentrl plan` prints."""
    p, c, w, lay, m, t = plan.params, plan.cluster, plan.workload, plan.layout, plan.memory, plan.time
    lines = [f"model {name}", "parameters                      total          active"]
    for comp in COMPONENTS:
        if p.total[comp]:
            lines.append(f"  {comp:20s} {_b(p.total[comp]):>14s} {_b(p.active[comp]):>14s}")
    lines.append(f"  {'total':20s} {_b(p.num_total):>14s} {_b(p.num_active):>14s}")
    lines += [
        "",
        f"cluster  {c.num_gpus} GPUs of {c.gpu_memory_gib:g} GiB ({c.usable_bytes / GiB:.1f} GiB usable), "
        f"{c.gpus_per_node} per node; NVLink {c.intra_node_gbytes_s:g} GB/s, "
        f"{c.nics_per_node} × {c.inter_node_gbits_s:g} Gb/s per node; {c.peak_tflops:g} TFLOP/s bf16",
        f"workload {w.context:,} tokens per sequence, micro-batch {w.micro_batch_tokens:,} tokens, "
        f"{w.tokens_per_step:,} tokens per step, gradient checkpointing "
        f"{'on' if w.gradient_checkpointing else 'off'}",
        f"layout   {lay.describe()}",
        "",
        f"memory per GPU (GiB), stage {m.stage} of {lay.pp} (layers {m.layers[0]}–{m.layers[1]}), the heaviest",
    ]
    lines[-1] += f"; activations × {plan.activation_scale:.2f} (calibrated)"
    for label, value in (("weights (bf16)", m.weights), ("gradients (bf16)", m.gradients),
                         ("optimizer (fp32 master, m, v)", m.optimizer), ("ZeRO-3 gathered layers", m.zero3_gather),
                         ("activations kept (× in-flight)", m.activations_stored),
                         ("one layer recomputed + backward", m.activations_transient),
                         ("  (KDA chunk states, one layer)", m.kda_states),
                         ("  (MLA keys + values, one layer)", m.mla_kv),
                         ("logits chunk", m.logits)):
        lines.append(f"  {label:32s} {value / GiB:9.2f}")
    lines.append(f"  {'total':32s} {m.total / GiB:9.2f}  of {c.usable_bytes / GiB:.1f} usable")
    tokens_s = t.tokens_per_step / t.total_s
    if t.mfu_calibrated:
        e_dense, e_attention = calibrated_efficiency()
        source = (f"matmul work at {e_dense:.1%} and attention at {e_attention:.1%} of peak, calibrated on the "
                  f"`{CALIBRATION_PRESET}` preset")
        if w.gradient_checkpointing:
            source += f", × {CHECKPOINTING_SPEED} for recomputation"
    else:
        source = "given"
    lines += ["", f"training step (slowest stage; MFU {t.mfu:.1%}: {source})"]
    for label, value in (("compute", t.compute_s), ("expert all-to-all", t.expert_all_to_all_s),
                         ("ZeRO collectives", t.zero_collectives_s), ("context-parallel gathers", t.context_parallel_s),
                         ("pipeline sends", t.pipeline_send_s), ("pipeline bubble", t.bubble_s)):
        lines.append(f"  {label:32s} {value:9.3f} s")
    lines.append(f"  {'step':32s} {t.total_s:9.3f} s  = {tokens_s:,.0f} tokens/s "
                 f"({tokens_s / c.num_gpus:,.0f} per GPU)")
    fits_one = p.num_total * BYTES_WEIGHT <= c.usable_bytes
    lines.append(f"  {'publish: gather weights to one':32s} {plan.weight_gather_s:9.3f} s  (link-bound"
                 + (")" if fits_one else f"; {p.num_total * BYTES_WEIGHT / GiB:,.0f} GiB of bf16 weights do not "
                    f"fit one GPU: publishing at this size must stream or reshard)"))
    d = plan.decode
    if d is not None:
        lines += ["", f"rollout (decode at {w.context:,} tokens of context; assumed efficiencies, not calibrated)",
                  f"  replica {d.replica_gpus} GPUs (experts over all, the rest tensor-parallel in a node) × "
                  f"{d.num_replicas}; weights {d.weights_per_gpu / GiB:.1f} GiB per GPU",
                  f"  state per sequence {d.state_bytes_per_seq / GiB:.3f} GiB; {d.seqs_per_replica:,} sequences "
                  f"per replica; step {d.step_s * 1e3:.1f} ms ({d.bound}-bound)",
                  f"  {d.tokens_per_s_replica:,.0f} tokens/s per replica, {d.tokens_per_s:,.0f} on the cluster "
                  f"({d.tokens_per_s / c.num_gpus:,.0f} per GPU)"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
