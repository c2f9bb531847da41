# Sourced at the start of a device call (`. scripts/gpu_env.sh`): installs the wheels of .gpuwheels/ (made by
# scripts/gpu_wheels.sh) into /tmp/site, puts them and the checkout on PYTHONPATH, keeps NVLink multicast off
# (the device's rule), and unpacks a Triton kernel cache carried from an earlier call, if any, so that fla's
# autotuned kernels are not compiled again.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpuwheels/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# (the cache comes back from a call in parts under the 16 MiB per-file limit: tc.part_aa, tc.part_ab, ...)
if compgen -G ".gpuwheels/tc.part_*" >/dev/null; then
    mkdir -p ~/.triton && cat .gpuwheels/tc.part_* | tar xJf - -C ~/.triton
fi
