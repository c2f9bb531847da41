"""The processes a job started end with it, however it ends: a killed driver's leftovers are reaped (issue 27)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from agentrl.reaper import GRACE_S
from tests.processes import descendants, still_alive_after

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a driver that starts the reaper, then a process in a session of its own that ignores SIGTERM (as Ray's agents
# outlived a killed driver) with a child of its own
DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from agentrl.reaper import start_reaper

    start_reaper()
    stubborn = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
    time.sleep(2)  # the reaper has noted them
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_drivers_processes_are_reaped_and_the_reaper_ends_too():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert driver.stdout.readline().strip() == "ready"
        started = descendants(driver.pid)
        assert len(started) == 3, started  # the reaper, the stubborn process and its child
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    left = still_alive_after(started, GRACE_S + 10)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after their driver was killed: {left}"
