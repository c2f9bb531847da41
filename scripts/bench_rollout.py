"""Rollout throughput: the multi-turn agent loop against bare vLLM generation of the same prompts and lengths.

    python scripts/bench_rollout.py [--episodes 32 256] [--repeats 3] [--turns 3] [--env-isolation process|thread]
                                    [--worker-process]

Builds the tiny hybrid policy (served by the agentrl vLLM plugin on CPU) and, for each concurrency in `--episodes`
and each env, runs `--repeats` pairs: the episodes through the agent loop and exactly the same requests on the
bare engine — every assistant turn's prompt tokens, forced to the same number of sampled tokens, the k-th turns of
all episodes together — each after emptying the prefix cache; every other pair runs the bare side first (replaying
the previous pair's episodes), so that an advantage of going first or second cancels. Both share the engine and the
machine's load at that moment, so their ratio (goal >= 0.95) is read per pair; the table gives the median pair and
the range. The bare
replay waits for all k-th turns before the (k+1)-th: it does less scheduling work than the loop but never overlaps
a turn with another episode's env step.

Then how much of each prompt vLLM served from its prefix cache (multi-turn state reuse: KDA recurrent and conv
states, MLA cache) over the episodes of the last pair. A random policy ends episodes at the turn limit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from agentrl.init_model import init_model
from agentrl.report import markdown_table as table
from agentrl.rollout.agent_loop import AgentLoop, EpisodeRequest, prefix_cache_stats
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy_engine import EngineSpec, PolicyEngine
from agentrl.types import Status

# each env's kwargs for `turns` turns and tasks 0..n-1 (DocSearch generates 200 tasks unless told)
ENVS = {"agentrl/Calc-v0": lambda turns, n: {"max_turns": turns},
        "agentrl/KVChain-v0": lambda turns, n: {"max_turns": turns, "hops": turns},
        "agentrl/DocSearch-v0": lambda turns, n: {"max_turns": turns, "context_tokens": 2048, "num_tasks": n}}


def requests(env_id: str, kwargs: dict, n: int) -> list[EpisodeRequest]:
    return [EpisodeRequest(env_id=env_id, task_index=i, group_id=f"g{i}", trajectory_id=f"{env_id}-{i}", seed=i,
                           env_kwargs=kwargs) for i in range(n)]


async def run_loop(loop: AgentLoop, asks: list[EpisodeRequest], env_id: str):
    """The episodes through the agent loop from an empty prefix cache."""
    await loop.engine.llm.reset_prefix_cache()
    trajs = await asyncio.gather(*[loop.run(r) for r in asks])
    failed = [t for t in trajs if t.status == Status.FAILED]
    if failed:  # a failing env would flatter neither side: stop
        raise RuntimeError(f"{len(failed)} {env_id} episodes failed, e.g. {failed[0].error}")
    return trajs


async def bare_replay(engine: PolicyEngine, trajs) -> float:
    """Seconds the bare engine takes for the trajectories' assistant turns, turn by turn, from an empty prefix cache
    (it must not reuse the loop's cached prefixes)."""
    await engine.llm.reset_prefix_cache()
    turns = [[t for t in traj.turns if t.role == "assistant"] for traj in trajs]
    seconds = 0.0
    for k in range(max(len(x) for x in turns)):
        jobs = [_forced(engine, traj.tokens[:a[k].start], sum(traj.loss_mask[a[k].start:a[k].end]))
                for traj, a in zip(trajs, turns) if k < len(a)]
        t0 = time.perf_counter()
        await asyncio.gather(*jobs)
        seconds += time.perf_counter() - t0
    return seconds


async def run(args) -> None:
    root = tempfile.mkdtemp(prefix="bench_rollout_")
    ckpt = init_model(os.path.join(root, "ckpt"), preset="tiny", vocab_size=1024, env_ids=tuple(ENVS))
    from agentrl.chat import load_chat_format

    most = max(args.episodes)
    # --worker-process: the model's worker in a process of its own, vLLM's CPU default (engine.start_async_llm)
    extra = {"distributed_executor_backend": "mp"} if args.worker_process else {}
    engine = await PolicyEngine.create(EngineSpec(model=ckpt, max_model_len=4096, kv_cache_memory_bytes=1 << 30,
                                                  max_num_seqs=most, extra=extra))
    config = RolloutConfig(max_tokens_per_turn=args.tokens_per_turn, max_trajectory_tokens=4096,
                           max_concurrent_episodes=most, env_isolation=args.env_isolation)
    loop = AgentLoop(engine, load_chat_format(ckpt), config)
    envs = [e for e in ENVS if e in args.envs]
    # warm-up: one episode per slot of each env, so that the measured runs reuse built envs (as every RL step after
    # a job's first does) and the engine has compiled its shapes
    for env_id in envs:
        await asyncio.gather(*[loop.run(r) for r in requests(env_id, ENVS[env_id](args.turns, most), most)])
    speed_rows, cache_rows = [], []
    for n in args.episodes:
        for env_id in envs:
            asks = requests(env_id, ENVS[env_id](args.turns, most), n)
            pairs = []
            for repeat in range(args.repeats):
                # odd pairs run the bare side first (replaying the previous pair's episodes), so that whatever the
                # order favours cancels in the median; each side's tokens/s counts the tokens it generated
                bare_first = repeat % 2 == 1
                if bare_first:
                    bare_tps = sampled / await bare_replay(engine, trajs)
                t0 = time.perf_counter()
                trajs = await run_loop(loop, asks, env_id)
                sampled = sum(t.num_sampled for t in trajs)
                loop_tps = sampled / (time.perf_counter() - t0)
                if not bare_first:
                    bare_tps = sampled / await bare_replay(engine, trajs)
                pairs.append((loop_tps, bare_tps, loop_tps / bare_tps))
            ratios = sorted(p[2] for p in pairs)
            mid = sorted(pairs, key=lambda p: p[2])[len(pairs) // 2]
            speed_rows.append([n, env_id, sampled, f"{mid[0]:,.0f}", f"{mid[1]:,.0f}",
                               f"{statistics.median(ratios):.2f}", f"{ratios[0]:.2f}–{ratios[-1]:.2f}"])
            cache = prefix_cache_stats(trajs)
            cache_rows.append([n, env_id, f"{sum(len(t.tokens) for t in trajs) / len(trajs):.0f}",
                               cache["prompt_tokens"], cache["cached_tokens"],
                               f"{cache['cached_tokens'] / max(cache['prompt_tokens'], 1):.1%}",
                               cache["reusable_tokens"], cache["reused_tokens"],
                               f"{cache['reused_tokens'] / max(cache['reusable_tokens'], 1):.1%}"])
            print(f"  {n} episodes, {env_id}: ratios {', '.join(f'{r:.2f}' for r in ratios)}", flush=True)
    engine.shutdown()
    loop.envs.close()
    print(f"\n### Agent loop vs bare vLLM ({args.turns} turns of <= {args.tokens_per_turn} tokens, tiny hybrid via the "
          f"plugin, rollout.env_isolation={args.env_isolation}, {args.repeats} pairs each, 2 CPU cores)\n")
    print(table(["concurrent episodes", "env", "sampled tokens", "agent loop tok/s", "bare vLLM tok/s",
                 "ratio (median pair)", "ratio range"], speed_rows))
    print("\n### Prompt tokens served from vLLM's prefix cache (all calls; and on turns 2+, of the tokens the engine "
          "had already run for the episode)\n")
    print(table(["concurrent episodes", "env", "tokens/episode", "prompt tokens", "from the cache", "hit rate",
                 "earlier turns' tokens (turn 2+)", "reused", "reuse"], cache_rows))


async def _forced(engine: PolicyEngine, prompt: list[int], n: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max(n, 1), min_tokens=max(n, 1), ignore_eos=True, logprobs=0,
                            detokenize=False)
    async for _ in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                       request_id=f"bare-{id(prompt)}-{time.time_ns()}"):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, nargs="+", default=[32, 256], help="concurrent episodes")
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    parser.add_argument("--repeats", type=int, default=3, help="loop/bare pairs per concurrency and env")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=48)
    parser.add_argument("--env-isolation", choices=("process", "thread"), default="process")
    parser.add_argument("--worker-process", action="store_true",
                        help="the engine's model worker in a process of its own (vLLM's CPU default)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
