"""Rewards: task-completion scorers, weighted named components, format penalties, and the failed-run rule.

A reward is a dict of named components (``{"correct": 1.0, "tests_passed": 0.8, "format": -0.1}``) and a dict of
weights; the total is their weighted sum (``weighted_total``). Keeping the components, not just the total, lets the
tracker plot each one and lets a job reweight them without touching the env.

The failed-run rule: when the *system* fails during an episode (a tool crashed, the sandbox could not start, a
timeout the system caused), the episode's status is ``"failed"`` and its reward is not a score: ``group_advantages``
leaves it out of the group baseline and gives it no advantage, so infrastructure trouble never teaches the policy
that its (possibly correct) behaviour was bad. Scoring such an episode 0 would do exactly that.

This module imports only the standard library; ``agentrl.envs`` uses it and must stay free of torch.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

FAILED = "failed"  # the episode status whose reward is excluded from advantages

_NUMBER = re.compile(r"[-+]?(?:\d[\d,_]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")


def normalize_answer(text: str) -> str:
    """Casefolded, whitespace collapsed, surrounding quotes and a trailing period removed."""
    text = " ".join(str(text).split()).casefold()
    text = text.strip().strip("\"'`").strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_match(prediction: str, gold: str, *, normalize: bool = True) -> float:
    """1.0 if the prediction equals the gold answer (after ``normalize_answer`` unless ``normalize=False``)."""
    if normalize:
        return float(normalize_answer(prediction) == normalize_answer(gold))
    return float(prediction == gold)


def parse_number(text: str) -> float | None:
    """The number an answer states: the whole text if it is one, else the last number in it.

    Understands ``1,234.5``, ``$12``, ``12%`` (as 12), ``3/4`` and ``-2.5e3``; ``None`` if there is no number.
    """
    matches = _NUMBER.findall(str(text))
    if not matches:
        return None
    token = matches[-1].replace(",", "").replace("_", "").replace(" ", "")
    try:
        if "/" in token:
            numerator, denominator = token.split("/")
            return float(numerator) / float(denominator) if float(denominator) != 0 else None
        value = float(token)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def numeric_match(prediction: str, gold: float, *, rel_tol: float = 1e-4, abs_tol: float = 1e-6) -> float:
    """1.0 if the number in ``prediction`` is within ``rel_tol``/``abs_tol`` of ``gold`` (``math.isclose``)."""
    value = parse_number(prediction)
    return float(value is not None and math.isclose(value, float(gold), rel_tol=rel_tol, abs_tol=abs_tol))


def unit_tests_passed(passed: int, total: int) -> float:
    """The fraction of unit tests passed, in [0, 1]."""
    if total <= 0:
        raise ValueError(f"unit_tests_passed needs total > 0, got total={total!r}")
    if not 0 <= passed <= total:
        raise ValueError(f"unit_tests_passed needs 0 <= passed <= total, got passed={passed!r}, total={total!r}")
    return passed / total


def format_penalty(num_malformed: int, *, per_turn: float, cap: float = 1.0) -> float:
    """A non-positive component: ``-per_turn`` for each malformed message, at most ``cap`` in magnitude."""
    if per_turn < 0 or cap < 0:
        raise ValueError(f"format_penalty needs per_turn >= 0 and cap >= 0, got {per_turn!r}, {cap!r}")
    return -min(cap, per_turn * max(num_malformed, 0))


def weighted_total(components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """Sum of ``weights[name] * components[name]``. Every component needs a weight and vice versa.

    A weight of 0 logs a component without rewarding it. A mismatch is a ``ValueError``: a typo in a job's weights
    must not silently drop a component.
    """
    if set(components) != set(weights):
        raise ValueError(f"reward components {sorted(components)} and weights {sorted(weights)} must name the "
                         "same components")
    return math.fsum(weights[name] * float(value) for name, value in components.items())


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A scored episode, or a failed one. ``total`` is 0.0 when failed and must not be used as a score."""

    status: str  # "scored" or FAILED
    components: dict[str, float] = field(default_factory=dict)
    total: float = 0.0
    failure: dict[str, Any] | None = None  # {"boundary": "env" | "tool" | "sandbox", "message": str}

    @classmethod
    def scored(cls, components: Mapping[str, float], weights: Mapping[str, float]) -> RewardResult:
        return cls(status="scored", components=dict(components), total=weighted_total(components, weights))

    @classmethod
    def failed(cls, boundary: str, message: str) -> RewardResult:
        if boundary not in ("env", "tool", "sandbox"):
            raise ValueError(f"failure boundary must be 'env', 'tool' or 'sandbox', got {boundary!r}")
        return cls(status=FAILED, failure={"boundary": boundary, "message": message})


def group_advantages(rewards: Sequence[float], statuses: Sequence[str], *, normalize_std: bool = False,
                     eps: float = 1e-6) -> list[float | None]:
    """GRPO-style advantages within one group of episodes of the same task: reward minus the group mean.

    Episodes whose status is ``"failed"`` are excluded: they get ``None`` and do not enter the mean (or std). With
    ``normalize_std`` the centred rewards are divided by the group's population std plus ``eps``.
    """
    if len(rewards) != len(statuses):
        raise ValueError(f"got {len(rewards)} rewards but {len(statuses)} statuses")
    kept = [float(r) for r, s in zip(rewards, statuses) if s != FAILED]
    if not kept:
        return [None] * len(rewards)
    mean = math.fsum(kept) / len(kept)
    scale = statistics.pstdev(kept) + eps if normalize_std else 1.0
    return [None if s == FAILED else (float(r) - mean) / scale for r, s in zip(rewards, statuses)]


def drop_uniform_groups(trajectories: Sequence[Any]) -> tuple[list[Any], int]:
    """The trajectories of groups whose scored rewards differ, and how many groups were left out.

    In a group whose (non-failed) members all got the same reward every advantage is zero: the policy-gradient term
    is zero, yet an optimizer step on it still moves the weights (Adam's momentum, weight decay) and dilutes a
    token-mean loss. DAPO's dynamic sampling drops such groups; so does the driver (`algorithm.skip_uniform_groups`).
    """
    groups: dict[str, list[Any]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    kept, dropped = [], 0
    for members in groups.values():
        rewards = {float(t.reward) for t in members if t.status.value != FAILED}
        if len(rewards) > 1:
            kept.extend(members)
        else:
            dropped += 1
    return kept, dropped


def select_trainable(trajectories: Sequence[Any], group_size: int, *, skip_uniform_groups: bool,
                     drop_short_groups: bool) -> tuple[list[Any], int, int]:
    """The members of a training batch the loss takes (the batch holds each group's members that did not fail), how
    many groups were left out for equal rewards (`skip_uniform_groups`, see drop_uniform_groups), and how many
    because a member failed (`drop_short_groups`: algorithm.failed_members=drop)."""
    trajectories, short = list(trajectories), 0
    if drop_short_groups:
        size = Counter(t.group_id for t in trajectories)
        trajectories = [t for t in trajectories if size[t.group_id] == group_size]
        short = sum(n < group_size for n in size.values())
    if not skip_uniform_groups:
        return trajectories, 0, short
    kept, uniform = drop_uniform_groups(trajectories)
    return kept, uniform, short
