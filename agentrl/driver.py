"""The RL job: one loop, every remote call visible — rollout → store → train → publish weights → log.

    run_job(job, resolved)           # agentrl train CONFIG

Synchronous mode rolls out with the current policy, then trains on it. Asynchronous mode submits the next step's
rollout before training on the current one: the rollout workers keep sampling while the trainer trains, take the new
weights in flight when they are published (tokens record the version that sampled them), and the store refuses
groups older than `max_staleness` versions. A context schedule raises the trajectory length limit by step.

Everything is resumable: the trainer checkpoint carries the step, the policy version, the store's position and the
metrics of the steps it completes; the store replays its Parquet log to that position; the MLflow run is reopened and
its curves continue (MLflow gets a step once it is checkpointed, so no step is ever logged twice). A trainer rank or
the store that dies restarts the job from that checkpoint in place; a dead rollout worker is replaced (RolloutPool).
Episodes that were running when their worker or the run died continue from their last turn-boundary snapshot in the
store (agentrl.rollout.snapshots). A run that one update stalled (every group's rewards equal from then on) goes back
to the checkpoint before that update and on with new tasks (agentrl.stall).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import random
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agentrl.config import ConfigError, JobConfig, check_checkpoint, check_env
from agentrl.failures import (ActorLost, EnvCodeError, FailureWatch, JobFailed, describe_failures, first_line,
                              lost_actor)
from agentrl.interrupt import JobInterrupted, StopRequest
from agentrl.report import duration
from agentrl.rollout.agent_loop import EpisodeRequest, prefix_cache_stats
from agentrl.rollout.policy_engine import EngineSpec
from agentrl.stall import STALLED_STEPS, StallWatch, restored_policy
from agentrl.tracking import Tracker
from agentrl.trainer.losses import LossConfig
from agentrl.types import Boundary, EpisodeSummary, Status

log = logging.getLogger("agentrl")


def run_job(job: JobConfig, resolved: DictConfig | None = None, *, rl: bool = True) -> dict[str, Any]:
    """Runs (or resumes) the job in `job.run_dir`; returns the final metrics.

    SIGINT / SIGTERM stop it at the next step boundary with a checkpoint (JobInterrupted; the MLflow run ends KILLED);
    a trainer rank or the store that dies restarts it from its last checkpoint, up to `cluster.max_restarts` times
    (each restart is logged, its traceback appended to `<run_dir>/error.log`); any other failure ends the MLflow run
    FAILED; a JobFailed (an env that keeps failing, an oracle that raises, too many restarts) has its traceback
    written to `<run_dir>/error.log`. Either way the job's actors are shut down.
    """
    import ray

    check_env(job)  # a bad env setting fails here, before any actor starts
    # MLflow's store set-up (its imports and the sqlite schema: ~5 s of one core) runs while Ray starts its processes
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        tracking = background.submit(Tracker, job.tracking, job.run_dir)
        try:
            connect(job)
        except BaseException:
            tracking.result().finish("FAILED")
            raise
        tracker = tracking.result()
    log.info("MLflow run %r: %s", os.path.basename(os.path.abspath(job.run_dir)), tracker.run_page())
    restarts = 0
    try:
        while True:
            try:
                with StopRequest() as stop, contextlib.ExitStack() as actors:
                    metrics = train(job, resolved, tracker, stop, actors, rl=rl)
                break
            except (ActorLost, ray.exceptions.RayActorError) as exc:  # the actors are down: start over from disk
                restarts += 1
                _append_error_log(job.run_dir, f"restart {restarts}")
                if restarts > job.cluster.max_restarts:
                    raise JobFailed(f"{lost_actor(exc)}; the job restarted {job.cluster.max_restarts} time(s) from "
                                    "its last checkpoint already (cluster.max_restarts)") from exc
                tracker.set_tag("agentrl.restarts", restarts)
                log.warning("%s: restarting from the last checkpoint (restart %d of at most %d)", lost_actor(exc),
                            restarts, job.cluster.max_restarts)
    except JobInterrupted:
        tracker.finish("KILLED")
        raise
    except JobFailed as exc:
        tracker.finish("FAILED")
        details = _append_error_log(job.run_dir, "job failed")
        raise JobFailed(f"{exc} (traceback: {details})") from exc
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish()
    log.info("done: the curves are at %s", tracker.run_page())
    return metrics


def _append_error_log(run_dir: str, what: str) -> str:
    """Appends the exception being handled to `<run_dir>/error.log`; returns the file's path."""
    path = os.path.join(run_dir, "error.log")
    with open(path, "a") as f:
        f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {what}\n{traceback.format_exc()}\n")
    return path


