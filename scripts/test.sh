#!/usr/bin/env bash
# Sets up .venv (once) and runs the test suite: unit (and gpu, skipped without CUDA) in one pytest process, then each
# integration file in its own (scripts/run_tests.py says why). Extra arguments run pytest directly on them instead,
# e.g. scripts/test.sh tests/unit -k kda
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" VLLM_ENABLE_V1_MULTIPROCESSING=0 DS_ACCELERATOR=cpu
if [[ $# -gt 0 ]]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python scripts/run_tests.py
