"""Rollout throughput: the multi-turn agent loop against bare vLLM generation of the same prompts and lengths.

    python scripts/bench_rollout.py [--episodes 32] [--turns 3] [--env-isolation process|thread]

Builds the tiny hybrid policy (served by the agentrl vLLM plugin on CPU), runs `--episodes` Calc-v0 episodes through
the agent loop, then replays exactly the same requests on the bare engine — every assistant turn's prompt tokens,
forced to the same number of sampled tokens, with the same concurrency per turn — and reports both sampled-token
rates and their ratio (goal ≥ 0.9). Then episodes/s for Calc-v0 and KVChain-v0. A random policy ends episodes at
the turn limit, so "episodes/s" counts full-length episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from agentrl.init_model import init_model
from agentrl.rollout.agent_loop import AgentLoop, EpisodeRequest, prefix_cache_stats
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy_engine import EngineSpec, PolicyEngine


def table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


async def run(args) -> None:
    root = tempfile.mkdtemp(prefix="bench_rollout_")
    ckpt = init_model(os.path.join(root, "ckpt"), preset="tiny", vocab_size=1024,
                      env_ids=("agentrl/Calc-v0", "agentrl/KVChain-v0"))
    engine = await PolicyEngine.create(EngineSpec(model=ckpt, max_model_len=4096, kv_cache_memory_bytes=512 << 20))
    from agentrl.chat import load_chat_format

    config = RolloutConfig(max_tokens_per_turn=args.tokens_per_turn, max_trajectory_tokens=4096,
                           max_concurrent_episodes=args.episodes, env_isolation=args.env_isolation)
    loop = AgentLoop(engine, load_chat_format(ckpt), config)

    def requests(env_id: str, kwargs: dict):
        return [EpisodeRequest(env_id=env_id, task_index=i, group_id=f"g{i}", trajectory_id=f"{env_id}-{i}",
                               seed=i, env_kwargs=kwargs) for i in range(args.episodes)]

    # warm-up: one short episode per slot of each env, so the measured runs reuse built envs (as every RL step after
    # a job's first does) and the engine has compiled its shapes
    for env_id, kwargs in (("agentrl/Calc-v0", {"max_turns": args.turns}),
                           ("agentrl/KVChain-v0", {"max_turns": args.turns, "hops": args.turns})):
        await asyncio.gather(*[loop.run(r) for r in requests(env_id, kwargs)])
    await engine.llm.reset_prefix_cache()
    rows, episode_rows, cache_rows = [], [], []
    for env_id, kwargs in (("agentrl/Calc-v0", {"max_turns": args.turns}),
                           ("agentrl/KVChain-v0", {"max_turns": args.turns, "hops": args.turns})):
        await engine.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        trajs = await asyncio.gather(*[loop.run(r) for r in requests(env_id, kwargs)])
        loop_s = time.perf_counter() - t0
        sampled = sum(t.num_sampled for t in trajs)
        episode_rows.append([env_id, len(trajs), f"{loop_s:.1f}", f"{len(trajs) / loop_s:.2f}",
                             f"{sum(len(t.tokens) for t in trajs) / len(trajs):.0f}"])
        cache = prefix_cache_stats(trajs)
        cache_rows.append([env_id, cache["prompt_tokens"], cache["cached_tokens"],
                           f"{cache['cached_tokens'] / max(cache['prompt_tokens'], 1):.1%}", cache["reusable_tokens"],
                           cache["reused_tokens"], f"{cache['reused_tokens'] / max(cache['reusable_tokens'], 1):.1%}"])
        # the same requests on the bare engine: turn by turn, all episodes' k-th turns concurrently
        turns = [[t for t in traj.turns if t.role == "assistant"] for traj in trajs]
        await engine.llm.reset_prefix_cache()  # the bare replay must not reuse the loop's cached prefixes
        bare_s = 0.0
        for k in range(max(len(x) for x in turns)):
            jobs = []
            for traj, assistant in zip(trajs, turns):
                if k < len(assistant):
                    turn = assistant[k]
                    n = sum(traj.loss_mask[turn.start:turn.end])
                    jobs.append(_forced(engine, traj.tokens[:turn.start], n))
            t0 = time.perf_counter()
            await asyncio.gather(*jobs)
            bare_s += time.perf_counter() - t0
        rows.append([env_id, sampled, f"{sampled / loop_s:,.0f}", f"{sampled / bare_s:,.0f}",
                     f"{bare_s / loop_s:.2f}"])
    engine.shutdown()
    loop.envs.close()
    print(f"### Agent loop vs bare vLLM ({args.episodes} concurrent episodes, {args.turns} turns, tiny hybrid via the "
          f"plugin, rollout.env_isolation={args.env_isolation}, 2 CPU cores)\n")
    print(table(["env", "sampled tokens", "agent loop tok/s", "bare vLLM tok/s", "ratio"], rows))
    print()
    print(table(["env", "episodes", "seconds", "episodes/s", "tokens/episode"], episode_rows))
    print("\n### Prompt tokens served from vLLM's prefix cache (all calls; and on turns 2+, of the tokens the engine "
          "had already run for the episode)\n")
    print(table(["env", "prompt tokens", "from the cache", "hit rate", "earlier turns' tokens (turn 2+)",
                 "reused", "reuse"], cache_rows))


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
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=48)
    parser.add_argument("--env-isolation", choices=("process", "thread"), default="process")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
