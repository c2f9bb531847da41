"""CPU serving benchmark: agentrl's hybrid model through the vLLM plugin vs vLLM's native Qwen3 of similar size.

    .venv/bin/python scripts/bench_serving.py                   # tiny and ~50M models, batch 1 and 32
    .venv/bin/python scripts/bench_serving.py --quick           # fewer tokens, one round, for a look

Builds random-weight fp32 checkpoints locally: agentrl's "tiny" preset and a ~50M hybrid, each beside a Qwen3
(`transformers.Qwen3Config` + `save_pretrained`) of about the same total size, plus a ~200M hybrid served only to time
weight updates. Each model is served by `vllm.LLM` in its own process (the hybrids with `engine.make_llm`: eager,
block 32, prefix caching, routing capture; Qwen3 with the same settings as vLLM's own model). The hybrid and its
Qwen3 are alive together and timed alternately, workload by workload and round by round, so that both see the same
load on a shared machine; the ratio column is the median over rounds of the paired speed ratios.

Workloads (every prompt is fresh random tokens, so there are no prefix-cache hits):
- generation: B prompts of `--prompt` tokens, `--new` sampled tokens each (ignore_eos); tokens/s counts generated
  tokens over the whole `generate` call, prefill included;
- prefill: B prompts of `--prefill` tokens and one sampled token; tokens/s counts prompt tokens;
- weight updates (hybrids): `engine.update_weights` from a checkpoint directory and from in-memory tensors,
  prefix-cache resets included.
Speeds are the best round; the machine's load average is printed with the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HYBRID_50M = dict(
    vocab_size=16384, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
    kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=256,
    first_k_dense_replace=1, attn_res_block_size=2,
    linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8], num_heads=8, head_dim=64,
                            short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True),
)
HYBRID_200M = dict(HYBRID_50M, vocab_size=32768, hidden_size=1024, intermediate_size=2048, kv_lora_rank=256,
                   moe_intermediate_size=512,
                   linear_attn_config=dict(HYBRID_50M["linear_attn_config"], num_heads=8, head_dim=128))
QWEN3 = {  # total parameters close to the hybrid's of the same size
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32),
    "50m": dict(vocab_size=16384, hidden_size=512, intermediate_size=2432, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}


def build(root: str) -> dict[str, dict]:
    """Writes the checkpoints; returns a description per model name."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentrl.model.config import HybridMoEConfig, preset_config
    from agentrl.model.modeling import HybridMoEForCausalLM

    models = {}
    sizes = (("tiny", preset_config("tiny")), ("50m", HybridMoEConfig(**HYBRID_50M)),
             ("200m", HybridMoEConfig(**HYBRID_200M)))
    for size, config in sizes:
        for version in (0, 1):
            torch.manual_seed(version)
            model = HybridMoEForCausalLM(config).float()
            model.save_pretrained(os.path.join(root, f"hybrid-{size}-v{version}"))
        total, active = model.parameter_counts()
        models[f"hybrid-{size}"] = dict(kind="hybrid", path=os.path.join(root, f"hybrid-{size}-v0"),
                                        update_path=os.path.join(root, f"hybrid-{size}-v1"), params=total,
                                        active=active, vocab=config.vocab_size)
        del model
        if size in QWEN3:
            qcfg = Qwen3Config(**QWEN3[size], max_position_embeddings=8192, tie_word_embeddings=False,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0)
            torch.manual_seed(0)
            qwen = Qwen3ForCausalLM(qcfg).float()
            path = os.path.join(root, f"qwen3-{size}")
            qwen.save_pretrained(path)
            count = sum(p.numel() for p in qwen.parameters())
            models[f"qwen3-{size}"] = dict(kind="qwen3", path=path, params=count, active=count, vocab=qcfg.vocab_size)
    return models


# --- one served model, driven over stdin/stdout -----------------------------------------------------------------------
def serve(spec: dict) -> None:
    """Builds the engine, then answers one JSON command per stdin line with `RESULT <seconds>`."""
    import torch
    from vllm import LLM, SamplingParams

    from agentrl.model.checkpoint import load_checkpoint_tensors
    from agentrl.rollout import engine as serving

    common = dict(max_model_len=spec["max_model_len"], kv_cache_memory_bytes=512 << 20,
                  max_num_seqs=spec["max_batch"], seed=0)
    if spec["kind"] == "hybrid":
        llm = serving.make_llm(spec["path"], **common)
        tensors = list(load_checkpoint_tensors(spec["update_path"]).items())
    else:
        llm = LLM(**serving.engine_kwargs(spec["path"], implementation="upstream", **common))
    gen = torch.Generator().manual_seed(0)
    versions = iter(range(1, 10**6))
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] in ("generate", "prefill"):
            length, new = (spec["prompt"], spec["new"]) if cmd["op"] == "generate" else (spec["prefill"], 1)
            prompts = [{"prompt_token_ids": torch.randint(3, spec["vocab"], (length,), generator=gen).tolist()}
                       for _ in range(cmd["batch"])]
            params = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, detokenize=False, logprobs=0)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
        else:
            source = spec["update_path"] if cmd["op"] == "update-directory" else tensors
            start = time.perf_counter()
            serving.update_weights(llm, source, version=next(versions))
        print(f"RESULT {time.perf_counter() - start}", flush=True)


