"""The job's `rollout` section, as the rollout workers, their agent loops and their engines take it.

    job.rollout.temperature, job.rollout.engine.kv_cache_mb    # agentrl train ... rollout.temperature=0.8

One typed config per component, as `trainer` (agentrl.trainer.config) and `tracking` are: the agent loop reads these
fields, not a copy of them. What a single call changes (evaluation's greedy temperature, the context schedule's limit)
is an argument of that call, not a second config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrl.rollout.policy_engine import SamplingSpec

ISOLATIONS = ("process", "thread")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    dtype: str = "float32"  # fp32 is ~3x faster than bf16 on AVX2 CPUs
    max_model_len: int = 4096  # the engine's context window, prompt and completions together
    kv_cache_mb: int = 256  # memory the engine reserves for KV cache and linear-attention states
    implementation: str = "auto"  # "agentrl" plugin, "upstream" vLLM (GPU), "auto"

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"rollout.engine.dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if self.implementation not in ("auto", "agentrl", "upstream"):
            raise ValueError(f"rollout.engine.implementation={self.implementation!r} must be auto/agentrl/upstream")


SYNC_MODES = ("memory", "disk")


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    # how each step's weights reach the engines: "memory" streams them from the trainer, one decoder layer at a time,
    # through shared buffers (/dev/shm on CPU, CUDA IPC on a shared GPU) and vLLM's weight-transfer API; "disk" writes
    # weights/v{N} and every engine reloads it
    mode: str = "memory"
    bucket_mb: int = 1024  # the largest bucket: trainer rank 0 holds two of them and one decoder layer, not the model
    # an engine left paused this long in the middle of a transfer (its sender gone) loads the last complete weights
    timeout_s: float = 300.0
    # memory mode: also write weights/v{N} every this many RL steps (0: only at the start, after SFT and at the end,
    # e.g. for `agentrl eval`); disk mode writes every step
    publish_every: int = 0

    def __post_init__(self):
        if self.mode not in SYNC_MODES:
            raise ValueError(f"rollout.weight_sync.mode={self.mode!r} must be one of {SYNC_MODES}")
        if self.bucket_mb < 1 or self.timeout_s <= 0 or self.publish_every < 0:
            raise ValueError(f"rollout.weight_sync needs bucket_mb >= 1, timeout_s > 0 and publish_every >= 0, got "
                             f"{self.bucket_mb}, {self.timeout_s}, {self.publish_every}")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    num_workers: int = 1  # rollout workers, one vLLM engine each
    group_size: int = 4  # samples per task (a GRPO group)
    groups_per_step: int = 8  # tasks per training step
    temperature: float = 1.0  # sampling temperature (the trainer scores log-probs at the same one)
    top_p: float = 1.0  # nucleus sampling mass
    max_tokens_per_turn: int = 128  # sampled tokens per assistant turn
    max_trajectory_tokens: int = 2048  # the initial context limit; algorithm.context_schedule raises it
    env_timeout_s: float = 30.0  # one env step (a tool call) may take this long before the episode fails
    # "process": each env instance runs in a process of its own, killed when a call overruns env_timeout_s (a tool
    # that holds the GIL cannot freeze the worker); "thread": in the worker, cheaper, but such a tool can
    env_isolation: str = "process"
    max_concurrent_episodes: int = 64  # episodes in flight per worker
    token_budget: int | None = None  # sampled tokens per iteration; unfinished episodes become partial
    # each generation samples from its own generator, seeded by the episode's seed and the trajectory's length, so an
    # episode's tokens do not depend on which other requests share the engine's batches: a synchronous run with the
    # same seed repeats (up to the engine's batch-dependent rounding); agent_loop.sampling_seed
    seeded_sampling: bool = False
    # running episodes are snapshotted at turn boundaries into the store, so an episode whose worker or run dies
    # resumes where it stood instead of starting over (rollout/snapshots.py); off, only what a kill loses is counted
    snapshots: bool = True
    snapshot_interval_s: float = 1.0  # seconds between a worker's reports to the store (snapshots and progress)
    engine: EngineConfig = field(default_factory=EngineConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    def __post_init__(self):
        for name in ("num_workers", "group_size", "groups_per_step", "max_tokens_per_turn", "max_trajectory_tokens",
                     "max_concurrent_episodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.top_p <= 1 or self.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0 and top_p={self.top_p} in (0, 1]")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"rollout.token_budget={self.token_budget} must be None or >= 1")
        if self.env_timeout_s <= 0:
            raise ValueError(f"rollout.env_timeout_s={self.env_timeout_s} must be > 0")
        if self.env_isolation not in ISOLATIONS:
            raise ValueError(f"rollout.env_isolation={self.env_isolation!r} must be one of {ISOLATIONS}")
        if self.snapshot_interval_s <= 0:
            raise ValueError(f"rollout.snapshot_interval_s={self.snapshot_interval_s} must be > 0")

    def sampling(self, temperature: float | None = None) -> SamplingSpec:
        """One assistant turn's sampling (`temperature` instead of the configured one: 0 samples greedily)."""
        return SamplingSpec(temperature=self.temperature if temperature is None else temperature, top_p=self.top_p,
                            max_tokens=self.max_tokens_per_turn)


__all__ = ["EngineConfig", "ISOLATIONS", "RolloutConfig", "SYNC_MODES", "WeightSyncConfig"]
