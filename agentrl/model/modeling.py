"""HybridMoEForCausalLM: the Kimi K3-family policy model (KDA + gated MLA, MoE, Block AttnRes).

Legend: B = batch rows, T = tokens (packed over all sequences), N = sequences, D = hidden, V = vocabulary,
L = MoE layers, K = experts per token.

Every layer works on packed tokens [T, D] with `cu_seqlens` ([N+1] offsets): a [B, T] batch is packed as B equal
sequences, so training on packed variable-length sequences and plain batches share one code path, and nothing
crosses a sequence boundary (KDA state, convolution, MLA attention).

For training, `forward(..., target_ids=...)` returns per-token log-probabilities of the targets computed chunk by
chunk with a hand-written backward that remakes each chunk's logits, so the [T, V] logits of a long sequence never
exist at once.

The decoder layers never call torch.distributed themselves: sharding and the bias all-reduce live in the trainer,
and what crosses ranks under context or expert parallelism lives in context_parallel.py and expert_parallel.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from agentrl.model import logprob_kernels
from agentrl.model.attn_res import BlockState, attn_res_mix, attn_res_query
from agentrl.model.balancing import update_biases
from agentrl.model.cache import HybridCache
from agentrl.model.checkpoint import load_checkpoint_tensors, load_state_into, save_checkpoint
from agentrl.model.config import HybridMoEConfig
from agentrl.model.context_parallel import ContextShard
from agentrl.model.kda import KimiDeltaAttention
from agentrl.model.layers import MLP, RMSNorm
from agentrl.model.mla import GatedMLA
from agentrl.model.moe import SparseMoE

# one log-prob chunk holds at most this many fp32 logits (256 MB): 2048 tokens at a 32K vocabulary, 409 at K3's 164K
LOGPROB_CHUNK_ELEMENTS = 1 << 26


@dataclass(kw_only=True)
class HybridOutput:
    logits: torch.Tensor | None = None  # [B, T, V] or [T, V] (packed input)
    token_logprobs: torch.Tensor | None = None  # [B, T] or [T]: log p(target_t | tokens ≤ t)
    entropy: torch.Tensor | None = None  # same shape: entropy of the next-token distribution
    hidden_states: torch.Tensor | None = None  # final-norm hidden states
    cache: HybridCache | None = None
    routed_experts: torch.Tensor | None = None  # [T, L, K] int: experts chosen per token per MoE layer


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridMoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda_layer(layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.self_attn = KimiDeltaAttention(config, layer_idx) if self.is_kda else GatedMLA(config, layer_idx)
        if self.is_moe:
            self.block_sparse_moe = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           config.activation_situ_beta, config.activation_situ_linear_beta)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.use_attn_res = config.attn_res_block_size is not None
        if self.use_attn_res:
            self.self_attention_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.self_attention_res_proj = attn_res_query(config.hidden_size)
            self.mlp_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_res_proj = attn_res_query(config.hidden_size)

    def attention(self, h_TD, cu_seqlens, cache: HybridCache | None, use_cache: bool,
                  shard: ContextShard | None = None) -> torch.Tensor:
        state = None if cache is None else cache.layers[self.layer_idx]
        out, new_state = self.self_attn(self.input_layernorm(h_TD), cu_seqlens, state, use_cache, shard=shard)
        if use_cache:
            cache.layers[self.layer_idx] = new_state
        return out

    def feed_forward(self, h_TD, forced_experts_TK, counted_T=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        h_TD = self.post_attention_layernorm(h_TD)
        if self.is_moe:
            return self.block_sparse_moe(h_TD, forced_experts_TK, counted_T)
        return self.mlp(h_TD), None


class HybridMoEModel(nn.Module):
    def __init__(self, config: HybridMoEConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_res_block_size = config.attn_res_block_size
        if self.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.output_attn_res_proj = attn_res_query(config.hidden_size)
        self.moe_layer_ids = [i for i, layer in enumerate(self.layers) if layer.is_moe]
        self.gradient_checkpointing = False

    def _run(self, fn, *args):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def forward(self, input_ids_T: torch.Tensor, cu_seqlens: torch.Tensor, cache: HybridCache | None = None,
                use_cache: bool = False, forced_experts_TLK: torch.Tensor | None = None,
                shard: ContextShard | None = None, counted_T: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed tokens → final-norm hidden states [T, D] and the routed experts [T, L, K] (None without MoE).

        `shard`: under context parallelism the tokens are this rank's slice of a micro-batch and `cu_seqlens` its
        pieces of sequences (shard.cu_seqlens); KDA and MLA exchange what crosses ranks (context_parallel.py),
        everything else is per token. The trainer slices on the host: the shard's offsets come to the tokens'
        device here. `counted_T`: the tokens the MoE layers' load balancers count (None: all; a micro-batch padded
        for a CUDA graph leaves its padding out)."""
        if shard is not None and shard.cu_seqlens.device != input_ids_T.device:
            shard = shard.on(input_ids_T.device)
        x = self.embed_tokens(input_ids_T)
        routed: list[torch.Tensor] = []
        moe_slot = {layer_id: i for i, layer_id in enumerate(self.moe_layer_ids)}
        blocks = BlockState(x, self.attn_res_block_size) if self.attn_res_block_size is not None else None
        for layer in self.layers:
            forced = None
            if forced_experts_TLK is not None and layer.is_moe:
                forced = forced_experts_TLK[:, moe_slot[layer.layer_idx]]
            attn = lambda h, layer=layer: layer.attention(h, cu_seqlens, cache, use_cache, shard)  # noqa: E731
            ffn = lambda h, f=forced, layer=layer: layer.feed_forward(h, f, counted_T)  # noqa: E731
            if blocks is None:
                x = x + self._run(attn, x)
                out, experts = self._run(ffn, x)
                x = x + out
            else:
                sources = blocks.before_attention(layer.layer_idx)
                h = attn_res_mix(sources, layer.self_attention_res_norm, layer.self_attention_res_proj)
                sources = blocks.after_attention(layer.layer_idx, self._run(attn, h))
                h = attn_res_mix(sources, layer.mlp_res_norm, layer.mlp_res_proj)
                out, experts = self._run(ffn, h)
                blocks.after_mlp(out)
            if experts is not None:
                routed.append(experts)
        if blocks is not None:
            x = attn_res_mix(blocks.final_sources(), self.output_attn_res_norm, self.output_attn_res_proj)
        if cache is not None and use_cache:
            cache.seq_lens = cache.seq_lens + (cu_seqlens[1:] - cu_seqlens[:-1]).cpu()
        return self.norm(x), (torch.stack(routed, dim=1) if routed else None)


