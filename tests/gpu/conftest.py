"""Settings for the GPU tests: each test hands the GPU memory it cached back when it ends.

The suite runs in several pytest-xdist workers on one GPU. PyTorch's caching allocator keeps what a test allocated
reserved in its worker after the test, so each worker held the peak of every test it had run, and on one 80 GB H100
four workers (then three) ran out of memory in a dozen tests that pass alone (docs/benchmarks.md, session 39).
"""

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    yield
    if torch.cuda.is_available():
        gc.collect()  # DeepSpeed engines and CUDA graphs sit in reference cycles: free them before the cache
        torch.cuda.empty_cache()