def train(job: JobConfig, resolved: DictConfig | None, tracker: Tracker, stop: StopRequest,
          actors: contextlib.ExitStack, *, rl: bool) -> dict[str, float]:
    """The job's loop (see the module docstring); the actors it starts are shut down by `actors`."""
    import ray

    from agentrl.trainer.actor import create_trainer_group
    from agentrl.trainer.publish import weights_dir

    if resolved is not None:
        tracker.log_config(OmegaConf.to_container(resolved, resolve=True), OmegaConf.to_yaml(resolved))
    policy_dir, resume = prepare_policy(job)
    t0 = time.perf_counter()
    store = pool = None
    if not resume:  # a fresh run's engines serve weights/v0: their workers start beside the trainer ranks (below)
        store, pool = start_rollout(job, policy_dir, (weights_dir(job.run_dir, 0), 0), position=None, resume=False,
                                    actors=actors)
    trainer = create_trainer_group(job.trainer, policy_dir, num_ranks=job.cluster.trainer_ranks,
                                   num_cpus_per_rank=job.cluster.trainer_cpus,
                                   num_gpus_per_rank=job.cluster.trainer_gpus,
                                   call_timeout_s=job.cluster.trainer_timeout_s)
    actors.callback(trainer.shutdown)
    # a checkpoint before phases existed is an RL one; a fresh run starts with the warm start (when it has one)
    state = (trainer.load_checkpoint() if resume
             else {"global_step": 0, "store_position": 0, "phase": "sft" if job.algorithm.sft_steps else "rl"})
    tracker.log_missing(state.get("pending_metrics", []))  # killed between its checkpoint and its log
    metrics_log = PendingMetrics(tracker)
    weights = trainer.publish_weights()
    if pool is None:
        store, pool = start_rollout(job, policy_dir, (weights.path, weights.version),
                                    position=state.get("store_position"), resume=True, actors=actors)
    elif (weights.path, weights.version) != pool.weights:
        raise RuntimeError(f"the trainer published {weights.path} (version {weights.version}) where the engines were "
                           f"told to find {pool.weights[0]} (version {pool.weights[1]})")
    pool.start_engines()  # while the warm start trains, not at its end
    sampler = TaskSampler(job)
    step = state.get("rl_step", 0)
    tracker.log_metrics({"phase/setup_s": time.perf_counter() - t0}, step=step)
    version = weights.version
    log.info("job ready in %.0fs: policy version %d, rl step %d", time.perf_counter() - t0, version, step)

    if state.get("phase", "rl") == "sft":
        warm_start(job, trainer, metrics_log, pool, sampler, stop, first_step=state.get("sft_step", 0) + 1)
        version = publish(job, trainer, pool).version
        write_to_disk(trainer, pool)  # the warm-started policy, as weights/v{N}
        trainer.save_checkpoint({"store_position": 0, "rl_step": 0, "phase": "rl", **metrics_log.state()})
        metrics_log.flush()  # SFT is done
    if not rl:
        return {}

    def submit_rollout(at_step: int):
        """Starts step `at_step`'s episodes (and the paused ones) under that step's context limit. After a resume the
        store may already hold some of them (finished or paused after the checkpoint): those are not sampled again;
        those that were running continue from their last snapshot."""
        limit_at = job.algorithm.max_trajectory_tokens(at_step, job.rollout.max_trajectory_tokens)
        pool.set_max_trajectory_tokens(limit_at)
        requests = sampler.requests(at_step)
        held = ray.get(store.held.remote([r.trajectory_id for r in requests]))
        done = ray.get(store.held_results.remote(held)) if held else []  # the step's metrics count them
        skip = set(held)
        fresh = [r for r in requests if r.trajectory_id not in skip]
        resumed = ray.get(store.hand_out_snapshots.remote([r.trajectory_id for r in fresh]))
        running = {t.trajectory_id for t in resumed}
        fresh = [r for r in fresh if r.trajectory_id not in running]
        # with the policy version serving when they start (async: one behind the one trained meanwhile); the paused
        # and snapshotted episodes reach the workers by reference, and the workers hand the trajectories to the store
        # and return their summaries
        return pool.submit(fresh, ray.get(store.hand_out_partials.remote()) + resumed, job.rollout.token_budget,
                           to_store=True, transcripts=job.tracking.transcripts_per_step), version, done

    if step == 0:  # a resumed run evaluated when it started (and at its eval_every steps)
        metrics_log.add(step, evaluate(pool, job, sampler))
    in_flight = submit_rollout(step)
    metrics: dict[str, float] = {}
    watch = FailureWatch(job.env.id, job.algorithm.max_failed_fraction, job.algorithm.failure_window)
    stall, rollbacks = StallWatch.resumed(state.get("stall")), state.get("rollbacks", 0)
    progress = Progress(first_step=step, last_step=job.algorithm.steps)
    while step < job.algorithm.steps:
        t_step = time.perf_counter()
        limit = job.algorithm.max_trajectory_tokens(step, job.rollout.max_trajectory_tokens)
        pending, submitted_version, held = in_flight
        sampled = pool.collect(pending)                                      # rollout, into the store: summaries back
        sampled += resample_failed(job, pool, sampled, sampler.requests(step))            # top groups up
        rollout_s = time.perf_counter() - t_step
        episodes = held + sampled  # the step's episodes: a redone step's include those finished before a kill
        dropped_before = ray.get(store.stats.remote())
        # sync: the step's episodes are all back, so what is complete trains now (a group whose every member failed
        # was dropped); async: wait for a full batch. The batch goes from the store to the trainer ranks by
        # reference; the driver sees which groups train
        selected, batch = store.take_training_batch.options(num_returns=2).remote(
            job.rollout.groups_per_step, version, job.algorithm.max_staleness,
            min_groups=1 if job.algorithm.mode == "sync" else None,
            skip_uniform_groups=job.algorithm.skip_uniform_groups,
            drop_short_groups=job.algorithm.failed_members == "drop")
        selected = ray.get(selected)
        if job.algorithm.mode == "async" and step + 1 < job.algorithm.steps:               # next rollout, now
            in_flight = submit_rollout(step + 1)
        t_train = time.perf_counter()
        train = trainer.step(batch) if selected.trajectories else {}                        # train
        train_s = time.perf_counter() - t_train
        del batch  # the object store frees the batch once the ranks have it
        published = publish(job, trainer, pool) if selected.trajectories else None             # weights to engines
        step += 1
        sampled_metrics = rollout_metrics(episodes)
        restored = None
        # (a step whose groups wait for more, in async mode, says nothing about the policy)
        if selected.taken and stall.observe(len(selected.group_ids), sampled_metrics.get("rollout/success_rate")) \
                and rollbacks < job.algorithm.max_rollbacks:                  # undo the update that stalled the run
            rollbacks += 1
            published, restored = roll_back(job, trainer, pool, step, rollbacks, published)
            stall.reset()
        version = published.version if published else version
        if job.algorithm.mode == "sync" and step < job.algorithm.steps:                   # next rollout
            in_flight = submit_rollout(step)
        every = job.rollout.weight_sync.publish_every
        write_s = write_to_disk(trainer, pool) if step == job.algorithm.steps or every and step % every == 0 else 0.0
        store_stats = ray.get(store.stats.remote())
        groups = GroupReport.of(job.rollout.groups_per_step, selected, dropped_before, store_stats)
        metrics = {**sampled_metrics, **{f"train/{k}": v for k, v in train.items()},
                   "train/uniform_groups": selected.uniform, "train/short_groups_dropped": selected.short,
                   "train/groups_trained": groups.trained,
                   **{f"store/{k}": v for k, v in store_stats.items()},
                   "policy_version": version, "rollout/submitted_version": submitted_version,
                   "context/max_trajectory_tokens": limit,
                   "time/rollout_s": rollout_s, "time/train_s": train_s,
                   "time/sync_s": published.sync_s if published else 0.0,
                   "time/step_s": time.perf_counter() - t_step,
                   "weights/publish_s": (published.write_s if published else 0.0) + write_s,
                   "weights/sync_bytes": published.num_bytes if published else 0}
        if restored is not None:
            metrics["train/rolled_back_to_step"] = restored
        if job.algorithm.eval_every and step % job.algorithm.eval_every == 0 or step == job.algorithm.steps:
            metrics.update(evaluate(pool, job, sampler))
        t_log = time.perf_counter()
        tracker.log_transcripts(episodes, step, last=step == job.algorithm.steps)
        metrics_log.add(step, metrics)
        stopping = stop.requested  # read once: a signal landing after the checkpoint waits for the next step
        if step % job.algorithm.checkpoint_every == 0 or step == job.algorithm.steps or stopping:
            position = ray.get(store.stats.remote())["position"]
            trainer.save_checkpoint({"store_position": int(position), "rl_step": step, "phase": "rl",
                                     "rollbacks": rollbacks, "stall": stall.state(), **metrics_log.state()})
            metrics_log.flush(log_s=time.perf_counter() - t_log)                                # log
        progress.report(step, metrics, groups, describe_failures(episodes), time.perf_counter() - t_step)
        if stopping:
            write_to_disk(trainer, pool)  # `agentrl eval` of the stopped run reads the weights it stopped at
            raise stop.interrupted(f"RL step {step} of {job.algorithm.steps}")
        watch.observe(episodes, step)  # after the checkpoint: a fixed env resumes from here
    return metrics


