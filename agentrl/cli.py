"""The `agentrl` command.

    agentrl train CONFIG [key=value ...]     SFT warm start (if configured), then RL; curves in MLflow
    agentrl sft CONFIG [key=value ...]       only the SFT warm start on oracle trajectories
    agentrl eval CONFIG --checkpoint DIR     success rate of a checkpoint on the env's held-out tasks
    agentrl init-model --preset tiny --out DIR
    agentrl envs                             registered tool environments
    agentrl presets                          model presets with their parameter counts
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _load(args):
    from agentrl.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        sys.exit(f"agentrl: bad config: {exc}")


def cmd_train(args) -> None:
    from agentrl.driver import run_job

    job, resolved = _load(args)
    run_job(job, resolved, rl=True)


def cmd_sft(args) -> None:
    from agentrl.driver import run_job

    job, resolved = _load(args)
    run_job(job, resolved, rl=False)


def cmd_eval(args) -> None:
    from agentrl.driver import evaluate_checkpoint

    job, _ = _load(args)
    result = evaluate_checkpoint(job, args.checkpoint, num_tasks=args.num_tasks)
    print(json.dumps(result, indent=1))


def cmd_init_model(args) -> None:
    from agentrl.init_model import init_model

    overrides = json.loads(args.overrides) if args.overrides else None
    out = init_model(args.out, preset=args.preset, overrides=overrides, tokenizer_dir=args.tokenizer,
                     vocab_size=args.vocab_size, seed=args.seed)
    print(out)


def cmd_envs(args) -> None:
    from agentrl.envs import list_envs

    for env_id in list_envs(None if args.all else "agentrl"):
        print(env_id)


def cmd_presets(args) -> None:
    import torch

    from agentrl.model.config import PRESETS, preset_config
    from agentrl.model.modeling import HybridMoEForCausalLM

    for name in PRESETS:
        with torch.device("meta"):
            total, active = HybridMoEForCausalLM(preset_config(name)).parameter_counts()
        print(f"{name:22s} {total / 1e9:10.3f}B total {active / 1e9:10.3f}B active")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="agentrl", description="Agentic RL post-training for hybrid MoE models")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_text in (("train", cmd_train, "SFT warm start then RL"),
                                ("sft", cmd_sft, "SFT on oracle trajectories only")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.group_size=8")
        p.set_defaults(fn=fn)
    p = sub.add_parser("eval", help="success rate of a checkpoint on held-out tasks")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--num-tasks", type=int, default=None)
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("init-model", help="build a model and tokenizer locally from a preset")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None, help="an existing tokenizer directory (default: train one)")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--overrides", default=None, help="JSON object of config fields over the preset")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_init_model)
    p = sub.add_parser("envs", help="list registered tool environments")
    p.add_argument("--all", action="store_true", help="every gymnasium namespace, not only agentrl/")
    p.set_defaults(fn=cmd_envs)
    p = sub.add_parser("presets", help="list model presets")
    p.set_defaults(fn=cmd_presets)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("vllm", "ray", "mlflow", "deepspeed", "datasets", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args.fn(args)


if __name__ == "__main__":
    main()
