"""The hybrid MoE model's configuration, in the keys of vLLM's Kimi Linear / Kimi K3 config, and its presets.

The config.json a checkpoint carries is read by three parties: this package, upstream vLLM's `KimiLinearForCausalLM`
(the K3 path on GPUs), and agentrl's vLLM plugin. Their shared keys are the contract, so the field names here are
vLLM's (`vllm/transformers_utils/configs/kimi_linear.py`); agentrl-only training knobs (load balancing) are extra keys
that the others ignore.

Missing keys take the family's defaults, not agentrl's K3 presets: the K3 features default to off as in vLLM's
KimiLinearConfig (no MLA output gate; `linear_attn_config` without `gate_lower_bound` is the unbounded gate, without
`use_full_rank_gate` the low-rank output gate; no AttnRes, no latent experts), so the released Kimi Linear
config.json, which names none of them, builds Kimi Linear. The presets (and so every checkpoint agentrl writes: it
saves every key) state their K3 features explicitly. The load balancer is an agentrl training knob, off unless the
config names it: fine-tuning a released checkpoint keeps its router bias as released (`model.overrides.moe_balancing`
turns Quantile Balancing on). A K3 directory's nested config is flattened on load (released.py); an incoming
`head_dim` is ignored (agentrl derives it; the released config's 72 is unused by every reader).

Layer layout: `linear_attn_config["kda_layers"]` and `["full_attn_layers"]` list 1-based layer numbers; every layer is
in exactly one of them. `first_k_dense_replace` layers at the bottom use a dense MLP; the others are MoE.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig

from agentrl.model.balancing import BALANCING_METHODS

ACTIVATIONS = ("silu", "situ")
# fla's bounded-gate kernels take lower bounds in [-5, 0); vLLM asserts the same range.
GATE_LOWER_BOUND_RANGE = (-5.0, 0.0)


class HybridMoEConfig(PretrainedConfig):
    """Kimi K3-family hybrid: KDA + gated MLA layers, fine-grained MoE, optional Block AttnRes.

    Attribute names follow vLLM's KimiLinearConfig. `linear_attn_config` holds the KDA settings: `kda_layers`,
    `full_attn_layers` (1-based), `num_heads`, `head_dim`, `short_conv_kernel_size`, `gate_lower_bound` (None for the
    unbounded −e^A·softplus gate, else g_min of g = g_min·σ(e^A·z)) and `use_full_rank_gate` (output gate W_g x of
    full rank instead of the low-rank g_b(g_a(x))).
    """

    model_type = "kimi_linear"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        intermediate_size: int = 2816,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        hidden_act: str = "silu",
        activation_situ_beta: float | None = None,
        activation_situ_linear_beta: float | None = None,
        initializer_range: float = 0.02,
        embedding_init_std: float | None = None,
        rms_norm_eps: float = 1e-5,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        # MLA
        q_lora_rank: int | None = None,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = False,
        # MoE
        num_experts: int | None = 64,
        num_experts_per_token: int = 8,
        num_shared_experts: int = 1,
        moe_intermediate_size: int = 512,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        routed_scaling_factor: float = 1.0,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        topk_method: str = "noaux_tc",
        routed_expert_hidden_size: int | None = None,
        latent_moe_use_norm: bool = False,
        # KDA and the layout
        linear_attn_config: dict[str, Any] | None = None,
        # Block AttnRes: None = plain residuals; else the number of layers per block
        attn_res_block_size: int | None = None,
        num_nextn_predict_layers: int = 0,
        max_position_embeddings: int = 1048576,
        # KDA's per-head output norm: vLLM's K3 kernels fix eps at 1e-5 (transformers' port uses rms_norm_eps)
        kda_output_norm_eps: float = 1e-5,
        # agentrl training knobs (ignored by vLLM); off by default: a released router bias stays as released
        moe_balancing: str = "none",
        moe_balancing_bins: int = 4096,
        moe_balancing_sign_rate: float = 1e-3,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        kwargs.pop("head_dim", None)  # derived below; a config's own value (the released 72) means nothing here
        self.head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.initializer_range = initializer_range
        # None: the token embeddings start at initializer_range like every other matrix
        self.embedding_init_std = embedding_init_std
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_renormalize = moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.routed_scaling_factor = routed_scaling_factor
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.topk_method = topk_method
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        if linear_attn_config is None:
            kda = [i + 1 for i in range(num_hidden_layers) if (i + 1) % 4 != 0 and i != num_hidden_layers - 1]
            linear_attn_config = {
                "kda_layers": kda,
                "full_attn_layers": [i + 1 for i in range(num_hidden_layers) if i + 1 not in kda],
                "num_heads": num_attention_heads,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
            }
        self.linear_attn_config = dict(linear_attn_config)
        self.attn_res_block_size = attn_res_block_size
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.max_position_embeddings = max_position_embeddings
        self.kda_output_norm_eps = kda_output_norm_eps
        self.moe_balancing = moe_balancing
        self.moe_balancing_bins = moe_balancing_bins
        self.moe_balancing_sign_rate = moe_balancing_sign_rate
        kwargs.setdefault("architectures", ["KimiLinearForCausalLM"])
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> HybridMoEConfig:
        """Also reads a Kimi K3 config.json (its language model's `text_config`, flattened; released.py)."""
        from agentrl.model import released

        if released.is_k3_config(config_dict):
            config_dict = released.flatten_config(config_dict)
        elif config_dict.get("quantization_config"):
            released.check_quantization(config_dict["quantization_config"])
            config_dict = {k: v for k, v in config_dict.items() if k != "quantization_config"}
        return super().from_dict(config_dict, **kwargs)

    # --- derived layout -------------------------------------------------------------------------------------------
    def is_kda_layer(self, layer_idx: int) -> bool:
        """Whether the 0-based layer `layer_idx` is a KDA layer (else gated MLA)."""
        return (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.num_experts is not None and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @property
    def kda_num_heads(self) -> int:
        return self.linear_attn_config["num_heads"]

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config["head_dim"]

    @property
    def kda_conv_size(self) -> int:
        return self.linear_attn_config.get("short_conv_kernel_size", 4)

    @property
    def gate_lower_bound(self) -> float | None:
        return self.linear_attn_config.get("gate_lower_bound")

    @property
    def use_full_rank_gate(self) -> bool:
        return bool(self.linear_attn_config.get("use_full_rank_gate", False))

    # --- validation -----------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raises ValueError naming the first bad field and its value."""

        def bad(field: str, value: Any, why: str) -> ValueError:
            return ValueError(f"HybridMoEConfig.{field}={value!r}: {why}")

        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                      "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise bad(field, value, "must be a positive integer")
        if not self.initializer_range > 0:
            raise bad("initializer_range", self.initializer_range, "must be > 0")
        if self.embedding_init_std is not None and not self.embedding_init_std > 0:
            raise bad("embedding_init_std", self.embedding_init_std, "must be None (initializer_range) or > 0")
        if self.qk_rope_head_dim < 0:
            raise bad("qk_rope_head_dim", self.qk_rope_head_dim, "must be >= 0")
        if self.hidden_act not in ACTIVATIONS:
            raise bad("hidden_act", self.hidden_act, f"must be one of {ACTIVATIONS}")
        if self.moe_router_activation_func != "sigmoid":
            raise bad("moe_router_activation_func", self.moe_router_activation_func,
                      "agentrl's router is sigmoid-scored (the selection bias assumes scores in (0, 1))")
        if not self.mla_use_nope:
            raise bad("mla_use_nope", self.mla_use_nope, "the K3 family is NoPE: position comes from KDA's decay")
        lac = self.linear_attn_config
        for key in ("kda_layers", "full_attn_layers", "num_heads", "head_dim"):
            if key not in lac:
                raise bad("linear_attn_config", lac, f"missing key {key!r}")
        layers = list(lac["kda_layers"]) + list(lac["full_attn_layers"])
        if sorted(layers) != list(range(1, self.num_hidden_layers + 1)):
            raise bad("linear_attn_config", {k: lac[k] for k in ("kda_layers", "full_attn_layers")},
                      f"kda_layers and full_attn_layers must partition the 1-based layers 1..{self.num_hidden_layers}")
        lb = lac.get("gate_lower_bound")
        if lb is not None and not GATE_LOWER_BOUND_RANGE[0] <= lb < GATE_LOWER_BOUND_RANGE[1]:
            raise bad("linear_attn_config.gate_lower_bound", lb, f"must lie in [{GATE_LOWER_BOUND_RANGE[0]}, 0)")
        if self.num_experts is not None:
            if not 0 < self.num_experts_per_token < self.num_experts:
                raise bad("num_experts_per_token", self.num_experts_per_token,
                          f"must be in [1, num_experts={self.num_experts})")
            if self.num_experts % self.num_expert_group:
                raise bad("num_expert_group", self.num_expert_group,
                          f"must divide num_experts={self.num_experts}")
            if not 0 < self.topk_group <= self.num_expert_group:
                raise bad("topk_group", self.topk_group, f"must be in [1, num_expert_group={self.num_expert_group}]")
            if self.moe_layer_freq < 1:
                raise bad("moe_layer_freq", self.moe_layer_freq, "must be >= 1")
        if self.moe_balancing not in BALANCING_METHODS:
            raise bad("moe_balancing", self.moe_balancing, f"must be one of {BALANCING_METHODS}")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise bad("attn_res_block_size", self.attn_res_block_size, "must be None (plain residuals) or >= 1 layer")
        if self.tie_word_embeddings:
            raise bad("tie_word_embeddings", True, "vLLM's Kimi loader always reads a separate lm_head.weight")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", self.num_key_value_heads, "must divide num_attention_heads")


def _layout(num_layers: int, mla_every: int) -> dict[str, list[int]]:
    """KDA:MLA = (mla_every−1):1 with the last layer MLA, as in K3."""
    full = [i for i in range(1, num_layers + 1) if i % mla_every == 0 or i == num_layers]
    return {"kda_layers": [i for i in range(1, num_layers + 1) if i not in full], "full_attn_layers": full}


# what agentrl's own presets add to the family's defaults besides the bounded gate and AttnRes
_K3_FEATURES = dict(mla_use_output_gate=True, moe_balancing="quantile")

PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the quickstart: < 5M parameters.
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, routed_scaling_factor=1.0, attn_res_block_size=2, **_K3_FEATURES,
        linear_attn_config=dict(_layout(4, 4), num_heads=2, head_dim=16, short_conv_kernel_size=4,
                                gate_lower_bound=-5.0, use_full_rank_gate=True),
    ),
    # One GPU: a few hundred million parameters in total.
    "small": dict(
        vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
        num_experts=32, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=512,
        first_k_dense_replace=1, routed_scaling_factor=2.0, attn_res_block_size=2, **_K3_FEATURES,
        routed_expert_hidden_size=512, latent_moe_use_norm=True,
        linear_attn_config=dict(_layout(8, 4), num_heads=8, head_dim=128, short_conv_kernel_size=4,
                                gate_lower_bound=-5.0, use_full_rank_gate=True),
    ),
    # The released Kimi Linear's shape at CPU-test size: its config.json's keys (no output gate, unbounded gate,
    # low-rank output gate, no AttnRes, router bias kept), shrunk; 3 KDA : 1 MLA with the last layer MLA.
    "kimi-linear-tiny": dict(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
        routed_scaling_factor=2.446, rms_norm_eps=1e-5,
        linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=2, head_dim=16,
                                short_conv_kernel_size=4),
    ),
    # moonshotai/Kimi-Linear-48B-A3B (the released Kimi Linear: unbounded gate, low-rank output gate, no AttnRes).
    "kimi-linear-48b-a3b": dict(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=27, num_attention_heads=32,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=False,
        num_experts=256, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024,
        first_k_dense_replace=1, routed_scaling_factor=2.446, rms_norm_eps=1e-5,
        linear_attn_config=dict(kda_layers=[i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                                full_attn_layers=[4, 8, 12, 16, 20, 24, 27], num_heads=32, head_dim=128,
                                short_conv_kernel_size=4, gate_lower_bound=None, use_full_rank_gate=False),
    ),
    # Kimi K3: 93 layers (69 KDA + 24 MLA), hidden 7168, 896 routed experts top-16, 2 shared, expert hidden 3072,
    # latent width 3584, vocab 160K; 2.78T total / 104.2B active. The head counts are not published with those
    # figures: 96 KDA heads and 80 MLA heads of 128 reproduce both totals (2778.3B / 104.17B, tests/unit).
    "k3": dict(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, num_hidden_layers=93, num_attention_heads=80,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
        routed_expert_hidden_size=3584, latent_moe_use_norm=True, first_k_dense_replace=1,
        routed_scaling_factor=2.5, hidden_act="situ", activation_situ_beta=1.0, attn_res_block_size=8, **_K3_FEATURES,
        linear_attn_config=dict(_layout(93, 4), num_heads=96, head_dim=128, short_conv_kernel_size=4,
                                gate_lower_bound=-5.0, use_full_rank_gate=True),
    ),
}


def preset_config(name: str, **overrides: Any) -> HybridMoEConfig:
    """A preset by name, with field overrides (e.g. attn_res_block_size=None)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    kwargs = copy.deepcopy(PRESETS[name])
    lac_overrides = overrides.pop("linear_attn_config", None)
    if lac_overrides:
        kwargs["linear_attn_config"].update(lac_overrides)
    kwargs.update(overrides)
    return HybridMoEConfig(**kwargs)
