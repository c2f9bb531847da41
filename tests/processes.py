"""Process helpers for tests that check what is left running after something was killed (Linux /proc)."""

from __future__ import annotations

import os
import time

from agentrl.reaper import descendants  # noqa: F401 - the process tree below a pid, for the tests


def alive(pid: int) -> bool:
    """Running, or stopped, but not gone and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    """The direct children of `pid`, from /proc/PID/task/TID/children."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def still_alive_after(pids: list[int], timeout_s: float) -> list[int]:
    """Waits up to `timeout_s` for every one of `pids` to end; returns those still alive then."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ").strip()
    except FileNotFoundError:
        return ""


def rss_mb(pid: int) -> float:
    """Resident memory in MiB (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0
