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
workers' 20 and 11 GB; those tests now take the lock too.
"""

import contextlib
import fcntl
import gc
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
def _release_cached_gpu_memory(_one_heavy_test_at_a_time):  # released before the lock is
    yield
    if torch.cuda.is_available():
        gc.collect()  # DeepSpeed engines and CUDA graphs sit in reference cycles: free them before the cache
        torch.cuda.empty_cache()
