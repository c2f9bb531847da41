"""GPU benchmarks of the hybrid model on an H200, each comparison measured in one run, printed as Markdown tables.

    python scripts/bench_gpu.py throughput   # fwd+bwd tokens/s and MFU at 4K/32K/128K: agentrl `small`, fla's
                                             # KDAForCausalLM (all KDA, and the hybrid with softmax layers where
                                             # `small` has MLA) and transformers' KimiLinearForCausalLM
    python scripts/bench_gpu.py memory       # peak memory vs sequence length (gradient checkpointing on)
    python scripts/bench_gpu.py gate         # bounded vs unbounded KDA gate inside the full model
    python scripts/bench_gpu.py publish      # weight publishing GPU→GPU over NCCL vs device copy bandwidth (2 GPUs)
    python scripts/bench_gpu.py weight-ipc   # in-memory weight sync to a second process on the GPU (CUDA IPC) vs D2D
                                             # (--receiver-gpu 1: to GPU 1, against the peer copy)
    python scripts/bench_gpu.py host         # the state dict to host memory (publishing's copy): per tensor vs bucketed
    python scripts/bench_gpu.py trainer      # agentrl's DeepSpeed step (ZeRO-2/3) vs the bare fwd+bwd, same tokens,
                                             # interleaved in each process (--rounds, --processes; --out DIR: a
                                             # profile of each ZeRO step; --variants [NAME ...]: the ablation over
                                             # TRAINER_VARIANTS' engine settings)
    python scripts/bench_gpu.py profile      # wall vs GPU-busy time and torch.profiler kernel tables of one fwd+bwd
                                             # (--tokens, --models, --out FILE for the full tables)
    python scripts/bench_gpu.py components   # the short step by part: each kind of layer's fwd+bwd alone (wall, GPU
                                             # time, launches) and its share of the whole step's launches
    python scripts/bench_gpu.py throughput --models kimi-linear-4l k3-4l --tokens 8192 32768
                                             # the same at the layer shapes of Kimi Linear 48B and of K3
    python scripts/bench_gpu.py all          # throughput, gate, memory, publish, weight-ipc, host

Context parallelism (R ranks against one, on R GPUs or sharing one) is scripts/bench_cp.py.

Every model trains in bf16 on one packed sequence (B=1) with its own loss path: agentrl's chunked, recomputed
target log-probs; fla's fused linear cross-entropy; transformers' full logits and cross-entropy. MFU is
6·N_active·tokens / step time over the dense bf16 peak of an H200 or H100 SXM (990 TFLOP/s, datasheet: the same for
both), the anchors' convention, and once more with the softmax layers' causal attention FLOPs added (3 · T² · heads ·
(d_qk + d_v) per layer for fwd+bwd): the first ignores the T² work that only the models with softmax layers do, and at
128K that work is most of their step, so only the second compares an all-KDA model with a hybrid.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrl.model import layers, logprob_kernels, mla_kernels  # noqa: E402
from agentrl.model.config import preset_config  # noqa: E402
from agentrl.model.modeling import HybridMoEForCausalLM  # noqa: E402
from agentrl.net import free_port  # noqa: E402
from agentrl.report import markdown_table as table  # noqa: E402

PEAK_FLOPS = 990e12
TOKENS = (4096, 32768, 131072)


# --- the models ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Built:
    model: torch.nn.Module
    total: int  # parameters
    active: int  # parameters a token passes through
    # the softmax-attention layers as (heads, qk head dim, v head dim), one entry per layer: their T² FLOPs
    attention: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    def flops(self, tokens: int) -> float:
        """fwd+bwd FLOPs of one sequence of `tokens`: 6·N_active·T plus causal attention, 3·T²·H·(d_qk + d_v)."""
        return 6 * self.active * tokens + sum(3 * tokens**2 * h * (dqk + dv) for h, dqk, dv in self.attention)


def agentrl_small(**overrides) -> Built:
    config = preset_config("small", **overrides)
    model = HybridMoEForCausalLM(config)
    total, active = model.parameter_counts()
    return Built(model, total, active, _mla_layers(config))


REAL_WIDTHS = {
    # Kimi Linear 48B's layer shapes in 4 layers (3 KDA + 1 MLA, all 256 experts top-8): 8.2B / 1.2B active
    "kimi-linear-4l": ("kimi-linear-48b-a3b", dict(num_hidden_layers=4, linear_attn_config=dict(
        kda_layers=[1, 2, 3], full_attn_layers=[4]))),
    # Kimi Linear's layer shapes in 2 layers (KDA with the dense MLP, MLA with the 256 experts): 2.7B, small enough
    # for the trainer table, which holds the DeepSpeed model (16 bytes a parameter) and the bare one on one GPU
    "kimi-linear-2l": ("kimi-linear-48b-a3b", dict(num_hidden_layers=2, linear_attn_config=dict(
        kda_layers=[1], full_attn_layers=[2]))),
    # K3's layer shapes in 4 layers (3 KDA + 1 MLA) with 64 of its 896 experts (top-16), so that it fits one GPU
    "k3-4l": ("k3", dict(num_hidden_layers=4, num_experts=64, linear_attn_config=dict(
        kda_layers=[1, 2, 3], full_attn_layers=[4]))),
}


def real_width_model(name: str) -> HybridMoEForCausalLM:
    """A REAL_WIDTHS model, or `small`, built in bf16 straight on the GPU (the real widths are 8–13B parameters)."""
    preset, overrides = ("small", {}) if name == "small" else REAL_WIDTHS[name]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return HybridMoEForCausalLM(preset_config(preset, **overrides))
    finally:
        torch.set_default_dtype(default)


def agentrl_real_width(name: str):
    def build() -> Built:
        model = real_width_model(name)
        total, active = model.parameter_counts()
        return Built(model, total, active, _mla_layers(model.config))
    return build


def _mla_layers(config) -> list[tuple[int, int, int]]:
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    return [(config.num_attention_heads, qk, config.v_head_dim)] * len(config.linear_attn_config["full_attn_layers"])


def agentrl_loss(model, ids):
    return -model(ids[:, :-1], target_ids=ids[:, 1:]).token_logprobs.mean()


def fla_kda(**overrides) -> Built:
    """fla's all-KDA model at the small preset's width: hidden 1024, 8 layers, 8 heads of 128, vocab 32K."""
    from fla.models import KDAConfig, KDAForCausalLM

    cfg = KDAConfig(hidden_size=1024, num_hidden_layers=8, num_heads=8, head_dim=128, vocab_size=32768,
                    **overrides)
    model = KDAForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    attention = []
    if cfg.attn:  # fla's softmax layers: head dim = hidden / heads for q, k and v
        heads = cfg.attn["num_heads"]
        attention = [(heads, cfg.hidden_size // heads, cfg.hidden_size // heads)] * len(cfg.attn["layers"])
    return Built(model, total, total, attention)


def fla_hybrid() -> Built:
    """fla's KDA model with softmax attention where `small` has MLA (layers 4 and 8; 16 heads of 64), fla's kernels
    for the rest: the like-for-like of the K3 layout that fla itself offers."""
    _flash_attn_from_torch()
    return fla_kda(attn={"layers": [3, 7], "num_heads": 16})


def _flash_attn_from_torch() -> None:
    """fla's softmax layer calls the flash-attn package, which the device does not have; torch ships the same
    FlashAttention-2 kernel (`torch.nn.attention.varlen.varlen_attn`, what agentrl's MLA runs), so fla's two entry
    points are pointed at it."""
    import fla.layers.attn as fla_attn
    from torch.nn.attention.varlen import varlen_attn

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                               window_size=(-1, -1), softmax_scale=None):
        # flash-attn takes causal as a flag beside the window (left, right); torch's kernel takes causal as right = 0
        left, right = window_size
        return varlen_attn(q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), max_seqlen_q,
                           max_seqlen_k, scale=softmax_scale, window_size=(left, 0 if causal else right))

    def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None):
        batch, length = q.shape[:2]
        cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=q.device)
        out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, length, length,
                                     causal, window_size, softmax_scale)
        return out.unflatten(0, (batch, length))

    fla_attn.flash_attn_func, fla_attn.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func


def hf_loss(model, ids):
    return model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss


def kimi_linear() -> Built:
    """transformers' KimiLinearForCausalLM at the small preset's sizes (no latent MoE, no AttnRes: it has neither)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    s = preset_config("small")
    cfg = KimiLinearConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        moe_intermediate_size=s.moe_intermediate_size, num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_attention_heads,
        kv_lora_rank=s.kv_lora_rank, qk_rope_head_dim=s.qk_rope_head_dim, qk_nope_head_dim=s.qk_nope_head_dim,
        v_head_dim=s.v_head_dim, num_local_experts=s.num_experts, num_experts_per_tok=s.num_experts_per_token,
        n_shared_experts=s.num_shared_experts, routed_scaling_factor=s.routed_scaling_factor,
        linear_attn_config=dict(head_dim=s.kda_head_dim, num_heads=s.kda_num_heads, short_conv_kernel_size=4,
                                kda_layers=list(s.linear_attn_config["kda_layers"]),
                                full_attn_layers=list(s.linear_attn_config["full_attn_layers"])),
        first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = KimiLinearForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + routed * s.num_experts_per_token // s.num_experts
    return Built(model, total, active, _mla_layers(s))


# --- timing -------------------------------------------------------------------------------------------------------
def synchronized_seconds(fn) -> float:
    """Seconds of one call of `fn`, the GPU's queued work before and its own after included."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def median_seconds(fn, repeats: int, after_warmup=None) -> float:
    """Median seconds of `fn` over `repeats` synchronized calls, after one warm-up call (then `after_warmup()`)."""
    fn()
    torch.cuda.synchronize()
    if after_warmup is not None:
        after_warmup()
    return statistics.median(synchronized_seconds(fn) for _ in range(repeats))


def train_step(model, loss_fn, tokens: int):
    """One fwd+bwd of `model` on a random sequence of `tokens` tokens, as a function to time or profile."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens + 1), device="cuda")

    def step():
        loss_fn(model, ids).backward()
        model.zero_grad(set_to_none=True)

    return step


def step_time(model, loss_fn, tokens: int, repeats: int = 3) -> float:
    """Median seconds of one fwd+bwd on one sequence of `tokens` tokens, after a warm-up step."""
    return median_seconds(train_step(model, loss_fn, tokens), repeats)


def measure(built: Built, loss_fn, tokens: int, repeats: int = 3) -> tuple[str, str, str, str]:
    """(tokens/s, MFU 6N, MFU with attention, note); retries with gradient checkpointing on OOM."""
    model = built.model
    note = ""
    dt = _step_time_or_oom(model, loss_fn, tokens, repeats)
    if dt is None:
        model.gradient_checkpointing_enable()
        try:
            dt = _step_time_or_oom(model, loss_fn, tokens, repeats)
            note = "ckpt"
        finally:
            model.gradient_checkpointing_disable()
        if dt is None:
            return "OOM", "", "", ""
    return (f"{tokens / dt:,.0f}", f"{6 * built.active * tokens / dt / PEAK_FLOPS * 100:.1f}%",
            f"{built.flops(tokens) / dt / PEAK_FLOPS * 100:.1f}%", note)


def _step_time_or_oom(model, loss_fn, tokens: int, repeats: int) -> float | None:
    """step_time, or None on OOM with the failed step's memory released. The retry must not run inside the
    `except` block: the exception's traceback holds the failed forward's frames and with them its activations (K3's
    width at 8K tokens "ran out of memory" with checkpointing only because of that: 49 GB peak when run alone)."""
    try:
        return step_time(model, loss_fn, tokens, repeats)
    except torch.OutOfMemoryError:
        pass
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return None


MODELS = {
    "agentrl": ("agentrl `small` (K3 layout)", agentrl_small, agentrl_loss, True),
    "unfused": ("agentrl `small`, fla fused kernels off", agentrl_small, agentrl_loss, False),
    "small-torch-head": ("agentrl `small`, log-prob head in PyTorch", agentrl_small, agentrl_loss, "torch-head"),
    "small-padded-mla": ("agentrl `small`, MLA by flash with padding", agentrl_small, agentrl_loss, "padded-mla"),
    "fla": ("fla KDAForCausalLM", fla_kda, hf_loss, True),
    "fla-hybrid": ("fla KDAForCausalLM + softmax layers 4, 8", fla_hybrid, hf_loss, True),
    "kimi": ("transformers KimiLinearForCausalLM", kimi_linear, hf_loss, True),
    "kimi-linear-4l": ("agentrl at Kimi Linear 48B's width, 4 layers", agentrl_real_width("kimi-linear-4l"),
                       agentrl_loss, True),
    "kimi-linear-4l-torch-head": ("agentrl at Kimi Linear 48B's width, 4 layers, log-prob head in PyTorch",
                                  agentrl_real_width("kimi-linear-4l"), agentrl_loss, "torch-head"),
    "kimi-linear-4l-padded-mla": ("agentrl at Kimi Linear 48B's width, 4 layers, MLA by flash with padding",
                                  agentrl_real_width("kimi-linear-4l"), agentrl_loss, "padded-mla"),
    "k3-4l": ("agentrl at K3's width, 4 layers, 64 experts", agentrl_real_width("k3-4l"), agentrl_loss, True),
}

DEFAULT_MODELS = ["agentrl", "unfused", "fla", "fla-hybrid", "kimi"]  # the real widths only when asked for


@contextlib.contextmanager
def kernels(setting):
    """The model's fused CUDA kernels for a MODELS entry: True (all, the log-prob head's and MLA's Triton kernels
    included: the model's default), False (none: the PyTorch references), "torch-head" (all but the log-prob head's
    kernels) or "padded-mla" (all but MLA's kernels: its attention by flash with padding): what each buys."""
    previous = (layers.set_fused(setting is not False),
                logprob_kernels.set_enabled(setting not in ("torch-head", False)),
                mla_kernels.set_enabled(setting not in ("padded-mla", False)))
    try:
        yield
    finally:
        layers.set_fused(previous[0])
        logprob_kernels.set_enabled(previous[1])
        mla_kernels.set_enabled(previous[2])


def bench_throughput(tokens_list=TOKENS, models: list[str] | None = None) -> None:
    rows = []
    results: dict[str, dict[int, str]] = {}
    for name, build, loss_fn, fused in (MODELS[m] for m in (models or DEFAULT_MODELS)):
        torch.manual_seed(0)
        try:
            built = build()
        except Exception as e:  # e.g. a transformers without KimiLinear
            print(f"  {name}: not built ({type(e).__name__}: {e})", flush=True)
            continue
        built.model = built.model.to("cuda", torch.bfloat16).train()
        for tokens in tokens_list:
            # a cold Triton cache compiles and autotunes fla's kernels in the warm-up step: minutes, silently
            print(f"  {name} T={tokens}: warming up", flush=True)
            with kernels(fused):
                tps, mfu, mfu_attention, note = measure(built, loss_fn, tokens)
            results.setdefault(name, {})[tokens] = tps
            rows.append([name, f"{built.total / 1e6:.0f}M / {built.active / 1e6:.0f}M", tokens, tps, mfu,
                         mfu_attention, note])
            print(f"  {name} T={tokens}: {tps} tok/s {mfu} {mfu_attention} {note}", flush=True)
        del built
        torch.cuda.empty_cache()
    print(f"\n### Training throughput, bf16 fwd+bwd, B=1, one {torch.cuda.get_device_name()}\n")
    print(table(["model", "params total / active", "tokens", "tokens/s", "MFU (6·N_active)",
                 "MFU (+ attention T²)", "note"], rows))
    ours = results.get(MODELS["agentrl"][0])
    ratio_rows = []
    if ours is None:
        return
    def num(s):
        try:
            return float(s.replace(",", ""))
        except (ValueError, AttributeError):
            return None

    for tokens in tokens_list:
        others = [num(results[n][tokens]) for n in results if not n.startswith("agentrl")]
        others = [o for o in others if o]
        if num(ours[tokens]) and others:
            ratio_rows.append([tokens, f"{num(ours[tokens]) / max(others):.2f}×"])
    print("\nagentrl `small` over the best of the others (tokens/s):\n")
    print(table(["tokens", "ratio"], ratio_rows))
    print(flush=True)


def bench_gate(tokens_list=(32768, 131072)) -> None:
    rows = []
    for label, overrides in (("bounded (K3: −5·σ, safe_gate)", {}),
                             ("unbounded (Kimi Linear: −e^A·softplus)", dict(linear_attn_config=dict(
                                 gate_lower_bound=None)))):
        torch.manual_seed(0)
        built = agentrl_small(**overrides)
        built.model = built.model.to("cuda", torch.bfloat16).train()
        for tokens in tokens_list:
            tps, mfu, _, note = measure(built, agentrl_loss, tokens)
            rows.append([label, tokens, tps, mfu, note])
        del built
        torch.cuda.empty_cache()
    print("### Bounded vs unbounded KDA gate inside the `small` model, bf16 fwd+bwd, B=1\n")
    print(table(["gate", "tokens", "tokens/s", "MFU", "note"], rows))
    print(flush=True)


def bench_memory(tokens_list=(8192, 32768, 131072, 262144, 524288)) -> None:
    """One cold fwd+bwd per length: MLA's T² attention makes each doubling ~4× slower, so lengths stop at 512K."""
    torch.manual_seed(0)
    model = agentrl_small().model
    model = model.to("cuda", torch.bfloat16).train()
    model.gradient_checkpointing_enable()
    weights = torch.cuda.memory_allocated() / 2**30
    rows = []
    for tokens in tokens_list:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ids = torch.randint(0, model.config.vocab_size, (1, tokens + 1), device="cuda")
        try:
            dt = synchronized_seconds(lambda: agentrl_loss(model, ids).backward())
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            rows.append([tokens, f"{peak:.2f}", f"{peak * 2**20 / tokens:.1f}", f"{tokens / dt:,.0f}"])
        except torch.OutOfMemoryError:
            rows.append([tokens, "OOM", "", ""])
            break
        finally:
            model.zero_grad(set_to_none=True)
            del ids
        print(f"  memory T={tokens}: {rows[-1]}", flush=True)
    print(f"### Peak memory vs length, `small`, bf16, gradient checkpointing on (weights {weights:.2f} GiB)\n")
    print(table(["tokens", "peak GiB above weights (fwd+bwd)", "KiB per token", "tokens/s (one step, cold)"],
                rows))
    print(flush=True)


# --- weight publishing --------------------------------------------------------------------------------------------
def _publish_rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    with torch.device("meta"):
        built = agentrl_small()
        model, total = built.model, built.total
    state = {k: torch.randn(v.shape, device="cuda", dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    flat = torch.cat([t.reshape(-1) for t in state.values()])
    shard = flat.chunk(2)[rank].clone()
    gathered = torch.empty(shard.numel() * 2, dtype=flat.dtype, device="cuda")

    def timed(fn, collective=True) -> float:
        return median_seconds(fn, 5, after_warmup=dist.barrier if collective else None)

    def per_tensor():
        for t in state.values():
            dist.broadcast(t, src=0)

    rows = {
        "NCCL broadcast, one call per tensor (trainer → rollout)": timed(per_tensor),
        "NCCL broadcast, one flat bf16 bucket": timed(lambda: dist.broadcast(flat, src=0)),
        "NCCL all-gather of two flat halves (ZeRO-3 gather)": timed(
            lambda: dist.all_gather_into_tensor(gathered, shard)),
    }
    if rank == 0:
        big = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
        other = torch.empty_like(big, device="cuda:1")
        dst = torch.empty_like(big)
        copy_s = timed(lambda: dst.copy_(big), collective=False)
        peer_s = timed(lambda: other.copy_(big), collective=False)
        queue.put(dict(rows=rows, nbytes=nbytes, total=total, num_tensors=len(state), copy_s=copy_s,
                       copy_bytes=big.numel(), peer_s=peer_s))
    dist.barrier()
    dist.destroy_process_group()


def bench_publish() -> None:
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        print("publish: needs 2 GPUs; skipped")
        return
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_publish_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    res = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    gb = res["nbytes"] / 1e9
    rows = [[name, f"{gb:.2f}", f"{s * 1e3:.1f}", f"{gb / s:.0f}"] for name, s in res["rows"].items()]
    cb = res["copy_bytes"] / 1e9
    rows.append(["device-to-device copy on one GPU, 4.3 GB (bytes moved = read + write)", f"{cb:.2f}",
                 f"{res['copy_s'] * 1e3:.1f}", f"{2 * cb / res['copy_s']:.0f} ({cb / res['copy_s']:.0f} copied)"])
    rows.append(["peer copy GPU0 → GPU1, 4.3 GB (copy_, P2P)", f"{cb:.2f}", f"{res['peer_s'] * 1e3:.1f}",
                 f"{cb / res['peer_s']:.0f}"])
    print(f"### Weight publishing GPU→GPU: the `small` state dict ({res['total'] / 1e6:.0f}M parameters, "
          f"{res['num_tensors']} tensors, bf16)\n")
    print(table(["transfer", "GB", "ms", "GB/s"], rows))
    print(flush=True)


def _ipc_receiver(name: str, requests, replies, device: int) -> None:
    """The second process, on GPU `device`: builds the same model, then copies each bucket it is told of into it."""
    from agentrl.weight_buckets import BucketMeta, unpack

    torch.cuda.set_device(device)
    torch.manual_seed(1)  # other weights than the sender's, until the buckets arrive
    model = real_width_model(name)
    state = model.state_dict()
    replies.put("ready")
    while (message := requests.get()) is not None:
        if message == "logits":
            ids = torch.arange(256, device="cuda").unsqueeze(0) % model.config.vocab_size
            with torch.no_grad():
                replies.put(model(ids).logits.float().cpu())
            continue
        targets, views = [], []
        for part, view in unpack(BucketMeta.from_dict(message)):
            targets.append(state[part.name] if part.rows is None else state[part.name][part.rows[0]:part.rows[1]])
            views.append(view)
        torch._foreach_copy_(targets, views)
        torch.cuda.synchronize()  # the sender refills the buffer once this process has read it
        replies.put(message["index"])


def bench_weight_ipc(models=("small", "kimi-linear-4l"), buckets_mb=(1024, 256), repeats: int = 5,
                     receiver_gpu: int = 0) -> None:
    """In-memory weight sync: the trainer's process (GPU 0) hands a state dict (bf16) in buckets to a second process
    through CUDA IPC (agentrl.weight_buckets, as trainer/weight_stream.py does for an engine), which copies each
    bucket into its own parameters; against a copy of as many bytes to the receiver's GPU measured in the same run
    (device to device on one GPU; peer to peer with `receiver_gpu` 1, issue 25's two-GPU run, where `publish`
    measures the bucketed NCCL broadcast). The receiver's logits equal the sender's afterwards (same weights, same
    kernels)."""
    import torch.multiprocessing as mp

    from agentrl.weight_buckets import BucketRing, split_into_buckets

    copy_name = "device-to-device copy" if receiver_gpu == 0 else f"peer copy GPU 0 → GPU {receiver_gpu}"
    rows = []
    for name in models:
        ctx = mp.get_context("spawn")
        requests, replies = ctx.Queue(), ctx.Queue()
        receiver = ctx.Process(target=_ipc_receiver, args=(name, requests, replies, receiver_gpu))
        receiver.start()
        torch.manual_seed(0)
        model = real_width_model(name)
        state = model.state_dict()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        assert replies.get(timeout=600) == "ready"
        gb = nbytes / 1e9
        big = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(big, device=f"cuda:{receiver_gpu}")

        def copy() -> None:
            dst.copy_(big)
            torch.cuda.synchronize(receiver_gpu)

        copy_s = median_seconds(copy, repeats)
        del big, dst
        for bucket_mb, by_reference in [(mb, False) for mb in buckets_mb] + [(mb, True) for mb in (1024, 16384)]:
            ring = BucketRing.create("cuda_ipc", bucket_mb << 20)

            def sync() -> None:
                for entries in split_into_buckets(state.items(), ring.capacity):
                    meta = ring.pack(entries, by_reference=by_reference)
                    requests.put(meta.to_dict())
                    ring.reuse(meta.index, lambda: replies.get(timeout=120))  # the receiver answers in order
                ring.drain()

            t = median_seconds(sync, repeats)
            ring.close()
            how = (f"the receiver reads the sender's tensors (by reference), {bucket_mb} MB per message"
                   if by_reference else f"copied into {bucket_mb} MB buckets")
            rows.append([name, f"{gb:.2f}", f"{len(state)}", f"CUDA IPC, {how}", f"{t * 1e3:.1f}",
                         f"{gb / t:.0f}", f"{copy_s / t:.0%}"])
        rows.append([name, f"{gb:.2f}", "", f"{copy_name}, one process", f"{copy_s * 1e3:.1f}",
                     f"{gb / copy_s:.0f}", "100%"])
        requests.put("logits")
        theirs = replies.get(timeout=120)
        ids = torch.arange(256, device="cuda").unsqueeze(0) % model.config.vocab_size
        with torch.no_grad():
            ours = model(ids).logits.float().cpu()
        requests.put(None)
        receiver.join(timeout=60)
        print(f"{name}: receiver's logits vs the sender's: max |diff| {float((theirs - ours).abs().max()):.3g}",
              flush=True)
        del model, state
        torch.cuda.empty_cache()
    where = f"one {torch.cuda.get_device_name()}" if receiver_gpu == 0 else f"GPU 0 → GPU {receiver_gpu}"
    print(f"\n### In-memory weight sync, {where}: trainer process → a second process (bf16), median of {repeats}\n")
    print(table(["model", "GB", "tensors", "transfer", "ms", "GB/s", f"vs {copy_name}"], rows))
    print(flush=True)


# --- trainer: DeepSpeed around the forward + backward ------------------------------------------------------------
def _trainer_batch(vocab: int, tokens: int, sequences: int = 8, prompt: int = 64):
    """`sequences` trajectories in two GRPO groups that pack to exactly `tokens` training tokens (each trains on its
    tokens[:-1] → tokens[1:]): a `prompt`-token prompt, the rest sampled at version 0."""
    if tokens // sequences + 1 <= prompt:
        raise ValueError(f"{tokens} tokens in {sequences} sequences leave none to sample after {prompt}-token prompts")
    import numpy as np

    from agentrl.types import Trajectory

    rng = np.random.default_rng(0)
    batch = []
    for i in range(sequences):
        t = Trajectory(trajectory_id=f"t{i}", task_id=f"g{i % 2}", group_id=f"g{i % 2}", env_id="bench",
                       reward=float(i % 3))
        sampled = tokens // sequences + 1 - prompt
        t.append_prompt(rng.integers(0, vocab, prompt).tolist())
        t.append_sampled(rng.integers(0, vocab, sampled).tolist(), (-8.0 - rng.random(sampled)).tolist(), version=0)
        batch.append(t)
    return batch


def _profile_trainer_step(trainer, batch, out: str) -> None:
    """One PolicyTrainer.step under torch.profiler, its phases labelled (the host time each phase holds the step,
    the kernels it launches): where the DeepSpeed step's time over the bare forward + backward goes."""
    from torch.autograd import DeviceType
    from torch.profiler import record_function

    from agentrl.trainer import policy_trainer

    def labelled(label, fn):
        def call(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return call

    patched = [(trainer.engine, "backward"), (trainer.engine, "step"), (trainer.engine, "get_global_grad_norm"),
               (trainer.policy, "update_expert_bias"), (trainer, "_sum_over_ranks"),
               (policy_trainer, "micro_batch_loss")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patched]
    for obj, name, fn in saved:
        setattr(obj, name, labelled(f"phase:{name}", fn))
    try:
        torch.cuda.synchronize()
        started = time.perf_counter()
        avg, gpu, syncs, launches = profiled_call(lambda: trainer.step(batch),
                                                  trace=out.removesuffix(".txt") + ".json")
        wall = time.perf_counter() - started
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    phases = table(["phase", "host ms (incl. waits)", "calls"],
                   [[e.key, f"{e.cpu_time_total / 1e3:.1f}", e.count] for e in avg
                    if e.key.startswith("phase:") and e.device_type == DeviceType.CPU])
    head = (f"### {out}: profiled wall {wall * 1e3:.1f} ms, GPU kernels {gpu * 1e3:.1f} ms, host syncs {syncs}, "
            f"kernel launches {launches}\n\n{phases}")
    with open(out, "w") as f:
        f.write(head + "\n\n" + avg.table(sort_by="cpu_time_total", row_limit=50, max_name_column_width=90)
                + "\n\n" + avg.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90))
    print(head, flush=True)
    sites = sync_sites_table(lambda: trainer.step(batch))
    with open(out, "a") as f:
        f.write("\n\n" + sites)
    print(sites, flush=True)


# DeepSpeed variants of the step for the ablation (`trainer --variants`); each names one suspect of the cost around
# the bare step.
@dataclasses.dataclass(frozen=True)
class Variant:
    stage: int
    engine: dict = dataclasses.field(default_factory=dict)  # merged into zero.engine_config's
    balancing: bool = True  # Quantile Balancing's statistics and bias updates
    bias_update: bool = True  # Quantile Balancing's bias update after each optimizer step (the statistics kept)
    per_tensor_overflow_check: bool = False  # DeepSpeed's own pass over every gradient (trainer/zero.py drops it)
    per_tensor_grad_norm: bool = False  # DeepSpeed's norm of one gradient at a time (trainer/zero.py: one pass)
    metrics_read_per_value: bool = False  # each loss metric read back as computed (before session 30: ~10 per micro)
    offsets_as_passed: bool = False  # KDA hands fla the alias ZeRO-3 passes it (before session 32: fla's cache missed)
    epilogue_host_wait: bool = False  # DeepSpeed's backward ends waiting for the GPU (before session 38)
    fetch_host_wait: bool = False  # ZeRO-3's fetches of unsharded parameters wait for the GPU (before session 38)
    cuda_graphs: bool = False  # micro-batches replayed from a CUDA graph of the micro-batch budget (session 39)


TRAINER_VARIANTS = {
    "zero2": Variant(2),
    "zero3": Variant(3),
    "zero2, overlap_comm off": Variant(2, {"zero_optimization": {"overlap_comm": False}}),
    "zero2, per-tensor overflow check": Variant(2, per_tensor_overflow_check=True),
    "zero2, per-tensor grad norm": Variant(2, per_tensor_grad_norm=True),
    "zero2, contiguous_gradients off": Variant(2, {"zero_optimization": {"contiguous_gradients": False}}),
    "zero2, reduce buckets 1e8": Variant(2, {"zero_optimization": {"reduce_bucket_size": 10**8}}),
    "zero2, no QB": Variant(2, balancing=False),
    "zero2, no QB bias update": Variant(2, bias_update=False),
    "zero2, metrics read per value": Variant(2, metrics_read_per_value=True),
    "zero3, no overflow check": Variant(3, {"bf16": {"check_grad_overflow": False}}),
    "zero3, all params persistent": Variant(3, {"zero_optimization": {"stage3_param_persistence_threshold": 10**10}}),
    "zero3, prefetch 2e8": Variant(3, {"zero_optimization": {"stage3_prefetch_bucket_size": 2 * 10**8}}),
    "zero3, persistence 1e6": Variant(3, {"zero_optimization": {"stage3_param_persistence_threshold": 10**6}}),
    "zero3, nothing persistent": Variant(3, {"zero_optimization": {"stage3_param_persistence_threshold": 0}}),
    "zero3, offsets as DeepSpeed passes them": Variant(3, offsets_as_passed=True),
    "zero2, the backward's end waits on the host": Variant(2, epilogue_host_wait=True),
    "zero3, the backward's end waits on the host": Variant(3, epilogue_host_wait=True),
    "zero3, each fetch waits on the host": Variant(3, fetch_host_wait=True),
    "zero3, DeepSpeed's waits (fetches, the backward's end)": Variant(3, epilogue_host_wait=True,
                                                                     fetch_host_wait=True),
    "zero2, micro-batches replayed from CUDA graphs": Variant(2, cuda_graphs=True),
}


def _merged(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


def bare_step(model, batch, tokens: int, device: str):
    """(the packing plan of `batch`; a function running the trainer's own loss path, `micro_batch_loss` over
    `PackedPolicy`, forward + backward over its micro-batches on `model` with gradient checkpointing on, as the
    trainer defaults, then `optimizer.step()` when given one): what DeepSpeed's step is measured against, here and
    in bench_host_ops.py."""
    from agentrl.trainer import forward
    from agentrl.trainer.batching import plan_step
    from agentrl.trainer.losses import LossConfig, grpo_advantages

    model.train().gradient_checkpointing_enable()
    loss = LossConfig()
    plan = plan_step(batch, grpo_advantages(batch, normalize_std=loss.normalize_adv_std), world_size=1,
                     token_budget=tokens, aggregation=loss.aggregation, norm_constant=loss.norm_constant,
                     num_moe_layers=len(model.moe_layers))

    def step(optimizer=None) -> None:
        for micro in plan.per_rank[0]:
            # looked up at each call, so that bench_host_ops' phase clock can time it
            out = forward.micro_batch_loss(forward.PackedPolicy(model), micro, loss, device=device)
            with model.balancers_observing(False):  # as the trainer: the recomputation is not counted again
                out.loss.backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)
    return plan, step


def _deepspeed_trainer(what: str, model, tokens: int, run_dir: str):
    """PolicyTrainer (DeepSpeed engine, its bf16 optimizer and gradient buckets, QB statistics, metrics) of `model`
    (a config, or a model instance) configured as the TRAINER_VARIANTS entry `what` says."""
    from agentrl.trainer import PolicyTrainer, TrainerConfig, zero

    variant = TRAINER_VARIANTS[what]
    engine_config, epilogue, fetches = (zero.engine_config, zero._epilogue_without_a_host_wait,
                                        zero._unsharded_fetches_without_a_host_wait)
    zero.engine_config = lambda **kw: _merged(engine_config(**kw), variant.engine)
    if variant.epilogue_host_wait:
        zero._epilogue_without_a_host_wait = lambda optimizer: None
    if variant.fetch_host_wait:  # this process runs one variant: DeepSpeed's handles were never replaced in it
        zero._unsharded_fetches_without_a_host_wait = lambda optimizer: None
    try:
        trainer = PolicyTrainer(TrainerConfig(run_dir=run_dir, zero_stage=variant.stage, dtype="bf16", lr=1e-6,
                                              micro_batch_tokens=tokens,
                                              cuda_graph_tokens=(tokens,) if variant.cuda_graphs else ()), model)
    finally:
        zero.engine_config = engine_config
        zero._epilogue_without_a_host_wait, zero._unsharded_fetches_without_a_host_wait = epilogue, fetches
    if variant.per_tensor_overflow_check:
        del trainer.engine.optimizer.check_overflow  # the class's method again
    if variant.per_tensor_grad_norm:
        del trainer.engine.optimizer.get_grad_norm_direct
    if variant.metrics_read_per_value:  # this process runs one variant: patching the module is local to it
        from agentrl.trainer import policy_trainer

        one_pass = policy_trainer.micro_batch_loss

        def read_per_value(*args, **kwargs):
            out = one_pass(*args, **kwargs)
            out.sums = {k: float(v) for k, v in out.sums.items()}
            float(out.loss.detach())
            return out

        policy_trainer.micro_batch_loss = read_per_value
    if variant.offsets_as_passed:  # this process runs one variant: patching the module is local to it
        from agentrl.model import kda

        kda.fla_offsets = lambda cu_seqlens: cu_seqlens
    if not variant.balancing:  # the routers neither observe nor update their biases
        observing = trainer.policy.balancers_observing
        trainer.policy.balancers_observing = lambda observe: observing(False)
    if not (variant.balancing and variant.bias_update):
        trainer.policy.update_expert_bias = lambda **kw: {}
    return trainer


def _trainer_rank(what: str, tokens: int, rounds: int, port: int, results, profile_dir: str | None = None,
                  model: str = "small") -> None:
    """One TRAINER_VARIANTS entry against the bare step in a process of its own (a DeepSpeed engine leaves its
    process group behind): after a warm-up of each, `rounds` rounds of (bare step, bare + fused AdamW step,
    DeepSpeed step), so that what drifts within a process (the host's load, clocks) hits all three alike; the two
    bare steps share one model. `model`: `small` or a REAL_WIDTHS name. Puts (what, [bare s], [bare+adam s],
    [deepspeed s], GiB the trainer holds after its first step)."""
    import tempfile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.manual_seed(0)
    bare_model = real_width_model(model)
    batch = _trainer_batch(bare_model.config.vocab_size, tokens)
    _, bare = bare_step(bare_model, batch, tokens, device="cuda")
    adam = torch.optim.AdamW(bare_model.parameters(), lr=1e-6, fused=True)
    bare()
    bare(adam)  # its first step makes AdamW's states: before the trainer's memory is counted
    with tempfile.TemporaryDirectory() as run_dir:
        before = _memory_held_gib()
        # `small` from its config, as the job builds it (fp32 on the host first); a real width straight on the GPU
        trainer = _deepspeed_trainer(what, bare_model.config if model == "small" else real_width_model(model),
                                     tokens, run_dir)
        steps = (bare, lambda: bare(adam), lambda: trainer.step(batch))
        steps[2]()  # its warm-up: the optimizer's states, and a CUDA graph where the variant records one
        held = _memory_held_gib() - before
        for step in steps:  # again: reading the memory released the allocator's cached blocks
            step()
        times: list[list[float]] = [[], [], []]
        for _ in range(rounds):
            for step, seconds in zip(steps, times):
                seconds.append(synchronized_seconds(step))
        if profile_dir:
            name = what.replace(", ", "_").replace(" ", "-")
            _profile_trainer_step(trainer, batch, os.path.join(profile_dir, f"trainer_{model}_{name}_{tokens}.txt"))
        trainer.close()
    results.put((what, *times, held))


def _memory_held_gib() -> float:
    """GiB of GPU memory this process holds beyond the caching allocator's free blocks, which are released first (a
    CUDA graph's private pool is not: it stays held while the graph lives)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() / 2**30


def _result_or_death(proc, results, timeout_s: float):
    """What `proc` puts on `results`, or None once it has ended without (a child that dies puts nothing)."""
    import queue

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            if not proc.is_alive():
                try:  # it may have put its result just before it ended
                    return results.get(timeout=1)
                except queue.Empty:
                    return None
    raise TimeoutError(f"no result from the trainer process within {timeout_s:.0f} s")


def bench_trainer(tokens_list=(4096, 32768), rounds: int = 7, processes: int = 2, profile_dir: str | None = None,
                  variants: list[str] | None = None, models: list[str] | None = None,
                  stages: tuple[str, ...] = ("zero2", "zero3")) -> None:
    """The full optimizer step of each of `models` (`small`, the default, or REAL_WIDTHS names) through agentrl's
    DeepSpeed trainer (ZeRO-2 and ZeRO-3, one GPU, bf16, gradient checkpointing on, as the trainer defaults) against
    the bare forward + backward of the same packed micro-batch in plain PyTorch. Each ZeRO stage (and each of
    `variants`, TRAINER_VARIANTS keys; [] for all) runs in `processes` processes of its own, each timing the bare
    step and the DeepSpeed step in turn for `rounds` rounds: the ratio is taken per round, so a process that runs
    slow (this host's medians moved ±15% from one process to the next) is slow for both. Reported: medians over all
    rounds, the ratio's median and range, and the GPU memory the trainer holds after its first step (weights,
    optimizer states, gradient buffers, CUDA graphs; the most of any process). With `profile_dir`, each ZeRO stage's
    step is also profiled once (tables written there). `stages`: which of the two ZeRO stages to time."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    chosen = [] if variants is None else [v for v in TRAINER_VARIANTS if v not in ("zero2", "zero3")
                                          and (not variants or v in variants)]
    names = [*stages, *chosen]
    rows = []
    for model, tokens in ((m, t) for m in (models or ["small"]) for t in tokens_list):
        for what in names:
            bare, adam, deep, held = [], [], [], []
            for p in range(processes):
                results = ctx.Queue()
                proc = ctx.Process(target=_trainer_rank, args=(what, tokens, rounds, free_port(), results,
                                                               profile_dir if p == 0 and what in ("zero2", "zero3")
                                                               else None, model))
                proc.start()
                got = _result_or_death(proc, results, timeout_s=500)
                proc.join()
                if got is None:  # out of memory, or killed: its traceback is above
                    print(model, tokens, what, f"process {p}: died (exit code {proc.exitcode})", flush=True)
                    break
                _, b, a, d, gib = got
                bare += b
                adam += a
                deep += d
                held.append(gib)
                print(model, tokens, what, f"process {p}: bare {statistics.median(b) * 1e3:.0f} ms, "
                      f"{what} {statistics.median(d) * 1e3:.0f} ms", flush=True)
            if not deep:
                rows.append([model, f"{tokens:,}", what, "", "", "died", "", "", "", ""])
                continue
            ratios = sorted(b / d for b, d in zip(bare, deep))
            rows.append([model, f"{tokens:,}", what, f"{statistics.median(bare) * 1e3:.0f}",
                         f"{statistics.median(adam) * 1e3:.0f}", f"{statistics.median(deep) * 1e3:.0f}",
                         f"{tokens / statistics.median(deep) / 1e3:.1f}K", f"{statistics.median(ratios):.2f}×",
                         f"{ratios[0]:.2f}–{ratios[-1]:.2f}", f"{max(held):.1f}"])
            print("row:", " | ".join(rows[-1]), flush=True)  # whole rows as they come: a cut run keeps them
    print(f"\n### DeepSpeed around the step on one {torch.cuda.get_device_name()}: bf16, ms per step; "
          f"{processes} processes × {rounds} rounds of (bare, bare + fused AdamW, DeepSpeed) per row\n")
    print(table(["model", "tokens", "DeepSpeed step", "bare fwd+bwd", "bare + fused AdamW", "DeepSpeed", "tokens/s",
                 "bare / DeepSpeed (median)", "range over rounds", "GPU GiB the trainer holds"], rows))
    print(flush=True)


# --- profile ------------------------------------------------------------------------------------------------------
def host_syncs_and_launches(averages) -> tuple[int, int]:
    """(the times the host waited for the GPU, the kernels it launched) in a profiled step's key averages. A wait is
    a stream, event or device synchronize or a blocking copy (`.item()`, `.tolist()` and `.cpu()` of a GPU tensor
    are a copy and a stream synchronize); the device synchronize that ends the profiled step is not counted."""
    counts = {e.key: e.count for e in averages}
    syncs = sum(counts.get(k, 0) for k in ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                                            "cudaMemcpy")) - 1
    launches = sum(counts.get(k, 0) for k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    return syncs, launches


def profiled_call(step, trace: str | None = None) -> tuple:
    """One call of `step` under torch.profiler: (its key averages, the GPU's kernel seconds, host syncs, kernel
    launches). `trace`: a file for its timeline (Chrome's trace format, gzipped), where the GPU's idle gaps and what
    the host did in them can be read."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
        subprocess.run(["gzip", "-f", trace], check=True)
    avg = prof.key_averages()
    # kernels only (as the table's "Self CUDA time total"): an aten op's self device time repeats them
    gpu_us = sum(e.self_device_time_total for e in avg if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    return (avg, gpu_us / 1e6, *host_syncs_and_launches(avg))


def sync_sites_table(step) -> str:
    """One call of `step` under torch's sync debug mode: who made the host wait (agentrl/host_syncs.py)."""
    from agentrl.host_syncs import sync_sites

    sites = sync_sites(step)
    return (f"host syncs by caller (torch's sync debug mode, one step: {sum(sites.values())} in all)\n\n"
            + table(["syncs", "synchronising call made at", "reached from agentrl at"],
                    [[n, site.caller, site.via] for site, n in sites.most_common()]))


def bench_profile(tokens_list, models: list[str] | None, out: str | None) -> None:
    """For each model and length: the step's wall time, its GPU busy time (the sum of kernel times: well below the
    wall time means the host is the bound) and the kernels that take the GPU's time."""
    summary, texts = [], []
    for key in models or ["agentrl"]:
        name, build, loss_fn, fused = MODELS[key]
        torch.manual_seed(0)
        built = build()
        model = built.model.to("cuda", torch.bfloat16).train()
        with kernels(fused):
            for tokens in tokens_list:
                step = train_step(model, loss_fn, tokens)
                started = time.perf_counter()
                print(f"  {name} T={tokens}: warming up (Triton compiles fla's kernels on a cold cache)", flush=True)
                wall = median_seconds(step, 3)
                print(f"  {name} T={tokens}: timed after {time.perf_counter() - started:.0f} s", flush=True)
                avg, gpu, syncs, launches = profiled_call(step)
                summary.append([name, tokens, f"{wall * 1e3:.1f}", f"{gpu * 1e3:.1f}", f"{gpu / wall * 100:.0f}%",
                                syncs, launches])
                print(f"  {name} T={tokens}: wall {wall * 1e3:.1f} ms, GPU kernels {gpu * 1e3:.1f} ms", flush=True)
                sites = sync_sites_table(step)
                print(sites, flush=True)
                texts.append(f"### {name}, T={tokens}: {sites}")
                texts.append(f"### {name}, T={tokens}: wall {wall * 1e3:.1f} ms, GPU kernels {gpu * 1e3:.1f} ms\n\n"
                             + avg.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=80))
                texts.append(f"### {name}, T={tokens}, by CPU total\n\n"
                             + avg.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=80))
                if out:  # written as it goes: a call stopped at its limit keeps what it measured
                    with open(out, "w") as f:
                        f.write("\n\n".join(texts))
                del step
        del built, model
        torch.cuda.empty_cache()
    print("### Where one fwd+bwd step's time goes (profiled step; wall time: median of 3 unprofiled)\n")
    print(table(["model", "tokens", "wall ms", "GPU kernels ms", "GPU busy", "host syncs", "kernel launches"],
                summary))
    print(flush=True)


