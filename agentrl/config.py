"""Job configuration: typed dataclasses with defaults, YAML deltas and `key=value` overrides merged by OmegaConf.

    cfg = load_config("configs/quickstart.yaml", ["rollout.group_size=8", "algorithm.steps=50"])

The typed defaults are the schema: a YAML file under configs/ states only what it changes. OmegaConf rejects an
unknown key or a value of the wrong type, each dataclass's __post_init__ rejects impossible values, and both are
reported as a ConfigError naming the key — all before any Ray actor starts. Library code receives the dataclasses
(`JobConfig` and its sections), never a DictConfig.
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agentrl.rollout.config import RolloutConfig
from agentrl.store import StoreConfig
from agentrl.tracking import TrackingConfig
from agentrl.trainer.config import TrainerConfig

GROUP_BASELINE_LOSSES = ("ppo", "gspo")  # trainer.loss kinds whose advantages are centred on the group's mean


class ConfigError(ValueError):
    """A bad job configuration; the message names the key."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    preset: str = "tiny"  # agentrl.model.config.PRESETS
    # HybridMoEConfig fields over the preset; over a checkpoint only its training knobs (init_model.CHECKPOINT_OVERRIDES)
    overrides: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None  # start from this checkpoint directory (agentrl's, Kimi Linear, Kimi K3)
    tokenizer: str | None = None  # tokenizer directory; None trains one on the environments' text
    vocab_size: int = 1024  # of the tokenizer trained when `tokenizer` is None
    # the template and tool-call grammar (agentrl.chat: agentrl, kimi, kimi_k3, qwen3); None: the checkpoint's own,
    # detected from its tokenizer; for a fresh preset, the format its tokenizer is built in
    chat_format: str | None = None
    seed: int = 0  # initialises the fresh preset model

    def __post_init__(self):
        from agentrl.chat import format_names
        from agentrl.model.config import PRESETS

        if self.checkpoint is None and self.preset not in PRESETS:
            raise ValueError(f"model.preset={self.preset!r} is not one of {sorted(PRESETS)}")
        unknown = sorted(set(self.overrides) - model_config_fields())
        if unknown:  # the model config would keep them as inert attributes: a misspelt field silently does nothing
            close = {k: difflib.get_close_matches(k, model_config_fields(), n=1) for k in unknown}
            raise ValueError("model.overrides " + ", ".join(
                f"{k!r}" + (f" (did you mean {close[k][0]!r}?)" if close[k] else "") for k in unknown)
                + " are not fields of the model config (agentrl/model/config.py, HybridMoEConfig)")
        if self.chat_format is not None and self.chat_format not in format_names():
            raise ValueError(f"model.chat_format={self.chat_format!r} is not one of {format_names()} "
                             "(or null: the checkpoint's own)")
        if self.checkpoint is not None:
            from agentrl.init_model import CHECKPOINT_OVERRIDES

            ignored = sorted(set(self.overrides) - set(CHECKPOINT_OVERRIDES))
            if ignored:  # e.g. a config written for a fresh preset, pointed at a checkpoint
                warnings.warn(f"model.overrides {ignored} shape a fresh preset and do not apply to model.checkpoint "
                              f"(its weights fix them): ignored; only {list(CHECKPOINT_OVERRIDES)} apply to a "
                              "checkpoint", stacklevel=2)
                self.overrides = {k: v for k, v in self.overrides.items() if k in CHECKPOINT_OVERRIDES}
        if self.vocab_size < 512:
            raise ValueError(f"model.vocab_size={self.vocab_size} is too small (>= 512)")


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    # a registered gymnasium id ("agentrl/Calc-v0", `agentrl envs`), or "package.module:Name-v0" to import the module
    # that registers it first
    id: str = "agentrl/Calc-v0"
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the env's constructor
    num_tasks: int = 1000  # task indices in use, 0..num_tasks-1 (at most the env's task count)
    eval_tasks: int = 64  # the last eval_tasks of them are held out for evaluation; training draws from the rest

    def __post_init__(self):
        if not 0 <= self.eval_tasks < self.num_tasks:
            raise ValueError(f"env.eval_tasks={self.eval_tasks} must be >= 0 and below env.num_tasks={self.num_tasks}")

    @property
    def train_tasks(self) -> int:
        return self.num_tasks - self.eval_tasks


@dataclass(kw_only=True, slots=True)
class ContextStage:
    """From `start_step` on, trajectories may grow to `max_trajectory_tokens` (e.g. 8K → 64K → 256K → 1M)."""

    start_step: int
    max_trajectory_tokens: int


