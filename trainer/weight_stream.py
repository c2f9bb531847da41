"""The policy's weights to the rollout engines in memory: one decoder layer at a time, bucket by bucket, no disk.

    record = stream_weights(policy, receivers, version=7, zero_stage=3, rank=rank, kind="shm", capacity=1 << 30)

Every rank runs through the layers (ZeRO-3 gathers each layer's parameters on all ranks; expert parallelism gathers
each MoE layer's experts over its group); rank 0 converts each layer to checkpoint names, packs the tensors into
shared buffers (agentrl.weight_buckets: /dev/shm on CPU, CUDA IPC on GPU) in the engines' dtype, and hands each
bucket's description to every receiver while it fills the other buffer. Rank 0 holds one layer and two buckets at a
time, never the model.

The receivers (a `Receivers`: the rollout workers, agentrl.rollout.worker.WorkerReceivers) switch versions together:
`begin(version)` pauses each engine and opens its transfer, `load(meta)` loads a bucket, `finish(version)` checks that
every tensor arrived, serves the new version and resumes. A receiver that fails on the way is left out of the rest
and reported (`SyncRecord.failed`); it never resumes on a mix of two versions (RolloutWorker restores a complete
version or ends itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from agentrl.model.checkpoint import to_checkpoint_tensors
from agentrl.model.expert_parallel import expert_parallel_layers, gather_full_experts
from agentrl.trainer import zero
from agentrl.weight_buckets import BucketRing, split_into_buckets


class Receivers(Protocol):
    """The engines a sync goes to (all calls from rank 0)."""

    def begin(self, version: int) -> None: ...

    def load(self, meta: dict) -> Callable[[], None]:
        """Starts loading the bucket `meta` on every receiver still in the transfer; returns a wait for all of
        them (a receiver that fails is dropped from the transfer and recorded in `failed`)."""

    def finish(self, version: int) -> None: ...

    @property
    def failed(self) -> list[int]:
        """Indices of the receivers that failed during this transfer."""


@dataclass(kw_only=True, slots=True)
class SyncRecord:
    """One in-memory sync: what moved, what it cost, who missed it."""

    version: int
    num_bytes: int = 0
    num_buckets: int = 0
    num_tensors: int = 0
    seconds: float = 0.0
    pack_s: float = 0.0  # rank 0 gathering, converting and copying into the buffers
    wait_s: float = 0.0  # rank 0 waiting for the receivers to read a buffer
    failed: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # why each failed receiver failed


def checkpoint_tensors(policy: nn.Module, *, zero_stage: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's tensors by checkpoint name, one decoder layer at a time (rank 0; the other ranks take part in
    the gathers and yield nothing). Collective: every rank runs it to the end."""
    experts = expert_parallel_layers(policy)
    for key, group in zero.state_groups(policy, zero_stage=zero_stage, rank=rank):
        mine = [name for name in experts if name.startswith(key + ".")]
        if mine:  # the layer's experts are sharded over expert-parallel groups: each group's first rank gets them
            full = gather_full_experts(policy, dst=0, layers=mine)
            group = {**group, **full} if rank == 0 else {}
        if rank == 0:
            yield from to_checkpoint_tensors(group)


def stream_weights(policy: nn.Module, receivers: Receivers | None, *, version: int, zero_stage: int, rank: int,
                   ring: BucketRing | None, dtype: torch.dtype | None = None) -> SyncRecord:
    """Sends the policy to `receivers` as `version` (see the module docstring); rank 0 passes the receivers and its
    bucket ring and gets the record, the other ranks pass None for both and take part in the gathers. The ring
    outlives the sync: its buffers are touched once (the first sync of a fresh /dev/shm buffer pays for its pages:
    ~1 s per GB here) and the engines map them once."""
    record = SyncRecord(version=version)
    start = time.perf_counter()
    if rank != 0:
        for _ in checkpoint_tensors(policy, zero_stage=zero_stage, rank=rank):
            pass
        return record
    # the receivers may read persistent parameters where they lie (CUDA IPC); gathered ones are copied, since the
    # gather releases them when the stream moves to the next layer
    by_reference = zero_stage < 3 and not expert_parallel_layers(policy)
    receivers.begin(version)
    ring.restart()
    tensors = checkpoint_tensors(policy, zero_stage=zero_stage, rank=rank)
    t = time.perf_counter()
    for entries in split_into_buckets(tensors, ring.capacity, dtype=dtype):
        meta = ring.pack(entries, dtype=dtype, by_reference=by_reference)
        record.pack_s += time.perf_counter() - t
        ring.reuse(meta.index, _timed(receivers.load(meta.to_dict()), record))
        record.num_buckets += 1
        record.num_bytes += sum(_part_bytes(p) for p in meta.parts)
        record.num_tensors += sum(p.rows is None or p.rows[0] == 0 for p in meta.parts)
        t = time.perf_counter()
    ring.drain()
    receivers.finish(version)
    record.failed = list(receivers.failed)
    record.errors = dict(getattr(receivers, "errors", {}))
    record.seconds = time.perf_counter() - start
    return record


def _part_bytes(part) -> int:
    n = getattr(torch, part.dtype).itemsize
    for d in part.shape:
        n *= d
    return n


def _timed(wait: Callable[[], None], record: SyncRecord) -> Callable[[], None]:
    def timed() -> None:
        t = time.perf_counter()
        wait()
        record.wait_s += time.perf_counter() - t
    return timed