def _components(model, tokens: int):
    """(name, layers of that kind in the model, fwd+bwd of one of them on `tokens` packed tokens) for each part of
    a decoder step, then the whole step, eager and replayed from a CUDA graph."""
    from agentrl.model.modeling import chunked_token_logprobs

    config, layers = model.config, list(model.model.layers)
    hidden = torch.randn(tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    targets = torch.randint(0, config.vocab_size, (tokens,), device="cuda")

    def fwd_bwd(forward):
        def step():
            h = hidden.detach().requires_grad_()
            forward(h).float().sum().backward()
            model.zero_grad(set_to_none=True)
        return step

    kinds = [("KDA attention (with its norm)", lambda layer: layer.is_kda,
              lambda layer: lambda h: layer.attention(h, cu_seqlens, None, False)),
             ("MLA attention (with its norm)", lambda layer: not layer.is_kda,
              lambda layer: lambda h: layer.attention(h, cu_seqlens, None, False)),
             ("MoE feed-forward (with its norm)", lambda layer: layer.is_moe,
              lambda layer: lambda h: layer.feed_forward(h, None)[0]),
             ("dense MLP (with its norm)", lambda layer: not layer.is_moe,
              lambda layer: lambda h: layer.feed_forward(h, None)[0])]
    for name, chosen, forward in kinds:
        matching = [layer for layer in layers if chosen(layer)]
        if matching:
            yield name, len(matching), fwd_bwd(forward(matching[0]))
    yield "log-prob head", 1, fwd_bwd(lambda h: chunked_token_logprobs(h, model.lm_head.weight, targets)[0])
    yield "whole step", 1, train_step(model, agentrl_loss, tokens)
    yield "whole step, replayed from a CUDA graph", 1, graphed_train_step(model, tokens)


def graphed_train_step(model, tokens: int):
    """`train_step`'s forward + backward (one sequence of `tokens`, the same loss) replayed from a CUDA graph of
    `tokens` tokens (trainer/cuda_graphs.py; the first call records it): the step without its launches."""
    from agentrl.trainer.cuda_graphs import GraphedForward

    graphs = GraphedForward(model, (tokens,), max_sequences=8)
    ids = torch.randint(0, model.config.vocab_size, (tokens + 1,), device="cuda")
    cu_seqlens = torch.tensor([0, tokens], device="cuda")

    def step():
        logprobs, _ = graphs(ids[:-1], cu_seqlens, ids[1:], None, 1.0)
        (-logprobs.mean()).backward()
        model.zero_grad(set_to_none=True)

    return step


def bench_components(tokens_list, models: list[str] | None) -> None:
    """Issue 26's short step, by part: each kind of layer's forward + backward alone at the step's length (wall time,
    the GPU's kernel time, the kernels launched, the host's waits), and how many of the whole step's launches that
    kind makes (× its layers). Where wall time is well above kernel time the host is the bound, and the launches say
    which part keeps it busy."""
    rows = []
    for key in models or ["small"]:
        model = real_width_model(key).train()
        for tokens in tokens_list:
            measured = []
            for name, count, step in _components(model, tokens):
                wall = median_seconds(step, 5)
                _, gpu, syncs, launches = profiled_call(step)
                measured.append((name, count, wall, gpu, syncs, launches))
                print(f"  {key} T={tokens} {name}: wall {wall * 1e3:.2f} ms, {launches} launches", flush=True)
            whole_launches = next(m[5] for m in measured if m[0] == "whole step")
            for name, count, wall, gpu, syncs, launches in measured:
                rows.append([key, f"{tokens:,}", name, count, f"{wall * 1e3:.2f}", f"{gpu * 1e3:.2f}",
                             f"{gpu / wall * 100:.0f}%", syncs, launches, f"{wall / launches * 1e6:.0f}",
                             f"{count * launches / whole_launches * 100:.0f}%"])
        del model
        torch.cuda.empty_cache()
    print("\n### The step by part: one layer of each kind, fwd+bwd alone, bf16, one sequence (wall: median of 5; "
          "kernels, launches, syncs: one profiled call)\n")
    print(table(["model", "tokens", "part", "layers", "wall ms", "GPU kernels ms", "GPU busy", "host syncs",
                 "kernel launches", "wall µs per launch", "share of the step's launches (× layers)"], rows))
    print(flush=True)


# --- the state dict to host memory -----------------------------------------------------------------------------------
def bench_host() -> None:
    """What `PolicyTrainer.full_state_dict` pays on rank 0 before writing: every tensor copied to host memory."""
    from agentrl.trainer.host_copy import to_host

    rows = []
    for experts in (None, 64):
        overrides = {} if experts is None else dict(num_experts=experts, num_experts_per_token=4)
        with torch.device("meta"):
            shapes = agentrl_small(**overrides).model.state_dict()
        state = {k: torch.randn(v.shape, device="cuda", dtype=torch.bfloat16) for k, v in shapes.items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())

        def per_tensor():  # what gather_state_dict did before (one synchronising pageable copy each, then a clone)
            return {k: v.detach().cpu().clone() for k, v in state.items()}

        got = to_host(state)
        assert all(torch.equal(got[k], state[k].cpu()) for k in state)
        label = "`small`" + ("" if experts is None else f", {experts} experts top-4")
        for name, fn in (("per tensor `.cpu().clone()`", per_tensor), ("bucketed `to_host`", lambda: to_host(state))):
            sec = median_seconds(fn, 5)
            rows.append([label, len(state), f"{nbytes / 1e9:.2f}", name, f"{sec * 1e3:.0f}",
                         f"{nbytes / sec / 1e9:.1f}"])
        del state, got
        torch.cuda.empty_cache()
    print(f"### The bf16 state dict from one {torch.cuda.get_device_name()} to host memory "
          "(median of 5 after a warm-up)\n")
    print(table(["model", "tensors", "GB", "copy", "ms", "GB/s"], rows))
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["throughput", "memory", "gate", "publish", "weight-ipc", "host",
                                         "trainer", "profile", "components", "all"])
    parser.add_argument("--tokens", type=int, nargs="*", default=None)
    parser.add_argument("--out", default=None, help="profile: a file for the full tables; trainer: a folder for "
                        "a profile of each DeepSpeed step")
    parser.add_argument("--models", nargs="*", default=None, help="throughput, profile: a subset of "
                        f"{', '.join(MODELS)} (default {', '.join(DEFAULT_MODELS)}; profile: agentrl), in the order "
                        "given; components and trainer: small (default) or "
                        f"{', '.join(REAL_WIDTHS)}")
    parser.add_argument("--variants", nargs="*", default=None, help="trainer: also time these TRAINER_VARIANTS "
                        "entries (none named: all)")
    parser.add_argument("--rounds", type=int, default=7, help="trainer: rounds of (bare, DeepSpeed) steps per process")
    parser.add_argument("--processes", type=int, default=2, help="trainer: processes per ZeRO stage or variant")
    parser.add_argument("--stages", nargs="+", choices=["zero2", "zero3"], default=["zero2", "zero3"],
                        help="trainer: the ZeRO stages timed (both by default)")
    parser.add_argument("--receiver-gpu", type=int, default=0, help="weight-ipc: the receiving process's GPU (1: "
                        "issue 25's GPU-to-GPU sync, with `publish` for the NCCL broadcast)")
    args = parser.parse_args()
    widths = ["small", *REAL_WIDTHS]
    if args.what in ("trainer", "components") and (unknown := [m for m in args.models or [] if m not in widths]):
        parser.error(f"{args.what} takes --models from {', '.join(widths)}; unknown: {', '.join(unknown)}")
    assert torch.cuda.is_available(), "run through the device tool"
    if args.what in ("throughput", "all"):
        bench_throughput(tuple(args.tokens) if args.tokens else TOKENS, args.models)
    if args.what in ("gate", "all"):
        bench_gate()
    if args.what in ("memory", "all"):
        bench_memory(tuple(args.tokens)) if args.tokens and args.what == "memory" else bench_memory()
    if args.what in ("publish", "all"):
        bench_publish()
    if args.what in ("weight-ipc", "all"):
        bench_weight_ipc(receiver_gpu=args.receiver_gpu)
    if args.what in ("host", "all"):
        bench_host()
    if args.what == "trainer":
        bench_trainer(tuple(args.tokens) if args.tokens else (4096, 32768), rounds=args.rounds,
                      processes=args.processes, profile_dir=args.out, variants=args.variants, models=args.models,
                      stages=tuple(args.stages))
    if args.what == "components":
        bench_components(tuple(args.tokens) if args.tokens else (4096,), args.models)
    if args.what == "profile":
        bench_profile(tuple(args.tokens) if args.tokens else (4096, 32768), args.models, args.out)


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