# --- the pieces the loop calls ---------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class Published:
    """New weights in every rollout engine."""

    version: int
    sync_s: float  # from the trainer into every engine, writing included (disk mode)
    write_s: float = 0.0  # writing weights/v{N} (disk mode)
    num_bytes: int = 0


def start_rollout(job: JobConfig, policy_dir: str, weights: tuple[str, int], *, position: int | None, resume: bool,
                  actors: contextlib.ExitStack):
    """The trajectory store actor and the rollout workers, whose engines will serve `weights` (path, version) once
    there. A worker's process and imports start now; its engine at its first call or at `pool.start_engines()`, so the
    driver may start the workers before the trainer has written the weights (docs/benchmarks.md, session 43)."""
    import ray

    from agentrl.rollout.worker import RolloutPool, rollout_worker_actor
    from agentrl.store import TrajectoryStoreActor

    store = TrajectoryStoreActor.remote(job.store_config(), resume=resume, position=position)
    actors.callback(ray.kill, store)
    pool = RolloutPool(rollout_worker_actor(num_cpus=job.cluster.rollout_cpus, num_gpus=job.cluster.rollout_gpus),
                       job.rollout.num_workers, (engine_spec(job, weights[0]), policy_dir, job.rollout),
                       {"version": weights[1], "chat_format": job.model.chat_format}, store=store)
    actors.callback(pool.shutdown)
    return store, pool


