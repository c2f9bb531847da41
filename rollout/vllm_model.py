"""agentrl's hybrid MoE model (KDA + gated MLA, MoE, Block AttnRes) as a vLLM model: `AgentRLHybridForCausalLM`.

Legend: T = tokens of one engine step (all running requests packed), N = requests in the step, D = hidden,
H = heads, K = KDA head dim, E = qk_nope_head_dim, P = qk_rope_head_dim, V = v_head_dim, Dp = padded MLA head size,
L = MoE layers, k = experts per token.

The model *is* agentrl's `HybridMoEModel` (embedding, decoder layers, MoE with the selection-only bias, dense MLPs,
norms, Block AttnRes, final norm — the same modules and forward, so the same math), with each layer's token mixer
swapped for a subclass that keeps its state in vLLM's caches:

- KDA (`VllmKDA`): a vLLM `MambaBase` layer whose short-convolution and recurrent states live in vLLM's mamba cache
  (GDN_ATTN metadata: per request a state slot, decodes first, `has_initial_state` for prefills). Each step gathers
  the requests' states, runs agentrl's own `KimiDeltaAttention.forward` with them (the recurrent step when every
  request brings one token, the chunked kernel otherwise; fla on CUDA), and writes the final states back. Chunked
  prefill and prefix caching ("align" mamba cache mode, where vLLM copies states between blocks) need nothing else.
- MLA (`VllmMLA`): agentrl's projections and latent expansion, attended by vLLM's standard `Attention` layer as
  expanded multi-head attention: the cache holds per-head keys [E+P] and values [V], both zero-padded to one head
  size Dp that the CPU backend supports (32, 64, ..., 256, 512), with the softmax scale of the unpadded E+P. Zero
  padding changes no dot product, and the padded value lanes are dropped. This costs memory: per token and MLA layer
  the cache holds 2·H·Dp values instead of the latent's R+P (tiny preset: 2·2·32 = 128 vs 40; K3: 2·80·192 =
  30,720 vs 576, ~53×). vLLM's CPU_MLA backend would keep the latent, but it runs only at block size 16, which hybrid
  models cannot use (their attention blocks are aligned up to the KDA state page). On GPUs, upstream vLLM's own
  `KimiLinearForCausalLM` serves the same checkpoint with the latent cache; this plugin stays selectable there.

vLLM must not treat this model as MLA (its model-type list marks "kimi_linear" as MLA, which would route every
attention layer to an MLA backend and, on CPU, switch prefix caching off). `engine.py` therefore serves checkpoints
with `hf_overrides` that name this architecture, a model type outside that list and the padded head size
(`plugin_hf_overrides`).

Weights load from the checkpoint names (`checkpoint.py`): per-expert w1/w3/w2 go into the stacked w13/w2, A_log
[1, 1, H, 1] is flattened, everything else is copied by name. The modules are plain PyTorch ones (no vLLM
repacking), so an in-place reload is a copy into the parameters (`weight_sync.py`). Tensor parallelism is not
supported (one worker); the model runs eagerly (`enforce_eager=True`).

Each forward records the routed experts of its tokens [T, L, k] and their positions (`last_step`), which
`routing.py` turns into per-request routing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMambaPrefixCaching
from vllm.model_executor.models.utils import maybe_prefix
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from agentrl.model.cache import KDAState
from agentrl.model.checkpoint import _PER_EXPERT
from agentrl.model.config import HybridMoEConfig
from agentrl.model.kda import KimiDeltaAttention
from agentrl.model.mla import GatedMLA
from agentrl.model.modeling import HybridMoEModel
from agentrl.rollout.vllm_plugin import ARCHITECTURE, MODEL_TYPE

# Head sizes vLLM's CPU attention backend accepts (v1/attention/backends/cpu_attn.py); GPU backends take them too.
ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def hybrid_config(model_dir: str) -> HybridMoEConfig:
    """agentrl's config of the served checkpoint, read from its config.json as the trainer reads it (not from the
    config vLLM built: its KimiLinearConfig fills missing keys with defaults of its own, e.g. rms_norm_eps 1e-6 and no
    shared experts, where agentrl's are the family's), so engine and trainer always build the same model."""
    return HybridMoEConfig.from_pretrained(model_dir)


def expanded_head_size(config: HybridMoEConfig) -> int:
    """Dp: the smallest supported attention head size that holds both the key (E+P) and the value (V)."""
    need = max(config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
    for size in ATTENTION_HEAD_SIZES:
        if size >= need:
            return size
    raise ValueError(f"MLA head of {need} channels exceeds the largest attention head size {ATTENTION_HEAD_SIZES[-1]}")


def plugin_hf_overrides(config: HybridMoEConfig) -> dict:
    """What `LLM(..., hf_overrides=...)` needs to serve an agentrl checkpoint with this model (see module doc)."""
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "head_dim": expanded_head_size(config),
            "num_key_value_heads": config.num_attention_heads}


def _kda_metadata(prefix: str) -> GDNAttentionMetadata | None:
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):  # profiling and dummy runs
        return None
    return metadata.get(prefix)


class VllmKDA(KimiDeltaAttention, MambaBase):
    """agentrl's KDA layer with its conv and recurrent states in vLLM's mamba cache (one slot per request)."""

    def __init__(self, config: HybridMoEConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__(config, layer_idx)
        self.prefix = prefix
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        forward_context = vllm_config.compilation_config.static_forward_context
        if prefix in forward_context:
            raise ValueError(f"duplicate layer name {prefix!r}")
        forward_context[prefix] = self  # vLLM binds this layer's cache and metadata by that name

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self):
        return MambaStateShapeCalculator.kda_state_shape(1, self.num_heads, self.head_dim,
                                                         conv_kernel_size=self.conv_size)

    def get_state_dtype(self):
        return MambaStateDtypeCalculator.kda_state_dtype(self.model_config.dtype, self.cache_config.mamba_cache_dtype,
                                                         self.cache_config.mamba_ssm_cache_dtype)

    def forward(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor, state: KDAState | None = None,
                use_cache: bool = False, shard: None = None) -> tuple[torch.Tensor, None]:
        """The step's tokens → KDA output; request boundaries and states come from vLLM, not from the arguments
        (`shard`, context parallelism, is for training: always None here)."""
        out_TD = torch.zeros_like(x_TD)
        m = _kda_metadata(self.prefix)
        if m is None:
            return out_TD, None
        if m.num_spec_decodes:
            raise NotImplementedError("agentrl's vLLM model does not support speculative decoding")
        num_seqs = m.num_decodes + m.num_prefills
        if num_seqs == 0:
            return out_TD, None
        query_start = m.non_spec_query_start_loc[: num_seqs + 1]
        num_tokens = int(query_start[-1])
        slots = m.non_spec_state_indices_tensor[:num_seqs].long()
        conv_cache, recurrent_cache = self.kv_cache
        conv_NCW = conv_cache[slots] if is_conv_state_dim_first() else conv_cache[slots].transpose(1, 2)
        recurrent_NHKV = recurrent_cache[slots].float()
        if m.has_initial_state is not None:  # prefills present: a fresh request starts from zeros
            fresh_N = ~m.has_initial_state[:num_seqs].bool()
            conv_NCW = conv_NCW.masked_fill(fresh_N[:, None, None], 0.0)
            recurrent_NHKV = recurrent_NHKV.masked_fill(fresh_N[:, None, None, None], 0.0)
        y_TD, final = KimiDeltaAttention.forward(
            self, x_TD[:num_tokens], query_start.to(torch.int32),
            KDAState(conv_NCW=conv_NCW.float(), recurrent_NHKV=recurrent_NHKV), use_cache=True)
        new_conv = final.conv_NCW if is_conv_state_dim_first() else final.conv_NCW.transpose(1, 2)
        conv_cache[slots] = new_conv.to(conv_cache.dtype)
        recurrent_cache[slots] = final.recurrent_NHKV.to(recurrent_cache.dtype)
        out_TD[:num_tokens] = y_TD
        return out_TD, None


class VllmMLA(GatedMLA):
    """agentrl's gated MLA projections; attention over vLLM's paged cache as expanded multi-head attention."""

    def __init__(self, config: HybridMoEConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__(config, layer_idx)
        self.padded_head = expanded_head_size(config)
        self.attn = Attention(self.num_heads, self.padded_head, self.scale, num_kv_heads=self.num_heads,
                              cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn")

    def forward(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor, state=None, use_cache: bool = False,
                shard: None = None) -> tuple[torch.Tensor, None]:
        num_tokens = x_TD.shape[0]
        qk_dim = self.nope_dim + self.pe_dim
        q = self.q_proj(x_TD) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
        latent, k_pe = self.kv_a_proj_with_mqa(x_TD).split([self.kv_rank, self.pe_dim], dim=-1)
        k, v = self._expand(self.kv_a_layernorm(latent), k_pe)
        q = F.pad(q.view(num_tokens, self.num_heads, qk_dim), (0, self.padded_head - qk_dim))
        k = F.pad(k, (0, self.padded_head - qk_dim))
        v = F.pad(v, (0, self.padded_head - self.v_dim))
        o = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1))
        o = o.view(num_tokens, self.num_heads, self.padded_head)[..., : self.v_dim]
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x_TD)).view(num_tokens, self.num_heads, self.v_dim)
        return self.o_proj(o.reshape(num_tokens, self.num_heads * self.v_dim)), None


@dataclass(kw_only=True, slots=True)
class StepRouting:
    """The experts the last forward chose: [T, L, k] (agentrl's `routed_experts` layout) and the tokens' positions."""

    index: int  # forwards so far; tells a reader whether a new step ran
    experts_TLK: torch.Tensor
    positions_T: torch.Tensor


class AgentRLHybridForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsMambaPrefixCaching):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError(f"{ARCHITECTURE} runs on one worker; got tensor_parallel_size="
                             f"{parallel.tensor_parallel_size}, pipeline_parallel_size="
                             f"{parallel.pipeline_parallel_size} (upstream vLLM's KimiLinearForCausalLM serves in "
                             "parallel)")
        if not vllm_config.model_config.enforce_eager:
            raise ValueError(f"{ARCHITECTURE} runs eagerly: pass enforce_eager=True")
        config = hybrid_config(vllm_config.model_config.model)
        self.config = config
        self.model = HybridMoEModel(config)
        model_prefix = maybe_prefix(prefix, "model")
        for layer in self.model.layers:
            name = f"{model_prefix}.layers.{layer.layer_idx}.self_attn"
            mixer = VllmKDA if layer.is_kda else VllmMLA
            layer.self_attn = mixer(config, layer.layer_idx, vllm_config, name)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.num_moe_layers = len(self.model.moe_layer_ids)
        self.top_k = config.num_experts_per_token
        self.last_step: StepRouting | None = None
        self._num_forwards = 0
        self.train(False)  # the routers' load balancers observe only in training

    # --- vLLM's hybrid-model contract ---------------------------------------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        lac = vllm_config.model_config.hf_text_config.linear_attn_config
        return MambaStateShapeCalculator.kda_state_shape(1, lac["num_heads"], lac["head_dim"],
                                                         conv_kernel_size=lac.get("short_conv_kernel_size", 4))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.kda_state_dtype(vllm_config.model_config.dtype, cache.mamba_cache_dtype,
                                                         cache.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.kda_state_copy_func()

    # --- forward -------------------------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if inputs_embeds is not None:
            raise NotImplementedError(f"{ARCHITECTURE} takes token ids, not input embeddings")
        whole = torch.tensor([0, input_ids.shape[0]], dtype=torch.int32, device=input_ids.device)
        hidden, routed = self.model(input_ids, whole)
        self._num_forwards += 1
        if routed is not None:
            self.last_step = StepRouting(index=self._num_forwards, experts_TLK=routed, positions_T=positions)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    # --- weights -------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     expert_slices: dict[str, int] | None = None) -> set[str]:
        """Copies checkpoint-named tensors into the model in place; returns the parameter names it wrote.

        A routed-experts parameter counts as written once every expert's slice has arrived; `expert_slices` carries
        the count across calls (a transfer whose buckets split a layer's experts). Unknown names and shape
        mismatches raise ValueError.
        """
        targets = dict(self.named_parameters())
        targets.update((n, b) for n, b in self.named_buffers() if n.endswith("e_score_correction_bias"))
        expert_slices = {} if expert_slices is None else expert_slices
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if m := _PER_EXPERT.match(name):
                    prefix, expert, which = m[1], int(m[2]), m[3]
                    target_name = f"{prefix}.{'w2' if which == 'w2' else 'w13'}_weight"
                    param = targets.get(target_name)
                    if param is None:
                        raise ValueError(f"checkpoint tensor {name!r} has no parameter {target_name!r} in "
                                         f"{ARCHITECTURE}")
                    if which == "w2":
                        dest = param[expert]
                    else:
                        half = param.shape[1] // 2
                        dest = param[expert, :half] if which == "w1" else param[expert, half:]
                    _copy(dest, tensor, name)
                    expert_slices[target_name] = expert_slices.get(target_name, 0) + 1
                    slices_needed = param.shape[0] * (1 if which == "w2" else 2)
                    if expert_slices[target_name] == slices_needed:
                        loaded.add(target_name)
                    continue
                if name.endswith(".A_log"):
                    tensor = tensor.reshape(-1)
                target = targets.get(name)
                if target is None:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {ARCHITECTURE}")
                _copy(target, tensor, name)
                loaded.add(name)
        return loaded


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dest.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, the model expects "
                         f"{tuple(dest.shape)}")
    dest.copy_(src)
