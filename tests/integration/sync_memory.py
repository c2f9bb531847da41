"""Rank 0's resident memory during an in-memory weight sync, and during the gather a disk publish does: a helper
process for tests/integration/test_weight_sync.py (a fresh process, so that its RSS is the trainer's own).

    python tests/integration/sync_memory.py RUN_DIR stream|gather    # prints model_mb=... bucket_mb=... peak_mb=...

A ~280 MB model (fp32) on one ZeRO-2 rank streams into receivers that read every tensor and keep nothing (`stream`),
or gathers its state dict as a disk publish does (`gather`); each in a process of its own, so that memory one of
them freed cannot hide the other's growth.
"""

from __future__ import annotations

import sys
import threading
import time

import psutil
import torch

from agentrl.model.config import preset_config
from agentrl.trainer import zero
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.policy_trainer import PolicyTrainer
from agentrl.weight_buckets import BucketMeta, unpack

BUCKET_BYTES = 8 << 20


class ReadingReceivers:
    """Reads each bucket's tensors where they lie (as an engine copying them would) and keeps nothing."""

    failed: list[int] = []

    def begin(self, version: int) -> None:
        self.checksum = 0.0

    def load(self, bucket: dict):
        for _, view in unpack(BucketMeta.from_dict(bucket)):
            self.checksum += float(view.sum())
        return lambda: None

    def finish(self, version: int) -> None:
        pass


def peak_growth_mb(fn) -> float:
    """Peak RSS above the level before `fn()` ran, sampled every millisecond."""
    me = psutil.Process()
    base = peak = me.memory_info().rss
    running = [True]

    def watch():
        nonlocal peak
        while running[0]:
            peak = max(peak, me.memory_info().rss)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = fn()
    running[0] = False
    watcher.join()
    del result
    return (peak - base) / 2**20


def main() -> None:
    run_dir, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    config = preset_config("tiny", hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
                           vocab_size=16384, num_experts=8, moe_intermediate_size=512, kv_lora_rank=128,
                           qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                           linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8], num_heads=4,
                                                   head_dim=64, short_conv_kernel_size=4))
    trainer = PolicyTrainer(TrainerConfig(run_dir=run_dir, dtype="fp32", num_threads=1), config)
    model_mb = sum(p.numel() * p.element_size() for p in trainer.policy.parameters()) / 2**20
    layers: dict[str, float] = {}
    for name, p in trainer.policy.named_parameters():
        key = zero._group_key(name)
        layers[key] = layers.get(key, 0.0) + p.numel() * p.element_size() / 2**20
    if mode == "stream":
        peak = peak_growth_mb(lambda: trainer.sync_weights(ReadingReceivers(), bucket_bytes=BUCKET_BYTES))
    else:
        peak = peak_growth_mb(lambda: zero.gather_state_dict(trainer.policy, zero_stage=2, rank=0))
    print(f"model_mb={model_mb:.1f} bucket_mb={BUCKET_BYTES / 2**20:.1f} largest_layer_mb={max(layers.values()):.1f} "
          f"peak_mb={peak:.1f}")
    trainer.close()


if __name__ == "__main__":
    main()
