"""Chaos runs: a real RL job under seeded random faults, then an audit of what it trained (issue 27).

    python scripts/chaos.py --faults 20                  # a synchronous run, faults of every kind, audited
    python scripts/chaos.py --faults 6 --mode async
    python scripts/chaos.py --faults 5 --compare         # and a fault-free run: do the final weights agree?
    python scripts/chaos.py --faults 20 --no-snapshots   # interrupted episodes start over: what a kill loses then

The job is the quickstart's config, shortened (a few SFT steps, small groups), on `tests/FlakyCalc-v0`: Calc-v0 where
every 10th task's env raises, hangs, has a tool return 10 MB or ends its process. While it runs, the harness SIGKILLs,
at seeded random moments spread over the run, one of: a rollout worker (`ray::RolloutWorker`), vLLM's engine core
(`VLLM::EngineCore`), a trainer rank (`ray::PolicyTrainer`), the trajectory store actor (`ray::TrajectoryStore`) or the
driver itself; one fault at a time (the next waits until the job has printed a step since it healed from the last,
so a fault can slip past its step, or past the run's end). The job heals what it can in place (a new worker and
engine, the episodes rerun; a restart from the last checkpoint for a lost trainer rank or store); a killed driver is
started again with the same command, as a user would, after the harness has checked what the dead one left running.

The audit, from the run directory once the job has finished:
- every task group the sampler drew for RL steps 0..N-1 was taken for training exactly once, or dropped once with a
  reason (stale, untrainable), in the store's event log; none is missing, none appears twice;
- no trajectory is stored twice, and none is in two training batches;
- every RL step 1..N and every SFT step is in MLflow exactly once (`time/step_s`, `train/loss`, `sft/loss`);
- the MLflow run ended FINISHED, and no process of any attempt is left running;
- with `--compare`: the final weights against those of the same job run without process faults.

It prints a table per fault (what was killed, at which step, how the job healed, the seconds it cost, and what the
episodes it interrupted carried over from their turn-boundary snapshots or lost: sampled tokens and episode-seconds,
from the store's resume events) and the soak
figures: faults survived, run length, and the peak resident memory of each kind of process in the first and in the
last third of the run (growth would show there). Exit status 0 when the audit passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agentrl.reaper import GRACE_S, start_ticks  # noqa: E402
from tests.processes import alive, cmdline, descendants, rss_mb  # noqa: E402

KINDS = ("rollout_worker", "engine_core", "trainer_rank", "store", "driver")
# what each fault kills: a process of the job whose command line starts so
TARGETS = {"rollout_worker": "ray::RolloutWorker", "engine_core": "VLLM::EngineCore",
           "trainer_rank": "ray::PolicyTrainer", "store": "ray::TrajectoryStore"}
# the kinds of process whose memory is reported (the first prefix that matches names it)
PROCESS_KINDS = (("ray::RolloutWorker", "rollout worker"), ("VLLM::EngineCore", "engine core"),
                 ("VLLM::Worker", "engine worker"), ("ray::PolicyTrainer", "trainer rank"),
                 ("ray::TrajectoryStore", "store"), ("agentrl.rollout.env_host", "env process"))
ENV_ID = "tests.faulty_envs:tests/FlakyCalc-v0"
FIND_WAIT_S = 120.0  # a rollout worker's engine starts in ~40 s on 2 cores; a restart starts every actor again
STEP_LINE = re.compile(r"agentrl: step (\d+)/(\d+):")


def job_overrides(run_dir: str, *, steps: int, mode: str, seed: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The chaos job: the quickstart shortened to seconds per step, on the flaky Calc env."""
    return [f"run_dir={run_dir}", f"seed={seed}", f"env.id={ENV_ID}", "env.kwargs.fault_every=10",
            "env.kwargs.max_turns=2", "env.eval_tasks=4", "rollout.group_size=2", "rollout.groups_per_step=4",
            "rollout.max_tokens_per_turn=48", "rollout.env_timeout_s=5", "rollout.seeded_sampling=true",
            "algorithm.sft_steps=40", "algorithm.sft_batch_episodes=8", "algorithm.sft_target_success=null",
            "algorithm.skip_uniform_groups=false", "algorithm.eval_every=0", f"algorithm.steps={steps}",
            f"algorithm.mode={mode}", "algorithm.checkpoint_every=2", "algorithm.max_failed_fraction=0.9",
            "cluster.max_restarts=100", "cluster.trainer_cpus=0.5", "cluster.rollout_cpus=0.5",
            "trainer.num_threads=1", *extra]


