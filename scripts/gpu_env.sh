# Sourced at the start of a device call (`. scripts/gpu_env.sh`): installs the wheels of .gpuwheels/ (made by
# scripts/gpu_wheels.sh) into /tmp/site, puts them and the checkout on PYTHONPATH, keeps NVLink multicast off
# (the device's rule), and unpacks a Triton kernel cache carried from an earlier call, if any, so that fla's
# autotuned kernels are not compiled again (a cold cache costs minutes per model and sequence length).
#
# To carry the cache to the next call: end the command with `save_triton_cache`, then here
# `cp /work/.device/<call>/tc.part_* .gpuwheels/` (git-ignored; it travels with `carry: [".gpuwheels"]`).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpuwheels/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# (parts tc.part_aa, tc.part_ab, ... as save_triton_cache below writes them)
if compgen -G ".gpuwheels/tc.part_*" >/dev/null; then
    mkdir -p ~/.triton && cat .gpuwheels/tc.part_* | tar xJf - -C ~/.triton
fi

save_triton_cache() {  # the kernel cache as xz parts within what comes back from $OUT (64 MiB in all, 16 MiB a file)
    # The cache only grows (every shape and kernel variant ever compiled), and once it compressed past the limit the
    # last part did not come back. Newest kernels first: the oldest fifth is left out until the archive fits. 46 MiB:
    # the next call carries it with the wheels (~8 MiB) and the tree (~4 MiB) within 64 MiB; at 56 it did not go.
    local budget=$((${TRITON_CACHE_BUDGET_MB:-46} << 20)) dirs
    mapfile -t dirs < <(cd ~/.triton/cache && ls -1t)
    while :; do
        (cd ~/.triton && printf 'cache/%s\n' "${dirs[@]}" | tar cf - -T -) | xz -T0 -6 > /tmp/tc.tar.xz
        if [ "$(stat -c %s /tmp/tc.tar.xz)" -le "$budget" ] || [ "${#dirs[@]}" -le 1 ]; then break; fi
        echo "save_triton_cache: $(du -m /tmp/tc.tar.xz | cut -f1) MiB over the budget; leaving out the oldest fifth" >&2
        dirs=("${dirs[@]:0:$(( ${#dirs[@]} * 4 / 5 ))}")
    done
    split -b 15M /tmp/tc.tar.xz "$OUT/tc.part_"
    rm -f /tmp/tc.tar.xz
}
