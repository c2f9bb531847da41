"""The chaos harness's own rules (scripts/chaos.py): when a fault is due, and that a kill hits a live process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import types

import pytest

from tests.processes import alive
from tests.scripts import load_script

chaos = load_script("chaos")

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the harness reads /proc (Linux)")


def test_a_fault_waits_for_its_step_and_for_the_job_to_heal_from_the_last():
    first, second = chaos.Fault("trainer_rank", after_step=2, delay_s=0.0), chaos.Fault("engine_core", 3, 0.0)
    faults = [first, second]
    assert not chaos.ready(first, faults, step=1)
    assert chaos.ready(first, faults, step=2)
    first.at_step, first.injected_at = 2, 1.0  # killed; the job restarts from its checkpoint
    assert not chaos.ready(second, faults, step=3)  # step 3 printed before the restart began
    first.healed = "restarted in place"
    assert not chaos.ready(second, faults, step=3)  # restarting: its actors are being ended and started again
    first.recovery_s = 20.0  # a step printed since it healed
    assert chaos.ready(second, faults, step=3)
    first.recovery_s, first.healed = 0.0, "missed"  # one that found no target holds nothing up
    assert chaos.ready(second, faults, step=3)


@pytest.fixture
def job():
    """A stand-in for the job: a process with one child named like the trajectory store actor."""
    proc = subprocess.Popen(["bash", "-c", 'exec -a "ray::TrajectoryStore.run" sleep 60 & wait'],
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while chaos.find(types.SimpleNamespace(proc=proc), "store") is None:
        assert time.monotonic() < deadline, "the stand-in's child did not start"
        time.sleep(0.05)
    yield types.SimpleNamespace(proc=proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_target_that_ends_before_the_kill_is_looked_for_again(job, monkeypatch):
    gone = subprocess.Popen(["true"])  # left unreaped: a zombie, whose pid no new process can take meanwhile
    deadline = time.monotonic() + 30
    while alive(gone.pid):
        assert time.monotonic() < deadline, "`true` did not end"
        time.sleep(0.05)
    real_find, found = chaos.find, []

    def find(job, kind):  # the first process found ends before it is killed, as one a restart is ending does
        found.append(gone.pid if not found else real_find(job, kind))
        return found[-1]

    monkeypatch.setattr(chaos, "find", find)
    fault = chaos.Fault("store", after_step=1, delay_s=0.0)
    chaos.inject(job, fault, step=1, leftovers=[])
    gone.wait()
    assert fault.healed == "" and fault.pid == found[-1] != gone.pid and fault.injected_at > 0
    deadline = time.monotonic() + 30
    while alive(fault.pid):
        assert time.monotonic() < deadline, "the live target was not killed"
        time.sleep(0.05)


def test_a_fault_with_no_target_is_missed_once_the_job_ends(monkeypatch):
    proc = subprocess.Popen(["true"])
    proc.wait()
    fault = chaos.Fault("engine_core", after_step=1, delay_s=0.0)
    chaos.inject(types.SimpleNamespace(proc=proc), fault, step=1, leftovers=[])
    assert fault.healed == "missed" and fault.injected_at == 0.0
