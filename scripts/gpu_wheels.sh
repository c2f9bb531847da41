#!/usr/bin/env bash
# Fills .gpuwheels/ with the wheels the GPU device lacks (python 3.12, x86-64; its image has torch, triton,
# transformers, einops, pytest-xdist but no fla, DeepSpeed, OmegaConf, psutil or gymnasium, which the trainer's
# imports reach), for `device run --carry .gpuwheels`.
# On the device, `. scripts/gpu_env.sh` installs them. DeepSpeed ships only an sdist: it is built here into a
# pure-Python wheel (DS_BUILD_OPS=0: its ops are JIT-built where they are used, none are needed by our path).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpuwheels
mkdir -p $out
py=.venv/bin/python
[[ -x $py ]] || py=python3
fetch=($py -m pip download --quiet --disable-pip-version-check --no-deps -d $out)
binary=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# Versions pinned to what pyproject.toml and the CPU environment use.
"${fetch[@]}" "${binary[@]}" fla-core==0.6.0 flash-linear-attention==0.6.0 omegaconf==2.4.0 hjson==3.1.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 psutil==7.2.2 gymnasium==1.4.0 cloudpickle==3.1.3 farama-notifications==0.0.6
# Pure-Python sdists, built into wheels here.
tmp=$(mktemp -d)
"${fetch[@]}" --no-binary=:all: -d "$tmp" deepspeed==0.19.8
for sdist in "$tmp"/*.tar.gz; do
    DS_BUILD_OPS=0 $py -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
        -w $out "$sdist"
done
rm -rf "$tmp"
ls -1 $out
