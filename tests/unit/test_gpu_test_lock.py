"""The lock that runs the GPU suite's memory-heavy tests (DeepSpeed trainers, the small preset in fp32) one at a
time across pytest-xdist workers (tests/gpu/conftest.py): two processes that take it never hold it at once."""

import multiprocessing
import time

from tests.gpu.conftest import exclusive


def _hold(lock_path, spans):
    with exclusive(lock_path):
        start = time.monotonic()
        time.sleep(0.3)
        spans.put((start, time.monotonic()))


def test_two_processes_taking_the_lock_hold_it_one_after_the_other(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    spans = ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(tmp_path / "lock", spans)) for _ in range(2)]
    for proc in procs:
        proc.start()
    (start_a, end_a), (start_b, end_b) = sorted(spans.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert end_a <= start_b, f"held at once: {start_a:.3f}–{end_a:.3f} and {start_b:.3f}–{end_b:.3f}"
