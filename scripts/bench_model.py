"""Benchmarks of the hybrid model: whole-model training throughput and memory, and load-balancing convergence.

    python scripts/bench_model.py cpu        # tiny/50M-class model fwd+bwd tokens/s on CPU; QB convergence
    python scripts/bench_model.py gpu        # `small` preset fwd+bwd tokens/s at 4K/32K, peak memory vs length

Kernel-level KDA figures (chunked vs naive recurrence, bounded vs unbounded) are in scripts/bench_kda.py. Every
table is printed as Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from agentrl.model.balancing import ExpertBalancer, exact_quantile_bias
from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.report import markdown_table as table


def train_step_time(model, tokens: int, device: str, repeats: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens + 1), device=device)
    def step():
        lp = model(ids[:, :-1], target_ids=ids[:, 1:]).token_logprobs
        (-lp.mean()).backward()
    step()  # warm-up (kernel autotuning, allocator)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def bench_cpu() -> None:
    torch.set_num_threads(2)
    rows = []
    for name, overrides in (("tiny", {}), ("tiny, 4x wider (~30M)", dict(hidden_size=256, intermediate_size=512,
                                                                           moe_intermediate_size=128, kv_lora_rank=128,
                                                                           qk_nope_head_dim=32, v_head_dim=32,
                                                                           linear_attn_config=dict(num_heads=4,
                                                                                                   head_dim=64)))):
        torch.manual_seed(0)
        model = HybridMoEForCausalLM(preset_config("tiny", **overrides)).float().train()
        total, active = model.parameter_counts()
        for tokens in (1024, 4096):
            dt = train_step_time(model, tokens, "cpu", repeats=2)
            rows.append([name, f"{total / 1e6:.1f}M / {active / 1e6:.1f}M", tokens, f"{tokens / dt:,.0f}"])
    print("### Whole model, fwd+bwd on CPU (fp32, 2 threads)\n")
    print(table(["model", "params total/active", "tokens", "tokens/s"], rows))
    print()
    bench_balancing()


def bench_balancing() -> None:
    """Max/mean expert load over QB steps on a skewed router: DESIGN.md's α = (K+1)-th vs the per-expert threshold."""
    torch.manual_seed(0)
    experts, top_k, hidden = 16, 2, 32
    weight = torch.randn(experts, hidden) * 0.3
    weight[:3] += 0.6  # strongly skewed: three experts saturate for every token
    sample = lambda: torch.sigmoid((torch.randn(16384, hidden) + 0.5) @ weight.t())  # noqa: E731

    def ratio(bias):
        idx = (sample() + bias).topk(top_k).indices
        load = torch.bincount(idx.reshape(-1), minlength=experts).float()
        return (load.max() / load.mean()).item()

    def design_alpha(scores, bias):
        alpha = (scores + bias).topk(top_k + 1).values[:, -1:]
        b_hat = -torch.quantile((scores - alpha).double(), 1 - top_k / experts, dim=0).float()
        return b_hat - b_hat.mean()

    rows = []
    for label, update in (("DESIGN.md α = (K+1)-th for all", design_alpha),
                          ("per-expert α (agentrl)", lambda s, b: exact_quantile_bias(s, b, top_k))):
        bias = torch.zeros(experts)
        trace = [ratio(bias)]
        for _ in range(8):
            bias = update(sample(), bias)
            trace.append(ratio(bias))
        rows.append([label] + [f"{r:.2f}" for r in trace])
    hist = ExpertBalancer(num_experts=experts, top_k=top_k)
    bias = torch.zeros(experts)
    trace = [ratio(bias)]
    for _ in range(8):
        s = sample()
        hist.observe(s, bias, (s + bias).topk(top_k).indices)
        bias = hist.update(bias)
        trace.append(ratio(bias))
    rows.append(["per-expert α, 4096-bin histograms"] + [f"{r:.2f}" for r in trace])
    print("### Quantile Balancing: max/mean expert load per step (16 experts, top-2, 16K tokens/step)\n")
    print(table(["threshold"] + [f"step {i}" for i in range(9)], rows))


def bench_gpu() -> None:
    assert torch.cuda.is_available(), "run through the device tool"
    torch.manual_seed(0)
    cfg = preset_config("small")
    model = HybridMoEForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    total, active = model.parameter_counts()
    peak_flops = 990e12  # H200 dense bf16 (datasheet)
    rows = []
    for tokens in (4096, 32768):
        dt = train_step_time(model, tokens, "cuda", repeats=3)
        mfu = 6 * active * tokens / dt / peak_flops
        rows.append([tokens, f"{tokens / dt:,.0f}", f"{mfu * 100:.1f}%"])
    print(f"### `small` preset ({total / 1e6:.0f}M total, {active / 1e6:.0f}M active), bf16 fwd+bwd, B=1, H200\n")
    print(table(["tokens", "tokens/s", "MFU (6·N_active·tokens)"], rows))
    print()
    mem_rows = []
    model.gradient_checkpointing_enable()
    for tokens in (4096, 16384, 65536):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            dt = train_step_time(model, tokens, "cuda", repeats=1)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            mem_rows.append([tokens, f"{peak:.2f}", f"{peak * 2**20 / tokens:.1f}", f"{tokens / dt:,.0f}"])
        except torch.OutOfMemoryError:
            mem_rows.append([tokens, "OOM", "", ""])
        model.zero_grad(set_to_none=True)
    print("### Peak activation memory vs length (gradient checkpointing on)\n")
    print(table(["tokens", "peak GiB above weights", "MiB per 1K tokens", "tokens/s"], mem_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", choices=["cpu", "gpu"])
    args = parser.parse_args()
    bench_cpu() if args.target == "cpu" else bench_gpu()


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
