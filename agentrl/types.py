"""The one record every part exchanges: a Trajectory (one episode of a policy in a tool environment).

Tokens are kept exactly as generated (never decoded and re-tokenized): the prompt rendered once, then each assistant
turn as the engine sampled it, then each tool observation as rendered by the chat template. Per-token arrays are all
aligned with `tokens`:
- `loss_mask[t]` is 1 only where the policy sampled token t;
- `logprobs[t]` is the behaviour policy's log-probability of token t where sampled (after temperature/top-p), else 0;
- `versions[t]` is the policy version that produced token t (−1 for prompt and tool tokens);
- `routed_experts[t]` ([L, K] per token, optional) are the experts the engine's MoE layers chose while processing
  token t, for routing replay in training.
A trajectory that failed is data, not an exception: `status` says how it ended and `failure` which boundary failed.

`episode` is what the agent loop needs to continue the episode (a paused or snapshotted trajectory resumes from it);
an `EpisodeSummary` is what the driver learns of a trajectory the rollout workers handed to the store: no tokens.
"""

from __future__ import annotations

import copy
import enum
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np


class Status(str, enum.Enum):
    COMPLETED = "completed"  # the env terminated the episode (final answer)
    TRUNCATED = "truncated"  # an outside limit ended it: env turn budget, token budget, model context
    PARTIAL = "partial"  # paused by the iteration's token budget, to be resumed under a newer policy
    ABORTED = "aborted"  # cancelled by the system (shutdown, worker restart before retry)
    FAILED = "failed"  # a boundary failed; excluded from advantages


class Boundary(str, enum.Enum):
    """Where a failure happened (one per failed trajectory)."""

    MODEL = "model"  # the engine (generation error, context overflow it could not handle)
    ENV = "env"  # the environment's own code raised
    TOOL = "tool"  # a tool the env ran failed in a way the system caused (time-out, crash)
    SANDBOX = "sandbox"  # the code sandbox itself failed
    WORKER = "worker"  # the rollout worker died


@dataclass(kw_only=True)
class Turn:
    """A span of tokens for display: role is system/user/assistant/tool."""

    role: str
    start: int
    end: int
    text: str = ""


@dataclass(kw_only=True)
class Episode:
    """The request an episode of the agent loop started from, and where its current assistant turn began."""

    task_index: int
    seed: int = 0
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    replaces: str | None = None  # the failed member of the group this episode was resampled for
    turn_start: int = 0  # token index where the turn being sampled began (the prompt's end, then each observation's)


@dataclass(kw_only=True, frozen=True, slots=True)
class ResumePoint:
    """An episode to continue — paused by a token budget, or snapshotted at a turn boundary before its worker died —
    as the store hands it out: its ids for whoever routes it, its trajectory by reference (a Ray ObjectRef the
    rollout worker resolves), so that the tokens go from the store to the worker without passing through the
    driver."""

    trajectory_id: str
    group_id: str
    env_id: str
    episode: Episode | None
    trajectory: Any  # ray.ObjectRef to the PARTIAL Trajectory

    @classmethod
    def of(cls, trajectory: Trajectory, ref: Any) -> ResumePoint:
        return cls(trajectory_id=trajectory.trajectory_id, group_id=trajectory.group_id, env_id=trajectory.env_id,
                   episode=copy.deepcopy(trajectory.episode), trajectory=ref)


@dataclass(kw_only=True, frozen=True, slots=True)
class EpisodeSummary:
    """What the driver sees of one episode whose trajectory went to the store: counts, the reward, how it ended and,
    for a few episodes per step (transcripts to log), the turns' text."""

    trajectory_id: str
    task_id: str
    group_id: str
    env_id: str
    status: Status
    failure: Boundary | None
    error: str
    reward: float
    reward_components: dict[str, float]
    num_tokens: int
    num_sampled: int
    assistant_turns: int
    tool_calls: int
    num_tool_errors: int
    timings: dict[str, float]
    replaces: str | None
    episode: Episode | None  # the request it ran (a failed episode is resampled from it)
    prefix_cache: list[list[int]]
    policy_versions: list[int]
    turns: list[tuple[str, str]] | None = None  # (role, text) per turn, only where a transcript was asked for


