"""Memory per GPU: weights, gradients and optimizer states by ZeRO stage; activations as the trainer keeps them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentrl.plan.calibration import (BYTES_GRAD, BYTES_OPTIMIZER, BYTES_WEIGHT, CALIBRATION_PRESET, CP_MLA_KV_FACTOR,
                                        KDA_CHUNK, SMALL_ACTIVATION_ATTN_RES_MIX, SMALL_ACTIVATION_BYTES_PER_TOKEN)
from agentrl.plan.counts import ModelShape, layer_params
from agentrl.plan.layout import Layout, Workload, stages


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
    # gradient), one MLA layer's expanded keys and values of the whole sequence (all CP ranks' tokens; under CP as
    # calibrated: calibration.CP_MLA_KV_FACTOR)
    kda_states: float = 0.0
    mla_kv: float = 0.0

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.zero3_gather + self.activations_stored
                + self.activations_transient + self.logits)


def stage_params(cfg, layers: range, *, first: bool, last: bool) -> tuple[int, int, tuple[int, int]]:
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
    """Memory per GPU of each pipeline stage (see agentrl.plan's docstring for the accounting)."""
    from agentrl.model.modeling import logprob_chunk_tokens  # the head's own chunk rule (imports torch: lazily)

    cfg = ModelShape.of(cfg)
    g_dense, g_expert = layout.dp * layout.cp, layout.expert_dp
    out = []
    micro_tokens = workload.micro_batch_tokens / layout.cp
    num_micro = max(1, math.ceil(workload.tokens_per_step / (workload.micro_batch_tokens * layout.dp)))
    for s, layers in enumerate(stages(cfg, layout.pp)):
        first, last = s == 0, s == layout.pp - 1
        dense, expert, biggest = stage_params(cfg, layers, first=first, last=last)
        expert_local = expert / layout.ep

        def sharded(n_bytes: int, stage_from: int) -> float:
            d = dense / (g_dense if layout.zero >= stage_from else 1)
            e = expert_local / (g_expert if layout.zero >= stage_from else 1)
            return n_bytes * (d + e)

        in_flight = min(layout.pp - s, num_micro)  # 1F1B: stage s holds pp − s micro-batches
        stored = stored_activation_bytes_per_token(cfg, layers, workload, last_stage=last)
        # under CP an MLA layer's last rank holds the whole sequence's expanded keys and values and what comes with
        # them (calibration.CP_MLA_KV_FACTOR): per token of its slice, cp tokens' worth
        kv = BYTES_WEIGHT * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        sequence_kv = CP_MLA_KV_FACTOR * kv * layout.cp if layout.cp > 1 else 0.0
        transient = max(transient_activation_bytes_per_token(cfg, i, context=workload.context)
                        + (0 if cfg.is_kda_layer(i) else sequence_kv) for i in layers)
        # ZeRO-3 holds two layers gathered (computing, prefetched): all their non-expert weights, their expert shard
        gather = 2 * BYTES_WEIGHT * (biggest[0] + biggest[1] / layout.ep) if layout.zero == 3 else 0.0
        # the log-prob head's chunk of fp32 logits, live three times over (logits, exp, product or gradient)
        logits = 3 * 4 * min(micro_tokens, logprob_chunk_tokens(cfg.vocab_size)) * cfg.vocab_size if last else 0.0
        kda_states = mla_kv = 0.0
        if any(cfg.is_kda_layer(i) for i in layers):
            kda_states = 2 * 4 * cfg.kda_num_heads * cfg.kda_head_dim**2 / KDA_CHUNK * micro_tokens
        if not all(cfg.is_kda_layer(i) for i in layers):  # the whole sequence's, and under CP what comes with them
            mla_kv = kv * workload.micro_batch_tokens * (CP_MLA_KV_FACTOR if layout.cp > 1 else 1.0)
        mem = Memory(stage=s, layers=(layers[0], layers[-1]), kda_states=kda_states, mla_kv=mla_kv,
                     weights=sharded(BYTES_WEIGHT, 3), gradients=sharded(BYTES_GRAD, 2),
                     optimizer=sharded(BYTES_OPTIMIZER, 1), zero3_gather=gather,
                     activations_stored=act_scale * stored * micro_tokens * in_flight,
                     activations_transient=act_scale * transient * micro_tokens, logits=logits)
        out.append(mem)
    return out