def publish(job: JobConfig, trainer, pool) -> Published:
    """The trainer's current weights into every rollout engine: streamed in memory, layer by layer
    (rollout.weight_sync.mode=memory), or written to weights/v{N} and reloaded by each engine (disk)."""
    t0 = time.perf_counter()
    if job.rollout.weight_sync.mode == "memory":
        record = pool.sync_weights(trainer, job.rollout.weight_sync)
        return Published(version=record.version, sync_s=time.perf_counter() - t0, num_bytes=record.num_bytes)
    weights = trainer.publish_weights()
    pool.update_weights(weights.path, weights.version)
    return Published(version=weights.version, sync_s=time.perf_counter() - t0,
                     write_s=weights.gather_s + weights.write_s, num_bytes=weights.num_bytes)


def roll_back(job: JobConfig, trainer, pool, step: int, rollback: int,
              published: Published | None) -> tuple[Published | None, int | None]:
    """The checkpoint saved before the update that stalled the run (agentrl/stall.py) into the trainer and every rollout
    engine, as a new policy version; returns that and the RL step whose policy it is (0: the warm start's). Without
    such a checkpoint on disk the run goes on as it was: (`published`, None)."""
    try:
        restored = int(trainer.roll_back().get("rl_step", 0))
    except FileNotFoundError as exc:
        log.warning("step %d: the last %d RL steps trained no group, and the run cannot roll back: %s", step,
                    STALLED_STEPS, first_line(exc))
        return published, None
    log.warning("step %d: the last %d RL steps trained no group (every group's rewards equal) and their success rate "
                "fell below that of the update before them: the policy goes back to %s, and on with new tasks "
                "(rollback %d of at most %d, algorithm.max_rollbacks)", step, STALLED_STEPS, restored_policy(restored),
                rollback, job.algorithm.max_rollbacks)
    return publish(job, trainer, pool), restored


def write_to_disk(trainer, pool) -> float:
    """Writes weights/v{N} of the version the engines serve unless it is on disk already (synced in memory); it is
    what `agentrl eval` reads and what a replaced rollout worker starts from. Returns the seconds it took."""
    if pool.weights[1] == pool.version:
        return 0.0
    weights = trainer.publish_weights()
    pool.published(weights.path, weights.version)
    return weights.gather_s + weights.write_s


def connect(job: JobConfig) -> None:
    """ray.init: the configured address, else RAY_ADDRESS, else a local instance."""
    import ray

    if ray.is_initialized():
        return
    address = job.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        from agentrl.reaper import start_reaper

        start_reaper()  # the local instance's processes end with this one, however it ends
        # "local": a new instance even where `ray start` left a cluster running on this machine. Ray's default joins
        # that one (its address file, <tmp>/ray/ray_current_cluster), and the job waited for ever on a 1-CPU
        # cluster's resources, or, given cluster.num_cpus, failed: "num_cpus ... must not be provided"
        ray.init(address="local", num_cpus=job.cluster.num_cpus, include_dashboard=False, log_to_driver=False)