@dataclasses.dataclass
class Fault:
    kind: str
    after_step: int  # injected once the job has printed this RL step (and healed from the fault before)
    delay_s: float  # and this long after
    injected_at: float = 0.0  # monotonic
    injected_wall: float = 0.0  # time.time(), to match the store's events
    at_step: int = 0
    pid: int = 0
    healed: str = ""  # "replaced" (rollout), "restarted in place" (trainer, store), "resumed" (driver), "missed"
    recovery_s: float = 0.0  # from the kill to the first step line the job prints after healing


def schedule(num_faults: int, steps: int, seed: int, kinds: tuple[str, ...]) -> list[Fault]:
    """`num_faults` faults, every kind in turn (shuffled), at steps spread evenly over the run, seeded."""
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(num_faults)]
    rng.shuffle(order)
    at = [1 + (i * (steps - 2)) // max(1, num_faults) for i in range(num_faults)]  # leave the last step clean
    return [Fault(kind=k, after_step=s, delay_s=rng.uniform(0.0, 1.5)) for k, s in zip(order, at)]


class Job:
    """One attempt of the job (`agentrl train ...` in its own session), its output read on a thread."""

    def __init__(self, overrides: list[str], log_file):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", "configs/quickstart.yaml",
                                      *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: queue.Queue[tuple[float, str | None]] = queue.Queue()  # (when it was read, the line)
        self.tail: list[str] = []
        self.restarts = 0

        def read() -> None:
            for line in self.proc.stdout:
                log_file.write(line)
                self.tail = (self.tail + [line])[-60:]
                self.lines.put((time.monotonic(), line))
            self.lines.put((time.monotonic(), None))

        threading.Thread(target=read, daemon=True).start()

    def processes(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)] if alive(self.proc.pid) else []


def find(job: Job, kind: str) -> int | None:
    """The pid of a process to kill for a fault of `kind` (the driver: the job's own). Of several matches, the
    youngest: one of an earlier attempt's actors may still be ending (a restart from the checkpoint kills them and
    starts new ones), and killing it would hurt nothing."""
    if kind == "driver":
        return job.proc.pid
    prefix = TARGETS[kind]
    found = [p for p in descendants(job.proc.pid) if cmdline(p).startswith(prefix) and alive(p)]
    return max(found, key=lambda p: start_ticks(p) or 0, default=None)


def process_kind(pid: int, driver: int) -> str | None:
    if pid == driver:
        return "driver"
    line = cmdline(pid)
    return next((name for prefix, name in PROCESS_KINDS if prefix in line), None)


