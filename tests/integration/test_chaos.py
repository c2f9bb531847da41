"""A real job under faults heals, and trains every task group exactly once (issue 27; scripts/chaos.py, shortened).

At seeded moments of a six-step synchronous run on the flaky Calc env (every 10th task's env raises, hangs, floods or
dies), the harness SIGKILLs a trainer rank, vLLM's engine core, the trajectory store actor and the driver. The job
restarts in place from its last checkpoint (trainer rank, store), replaces the rollout worker whose engine died, and is
resumed with the same command after the driver's death. The audit reads the store's event log and MLflow: every group
drawn trained once or dropped once with a reason, no trajectory stored or trained twice, every SFT and RL step logged
exactly once, the run FINISHED, and nothing the killed driver started left running."""

from __future__ import annotations

import argparse
import os
import time

import pytest

from tests.scripts import load_script

pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

chaos = load_script("chaos")

KINDS = ("trainer_rank", "engine_core", "store", "driver")
HEALED = {"trainer_rank": "restarted in place", "store": "restarted in place", "engine_core": "replaced",
          "driver": "resumed"}


def timeline(run_dir: str, faults) -> str:
    """What a failure needs, short enough not to be cut: each fault, and the job's lines that tell how it healed."""
    marks = ("agentrl: step", "restarting from the last checkpoint", "starting a replacement", "Traceback")
    with open(os.path.join(run_dir, "chaos.log")) as f:
        lines = [line[:160].rstrip() for line in f if any(m in line for m in marks)]
    return "\n".join([*(f"{f.kind}: after step {f.after_step}, at step {f.at_step}, killed at "
                         f"{time.strftime('%H:%M:%S', time.localtime(f.injected_wall)) if f.injected_wall else '-'}, "
                         f"healed {f.healed!r}" for f in faults), *lines])


def test_a_job_under_faults_heals_and_trains_every_group_once(tmp_path):
    run_dir = str(tmp_path / "run")
    args = argparse.Namespace(steps=6, mode="sync", seed=0, timeout=1200)
    faults = chaos.schedule(len(KINDS), args.steps, args.seed, KINDS)
    outcome = chaos.run(args, run_dir, faults)
    assert sorted(f.kind for f in faults) == sorted(KINDS)
    for f in faults:
        assert f.healed == HEALED[f.kind], timeline(run_dir, faults)
    assert outcome["attempts"] == 2  # the driver's death alone needed the command again
    # only the engine core's death replaces a rollout worker (the store's, seen through a worker, restarts the job)
    assert outcome["replacements"] == 1, timeline(run_dir, faults)
    assert not outcome["leftovers"], outcome["leftovers"]
    result = chaos.audit(run_dir, chaos.job_overrides(run_dir, steps=args.steps, mode=args.mode, seed=args.seed))
    assert all(result["checks"].values()), result
    assert result["taken"] > 0 and not result["missing"]
