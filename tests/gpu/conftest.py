"""Settings for the GPU tests: each test hands the GPU memory it cached back when it ends, and the tests that hold
tens of GB (`@pytest.mark.gpu_memory_heavy`: DeepSpeed trainers, the `small` preset in fp32) run one at a time across
pytest-xdist workers.

The suite runs in several pytest-xdist workers on one GPU. PyTorch's caching allocator keeps what a test allocated
reserved in its worker after the test, so each worker held the peak of every test it had run, and on one 80 GB H100
four workers (then three) ran out of memory in a dozen tests that pass alone (docs/benchmarks.md, session 39). With
the cache released, four workers still failed five DeepSpeed trainer tests that passed alone (session 40; the run
was cut before pytest said why). Each builds one or more full `small` trainers (weights, fp32 master copy, optimizer
states, gradient buffers) and each trainer takes a free rendezvous port when it starts: two at once may run out of
memory together, or take the same port. Session 43's four workers on an H100 ran out of memory in eight tests that
passed alone: one trainer (~20 GB) beside the context-slice test's `small` model in fp32 (26 GB) and two other
workers' 20 and 11 GB; those tests now take the lock too. Session 44's two runs still ran out of memory in one and
three trainer tests: light tests (an RMSNorm of 500×1024) began with 18.5–20.8 GiB reserved in their workers, left
from an earlier test. Each test now writes what its worker had reserved before it, at its peak and after its release
into the JUnit report (`--junitxml`; scripts/gpu_memory_report.py prints it), and a failed test's exception, which
pytest keeps with every frame's locals (sys.last_*) until the next test's call, is dropped before the release.
"""

import contextlib
import fcntl
import gc
import sys
from pathlib import Path

import pytest
import torch


@contextlib.contextmanager
def exclusive(lock_path: Path):
    """Holds an exclusive lock on `lock_path` (made if missing) for the block: one process at a time, any number
    waiting."""
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _one_heavy_test_at_a_time(request, tmp_path_factory):
    if request.node.get_closest_marker("gpu_memory_heavy") is None:
        yield
        return
    # each xdist worker's base temp directory is a child of the one this session's workers share
    with exclusive(tmp_path_factory.getbasetemp().parent / "gpu_memory_heavy.lock"):
        yield


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory(_one_heavy_test_at_a_time, request):  # released before the lock is
    if not torch.cuda.is_available():
        yield
        return
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_reserved()
    # pytest keeps a failed test's exception in sys.last_* (for post-mortem debugging) until the next test's call, and
    # with it every frame's locals: a failed trainer test's GBs stayed reserved in its worker until the next release
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()  # DeepSpeed engines and CUDA graphs sit in reference cycles: free them before the cache
    torch.cuda.empty_cache()
    # in the JUnit report (`--junitxml`): what each test reserved, and what it left reserved in its worker, so that
    # which tests need the lock is read there, not guessed
    gib = 2 ** 30
    request.node.user_properties += [("gpu_reserved_before_gib", round(before / gib, 2)),
                                     ("gpu_peak_reserved_gib", round(peak / gib, 2)),
                                     ("gpu_reserved_after_gib", round(torch.cuda.memory_reserved() / gib, 2))]
