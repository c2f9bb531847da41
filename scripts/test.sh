#!/usr/bin/env bash
# Sets up .venv (once) and runs the test suite: unit, then integration. tests/gpu skips without CUDA.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -k kda
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" VLLM_ENABLE_V1_MULTIPROCESSING=0 DS_ACCELERATOR=cpu
exec .venv/bin/python -m pytest -q "${@:-tests}"
