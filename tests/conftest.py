"""Shared test settings: deterministic CPU torch with few threads (the CI machine has 2 cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")  # before torch is imported: it sizes its thread pool then
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

if not torch.cuda.is_available():  # on a GPU machine DeepSpeed must pick CUDA, or it keeps the model on the CPU
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
