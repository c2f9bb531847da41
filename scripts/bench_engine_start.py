"""A rollout engine's start-up and speed on CPU, with the model's worker inside vLLM's engine-core process (agentrl's
choice, `engine.start_async_llm`) or in a process of its own (vLLM's CPU default).

    .venv/bin/python scripts/bench_engine_start.py [--repeats 3] [--requests 64] [--tokens 64] [--threads N]

Each run is a fresh Python process, as a rollout worker is, that builds the tiny hybrid's `PolicyEngine` (AsyncLLM
through the agentrl plugin) and times: the engine's creation (vLLM's imports in the processes it spawns, model load,
cache set-up), the first generation, and then `--requests` concurrent requests of 32 prompt tokens and `--tokens`
sampled tokens each (ignore_eos), the steady rollout speed. Spawning is forced, as inside a Ray actor, where vLLM
must spawn. The two layouts alternate run by run, so that both see the same load; the table gives the median over
runs and the range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from agentrl.report import markdown_table as table

LAYOUTS = {"worker in the engine core (agentrl)": "uni", "worker in its own process (vLLM's CPU default)": "mp"}


async def one_run(checkpoint: str, backend: str, requests: int, tokens: int) -> dict[str, float]:
    from agentrl.rollout.policy_engine import EngineSpec, PolicyEngine, SamplingSpec

    t0 = time.perf_counter()
    engine = await PolicyEngine.create(EngineSpec(model=checkpoint, max_model_len=2048, max_num_seqs=requests,
                                                  extra={"distributed_executor_backend": backend}))
    create_s = time.perf_counter() - t0
    sampling = SamplingSpec(temperature=1.0, max_tokens=tokens)
    t0 = time.perf_counter()
    await engine.generate(list(range(5, 37)), sampling, [])
    first_s = time.perf_counter() - t0
    prompts = [[(7 * i + j) % 900 + 5 for j in range(32)] for i in range(requests)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, sampling, []) for p in prompts])
    seconds = time.perf_counter() - t0
    engine.shutdown()
    return {"create_s": create_s, "first_s": first_s, "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for the runs (0: unset)")
    parser.add_argument("--one", nargs=2, metavar=("CHECKPOINT", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one engine, one line of JSON
        result = asyncio.run(one_run(args.one[0], args.one[1], args.requests, args.tokens))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # vLLM's atexit hooks can hang on a closed loop; the engine is shut down already

    from agentrl.init_model import init_model

    checkpoint = init_model(os.path.join(tempfile.mkdtemp(prefix="bench_engine_start_"), "ckpt"), preset="tiny",
                            vocab_size=1024, env_ids=("agentrl/Calc-v0",))
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    else:  # vLLM's and agentrl's own choices
        env.pop("OMP_NUM_THREADS", None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    for r in range(args.repeats):
        for name, backend in LAYOUTS.items():
            done = subprocess.run([sys.executable, __file__, "--one", checkpoint, backend, "--requests",
                                   str(args.requests), "--tokens", str(args.tokens)], env=env, capture_output=True,
                                  text=True, timeout=900)
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise RuntimeError(f"{name}: the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            runs[name].append(json.loads(line[0][7:]))
            print(f"  run {r + 1}, {name}: {runs[name][-1]}", flush=True)

    def cell(name: str, key: str, fmt: str) -> str:
        values = sorted(x[key] for x in runs[name])
        return f"{format(statistics.median(values), fmt)} ({format(values[0], fmt)}–{format(values[-1], fmt)})"

    print(f"\n### Rollout engine start-up and speed on CPU ({args.repeats} runs each, alternating; tiny hybrid via the "
          f"plugin, fp32; {args.requests} requests x {args.tokens} sampled tokens; OMP_NUM_THREADS "
          f"{args.threads or 'unset'}; load average "
          f"{os.getloadavg()[0]:.1f})\n")
    print(table(["layout", "engine created (s)", "first generation (s)", "tokens/s"],
                [[name, cell(name, "create_s", ".1f"), cell(name, "first_s", ".2f"),
                  cell(name, "tokens_per_s", ",.0f")] for name in LAYOUTS]))


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