FAILED_MEMBERS = ("resample", "keep", "drop")


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    steps: int = 20  # RL steps
    mode: str = "sync"  # "sync": rollout then train; "async": the next rollout runs while the trainer trains
    max_staleness: int = 1  # a batch may be sampled by a policy at most this many versions old
    skip_uniform_groups: bool = True  # train on no group whose rewards are all equal (zero advantage; DAPO)
    sft_steps: int = 0  # warm start: SFT steps on oracle trajectories before RL
    sft_batch_episodes: int = 32  # oracle episodes per SFT step
    sft_lr: float | None = None  # None: the trainer's lr
    # stop the warm start early once the greedy success rate on the held-out tasks reaches this (None: run all
    # sft_steps); checked every sft_eval_every steps. "A modest success rate" leaves RL something to learn.
    sft_target_success: float | None = None
    sft_eval_every: int = 10  # SFT steps between the warm start's greedy checks (with sft_target_success)
    # once a check reaches this greedy success rate the warm start checks after every step (None: never): the rise
    # to the target can be sharp enough that a check every sft_eval_every steps lands well past it
    sft_check_every_step_from: float | None = None
    eval_every: int = 0  # evaluate the success rate on held-out tasks every n steps (0: only at start and end)
    # steps (SFT and RL) between checkpoints: a stopped run resumes from the last one, and MLflow gets a step's metrics
    # once it is checkpointed (a resumed run never logs a step twice)
    checkpoint_every: int = 10
    # the trajectory length limit by step: a list of {start_step, max_trajectory_tokens}
    context_schedule: list[ContextStage] = field(default_factory=list)
    # stop the job (non-zero exit, MLflow run FAILED) once more than this fraction of the episodes of the last
    # failure_window steps failed (an env, tool, sandbox or engine error, not a wrong answer); 1.0 never stops
    max_failed_fraction: float = 0.5
    failure_window: int = 3  # RL steps the failed fraction is measured over (fewer at the start)
    # a group some of whose episodes failed: "resample" runs each failed one again as a new episode of the same task
    # (a new seed, up to max_resamples times) so the group trains at full size; "keep" trains it on the members that
    # did not fail; "drop" leaves the whole group out. A failed episode never enters the loss or the group baseline.
    failed_members: str = "resample"
    max_resamples: int = 1  # how often one failed member is run again under "resample" (then the group keeps it out)
    # a run stalled by one update (its last 3 RL steps trained no group, every group's rewards equal, and their success
    # rate fell below that of the step that made the update) goes back to the checkpoint saved before that update and
    # on with the next steps' tasks, up to this many times (0: never; agentrl/stall.py). Needs the checkpoint before the
    # update on disk: trainer.keep_checkpoints >= 2
    max_rollbacks: int = 2

    def __post_init__(self):
        if self.mode not in ("sync", "async"):
            raise ValueError(f"algorithm.mode={self.mode!r} must be 'sync' or 'async'")
        if self.steps < 0 or self.sft_steps < 0 or self.max_staleness < 0:
            raise ValueError("algorithm.steps, sft_steps and max_staleness must be >= 0")
        if self.sft_lr is not None and not self.sft_lr > 0:
            raise ValueError(f"algorithm.sft_lr={self.sft_lr!r} must be > 0 (or null: the trainer's lr)")
        if self.sft_target_success is not None and not 0 < self.sft_target_success <= 1:
            raise ValueError(f"algorithm.sft_target_success={self.sft_target_success!r} must be in (0, 1] (or null)")
        if self.sft_eval_every < 1:
            raise ValueError(f"algorithm.sft_eval_every={self.sft_eval_every!r} must be >= 1")
        if self.sft_check_every_step_from is not None and not 0 <= self.sft_check_every_step_from <= 1:
            raise ValueError(f"algorithm.sft_check_every_step_from={self.sft_check_every_step_from!r} must be in "
                             "[0, 1] (or null)")
        if self.mode == "async" and self.max_staleness < 1:
            raise ValueError("algorithm.mode='async' trains on rollouts one version old: max_staleness must be >= 1")
        if not 0 <= self.max_failed_fraction <= 1 or self.failure_window < 1:
            raise ValueError(f"algorithm.max_failed_fraction={self.max_failed_fraction} must be in [0, 1] and "
                             f"algorithm.failure_window={self.failure_window} >= 1")
        if self.max_rollbacks < 0:
            raise ValueError(f"algorithm.max_rollbacks={self.max_rollbacks} must be >= 0")
        if self.failed_members not in FAILED_MEMBERS or self.max_resamples < 0:
            raise ValueError(f"algorithm.failed_members={self.failed_members!r} must be one of {FAILED_MEMBERS} and "
                             f"algorithm.max_resamples={self.max_resamples} >= 0")
        starts = [s.start_step for s in self.context_schedule]
        if starts != sorted(starts):
            raise ValueError(f"algorithm.context_schedule start steps must increase, got {starts}")

    def max_trajectory_tokens(self, step: int, default: int) -> int:
        """The context limit in force at `step`."""
        limit = default
        for stage in self.context_schedule:
            if step >= stage.start_step:
                limit = stage.max_trajectory_tokens
        return limit


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    address: str | None = None  # None: RAY_ADDRESS if set, else a local Ray instance
    num_cpus: int | None = None  # for the local instance (None: all)
    rollout_cpus: float = 1.0  # per rollout worker
    rollout_gpus: float = 0.0  # per rollout worker
    trainer_ranks: int = 1  # DeepSpeed data-parallel ranks
    trainer_cpus: float = 1.0  # per trainer rank
    trainer_gpus: float = 0.0  # per trainer rank
    placement: str = "colocated"  # "colocated": rollout and trainer share nodes/GPUs; "separate": disjoint bundles
    # a trainer rank or the store that dies (or a trainer call that outlasts trainer_timeout_s) restarts the job from
    # its last checkpoint, in place, up to max_restarts times; dead rollout workers are replaced without a restart
    max_restarts: int = 3
    trainer_timeout_s: float = 3600.0  # the longest wait for a trainer call (a step, a checkpoint) before a restart

    def __post_init__(self):
        if self.trainer_ranks < 1:
            raise ValueError(f"cluster.trainer_ranks={self.trainer_ranks} must be >= 1")
        if self.max_restarts < 0 or self.trainer_timeout_s <= 0:
            raise ValueError(f"cluster.max_restarts must be >= 0 and cluster.trainer_timeout_s > 0, got "
                             f"{self.max_restarts}, {self.trainer_timeout_s}")
        if self.placement not in ("colocated", "separate"):
            raise ValueError(f"cluster.placement={self.placement!r} must be 'colocated' or 'separate'")