def run(args: argparse.Namespace, run_dir: str, faults: list[Fault]) -> dict:
    """Runs the job to its end under `faults`; returns what happened (per fault, memory, attempts, leftovers)."""
    overrides = job_overrides(run_dir, steps=args.steps, mode=args.mode, seed=args.seed,
                              extra=getattr(args, "extra", ()))
    os.makedirs(run_dir, exist_ok=True)
    log_file = open(os.path.join(run_dir, "chaos.log"), "a", buffering=1)
    started = time.monotonic()
    deadline = started + args.timeout
    job, attempts, leftovers = Job(overrides, log_file), 1, []
    memory: list[tuple[float, str, float]] = []  # (time, kind, MiB)
    step, step_times = 0, []  # the highest RL step seen; when each new one was printed
    replacements = 0  # rollout workers the job replaced (a fault of another kind must cause none)
    pending = list(faults)
    last_sample = 0.0
    while True:
        now = time.monotonic()
        if now > deadline:
            os.killpg(job.proc.pid, signal.SIGKILL)
            raise TimeoutError(f"the chaos job did not finish in {args.timeout}s:\n" + "".join(job.tail))
        if now - last_sample > 2.0:
            last_sample = now
            for pid in job.processes():
                kind = process_kind(pid, job.proc.pid)
                if kind:
                    memory.append((now - started, kind, rss_mb(pid)))
        try:
            read_at, line = job.lines.get(timeout=0.2)
        except queue.Empty:
            read_at, line = time.monotonic(), ""
        if line is None:  # the attempt ended
            code = job.proc.wait()
            if code == 0:
                break
            killed_driver = [f for f in faults if f.kind == "driver" and f.injected_at and not f.healed]
            if not killed_driver:
                raise RuntimeError(f"the job failed (exit {code}) without its driver being killed:\n"
                                   + "".join(job.tail))
            job = Job(overrides, log_file)  # the same command, as a user would
            attempts += 1
            continue
        # what the job printed after a fault (not lines read before it, still in the queue) tells how it healed
        after = [f for f in faults if f.injected_at and f.injected_at < read_at]
        if "restarting from the last checkpoint" in line:
            for f in after:
                if not f.healed and f.kind in ("trainer_rank", "store"):
                    f.healed = "restarted in place"
        if "rollout worker" in line and "starting a replacement" in line:
            replacements += 1
            for f in after:
                if not f.healed and f.kind in ("rollout_worker", "engine_core"):
                    f.healed = "replaced"
        match = STEP_LINE.search(line)
        if match:
            # a fault costs until the first step the job ends once it has healed: a worker killed after its step's
            # rollout returned is noticed, and replaced, during the next step, whose line then carries the cost
            for f in after:
                if not f.recovery_s and (f.healed or f.kind == "driver"):
                    f.recovery_s = time.monotonic() - f.injected_at
                    if f.kind == "driver" and not f.healed:
                        f.healed = "resumed"
            if int(match.group(1)) > step:
                step = int(match.group(1))
                step_times.append(time.monotonic())
        if pending and ready(pending[0], faults, step):
            fault = pending.pop(0)
            time.sleep(fault.delay_s)
            inject(job, fault, step, leftovers)
    log_file.close()
    return {"attempts": attempts, "replacements": replacements, "seconds": time.monotonic() - started,
            "memory": memory,
            "leftovers": leftovers, "step_s": statistics.median(b - a for a, b in zip(step_times, step_times[1:]))
            if len(step_times) > 2 else 0.0}


def ready(fault: Fault, faults: list[Fault], step: int) -> bool:
    """Whether `fault` is due: the job has printed its step, and a step since it healed from every fault injected
    before (a kill that lands while the job restarts from its checkpoint would hit a process the restart is ending
    anyway, or none: one fault at a time)."""
    return step >= fault.after_step and all(f.recovery_s or f.healed == "missed" for f in faults if f.at_step)


def inject(job: Job, fault: Fault, step: int, leftovers: list) -> None:
    """SIGKILLs the fault's process. A job that is restarting has none of that kind for a while (the engine core
    between a worker's death and its replacement's start, any actor while the job restarts from its checkpoint): the
    fault waits up to FIND_WAIT_S for one, and is "missed" only if none comes."""
    fault.at_step = step
    deadline = time.monotonic() + FIND_WAIT_S
    while True:
        if time.monotonic() > deadline or job.proc.poll() is not None:
            fault.healed = "missed"
            return
        pid = find(job, fault.kind)
        before = job.processes() if fault.kind == "driver" else []
        injected_at, injected_wall = time.monotonic(), time.time()
        try:
            if pid is not None and alive(pid):  # one that ended between finding and killing it is looked for again
                os.kill(pid, signal.SIGKILL)
                break
        except ProcessLookupError:
            pass
        time.sleep(0.5)
    fault.pid, fault.injected_at, fault.injected_wall = pid, injected_at, injected_wall
    if fault.kind == "driver":  # what the dead driver left behind must end by itself
        job.proc.wait()
        time.sleep(GRACE_S + 5)  # the job's reaper kills what did not end by itself after GRACE_S
        left = [(p, cmdline(p)[:60]) for p in before if p != pid and alive(p)]
        leftovers.extend(left)
        for p, _ in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- the audit --------------------------------------------------------------------------------------------------------