@dataclass(kw_only=True)
class Trajectory:
    trajectory_id: str
    task_id: str
    group_id: str
    env_id: str
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: np.ndarray | None = None  # [T, L, K] int16
    prompt_length: int = 0
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    status: Status = Status.COMPLETED
    failure: Boundary | None = None
    error: str = ""
    turns: list[Turn] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    num_tool_errors: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    env_state: bytes | None = None  # pickled env state, kept only while PARTIAL
    episode: Episode | None = None  # set by the agent loop (None: not sampled by it, e.g. an oracle trajectory)
    prefix_cache: list[list[int]] = field(default_factory=list)  # per engine call: [prompt, sampled, cached] tokens
    metadata: dict[str, Any] = field(default_factory=dict)  # free-form, for users and tools; agentrl reads none of it

    # --- token bookkeeping ----------------------------------------------------------------------------------------
    def append_prompt(self, token_ids: list[int]) -> None:
        """Tokens the policy did not sample (prompt, tool observations, chat-template glue)."""
        self.tokens.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([-1] * len(token_ids))

    def append_sampled(self, token_ids: list[int], logprobs: list[float], version: int | list[int]) -> None:
        """Tokens the policy sampled, with their log-probabilities and the version (one, or one per token)."""
        versions = [version] * len(token_ids) if isinstance(version, int) else list(version)
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(logprobs)} log-probabilities and "
                             f"{len(versions)} versions")
        self.tokens.extend(token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.versions.extend(versions)

    def snapshot(self, env_state: bytes, *, episode_s: float) -> Trajectory:
        """A PARTIAL copy of this running episode, taken at a turn boundary with the env's saved state and the
        seconds it has run: what a rollout resumes from when the worker holding the episode dies."""
        return replace(self, tokens=list(self.tokens), loss_mask=list(self.loss_mask), logprobs=list(self.logprobs),
                       versions=list(self.versions),
                       routed_experts=None if self.routed_experts is None else self.routed_experts.copy(),
                       reward_components=dict(self.reward_components), turns=list(self.turns),
                       tool_calls=list(self.tool_calls), timings={**self.timings, "episode_s": episode_s},
                       episode=copy.deepcopy(self.episode), prefix_cache=[list(c) for c in self.prefix_cache],
                       metadata=copy.deepcopy(self.metadata), status=Status.PARTIAL,
                       env_state=env_state).pad_routing()

    def pad_routing(self) -> Trajectory:
        """Pads the routing to [T, L, K]: tokens the engine never ran (the last sampled one, appended glue) get −1."""
        if self.routed_experts is not None:
            rows = self.routed_experts[: len(self.tokens)]
            if len(rows) < len(self.tokens):
                pad = np.full((len(self.tokens) - len(rows), *rows.shape[1:]), -1, dtype=np.int16)
                rows = np.concatenate([rows, pad])
            self.routed_experts = rows
        return self

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    @property
    def replaces(self) -> str | None:
        """The failed member of its group this trajectory stands in for (algorithm.failed_members=resample)."""
        return self.episode.replaces if self.episode is not None else None

    def summary(self, *, transcript: bool = False) -> EpisodeSummary:
        """This trajectory without its tokens; with `transcript`, the turns' text too."""
        return EpisodeSummary(
            trajectory_id=self.trajectory_id, task_id=self.task_id, group_id=self.group_id, env_id=self.env_id,
            status=self.status, failure=self.failure, error=self.error, reward=self.reward,
            reward_components=dict(self.reward_components), num_tokens=len(self.tokens),
            num_sampled=self.num_sampled, assistant_turns=sum(t.role == "assistant" for t in self.turns),
            tool_calls=len(self.tool_calls), num_tool_errors=self.num_tool_errors, timings=dict(self.timings),
            replaces=self.replaces, episode=copy.deepcopy(self.episode),
            prefix_cache=[list(c) for c in self.prefix_cache],
            policy_versions=self.policy_versions,
            turns=[(t.role, t.text) for t in self.turns] if transcript else None)

    @property
    def policy_versions(self) -> list[int]:
        """The distinct policy versions that sampled this trajectory, in order."""
        seen: list[int] = []
        for v in self.versions:
            if v >= 0 and (not seen or seen[-1] != v):
                seen.append(v)
        return seen

    @property
    def trainable(self) -> bool:
        """Whether it may enter a policy-gradient batch (failed and aborted ones never do)."""
        return self.status in (Status.COMPLETED, Status.TRUNCATED) and self.num_sampled > 0

    def validate(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.trajectory_id}: {name} has {len(getattr(self, name))} entries, "
                                 f"tokens has {n}")
        if self.routed_experts is not None and self.routed_experts.shape[0] != n:
            raise ValueError(f"trajectory {self.trajectory_id}: routed_experts covers "
                             f"{self.routed_experts.shape[0]} tokens, tokens has {n}")

    # --- serialisation (one flat row for Parquet) -------------------------------------------------------------------
    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["status"] = self.status.value
        row["failure"] = self.failure.value if self.failure else ""
        row["routed_experts"] = (self.routed_experts.astype(np.int16).tobytes() if self.routed_experts is not None
                                 else b"")
        row["routed_experts_shape"] = list(self.routed_experts.shape) if self.routed_experts is not None else []
        row["env_state"] = self.env_state or b""
        row["episode"] = json.dumps(asdict(self.episode)) if self.episode is not None else ""
        for key in ("reward_components", "turns", "tool_calls", "timings", "prefix_cache", "metadata"):
            row[key] = json.dumps(row[key], default=str)
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Trajectory:
        row = dict(row)
        shape = row.pop("routed_experts_shape", [])
        raw = row.get("routed_experts") or b""
        row["routed_experts"] = np.frombuffer(raw, dtype=np.int16).reshape(shape).copy() if shape else None
        row["status"] = Status(row["status"])
        row["failure"] = Boundary(row["failure"]) if row.get("failure") else None
        row["env_state"] = row.get("env_state") or None
        row["episode"] = Episode(**json.loads(row["episode"])) if row.get("episode") else None
        for key in ("reward_components", "turns", "tool_calls", "timings", "prefix_cache", "metadata"):
            value = row.get(key)
            row[key] = json.loads(value) if isinstance(value, str) else (value or {})
        row["turns"] = [Turn(**t) for t in row["turns"]] if row["turns"] else []
        row["tool_calls"] = row["tool_calls"] or []
        row["prefix_cache"] = row["prefix_cache"] or []
        return cls(**row)
