"""What reaches the driver process: every value `ray.get` returns there, and how many Trajectory objects it holds.

    received = record_driver_gets(ray, monkeypatch)   # then run the code under test in this process
    assert not [r for r in received if r[1]]          # (type name, trajectories) per ray.get
"""

from __future__ import annotations

import dataclasses
from typing import Any


def trajectories_in(value: Any, depth: int = 0) -> int:
    """How many Trajectory objects `value` holds (in lists, tuples, dicts and dataclass fields)."""
    from agentrl.types import Trajectory

    if isinstance(value, Trajectory):
        return 1
    if depth > 6 or isinstance(value, (str, bytes, int, float)):
        return 0
    if isinstance(value, dict):
        return sum(trajectories_in(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return sum(trajectories_in(v, depth + 1) for v in value)
    if dataclasses.is_dataclass(value):
        return sum(trajectories_in(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    return 0


def record_driver_gets(ray: Any, monkeypatch: Any) -> list[tuple[str, int]]:
    """Wraps `ray.get` for the rest of the test; returns the list it fills with (type name, trajectories held)."""
    received: list[tuple[str, int]] = []
    real_get = ray.get

    def get(refs, *args, **kwargs):
        value = real_get(refs, *args, **kwargs)
        received.append((type(value).__name__, trajectories_in(value)))
        return value

    monkeypatch.setattr(ray, "get", get)
    return received
