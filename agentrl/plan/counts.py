"""Parameter counts by component, from the config alone (as `HybridDecoderLayer` builds the model)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