@dataclass(frozen=True, slots=True)
class GroupReport:
    """What one RL step trained: groups trained out of those asked for, and why the others were not."""

    asked: int
    trained: int
    uniform: int  # every member got the same reward: no advantage (algorithm.skip_uniform_groups)
    short: int  # some member failed, and algorithm.failed_members=drop
    stale: int  # sampled by a policy more than algorithm.max_staleness versions old, dropped by the store
    failed: int  # every member failed, dropped by the store
    waiting: bool  # fewer complete groups than asked: no batch this step, they wait in the store

    @classmethod
    def of(cls, asked: int, selected, before: dict[str, float], after: dict[str, float]) -> GroupReport:
        """From the store's Selection of the step's batch and its stats before and after taking it."""
        return cls(asked=asked, trained=len(selected.group_ids), uniform=selected.uniform, short=selected.short,
                   stale=int(after["groups_dropped_stale"] - before["groups_dropped_stale"]),
                   failed=int(after["groups_dropped_untrainable"] - before["groups_dropped_untrainable"]),
                   waiting=not selected.taken)

    def __str__(self) -> str:
        reasons = [f"{n} {why}" for n, why in ((self.uniform, "uniform"), (self.short, "short of a failed member"),
                                               (self.stale, "stale"),
                                               (self.failed, "failed")) if n]
        if self.waiting:
            reasons.append("too few complete groups: they wait for the next step")
        return f"trained {self.trained}/{self.asked} groups" + (f" ({', '.join(reasons)})" if reasons else "")


class Progress:
    """The console's line per RL step: rewards, what trained, what failed, time and the estimated time left."""

    def __init__(self, first_step: int, last_step: int):
        self.first_step, self.last_step = first_step, last_step
        self.started = time.perf_counter()

    def report(self, step: int, metrics: dict[str, float], groups: GroupReport, failures: str, step_s: float) -> None:
        left = (time.perf_counter() - self.started) / (step - self.first_step) * (self.last_step - step)
        parts = [f"step {step}/{self.last_step}: reward {metrics.get('rollout/reward_mean', 0.0):.3f} "
                 f"success {metrics.get('rollout/success_rate', 0.0):.3f}", str(groups)]
        if "eval/success_rate" in metrics:
            parts.append(f"held-out success {metrics['eval/success_rate']:.3f}")
        if failures:
            parts.append(failures)
        skipped = int(metrics.get("train/optimizer_steps_skipped", 0))  # DeepSpeed's, for a non-finite gradient
        if skipped:
            parts.append(f"{skipped} of {int(metrics.get('train/optimizer_steps', skipped))} optimizer step(s) "
                         f"skipped: the gradient held inf or NaN")
        parts.append(f"{step_s:.0f}s" + (f", ETA {duration(left)}" if step < self.last_step else ""))
        if "train/rolled_back_to_step" in metrics:
            log.warning(" | ".join(parts) + " | rolled back to " +
                        restored_policy(int(metrics["train/rolled_back_to_step"])))
        elif not groups.trained:
            log.warning(" | ".join(parts) + " | nothing trained: the policy did not change this step")
        elif skipped:
            log.warning(" | ".join(parts))
        else:
            log.info(" | ".join(parts))


def _sft_pace(elapsed: float, done: int, left: int, target: float | None) -> str:
    """The SFT progress line's timing: the warm start may end at its success target long before its step cap, so
    the time left is an upper bound."""
    pace = f"{elapsed / done:.1f}s/step, {duration(elapsed)} so far"
    if left:
        pace += f", at most {duration(elapsed / done * left)} left"
        if target is not None:
            pace += f" (it ends once held-out success reaches {target})"
    return pace


def resample_failed(job: JobConfig, pool, episodes: list[EpisodeSummary],
                    requests: list[EpisodeRequest]) -> list[EpisodeSummary]:
    """Tops up the step's groups (algorithm.failed_members=resample): each failed episode is run again as a new episode
    of the same task and group with another seed, up to algorithm.max_resamples times; returns the new episodes, each
    naming the one it replaces (the store puts it in that one's place). A failed episode this step did not start (a
    paused one resumed) is resampled from the request it recorded."""
    if job.algorithm.failed_members != "resample":
        return []
    origin = {r.trajectory_id: r for r in requests}
    failed = [t for t in episodes if t.status == Status.FAILED]
    out: list[EpisodeSummary] = []
    for attempt in range(1, job.algorithm.max_resamples + 1):
        asks = []
        for t in failed:
            original = origin.get(t.trajectory_id)
            if original is None:
                with contextlib.suppress(ValueError):  # it failed before it recorded its request: it stays failed
                    original = EpisodeRequest.of(t)
            if original is not None:
                ask = original.resample(t.trajectory_id, attempt)
                origin[ask.trajectory_id] = original
                asks.append(ask)
        if not asks:
            break
        log.info("resampling %d failed episode(s) (attempt %d of %d)", len(asks), attempt, job.algorithm.max_resamples)
        again = pool.generate(asks, to_store=True)  # no token budget: the step's groups complete now
        out += again
        failed = [t for t in again if t.status == Status.FAILED]
    return out