class HybridMoEPreTrainedModel(PreTrainedModel):
    config_class = HybridMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Embedding) and self.config.embedding_init_std is not None:
            module.weight.normal_(0.0, self.config.embedding_init_std)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            if getattr(module, "_zero_init", False):
                module.weight.zero_()
            else:
                module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Conv1d):
            # depthwise short convolution: fan-in is the width
            bound = module.weight.shape[-1] ** -0.5
            module.weight.uniform_(-bound, bound)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, KimiDeltaAttention):
            module.o_norm.weight.fill_(1.0)
            module.reset_gate_parameters()
        elif module.__class__.__name__ == "Router":
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif module.__class__.__name__ == "RoutedExperts":
            module.w13_weight.normal_(0.0, std)
            module.w2_weight.normal_(0.0, std)


class HybridMoEForCausalLM(HybridMoEPreTrainedModel):
    def __init__(self, config: HybridMoEConfig):
        super().__init__(config)
        self.model = HybridMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.out_features == 1:
                module._zero_init = True  # AttnRes queries start at zero: a uniform mix of the sources
        self.post_init()

    def save_pretrained(self, save_directory: str, **_ignored) -> list[str]:
        """Writes config.json and safetensors in the Kimi Linear / K3 checkpoint layout (see checkpoint.py)."""
        return save_checkpoint(self, save_directory)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, **config_overrides) -> HybridMoEForCausalLM:
        """Loads a checkpoint written by save_pretrained (or any checkpoint in that layout), strictly."""
        config = HybridMoEConfig.from_pretrained(path, **config_overrides)
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=device or "cpu")
        load_state_into(model, load_checkpoint_tensors(path))
        if dtype is not None:
            model = model.to(dtype)
        return model

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def moe_layers(self) -> list[SparseMoE]:
        return [layer.block_sparse_moe for layer in self.model.layers if layer.is_moe]

    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                cache: HybridCache | None = None, use_cache: bool = False,
                target_ids: torch.Tensor | None = None, temperature: float = 1.0, return_entropy: bool = False,
                forced_experts: torch.Tensor | None = None, logits_to_keep: int | None = None,
                return_hidden: bool = False) -> HybridOutput:
        """Runs the model on a [B, T] batch or on packed 1-D tokens with `cu_seqlens`.

        Args:
            target_ids: same shape as input_ids; when given, returns `token_logprobs` (and `entropy` if asked) of
                logits/temperature instead of logits.
            cache / use_cache: continue and/or record decoding state (see HybridCache).
            forced_experts: [T, L, K] experts to use in the MoE layers (routing replay), T in packed order.
            logits_to_keep: only the last n positions of each row get logits (generation).
        """
        batched = input_ids.dim() == 2
        if batched:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens goes with packed 1-D input_ids; got a 2-D batch")
            rows, length = input_ids.shape
            cu_seqlens = torch.arange(0, rows * length + 1, length, device=input_ids.device, dtype=torch.int32)
            flat_ids = input_ids.reshape(-1)
        else:
            if cu_seqlens is None:
                cu_seqlens = torch.tensor([0, input_ids.numel()], device=input_ids.device, dtype=torch.int32)
            flat_ids = input_ids
        if int(cu_seqlens[-1]) != flat_ids.numel():
            raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but there are {flat_ids.numel()} tokens")
        if use_cache and cache is None:
            cache = HybridCache.empty(self.config.num_hidden_layers, cu_seqlens.numel() - 1)
        hidden, routed = self.model(flat_ids, cu_seqlens, cache, use_cache, forced_experts)
        out = HybridOutput(cache=cache if use_cache else None, routed_experts=routed,
                           hidden_states=hidden if return_hidden else None)
        unflatten = (lambda t: t.view(rows, length, *t.shape[1:])) if batched else (lambda t: t)
        if target_ids is not None:
            flat_targets = target_ids.reshape(-1)
            logprobs, entropy = chunked_token_logprobs(hidden, self.lm_head.weight, flat_targets, temperature,
                                                       return_entropy)
            out.token_logprobs = unflatten(logprobs)
            out.entropy = unflatten(entropy) if entropy is not None else None
            return out
        if logits_to_keep is not None:
            ends = cu_seqlens[1:].long()
            keep = torch.cat([torch.arange(int(e) - logits_to_keep, int(e)) for e in ends]).to(hidden.device)
            logits = self.lm_head(hidden[keep])
            out.logits = logits.view(-1, logits_to_keep, logits.shape[-1]) if batched else logits
        else:
            out.logits = unflatten(self.lm_head(hidden))
        return out

    @torch.no_grad()
    def generate_tokens(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                        generator: torch.Generator | None = None) -> torch.Tensor:
        """Sampling with the decoding cache (greedy at temperature 0), for tests and evaluation. [B, T+new]"""
        out = self(input_ids, use_cache=True, logits_to_keep=1)
        cache, tokens = out.cache, [input_ids]
        logits = out.logits[:, -1]
        for _ in range(max_new_tokens):
            if temperature == 0.0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)
            tokens.append(nxt)
            out = self(nxt, cache=cache, use_cache=True)
            logits = out.logits[:, -1]
        return torch.cat(tokens, dim=1)

    @contextlib.contextmanager
    def balancers_observing(self, observe: bool):
        """Whether the routers feed their balancers meanwhile (their `training` flag gates observation). A trainer
        turns it off for padding micro-batches and for the backward, where gradient checkpointing runs each layer's
        forward again: the same tokens would be counted twice, at a dozen more kernel launches per MoE layer."""
        gates = [moe.gate for moe in self.moe_layers]
        was = [gate.training for gate in gates]
        if not observe:
            for gate in gates:
                gate.training = False
        try:
            yield
        finally:
            for gate, training in zip(gates, was):
                gate.training = training

    @torch.no_grad()
    def update_expert_bias(self, all_reduce=None) -> dict[str, float]:
        """Applies every MoE layer's balancer after an optimizer step (one collective for all layers); returns
        max/mean expert load per layer."""
        gates = [moe.gate for moe in self.moe_layers]
        new_biases = update_biases([g.balancer for g in gates], [g.e_score_correction_bias for g in gates], all_reduce)
        written = [(gate.e_score_correction_bias, new) for gate, new in zip(gates, new_biases) if new is not None]
        if written:  # one multi-tensor copy for all layers (it bumps each bias's version, as observe expects)
            torch._foreach_copy_(*map(list, zip(*written)))
        loads = {}
        for layer_id, gate in zip(self.model.moe_layer_ids, gates):
            stats = gate.balancer.last_stats
            if stats is not None:
                loads[f"layer{layer_id}"] = stats.max_over_mean
        return loads

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active) parameters; active counts only top-K of the E routed experts per token."""
        total = sum(p.numel() for p in self.parameters())
        inactive = 0
        for moe in self.moe_layers:
            routed = moe.experts.w13_weight.numel() + moe.experts.w2_weight.numel()
            inactive += routed - routed * moe.gate.top_k // moe.gate.num_experts
        return total, total - inactive


def logprob_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the log-prob head: its fp32 logits hold at most LOGPROB_CHUNK_ELEMENTS values."""
    return max(1, LOGPROB_CHUNK_ELEMENTS // vocab_size)


def chunked_token_logprobs(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor,
                           temperature: float = 1.0, return_entropy: bool = False,
                           chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(h Wᵀ / τ)[target] per token (and the entropy of that distribution), chunked over tokens.

    Peak memory holds one chunk's [chunk, V] fp32 logits instead of [T, V]: by default chunks of
    LOGPROB_CHUNK_ELEMENTS / V tokens (2048 at a 32K vocabulary). Returns log-probs [T] (and entropy [T]) in fp32,
    fp64 for fp64 inputs.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    chunk = chunk_tokens or logprob_chunk_tokens(weight_VD.shape[0])
    logprobs, entropy = _ChunkedLogprobs.apply(hidden_TD, weight_VD, targets_T, temperature, return_entropy, chunk)
    return logprobs, (entropy if return_entropy else None)


class _ChunkedLogprobs(torch.autograd.Function):
    """The log-prob head with a hand-written backward: each chunk's logits are made twice (forward, and again in
    backward), where autograd over a checkpointed chunk ran ~20 elementwise fp32 passes over them (forward,
    recomputation, and each op's backward). On H200 the `small` step gained 1-6% with this and the fused RMSNorm
    together (docs/benchmarks.md, session 8).

    With z = h Wᵀ / τ, p = softmax(z), lp = z[t] − logsumexp(z) and H = logsumexp(z) − Σ p z:
        ∂lp/∂z = onehot(t) − p,    ∂H/∂z = −p ⊙ (z − Σ p z),
    so the incoming gradients (g_lp, g_H) give ∂z = g_lp · onehot(t) − p ⊙ (g_lp + g_H (z − E_p[z])), then
    ∂h = ∂z W / τ and ∂W = ∂zᵀ h / τ. Only logsumexp and H per token are kept between the passes. The forward
    chunks by tokens; the backward by tokens or by slices of the vocabulary, whichever leaves the smaller gradient
    to sum over its chunks (∂W [V, d] or ∂h [T, d]; summed in fp32 or wider).

    Per block of logits, the statistics (`_block_stats`) and ∂z (`_grad_block`) can be one Triton pass each over the
    GEMM's bf16/fp16 output on CUDA (`logprob_kernels`, on by default); the PyTorch forms here, over an fp32 copy
    (fp64 for fp64 inputs), are the reference and the CPU path.
    """

    @staticmethod
    def _logits(h, weight, temperature):
        z = F.linear(h, weight).to(torch.promote_types(h.dtype, torch.float32))  # fp32 (fp64 for fp64 inputs)
        return z.div_(temperature) if temperature != 1.0 else z

    @staticmethod
    def _block_stats(h, weight, targets, temperature, return_entropy):
        """(logsumexp, target logit, entropy or None) per token of the logits h Wᵀ / τ."""
        if logprob_kernels.available(h):
            z = F.linear(h, weight)
            lse, entropy = logprob_kernels.row_logsumexp_entropy(z, temperature, return_entropy)
            target = z.gather(-1, targets[:, None]).squeeze(-1).float().div_(temperature)
            return lse, target, (entropy if return_entropy else None)
        z = _ChunkedLogprobs._logits(h, weight, temperature)
        lse = torch.logsumexp(z, -1)
        entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if return_entropy else None
        return lse, z.gather(-1, targets[:, None]).squeeze(-1), entropy

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, return_entropy, chunk):
        num_tokens, dtype = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        logprobs, logz = hidden.new_empty(num_tokens, dtype=dtype), hidden.new_empty(num_tokens, dtype=dtype)
        entropy = hidden.new_zeros(num_tokens, dtype=dtype)
        for s in range(0, num_tokens, chunk):
            rows = slice(s, s + chunk)
            lse, target, ent = _ChunkedLogprobs._block_stats(hidden[rows], weight, targets[rows], temperature,
                                                             return_entropy)
            logz[rows] = lse
            logprobs[rows] = target - lse
            if return_entropy:
                entropy[rows] = ent
        ctx.save_for_backward(hidden, weight, targets, logz, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, logz, entropy = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        # contiguous: the kernels index them by row (a mean's backward hands in a stride-0 expansion)
        grads = tuple(g.contiguous() if g is not None else None for g in (grad_logprobs, grad_entropy))
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        if num_tokens < vocab:
            width = max(1, ctx.chunk * vocab // num_tokens)  # as many logits per pass as the forward's chunks
            if width >= 256:  # a multiple of 128 columns: the slice's logits are a GEMM operand's leading dimension
                width -= width % 128
            grad_h, grad_w = _ChunkedLogprobs._backward_by_vocabulary(
                hidden, weight, targets, logz, entropy, *grads, ctx.temperature, width, need_h, need_w)
        else:
            grad_h, grad_w = _ChunkedLogprobs._backward_by_tokens(
                hidden, weight, targets, logz, entropy, *grads, ctx.temperature, ctx.chunk, need_h, need_w)
        return grad_h, grad_w, None, None, None, None

    @staticmethod
    def _grad_block(h, w, temperature, lse, entropy, g_lp, g_ent, column, inside):
        """∂z, in h's dtype, of the block of logits h wᵀ / τ [tokens, vocabulary slice], given its tokens'
        logsumexp, entropy and incoming gradients ([tokens] each; a gradient may be None), `column`, each token's
        target column in the slice (clamped into it), and `inside`, 1 where the target lies in the slice, else 0."""
        if logprob_kernels.available(h):
            return logprob_kernels.grad_logits_(F.linear(h, w), temperature, lse, entropy, g_lp, g_ent, column,
                                                inside)
        z = _ChunkedLogprobs._logits(h, w, temperature)
        lse = lse[:, None]
        if g_ent is not None:  # coefficient of −p: g_lp + g_H (z − E_p[z]), E_p[z] = lse − H
            coef = (z - (lse - entropy[:, None])).mul_(g_ent[:, None])
            if g_lp is not None:
                coef.add_(g_lp[:, None])
        else:
            coef = g_lp[:, None]
        grad_z = z.sub_(lse).exp_().mul_(coef).neg_()  # z's storage is reused: z is not needed any more
        if g_lp is not None:
            grad_z.scatter_add_(1, column[:, None], (g_lp * inside)[:, None])
        if temperature != 1.0:
            grad_z.div_(temperature)
        return grad_z.to(h.dtype)

    @staticmethod
    def _backward_by_tokens(hidden, weight, targets, logz, entropy, grad_logprobs, grad_entropy, temperature, chunk,
                            need_h, need_w):
        """Chunks of tokens, each chunk's ∂W added into one [V, d] accumulator: for many tokens over a small
        vocabulary (T ≥ V)."""
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=logz.dtype) if need_w else None
        inside = torch.ones_like(logz)  # every target lies in the full vocabulary
        for s in range(0, hidden.shape[0], chunk):
            rows = slice(s, s + chunk)
            h = hidden[rows]
            grad_z = _ChunkedLogprobs._grad_block(
                h, weight, temperature, logz[rows], entropy[rows],
                grad_logprobs[rows] if grad_logprobs is not None else None,
                grad_entropy[rows] if grad_entropy is not None else None, targets[rows], inside[rows])
            if need_h:
                grad_h[rows] = grad_z @ weight
            if need_w:
                grad_w += (grad_z.t() @ h).to(grad_w.dtype)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None)

    @staticmethod
    def _backward_by_vocabulary(hidden, weight, targets, logz, entropy, grad_logprobs, grad_entropy, temperature,
                                width, need_h, need_w):
        """Slices of the vocabulary over all tokens at once (T < V): each slice's rows of ∂W come out of one GEMM
        over every token, and only ∂h, [T, d], is summed over the slices. Chunking by tokens adds into a [V, d] fp32
        accumulator once per chunk instead: at Kimi Linear's 164K vocabulary, 20 passes over 1.5 GB in an 8K-token
        step, most of the head's backward time on an H200 (docs/benchmarks.md, "Real widths")."""
        grad_h = torch.zeros_like(hidden, dtype=logz.dtype) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        for a in range(0, weight.shape[0], width):
            w = weight[a:a + width]
            column = targets - a
            inside = ((column >= 0) & (column < w.shape[0])).to(logz.dtype)  # no host sync: a mask, not an index
            grad_z = _ChunkedLogprobs._grad_block(hidden, w, temperature, logz, entropy, grad_logprobs, grad_entropy,
                                                  column.clamp(0, w.shape[0] - 1), inside)
            if need_h:
                grad_h += grad_z @ w
            if need_w:
                grad_w[a:a + width] = grad_z.t() @ hidden
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w
