"""The `agentrl` command.

    agentrl train CONFIG [key=value ...]     SFT warm start (if configured), then RL; curves in MLflow
    agentrl sft CONFIG [key=value ...]       only the SFT warm start on oracle trajectories
    agentrl eval CONFIG --checkpoint DIR     success rate of a checkpoint on the env's held-out tasks
    agentrl report RUN_DIR [--table]         the curves that matter, as RUN_DIR/report.html (or a table)
    agentrl config show [CONFIG] [k=v ...]   every config key: its value, default and meaning
    agentrl init-model --preset tiny [--chat-format kimi|kimi_k3|qwen3] --out DIR
    agentrl envs [--import pkg.module]       registered tool environments and their tools
    agentrl presets                          model presets with their parameter counts
    agentrl plan --preset k3 [--gpus N ...]  parameter counts, memory per GPU, a parallel layout, time estimates
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


KEYS_HINT = "Every config key, its default and its meaning: agentrl config show [CONFIG] [key=value ...]"


def _load(args):
    from agentrl.config import load_config

    return load_config(args.config, args.overrides)


def cmd_train(args) -> None:
    from agentrl.driver import run_job

    job, resolved = _load(args)
    run_job(job, resolved, rl=True)
    _print_summary(args, job)


def cmd_sft(args) -> None:
    from agentrl.driver import run_job

    job, resolved = _load(args)
    run_job(job, resolved, rl=False)
    _print_summary(args, job)


def _print_summary(args, job) -> None:
    """What the run did and the commands that show and evaluate it (agentrl.report.summary_text)."""
    import shlex

    from agentrl.report import RunCurves, summary_text

    # as the user ran it (scripts/quickstart.sh runs .venv/bin/agentrl)
    prog = os.path.relpath(sys.argv[0]) if os.path.basename(sys.argv[0]) == "agentrl" else "agentrl"
    evaluate = shlex.join([prog, "eval", args.config, *args.overrides, "--checkpoint", job.run_dir])
    try:
        text = summary_text(RunCurves(job.run_dir, job.tracking.tracking_uri), prog=prog, eval_command=evaluate)
    except Exception as exc:  # the run itself succeeded: a summary that cannot be read must not fail it
        logging.getLogger("agentrl").warning("the run finished, but its summary could not be read from MLflow: %s",
                                             exc)
        return
    print(text, flush=True)


def cmd_eval(args) -> None:
    from agentrl.driver import evaluate_checkpoint

    job, _ = _load(args)
    result = evaluate_checkpoint(job, args.checkpoint, num_tasks=args.num_tasks)
    print(json.dumps(result, indent=1))


def cmd_config_show(args) -> None:
    from agentrl.config_docs import show

    print(show(args.args))


def cmd_report(args) -> None:
    from agentrl.report import RunCurves, table_report, write_report

    try:
        if args.table:
            print(table_report(RunCurves(args.run_dir, args.tracking_uri), tuple(args.keys), args.every, args.window))
        else:
            print(write_report(args.run_dir, args.out, args.tracking_uri))
    except FileNotFoundError as exc:
        sys.exit(f"agentrl report: {exc}")


def cmd_init_model(args) -> None:
    from agentrl.init_model import init_model

    overrides = json.loads(args.overrides) if args.overrides else None
    try:
        out = init_model(args.out, preset=args.preset, overrides=overrides, tokenizer_dir=args.tokenizer,
                         vocab_size=args.vocab_size, seed=args.seed, chat_format=args.chat_format)
    except ValueError as exc:
        raise SystemExit(f"agentrl init-model: {exc}") from None
    print(out)


def cmd_envs(args) -> None:
    from agentrl.envs import describe_envs, import_envs, list_envs

    try:
        added = import_envs(args.imports)
    except ValueError as exc:
        sys.exit(f"agentrl envs: {exc}")
    if args.imports and not added:
        sys.exit(f"agentrl envs: importing {', '.join(args.imports)} registered no environment: call "
                 "gymnasium.register(id=..., entry_point='module:Class') at the module's top level")
    env_ids = added if args.imports else list_envs(None if args.all else "agentrl")
    for info in describe_envs(env_ids):
        print(f"{info.env_id}  ({info.entry_point})")
        if info.error:
            print(f"    cannot load: {info.error}")
        for name, text in info.tools.items():
            print(f"    {name}: {text}")
    if args.imports:
        module = args.imports[0]
        print(f"\ntrain on one: agentrl train configs/quickstart.yaml env.id={module}:{env_ids[0]}")


def cmd_presets(args) -> None:
    import torch

    from agentrl.model.config import PRESETS, preset_config
    from agentrl.model.modeling import HybridMoEForCausalLM

    for name in PRESETS:
        with torch.device("meta"):
            total, active = HybridMoEForCausalLM(preset_config(name)).parameter_counts()
        print(f"{name:22s} {total / 1e9:10.3f}B total {active / 1e9:10.3f}B active")


def cmd_plan(args) -> None:
    from agentrl.plan import Cluster, Workload, format_plan, make_plan, resolve_config, smallest_cluster

    try:
        overrides = json.loads(args.overrides) if args.overrides else None
    except json.JSONDecodeError as exc:
        sys.exit(f"agentrl plan: --overrides is not JSON ({exc}): {args.overrides}")
    if overrides is not None and not isinstance(overrides, dict):
        sys.exit(f"agentrl plan: --overrides must be a JSON object of config fields, got {args.overrides}")
    try:
        cfg = resolve_config(preset=None if args.config else args.preset, path=args.config, overrides=overrides)
        workload = Workload(context=args.context, micro_batch_tokens=args.micro_batch_tokens,
                            tokens_per_step=args.tokens_per_step,
                            gradient_checkpointing=not args.no_gradient_checkpointing,
                            attn_res_mix=args.attn_res_mix)
        hardware = dict(gpu_memory_gib=args.gpu_mem_gib, gpus_per_node=args.gpus_per_node,
                        intra_node_gbytes_s=args.nvlink_gbs, inter_node_gbits_s=args.ib_gbits,
                        nics_per_node=args.ib_nics)
        fixed = dict(pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep, zero=args.zero)
        if args.gpus is None:
            plan = smallest_cluster(cfg, workload, fixed, mfu=args.mfu, supported_only=args.supported_only,
                                    **hardware)
        else:
            plan = make_plan(cfg, Cluster(num_gpus=args.gpus, **hardware), workload, fixed, mfu=args.mfu,
                             supported_only=args.supported_only)
    except ValueError as exc:
        sys.exit(f"agentrl plan: {exc}")
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print(format_plan(plan, (args.config or args.preset) + (f" {args.overrides}" if overrides else "")))


def main(argv: list[str] | None = None) -> None:
    from agentrl.chat import format_names
    from agentrl.report import TABLE_KEYS

    parser = argparse.ArgumentParser(prog="agentrl", description="Agentic RL post-training for hybrid MoE models")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_text in (("train", cmd_train, "SFT warm start then RL"),
                                ("sft", cmd_sft, "SFT on oracle trajectories only")):
        p = sub.add_parser(name, help=help_text, epilog=KEYS_HINT)
        p.add_argument("config")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.group_size=8")
        p.set_defaults(fn=fn)
    p = sub.add_parser("eval", help="success rate of a checkpoint on held-out tasks")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", required=True,
                   help="a model directory: RUN_DIR/weights/vN (published weights), RUN_DIR itself (its latest "
                        "weights), or an imported checkpoint")
    p.add_argument("--num-tasks", type=int, default=None)
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("config", help="the resolved config: every key with its default and meaning")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    p = config_sub.add_parser("show", help="print the resolved config, a one-line description per key",
                              description="Prints every config key with its value after the file and the overrides, "
                                          "its default where it differs, and what it means.")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    p.set_defaults(fn=cmd_config_show)
    p = sub.add_parser("report", help="a run's curves that matter, as one HTML page (or a table)",
                       description="Writes RUN_DIR/report.html: success (training, held-out), reward and its "
                                   "components, failures and tool errors, trajectory length, what trained, "
                                   "staleness, step time by phase, the SFT warm start. --table prints a table.")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="the HTML file (default RUN_DIR/report.html)")
    p.add_argument("--table", action="store_true", help="print a Markdown table instead")
    p.add_argument("--every", type=int, default=5, help="table: a row every n RL steps")
    p.add_argument("--keys", nargs="+", default=list(TABLE_KEYS), help="table: the columns")
    p.add_argument("--window", type=int, default=5, help="table: steps averaged for the success rise")
    p.add_argument("--tracking-uri", default=None, help="where the run logged, if not to its run directory")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("init-model", help="build a model and tokenizer locally from a preset")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None, help="an existing tokenizer directory (default: train one)")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--overrides", default=None, help="JSON object of config fields over the preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-format", default=None, choices=format_names(),
                   help="the tokenizer layout and template (default: the preset's family, agentrl's own for agentrl's)")
    p.set_defaults(fn=cmd_init_model)
    p = sub.add_parser("envs", help="list registered tool environments")
    p.add_argument("--all", action="store_true", help="every gymnasium namespace, not only agentrl/")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE (which registers your envs) and list the envs it registered, with their tools")
    p.set_defaults(fn=cmd_envs)
    p = sub.add_parser("presets", help="list model presets")
    p.set_defaults(fn=cmd_presets)
    p = sub.add_parser("plan", help="memory, parallel layout and time estimates of a model on a GPU cluster",
                       description="Counts parameters, sizes memory per GPU, picks the fastest layout that fits (or "
                                   "checks the given degrees) and estimates step time and decode throughput. "
                                   "Defaults: H200 nodes of 8 GPUs, NVLink 900 GB/s, 8 × 400 Gb/s InfiniBand. "
                                   "See docs/scale.md.")
    p.add_argument("--preset", default="k3", help="model preset (default k3)")
    p.add_argument("--config", default=None, help="a checkpoint directory or its config.json, instead of a preset")
    p.add_argument("--overrides", default=None, help='JSON object of config fields, e.g. \'{"num_experts": 64}\'')
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the cluster (default: the fewest that fit)")
    p.add_argument("--gpu-mem-gib", type=float, default=139.0)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-gbs", type=float, default=900.0, help="intra-node GB/s per GPU")
    p.add_argument("--ib-gbits", type=float, default=400.0, help="inter-node Gb/s per NIC")
    p.add_argument("--ib-nics", type=int, default=8, help="NICs per node")
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default: one sequence")
    p.add_argument("--tokens-per-step", type=int, default=16 * 2**20)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--attn-res-mix", choices=("fused", "torch", "recomputed"), default="fused",
                   help="what AttnRes mixes keep for backward: fla's fused kernel (CUDA, default), the PyTorch "
                        "reference's fp32 stacks, or nothing (recomputed in the checkpoint)")
    for degree, text in (("pp", "pipeline stages"), ("dp", "data-parallel replicas"),
                         ("cp", "context-parallel ranks per sequence"), ("ep", "expert-parallel ranks"),
                         ("zero", "ZeRO stage 0-3")):
        p.add_argument(f"--{degree}", type=int, default=None, help=f"{text} (default: searched)")
    p.add_argument("--supported-only", action="store_true",
                   help="only layouts agentrl's trainer runs today (DP with ZeRO-2/3, EP under ZeRO-2; no PP, CP)")
    p.add_argument("--mfu", type=float, default=None,
                   help="instead of the calibrated efficiencies: the fraction of peak every training FLOP runs at, "
                        "recomputation included (0-1)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(fn=cmd_plan)
    args = parser.parse_args(argv)
    # `env.id=mypkg.mymod:MyEnv-v0` and `envs --import mypkg.mymod` find a package in the directory the command runs
    # from, as `python -m` would (last on the path: it shadows nothing installed); Ray's local workers inherit the path
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    from agentrl.config import ConfigError
    from agentrl.failures import EnvCodeError, JobFailed
    from agentrl.interrupt import JobInterrupted

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("vllm", "ray", "mlflow", "deepspeed", "datasets", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        args.fn(args)
    except ConfigError as exc:  # from loading the config, or the driver's checks before any actor starts
        sys.exit(f"agentrl: bad config: {exc}")
    except (JobFailed, EnvCodeError) as exc:  # the env or its oracle failed, not agentrl: one line, no traceback
        sys.exit(f"agentrl: job failed: {exc}")
    except JobInterrupted as exc:  # checkpointed; the same command line resumes
        print(f"agentrl: {exc}: {' '.join(['agentrl', *(argv if argv is not None else sys.argv[1:])])}",
              file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
