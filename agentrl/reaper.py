"""Every process a job started ends with it, however the job ends (Linux).

    start_reaper()          # in the driver, before it starts the local Ray instance

A local Ray instance, vLLM's engine processes and the env processes are all descendants of the driver. When the driver
ends cleanly they are shut down; when it is killed (kill -9, the OOM killer), most follow through Ray's own
fate-sharing, but not all: Ray's dashboard and runtime-env agents were found running on long after a killed driver
(they try to report the raylet's death to a GCS that died with it). The reaper is a small process of its own (in its
own session, so a kill of the job's process group spares it) that notes the driver's descendants every second while
the driver lives; once the driver is gone (its pipe to the reaper reads EOF) it gives them `GRACE_S` to end by
themselves and then SIGKILLs those still running. A process is identified by pid and start time, so a pid the kernel
reused meanwhile is never touched.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

GRACE_S = 5.0
POLL_S = 1.0


def start_reaper() -> subprocess.Popen | None:
    """Starts the reaper for this process (once); None where /proc is missing."""
    global _reaper
    if _reaper is not None or not os.path.isdir(f"/proc/{os.getpid()}/task"):
        return _reaper
    _reaper = subprocess.Popen([sys.executable, "-m", "agentrl.reaper", str(os.getpid())], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               close_fds=True)  # holds none of the job's output pipes open
    return _reaper


_reaper: subprocess.Popen | None = None


def start_ticks(pid: int) -> int | None:
    """The process's start time, in clock ticks since boot; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[19]) if fields[0] != "Z" else None  # field 22 of stat: 20th after the name


def _identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time), or None when the process is gone."""
    start = start_ticks(pid)
    return None if start is None else (pid, start)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` in the process tree (from /proc/PID/task/TID/children), those gone skipped."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split() if int(c) not in found]
            except OSError:
                continue
            found += kids
            queue += kids
    return found


def watch(driver: int) -> None:
    """The reaper's loop (see the module docstring); returns after the driver's leftovers are gone."""
    me = os.getpid()
    seen: set[tuple[int, str]] = set()
    while True:
        seen |= {ident for p in descendants(driver) if p != me and (ident := _identity(p)) is not None}
        readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if readable and not sys.stdin.buffer.read1(1):  # EOF: the driver is gone
            break
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_identity(pid) == (pid, start) for pid, start in seen):
        time.sleep(0.2)
    for pid, start in seen:
        if _identity(pid) == (pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C for the job is not for the reaper
    watch(int(sys.argv[1]))
