"""Shared test settings: deterministic CPU torch with few threads (the CI machine has 2 cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
