"""How sharp is a warm start? For each policy: the chance that sampling at a temperature reproduces the oracle's
answer turns on the held-out tasks, token for token.

    .venv/bin/python scripts/bench_warm_start.py MODEL_DIR [MODEL_DIR ...] [--temperatures 1.0 0.7]
    .venv/bin/python scripts/bench_warm_start.py --warm-starts ROOT [--seeds 0 1 2 3 4]

Two warm starts with the same greedy success rate can sample very different success rates at temperature 1: one
whose digits are right with probability ~0.95 or ~0.05, another whose digits are right with probability ~0.7 each.
RL starts from the sampled rate, so this is what tells them apart without an engine. Per policy and temperature,
on the config's held-out tasks (`env.eval_tasks`, teacher-forced on the oracle's trajectory, in-process, no DeepSpeed
or vLLM): the mean probability of the whole oracle sequence of sampled tokens (a floor on the sampled success rate:
other wordings can succeed too), the mean probability of the sampled tokens that are digits (the operands copied
into the tool call and the answer: where this task is won or lost), and the share of those below 0.5.

`--warm-starts ROOT` reads the policies scripts/bench_learning.py's runs under ROOT warm-started (ROOT/seedS/weights/
v<SFT steps>).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch


def oracle_probabilities(model_dir: str, job, temperatures: list[float]) -> dict[float, dict[str, float]]:
    from transformers import AutoTokenizer

    from agentrl.chat import load_chat_format
    from agentrl.driver import TaskSampler
    from agentrl.envs import make
    from agentrl.model.modeling import HybridMoEForCausalLM
    from agentrl.rollout.oracle import oracle_trajectory

    chat = load_chat_format(model_dir, job.model.chat_format)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = HybridMoEForCausalLM.from_pretrained(model_dir).eval()
    env = make(job.env.id, **job.env.kwargs)
    held_out = TaskSampler(job).eval_requests()  # the tasks and seeds the job's greedy checks and agentrl eval use
    trajectories = [oracle_trajectory(env, chat, env_id=job.env.id, task_index=r.task_index, seed=r.seed,
                                      group_id=r.group_id) for r in held_out]
    out = {}
    for temperature in temperatures:
        sequence_p, digit_p = [], []
        for t in trajectories:
            ids = torch.tensor(t.tokens)
            sampled = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
            with torch.no_grad():
                logprobs = model(ids[:-1], target_ids=ids[1:], temperature=temperature).token_logprobs[sampled]
            sequence_p.append(math.exp(logprobs.sum().item()))
            for token, logprob in zip(ids[1:][sampled].tolist(), logprobs.tolist()):
                if tokenizer.decode([token]).strip().isdigit():
                    digit_p.append(math.exp(logprob))
        out[temperature] = {"sequence": sum(sequence_p) / len(sequence_p),
                            "digit": sum(digit_p) / max(len(digit_p), 1),
                            "digit_below_half": sum(p < 0.5 for p in digit_p) / max(len(digit_p), 1),
                            "digits": len(digit_p), "tasks": len(trajectories)}
    return out


def main() -> None:
    from agentrl.config import load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="model directories (RUN_DIR/weights/vN or a shipped checkpoint)")
    parser.add_argument("--config", default="configs/quickstart.yaml", help="whose env and held-out tasks")
    parser.add_argument("--warm-starts", default=None, help="a scripts/bench_learning.py --root")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    args = parser.parse_args()
    models = list(args.models)
    if args.warm_starts:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_learning import warm_start

        models += [warm_start(args.warm_starts, seed) for seed in args.seeds]
    if not models:
        parser.error("name model directories or --warm-starts ROOT")
    job, _ = load_config(args.config, [])
    torch.set_num_threads(1)
    print(f"\n{args.config}: {job.env.eval_tasks} held-out tasks of {job.env.id}\n")
    print("| policy | temperature | P(oracle's sampled tokens), mean over tasks | digit tokens: mean p | digit tokens "
          "with p < 0.5 |")
    print("|---|---:|---:|---:|---:|")
    for model_dir in models:
        for temperature, r in oracle_probabilities(model_dir, job, args.temperatures).items():
            print(f"| {model_dir} | {temperature:g} | {r['sequence']:.3f} | {r['digit']:.3f} | "
                  f"{r['digit_below_half']:.3f} (of {r['digits']}) |", flush=True)


if __name__ == "__main__":
    from agentrl.host import machine_line

    print(machine_line(), flush=True)
    main()