class Server:
    def __init__(self, spec: dict, env: dict, log_path: str):
        self.log_path = log_path
        with open(log_path, "w") as log:  # vLLM logs plenty; a pipe nobody reads would fill and block the server
            self.proc = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(spec)], env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        with open(self.log_path) as log:
            sys.exit(f"server died:\n{log.read()[-5000:]}")

    def time(self, op: str, batch: int = 0) -> float:
        self.proc.stdin.write(json.dumps({"op": op, "batch": batch}) + "\n")
        self.proc.stdin.flush()
        return float(self._expect("RESULT "))

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="--prompt 32 --new 16 --prefill 128 --rounds 1")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # internal: one engine process
    args = parser.parse_args()
    if args.serve:
        serve(json.loads(args.serve))
        return
    if args.quick:
        args.prompt, args.new, args.prefill, args.rounds = 32, 16, 128, 1
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("OMP_NUM_THREADS", "2")
    shared = dict(prompt=args.prompt, new=args.new, prefill=args.prefill, max_batch=max(args.batches),
                  max_model_len=max(args.prompt + args.new, args.prefill + 1) + 64)
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as root:
        models = build(root)
        speed, ratios, updates = {}, {}, {}
        for size in ("tiny", "50m", "200m"):
            hybrid = Server(dict(models[f"hybrid-{size}"], **shared), env, os.path.join(root, f"hybrid-{size}.log"))
            qwen = None
            if size in QWEN3:
                qwen = Server(dict(models[f"qwen3-{size}"], **shared), env, os.path.join(root, f"qwen3-{size}.log"))
            workloads = [(op, b) for b in args.batches for op in ("generate", "prefill")] if qwen else []
            for op, batch in workloads:  # warm-up
                hybrid.time(op, batch)
                qwen.time(op, batch)
            for _ in range(args.rounds):
                for op, batch in workloads:
                    tokens = batch * (args.new if op == "generate" else args.prefill)
                    t_hybrid, t_qwen = hybrid.time(op, batch), qwen.time(op, batch)
                    for name, seconds in ((f"hybrid-{size}", t_hybrid), (f"qwen3-{size}", t_qwen)):
                        key = (name, op, batch)
                        speed[key] = max(speed.get(key, 0.0), tokens / seconds)
                    ratios.setdefault((size, op, batch), []).append(t_qwen / t_hybrid)
                for op in ("update-directory", "update-tensors"):
                    key = (f"hybrid-{size}", op)
                    updates[key] = min(updates.get(key, float("inf")), hybrid.time(op))
            if not workloads:
                for _ in range(args.rounds):
                    for op in ("update-directory", "update-tensors"):
                        key = (f"hybrid-{size}", op)
                        updates[key] = min(updates.get(key, float("inf")), hybrid.time(op))
            for server in (hybrid, qwen):
                if server is not None:
                    server.close()
            loads.append(os.getloadavg()[0])
            print(f"done: {size}", file=sys.stderr, flush=True)
    print_tables(models, speed, ratios, updates, args, env["OMP_NUM_THREADS"], loads)


def print_tables(models, speed, ratios, updates, args, threads: str, loads: list[float]) -> None:
    print(f"OMP_NUM_THREADS={threads}, fp32, generation: {args.prompt}-token prompts + {args.new} new tokens; "
          f"prefill: {args.prefill}-token prompts; best of {args.rounds} rounds; 1-min load average "
          f"{min(loads):.1f}-{max(loads):.1f} during the run\n")
    print("| model | params (active) | batch | generation tok/s | hybrid/Qwen3 | prefill tok/s | hybrid/Qwen3 |")
    print("|---|---|---|---|---|---|---|")
    for size in QWEN3:
        for name in (f"hybrid-{size}", f"qwen3-{size}"):
            model = models[name]
            for batch in args.batches:
                cells = []
                for op in ("generate", "prefill"):
                    cells.append(f"{speed[(name, op, batch)]:,.0f}")
                    ratio = statistics.median(ratios[(size, op, batch)])
                    cells.append(f"{ratio:.2f}" if name.startswith("hybrid") else "")
                print(f"| {name} | {model['params'] / 1e6:.2f}M ({model['active'] / 1e6:.2f}M) | {batch} | "
                      + " | ".join(cells) + " |")
    print("\n| model | params | weights (MB) | update from directory (ms) | update from tensors (ms) |")
    print("|---|---|---|---|---|")
    for name, model in models.items():
        if model["kind"] == "hybrid":
            print(f"| {name} | {model['params'] / 1e6:.1f}M | {model['params'] * 4 / 1e6:.0f} | "
                  f"{updates[(name, 'update-directory')] * 1e3:.1f} | {updates[(name, 'update-tensors')] * 1e3:.1f} |")


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
