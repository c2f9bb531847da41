"""The numbers `agentrl plan` rests on: those measured on H200s (docs/benchmarks.md) and those assumed."""

from __future__ import annotations

GiB = 1024**3

# ------------------------------------------------------------------------------------------------------------------
# Calibration: the measured numbers the estimates use, all from docs/benchmarks.md ("GPU (H200)"). Change them here
# when the benchmarks are re-measured.
# ------------------------------------------------------------------------------------------------------------------
CALIBRATION_PRESET = "small"
# bf16 forward+backward tokens/s of the `small` preset on one H200, B = 1, gradient checkpointing off, the code as it
# trains today (MLA on the flash varlen kernel, fused kernels on): `bench_gpu.py throughput --models agentrl`,
# 2026-12-01 ("Where the step's time goes ... session 8"). Until then these were 128,253 and 83,420, measured with
# cuDNN attention, which the model has not used since its backward failed on H200. The 4K figure (36,685) is left
# out: the host bounds it (kernel launches). Two lengths fit two efficiencies: of the matmul work and of MLA's T²
# attention (see `timing.calibrated_efficiency`). Since 2026-12-06 MLA runs agentrl's Triton kernels, which need no
# padding: on an H100, in one run, they raised these tokens/s 1.14x at 32K and 1.22x at 128K over flash with padding
# (docs/benchmarks.md, "MLA's attention without padding"). No H200 has measured them yet, so the figures below stay the
# flash path's: the estimates err slow.
SMALL_TRAIN_TOKENS_PER_S = {32768: 113_017, 131072: 62_190}
# In-memory weight sync on one H200 into a second process (CUDA IPC, the receiver reading the sender's tensors): 47% of
# the device-to-device copy rate at Kimi Linear 48B's widths, 4 layers, 12.85 GB (`bench_gpu.py weight-ipc`,
# 2026-12-03): 13.0 ms against 6.1 ms.
WEIGHT_IPC_COPY_FRACTION = 0.47
# Peak memory above the weights with gradient checkpointing on (fused kernels): marginal bytes per token between
# 128K and 256K tokens, and the AttnRes path that measurement ran. Measured 2026-11-30 with cuDNN attention; the
# flash varlen path gave the same peaks at 8K / 32K / 128K (1.52 / 4.77 / 18.55 GiB, 2026-12-01; 256K not re-run).
SMALL_ACTIVATION_BYTES_PER_TOKEN = (36.97 - 18.55) * GiB / (262144 - 131072)
SMALL_ACTIVATION_ATTN_RES_MIX = "fused"
# Under context parallelism the last rank of a sequence recomputes and back-propagates each MLA layer over the whole
# sequence's keys and values — expanded from the all-gathered latents, values padded to the key head dim for the
# kernel, and their gradients — where the model's `kv` counts one bf16 copy: this many `kv`s per token of the whole
# sequence. Fitted on the `small` preset at 256K tokens, CP = 2, one H200 (`bench_gpu.py cp-memory`, 2026-12-03:
# 27.9 GiB peak above the weights on the heavier rank; without the term the model gave 19.8); at 64K, CP = 2 the
# fitted model gives 8.0 GiB against 7.2 measured (over, on the safe side). KDA's widened value columns under CP are
# inside the fit. Attending in the latent space (W_UK absorbed into the queries) would remove most of it. Since
# session 31 the CP path attends through the MLA kernels (mla_kernels.py), which neither pad the values nor build
# the concatenated keys: the fit errs high, not re-measured (`scripts/bench_cp.py --cp 2 --tokens 262144` would).
CP_MLA_KV_FACTOR = 9.26

# ------------------------------------------------------------------------------------------------------------------
# Assumptions (not measured here): the H200's datasheet figures and efficiencies of collectives and decoding.
# ------------------------------------------------------------------------------------------------------------------
H200_BF16_TFLOPS = 989.0  # dense bf16 peak (docs/benchmarks.md rounds it to 990)
H200_HBM_TBPS = 4.8
USABLE_MEMORY_FRACTION = 0.92  # CUDA context, NCCL buffers, allocator fragmentation take the rest
BYTES_WEIGHT, BYTES_GRAD, BYTES_OPTIMIZER = 2, 2, 12  # bf16 weights and gradients; fp32 master + Adam m, v
COLLECTIVE_EFFICIENCY = 0.7  # achieved / link bandwidth for NCCL rings and all-to-all
A2A_LATENCY_S = 30e-6  # fixed cost of one all-to-all (decode is latency-bound)
DECODE_HBM_EFFICIENCY = 0.6  # achieved / peak HBM bandwidth in a decode step
DECODE_MFU = 0.3  # achieved / peak FLOP/s of the expert matmuls in a decode step
DECODE_MAX_SEQS_PER_GPU = 256  # scheduler cap on concurrent sequences per GPU
KDA_CHUNK = 64  # fla's chunk: one [H, K, K] fp32 state per chunk is saved for the backward pass
# Gradient checkpointing recomputes each forward once: (1 forward + 2 backward) / (2 + 2) of the speed. Before the
# fused kernels the `small` preset measured 52-54K tokens/s with it against 70K without (0.76).
CHECKPOINTING_SPEED = 0.75

# What each Block AttnRes mix keeps for the backward pass. The mixes run outside the sub-layer checkpoints.
ATTN_RES_MIXES = {
    "torch": "the PyTorch reference (CPU) stacks its sources in fp32 and keeps values and keys",
    "fused": "fla's fused_attnres (CUDA) keeps only references to its sources and per-source fp32 statistics",
    "recomputed": "recomputed inside the checkpoint (not in the trainer yet)",
}
DEFAULT_ATTN_RES_MIX = "fused"  # the model's CUDA path (agentrl/model/attn_res.py)