@dataclass(kw_only=True, slots=True)
class JobConfig:
    name: str = "agentrl"  # the job's name
    run_dir: str = "runs/agentrl"  # checkpoints, weights, the trajectory store and the MLflow run live here
    seed: int = 0  # the tasks each step draws and the engine's sampling
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    # load_config ties trainer.run_dir to run_dir and trainer.temperature to rollout.temperature
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(run_dir="runs/agentrl"))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        if self.rollout.group_size < 2 and self.trainer.loss.kind in GROUP_BASELINE_LOSSES:
            raise ValueError(f"rollout.group_size={self.rollout.group_size} cannot train trainer.loss.kind="
                             f"{self.trainer.loss.kind!r}: its advantage is each reward minus its group's mean, which "
                             "is 0 in a group of one. Use rollout.group_size >= 2")
        if self.rollout.weight_sync.mode == "memory" and self.rollout.engine.implementation == "upstream":
            raise ValueError("rollout.weight_sync.mode=memory streams into agentrl's vLLM model; "
                             "rollout.engine.implementation=upstream serves vLLM's own, which reloads from disk: set "
                             "rollout.weight_sync.mode=disk (or the implementation to agentrl)")
        if self.cluster.trainer_ranks % self.trainer.context_parallel:
            raise ValueError(f"trainer.context_parallel={self.trainer.context_parallel} must divide "
                             f"cluster.trainer_ranks={self.cluster.trainer_ranks}")
        if self.cluster.trainer_ranks % self.trainer.expert_parallel:
            raise ValueError(f"trainer.expert_parallel={self.trainer.expert_parallel} must divide "
                             f"cluster.trainer_ranks={self.cluster.trainer_ranks}")
        if self.trainer.zero_stage == 3 and self.cluster.trainer_ranks == 1:
            # one rank has no one to shard the parameters with, but ZeRO-3's per-module fetches and releases still
            # run on every forward and backward: host work (docs/benchmarks.md, issue 26)
            warnings.warn("trainer.zero_stage=3 with cluster.trainer_ranks=1 has no other rank to shard the "
                          "parameters over, and its step costs more (one H100, `small` preset, 4K tokens: 0.52x the "
                          "speed of the bare forward+backward against ZeRO-2's 0.72x); trainer.zero_stage=2 is the "
                          "choice for one rank", stacklevel=2)

    def store_config(self) -> StoreConfig:
        return StoreConfig(run_dir=self.run_dir, group_size=self.rollout.group_size)


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> tuple[JobConfig, DictConfig]:
    """The typed job config and its resolved DictConfig (for logging), or a ConfigError naming the bad key."""
    try:
        merged = OmegaConf.structured(JobConfig)
        merged.trainer.run_dir = "${run_dir}"
        merged.trainer.temperature = "${rollout.temperature}"
        if path is not None:
            merged = OmegaConf.merge(merged, _load_yaml(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
        merged = apply_overrides(merged, overrides)
        job = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"config key {key!r}: {_first_line(exc)}") from None
    except (ValueError, TypeError) as exc:  # a dataclass __post_init__ rejected a value (its message names it)
        raise ConfigError(str(exc)) from None
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {exc.filename}") from None
    return job, merged


def apply_overrides(merged: DictConfig, overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """`key=value` overrides in order. A plain dict or list value replaces the key's (`env.kwargs={}` empties it; a
    merge would keep the file's keys); a section (a dataclass) takes the fields given. An env's constructor arguments
    belong to it: naming another `env.id` drops the file's `env.kwargs`, and the overrides' own `env.kwargs.*` then
    apply to the new env."""
    given = [OmegaConf.from_dotlist([item]) for item in overrides]
    keys = [item.split("=", 1)[0].strip() for item in overrides]
    if "env.id" in keys and OmegaConf.select(given[keys.index("env.id")], "env.id") != merged.env.id:
        merged.env.kwargs = {}
    for key, tree in zip(keys, given):
        current = OmegaConf.select(merged, key, throw_on_missing=False)
        plain_dict = isinstance(current, DictConfig) and OmegaConf.get_type(current) in (dict, None)
        if plain_dict or isinstance(current, ListConfig):
            OmegaConf.update(merged, key, [] if isinstance(current, ListConfig) else {}, merge=False)
        merged = OmegaConf.merge(merged, tree)
    return merged


def model_config_fields() -> set[str]:
    """The fields `model.overrides` may set (HybridMoEConfig's constructor arguments)."""
    import inspect

    from agentrl.model.config import HybridMoEConfig

    return set(inspect.signature(HybridMoEConfig.__init__).parameters) - {"self", "kwargs"}


def check_env(job: JobConfig) -> None:
    """Builds the job's environment once, before any actor starts: its kwargs must be accepted and it must hold the
    `env.num_tasks` tasks the job samples from (ConfigError naming the key otherwise)."""
    from agentrl.envs import make

    try:
        env = make(job.env.id, **job.env.kwargs)
    except Exception as exc:  # an unknown id, a module that fails to import, kwargs the env refuses
        raise ConfigError(f"env.id={job.env.id!r} with env.kwargs={job.env.kwargs!r}: {_first_line(exc)}") from None
    available = len(env.tasks)
    env.close()
    if job.env.num_tasks > available:
        raise ConfigError(f"env.num_tasks={job.env.num_tasks} but {job.env.id} holds {available} tasks "
                          f"(a generated env takes its task count in env.kwargs, e.g. env.kwargs.num_tasks)")


def check_checkpoint(path: str, key: str, chat_format: str | None = None) -> None:
    """A checkpoint directory must hold its tokenizer, in a chat format agentrl speaks: the rollout workers load both
    from there (else they die at start-up, far from the cause)."""
    from agentrl.chat import load_chat_format

    if not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is not a directory")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}={path!r} holds no config.json: not a checkpoint directory")
    try:
        load_chat_format(path, chat_format)
    except FileNotFoundError as exc:
        raise ConfigError(f"{key}={path!r}: {exc}; a checkpoint directory needs the tokenizer beside the weights") \
            from None
    except ValueError as exc:
        raise ConfigError(f"{key}={path!r}: {exc}") from None


def _load_yaml(path: str) -> DictConfig:
    """The config file, or a ConfigError of one line naming the file and the line YAML stopped at."""
    import yaml

    try:
        loaded = OmegaConf.load(path)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        raise ConfigError(f"{where}: not valid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_first_line(exc)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: a config file is a mapping of sections (model:, env:, rollout: ...), "
                          f"this one holds a {type(loaded).__name__}")
    return loaded


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]