def audit(run_dir: str, overrides: list[str]) -> dict:
    """What the finished run trained, from its store and its MLflow run (see the module docstring)."""
    from mlflow import MlflowClient

    from agentrl.config import load_config
    from agentrl.driver import TaskSampler
    from agentrl.store import EVENTS_FILE, STORE_DIR, TrajectoryStore
    from agentrl.tracking import RUN_ID_FILE, read_metric_history, resolve_tracking_uri

    job, _ = load_config(os.path.join(ROOT, "configs/quickstart.yaml"), overrides)
    sampler = TaskSampler(job)
    drawn = {r.group_id for s in range(job.algorithm.steps) for r in sampler.requests(s)}
    events = [json.loads(line) for line in open(os.path.join(run_dir, STORE_DIR, EVENTS_FILE))]
    taken = Counter(g for e in events if e["op"] == "take" for g in e["groups"])
    dropped = Counter(g for e in events if e["op"] == "drop" for g in e["groups"])
    reasons = Counter(e["reason"] for e in events if e["op"] == "drop" for _ in e["groups"])
    rows = TrajectoryStore.read_trajectories(run_dir)
    full = [(r["trajectory_id"], r["group_id"]) for r in rows if r["kind"] == "full"]
    stored = Counter(t for t, _ in full)
    members = defaultdict(list)
    for t, g in full:
        members[g].append(t)
    trained = Counter(t for g in taken for t in members[g] for _ in range(taken[g]))
    history = {key: [s for s, _ in read_metric_history(run_dir, key)]
               for key in ("time/step_s", "train/loss", "sft/loss")}
    # a step that trained nothing (async: too few complete groups yet) has no loss
    trained_steps = [s for s, n in read_metric_history(run_dir, "train/groups_trained") if n > 0]
    run_id = open(os.path.join(run_dir, RUN_ID_FILE)).read().strip()
    status = MlflowClient(resolve_tracking_uri(None, run_dir)).get_run(run_id).info.status
    expected_rl, expected_sft = list(range(1, job.algorithm.steps + 1)), list(range(job.algorithm.sft_steps))
    checks = {
        "every group trained once or dropped once": all(taken[g] + dropped[g] == 1 for g in drawn),
        "no group taken or dropped twice": all(n == 1 for n in (taken + dropped).values()),
        "no trajectory stored twice": all(n == 1 for n in stored.values()),
        "no trajectory trained twice": all(n == 1 for n in trained.values()),
        "every RL step in MLflow once": history["time/step_s"] == expected_rl
        and history["train/loss"] == trained_steps,
        "every SFT step in MLflow once": history["sft/loss"] == expected_sft,
        "MLflow run FINISHED": status == "FINISHED",
    }
    return {"checks": checks, "groups": len(drawn), "taken": sum(taken.values()), "dropped": dict(reasons),
            "missing": sorted(g for g in drawn if taken[g] + dropped[g] == 0),
            "rl_steps_logged": history["time/step_s"], "sft_steps_logged": history["sft/loss"], "status": status}


def work_lost(run_dir: str, faults: list[Fault]) -> dict[int, dict[str, float]]:
    """Per fault (its index), what the episodes it interrupted carried over from their snapshots and what they lost
    (tokens sampled after the last snapshot, and the seconds they took), from the store's resume events: each event
    belongs to the latest fault injected before it."""
    from agentrl.store import EVENTS_FILE, STORE_DIR

    out = {i: {"carried_tokens": 0, "lost_tokens": 0, "lost_s": 0.0, "resumed": 0, "restarted": 0}
           for i in range(len(faults))}
    for line in open(os.path.join(run_dir, STORE_DIR, EVENTS_FILE)):
        e = json.loads(line)
        if e["op"] != "resume":
            continue
        before = [i for i, f in enumerate(faults) if f.injected_wall and f.injected_wall <= e["at"]]
        if not before:
            continue
        lost = out[max(before, key=lambda i: faults[i].injected_wall)]
        lost["carried_tokens"] += e["carried_tokens"]
        lost["lost_tokens"] += e["lost_tokens"]
        lost["lost_s"] += e["lost_s"]
        lost["resumed"] += len(e["ids"])
        lost["restarted"] += len(e["restarted"])
    return out


def final_weights(run_dir: str) -> dict:
    from safetensors.torch import load_file

    from agentrl.trainer.publish import latest_weights

    version, path = latest_weights(run_dir)
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    return {"version": version, "tensors": tensors}


def weight_difference(a: dict, b: dict) -> float:
    return max(float((a["tensors"][k].double() - b["tensors"][k].double()).abs().max()) for k in a["tensors"])