class PendingMetrics:
    """The metrics of the steps since the last checkpoint. MLflow gets a step once its checkpoint is written, so a
    run that resumes from that checkpoint (and redoes the steps after it) never logs a step twice; the checkpoint
    carries them, so a run killed between the checkpoint and the log still logs them when it resumes
    (Tracker.log_missing)."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.steps: list[tuple[int, dict[str, float]]] = []

    def add(self, step: int, metrics: dict[str, float]) -> None:
        if metrics:
            self.steps.append((step, {k: float(v) for k, v in metrics.items()}))

    def state(self) -> dict[str, Any]:
        """What the checkpoint about to be written carries."""
        return {"pending_metrics": list(self.steps)}

    def flush(self, **timings: float) -> None:
        """Logs the pending steps (after their checkpoint); `timings` (e.g. log_s) join the last one as time/<key>."""
        if self.steps and timings:
            self.steps[-1][1].update({f"time/{k}": v for k, v in timings.items()})
        for step, metrics in self.steps:
            self.tracker.log_metrics(metrics, step=step)
        self.steps = []


def prepare_policy(job: JobConfig) -> tuple[str, bool]:
    """(the initial checkpoint directory, whether the run resumes). Builds a fresh preset model when needed, and
    brings in a checkpoint agentrl must rewrite (K3 layout, MXFP4, training-knob overrides) as `run_dir/initial`."""
    from agentrl.init_model import import_checkpoint, init_model, needs_import

    resume = os.path.isdir(os.path.join(job.run_dir, "checkpoints"))
    initial = os.path.join(job.run_dir, "initial")
    if job.model.checkpoint:
        check_checkpoint(job.model.checkpoint, "model.checkpoint", job.model.chat_format)
        if not needs_import(job.model.checkpoint, dict(job.model.overrides)):
            return job.model.checkpoint, resume
        if not os.path.exists(os.path.join(initial, "config.json")):
            import_checkpoint(job.model.checkpoint, initial, dict(job.model.overrides))
        return initial, resume
    if not os.path.exists(os.path.join(initial, "config.json")):
        try:
            init_model(initial, preset=job.model.preset, overrides=dict(job.model.overrides),
                       tokenizer_dir=job.model.tokenizer, vocab_size=job.model.vocab_size, env_ids=(job.env.id,),
                       env_kwargs={job.env.id: dict(job.env.kwargs)}, seed=job.model.seed,
                       chat_format=job.model.chat_format)
        except EnvCodeError as exc:
            raise JobFailed(f"the tokenizer is trained on oracle episodes of {exc} (model.tokenizer=DIR uses an "
                            "existing tokenizer)") from exc
    return initial, resume


def engine_spec(job: JobConfig, weights_path: str) -> EngineSpec:
    e = job.rollout.engine
    return EngineSpec(model=weights_path, dtype=e.dtype, max_model_len=e.max_model_len,
                      kv_cache_memory_bytes=e.kv_cache_mb << 20, seed=job.seed, implementation=e.implementation,
                      max_num_seqs=job.rollout.max_concurrent_episodes,
                      return_routed_experts=job.trainer.routing_replay)


class TaskSampler:
    """Which tasks each step trains on (seeded: a resumed run draws the same ones) and the held-out eval tasks."""

    def __init__(self, job: JobConfig):
        self.job = job

    def requests(self, step: int) -> list[EpisodeRequest]:
        job = self.job
        rng = random.Random(f"{job.seed}-{step}")
        out = []
        for g in range(job.rollout.groups_per_step):
            task = rng.randrange(job.env.train_tasks)
            group_id = f"s{step}-g{g}-t{task}"
            out += [EpisodeRequest(env_id=job.env.id, task_index=task, group_id=group_id,
                                   trajectory_id=f"{group_id}-{i}", seed=rng.randrange(1 << 30),
                                   env_kwargs=dict(job.env.kwargs)) for i in range(job.rollout.group_size)]
        return out

    def eval_requests(self, limit: int | None = None) -> list[EpisodeRequest]:
        job = self.job
        count = job.env.eval_tasks if limit is None else min(limit, job.env.eval_tasks)
        return [EpisodeRequest(env_id=job.env.id, task_index=job.env.train_tasks + i, group_id=f"eval-{i}",
                               trajectory_id=f"eval-{time.time_ns()}-{i}", seed=i, env_kwargs=dict(job.env.kwargs))
                for i in range(count)]


def rollout_metrics(trajectories: list[EpisodeSummary], prefix: str = "rollout") -> dict[str, float]:
    done = [t for t in trajectories if t.status in (Status.COMPLETED, Status.TRUNCATED)]
    n = max(len(trajectories), 1)
    out: dict[str, float] = {
        f"{prefix}/episodes": len(trajectories),
        f"{prefix}/failed_fraction": sum(t.status == Status.FAILED for t in trajectories) / n,
        f"{prefix}/partial_fraction": sum(t.status == Status.PARTIAL for t in trajectories) / n,
        f"{prefix}/resampled": sum(bool(t.replaces) for t in trajectories),  # failed ones' stand-ins
        # failed episodes by the boundary that failed, every boundary each step (0 included: unbroken curves)
        **{f"{prefix}/failed/{b.value}": sum(t.status == Status.FAILED and t.failure == b for t in trajectories)
           for b in Boundary},
    }
    if done:
        rewards = [t.reward for t in done]
        mean = sum(rewards) / len(rewards)
        out.update({
            f"{prefix}/reward_mean": mean,
            f"{prefix}/reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
            f"{prefix}/success_rate": sum(r >= 1.0 for r in rewards) / len(done),
            f"{prefix}/tokens_mean": sum(t.num_tokens for t in done) / len(done),
            f"{prefix}/turns_mean": sum(t.assistant_turns for t in done) / len(done),
            f"{prefix}/tool_calls_mean": sum(t.tool_calls for t in done) / len(done),
            f"{prefix}/tool_error_rate": sum(t.num_tool_errors for t in done) / max(1, sum(
                t.assistant_turns for t in done)),
        })
        components: dict[str, list[float]] = {}
        for t in done:
            for k, v in t.reward_components.items():
                components.setdefault(k, []).append(v)
        out.update({f"{prefix}/reward/{k}": sum(v) / len(v) for k, v in components.items()})
        cache = prefix_cache_stats(trajectories)
        if cache["prompt_tokens"]:  # the share of prompt tokens vLLM's prefix cache served
            out[f"{prefix}/prefix_cache_hit_rate"] = cache["cached_tokens"] / cache["prompt_tokens"]
        if cache["reusable_tokens"]:  # turn 2 on: the share of the episode's earlier tokens not computed again
            out[f"{prefix}/prefix_reuse"] = cache["reused_tokens"] / cache["reusable_tokens"]
        sampled = sum(t.num_sampled for t in trajectories)
        generate_s = max((t.timings.get("generate_s", 0.0) for t in trajectories), default=0.0)
        out[f"{prefix}/sampled_tokens"] = sampled
        if generate_s:
            out[f"{prefix}/sampled_tokens_per_s"] = sampled / generate_s
    return out


def evaluate(pool, job: JobConfig, sampler: TaskSampler) -> dict[str, float]:
    """Greedy success rate on the held-out tasks."""
    if not job.env.eval_tasks:
        return {}
    log.info("evaluating greedily on %d held-out tasks", job.env.eval_tasks)
    t0 = time.perf_counter()
    episodes = pool.generate(sampler.eval_requests(), temperature=0.0, summarize=True)
    return {**rollout_metrics(episodes, prefix="eval"), "time/eval_s": time.perf_counter() - t0}


def warm_start(job: JobConfig, trainer, metrics_log: PendingMetrics, pool, sampler: TaskSampler, stop: StopRequest, *,
               first_step: int = 1) -> None:
    """SFT on oracle trajectories of the training tasks (the caller publishes the result). A checkpoint every
    `checkpoint_every` SFT steps (its steps' metrics reach MLflow then); the caller checkpoints the end.

    With `algorithm.sft_target_success` set, every `sft_eval_every` steps the rollout workers take the weights and
    the held-out tasks are evaluated greedily; the warm start ends once the success rate reaches the target. Once a
    check reaches `sft_check_every_step_from`, it checks after every step. A stop
    request checkpoints after the current SFT step; a resumed warm start continues at `first_step` with the tasks
    it would have drawn.
    """
    from agentrl.chat import load_chat_format
    from agentrl.envs import make
    from agentrl.rollout.oracle import oracle_trajectory

    algo = job.algorithm
    policy_dir, _ = prepare_policy(job)
    chat = load_chat_format(policy_dir, job.model.chat_format)
    env = make(job.env.id, **job.env.kwargs)
    rng = random.Random(job.seed)
    for _ in range((first_step - 1) * algo.sft_batch_episodes):  # the draws of the steps already taken
        rng.randrange(job.env.train_tasks)
    sft = LossConfig(kind="sft")
    if algo.sft_lr is not None:
        trainer.set_lr(algo.sft_lr)
    # the engine's first generation (its start-up and compilation, ~40 s on the CPU) overlaps the first SFT steps
    # instead of stalling the first check
    warmup = (pool.submit(sampler.eval_requests(), temperature=0.0, summarize=True)
              if algo.sft_target_success is not None else None)
    step = first_step - 1
    started = time.perf_counter()
    every = algo.sft_eval_every  # 1 once a check is near the target
    for step in range(first_step, algo.sft_steps + 1):
        tasks = [rng.randrange(job.env.train_tasks) for _ in range(algo.sft_batch_episodes)]
        batch = []
        for n, i in enumerate(tasks):
            try:
                batch.append(oracle_trajectory(env, chat, env_id=job.env.id, task_index=i, seed=i,
                                               group_id=f"sft-{step}-{n}"))
            except Exception as exc:  # the env's own code: its reset, oracle or step
                raise JobFailed(f"the SFT warm start plays {job.env.id}'s oracle and it raised on task {i}: "
                                f"{first_line(exc)} (algorithm.sft_steps=0 trains without a warm start)") from exc
        metrics = {f"sft/{k}": v for k, v in trainer.step(batch, sft).items()}
        reached = False
        if algo.sft_target_success is not None and step % every == 0 and step < algo.sft_steps:
            if warmup is not None:
                pool.collect(warmup)
                warmup = None
            publish(job, trainer, pool)
            success = evaluate(pool, job, sampler).get("eval/success_rate", 0.0)
            metrics["sft/eval_success_rate"] = success
            reached = success >= algo.sft_target_success
            if algo.sft_check_every_step_from is not None and success >= algo.sft_check_every_step_from:
                every = 1
        metrics_log.add(step - 1, metrics)
        if step % 10 == 1 or step == algo.sft_steps or "sft/eval_success_rate" in metrics:
            shown = ", ".join(f"{k[4:]} {metrics[k]:.3f}" for k in ("sft/loss", "sft/eval_success_rate") if k in metrics)
            log.info("sft step %d/%d: %s | %s", step, algo.sft_steps, shown,
                     _sft_pace(time.perf_counter() - started, step - first_step + 1, algo.sft_steps - step,
                               algo.sft_target_success))
        if reached:
            break
        stopping = stop.requested  # read once: a signal landing after the checkpoint waits for the next step
        if stopping or step % job.algorithm.checkpoint_every == 0 and step < algo.sft_steps:
            trainer.save_checkpoint({"store_position": 0, "rl_step": 0, "phase": "sft", "sft_step": step,
                                     **metrics_log.state()})
            metrics_log.flush()
        if stopping:
            raise stop.interrupted(f"SFT step {step} of {algo.sft_steps}")
    if warmup is not None:
        pool.collect(warmup)
    metrics_log.add(step - 1, {"sft/steps_run": step, "time/sft_s": time.perf_counter() - started})
    if algo.sft_lr is not None:
        trainer.set_lr(job.trainer.lr)
    trainer.reset_reference()  # RL's KL term (kl_coef > 0) anchors to the warm-started policy


def model_directory(path: str) -> str:
    """The model directory `agentrl eval --checkpoint` means: a run directory stands for its newest published weights;
    a DeepSpeed training checkpoint (optimizer state, no model files) is refused, naming the directories to give."""
    from agentrl.trainer.publish import latest_weights

    if os.path.isdir(os.path.join(path, "weights")):
        latest = latest_weights(path)
        if latest is not None:
            return latest[1]
    if not os.path.exists(os.path.join(path, "config.json")) and os.path.isdir(path):
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        if os.path.basename(os.path.dirname(os.path.abspath(path))) == "checkpoints":
            latest = latest_weights(run_dir)
            newest = f"; the newest is {latest[1]}" if latest else ""
            raise ConfigError(f"--checkpoint={path!r} is a DeepSpeed training checkpoint (optimizer state, for "
                              f"resuming); evaluation takes model weights: {run_dir}/weights/vN or the run "
                              f"directory {run_dir} for its newest{newest}")
    return path


def evaluate_checkpoint(job: JobConfig, checkpoint: str, num_tasks: int | None = None) -> dict[str, float]:
    """`agentrl eval`: one rollout worker on `checkpoint`, greedy, over the held-out tasks. A checkpoint agentrl must
    rewrite first (a K3 directory, MXFP4) is imported into a temporary directory for the evaluation. A run directory
    evaluates its newest published weights."""
    import shutil
    import tempfile

    from agentrl.init_model import import_checkpoint, needs_import
    from agentrl.rollout.worker import RolloutPool, rollout_worker_actor

    check_env(job)
    checkpoint = model_directory(checkpoint)
    check_checkpoint(checkpoint, "--checkpoint", job.model.chat_format)
    imported = None
    if needs_import(checkpoint):
        imported = tempfile.mkdtemp(prefix="agentrl-eval-")
        checkpoint = import_checkpoint(checkpoint, os.path.join(imported, "policy"))
    connect(job)
    pool = RolloutPool(rollout_worker_actor(num_cpus=job.cluster.rollout_cpus), 1,
                       (engine_spec(replace(job, trainer=replace(job.trainer, routing_replay=False)), checkpoint),
                        checkpoint, job.rollout), {"chat_format": job.model.chat_format})
    try:
        return rollout_metrics(pool.generate(TaskSampler(job).eval_requests(num_tasks), temperature=0.0,
                                             summarize=True), prefix="eval")
    finally:
        pool.shutdown()
        if imported is not None:
            shutil.rmtree(imported, ignore_errors=True)


