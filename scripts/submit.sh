#!/usr/bin/env bash
# Submits an agentrl job to a running Ray cluster with `ray job submit`.
#   scripts/submit.sh CONFIG [key=value ...]
# RAY_ADDRESS picks the cluster (default http://127.0.0.1:8265, the local dashboard). Ray 2.60 clusters started with
# token auth need RAY_AUTH_MODE=token here too. The runtime env ships this checkout (small: runs/, .venv/ and caches
# are excluded) and installs it on the workers with pip.
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:?usage: scripts/submit.sh CONFIG [key=value ...]}"; shift
export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
runtime_env=$(cat <<JSON
{"working_dir": ".", "excludes": ["runs/", ".venv/", ".git/", "**/__pycache__/", ".hypothesis/", ".pytest_cache/", ".whl/", ".gpuwheels/"],
 "env_vars": {"DS_ACCELERATOR": "${DS_ACCELERATOR:-cpu}", "OMP_NUM_THREADS": "1"}}
JSON
)
exec "${RAY:-.venv/bin/ray}" job submit --runtime-env-json "$runtime_env" -- \
    python -m agentrl.cli train "$config" "$@"