# --- the report -------------------------------------------------------------------------------------------------------
def memory_table(memory: list[tuple[float, str, float]], seconds: float) -> list[str]:
    """Peak RSS per process kind in the first and in the last third of the run."""
    lines = ["| process | peak RSS, first third (MiB) | peak RSS, last third (MiB) |", "|---|---|---|"]
    for kind in ["driver", *dict.fromkeys(name for _, name in PROCESS_KINDS)]:
        first = [m for t, k, m in memory if k == kind and t < seconds / 3]
        last = [m for t, k, m in memory if k == kind and t > 2 * seconds / 3]
        if first or last:
            lines.append(f"| {kind} | {max(first, default=0):.0f} | {max(last, default=0):.0f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: faults + 4)")
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--run-dir", default=None, help="default: runs/chaos-<mode>-<seed>-<time>")
    parser.add_argument("--compare", action="store_true", help="also run without process faults; compare weights")
    parser.add_argument("--timeout", type=float, default=7200.0)
    parser.add_argument("--no-snapshots", action="store_true",
                        help="rollout.snapshots=false: interrupted episodes start over (what a kill then loses)")
    args = parser.parse_args()
    args.extra = ("rollout.snapshots=false",) if args.no_snapshots else ()
    args.steps = args.steps or args.faults + 4
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    run_dir = os.path.abspath(args.run_dir or os.path.join(ROOT, "runs", f"chaos-{args.mode}-{args.seed}-"
                                                                         f"{time.strftime('%Y%m%d-%H%M%S')}"))
    faults = schedule(args.faults, args.steps, args.seed, kinds)
    outcome = run(args, run_dir, faults)
    overrides = job_overrides(run_dir, steps=args.steps, mode=args.mode, seed=args.seed, extra=args.extra)
    result = audit(run_dir, overrides)
    lost = work_lost(run_dir, faults)

    print(f"\n## chaos run: {args.mode}, seed {args.seed}, {args.steps} RL steps, {len(faults)} faults, snapshots "
          f"{'off' if args.no_snapshots else 'on'} ({run_dir})\n")
    print("| # | fault | at RL step | healed | kill to the next step after healing (s) | episodes resumed / restarted "
          "| sampled tokens carried over | sampled tokens lost | episode seconds lost |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for i, f in enumerate(faults):
        w = lost[i]
        healed = f.healed or ("not seen" if f.at_step else "not injected: the run ended first")
        print(f"| {i + 1} | {f.kind} | {f.at_step} | {healed} | {f.recovery_s:.1f} | "
              f"{w['resumed']} / {w['restarted']} | {w['carried_tokens']} | {w['lost_tokens']} | {w['lost_s']:.1f} |")
    total = {k: sum(w[k] for w in lost.values()) for k in ("carried_tokens", "lost_tokens", "lost_s")}
    print(f"\ninterrupted episodes: {total['carried_tokens']} sampled tokens carried over from snapshots, "
          f"{total['lost_tokens']} lost ({total['lost_s']:.1f} episode-seconds)")
    survived = sum(f.healed not in ("", "missed") for f in faults)
    injected, missed = sum(bool(f.at_step) for f in faults), sum(f.healed == "missed" for f in faults)
    print(f"\nfaults survived: {survived} of {injected} injected ({missed} "
          f"found no target); rollout workers replaced: {outcome['replacements']}; attempts (driver starts): "
          f"{outcome['attempts']}; run length {outcome['seconds']:.0f}s; "
          f"median step {outcome['step_s']:.1f}s")
    print(f"groups drawn {result['groups']}, trained {result['taken']}, dropped {result['dropped'] or 0}, "
          f"missing {len(result['missing'])}")
    print("left running after a killed driver: " + (", ".join(f"{p} {c}" for p, c in outcome["leftovers"]) or "none"))
    print()
    print("\n".join(memory_table(outcome["memory"], outcome["seconds"])))
    print()
    for name, ok in result["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    ok = all(result["checks"].values()) and not outcome["leftovers"]
    if args.compare:
        calm_dir = run_dir + "-calm"
        run(argparse.Namespace(**{**vars(args), "faults": 0}), calm_dir, [])
        diff = weight_difference(final_weights(run_dir), final_weights(calm_dir))
        print(f"\nfinal weights, with faults vs without (v{final_weights(run_dir)['version']}): max |diff| {diff:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
