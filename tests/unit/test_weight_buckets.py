"""Weight buckets: tensors through shared buffers by their descriptions alone, big ones in row ranges."""

from __future__ import annotations

import pytest
import torch

from agentrl.weight_buckets import ALIGN, BucketMeta, BucketRing, split_into_buckets, unpack


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(3, 5, generator=g)), ("embed", torch.randn(100, 7, generator=g)),
            ("scalar", torch.randn((), generator=g)), ("b", torch.randn(11, generator=g)),
            ("experts", torch.randn(4, 6, 3, generator=g))]


def received(named, capacity: int, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """What a receiver rebuilds from the buckets' descriptions (round-tripped through dicts, as RPCs carry them)."""
    out: dict[str, torch.Tensor] = {}
    buckets = 0
    with BucketRing.create("shm", capacity) as ring:
        for entries in split_into_buckets(iter(named), capacity, dtype=dtype):
            meta = BucketMeta.from_dict(ring.pack(entries, dtype=dtype).to_dict())
            assert meta.nbytes <= capacity and all(p.offset % ALIGN == 0 for p in meta.parts)
            buckets += 1
            for part, view in unpack(meta):
                if part.rows is None:
                    out[part.name] = view.clone()
                else:
                    full = out.setdefault(part.name, torch.empty(part.full_rows, *part.shape[1:], dtype=view.dtype))
                    full[part.rows[0]:part.rows[1]] = view
    return out, buckets


@pytest.mark.parametrize("capacity", [72, 100, 256, 700, 1 << 20])
def test_every_tensor_arrives_whole_whatever_the_bucket_size(capacity):
    named = named_tensors()
    got, buckets = received(named, capacity)
    assert set(got) == {n for n, _ in named}
    for name, tensor in named:
        assert torch.equal(got[name], tensor), name
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert buckets >= total // capacity  # the big tensor went in row ranges, not one oversized bucket


def test_buckets_carry_the_engines_dtype():
    named = named_tensors()
    got, _ = received(named, 256, dtype=torch.bfloat16)
    for name, tensor in named:
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor.to(torch.bfloat16)), name


def test_a_row_larger_than_a_bucket_is_refused_by_name():
    with pytest.raises(ValueError, match="wide: one row of \\(2, 100\\) does not fit"):
        list(split_into_buckets([("wide", torch.zeros(2, 100))], 256))


def test_a_buffer_is_refilled_only_after_its_reader_is_done():
    events: list[str] = []
    with BucketRing.create("shm", 64, count=2) as ring:
        for i, entries in enumerate(split_into_buckets([(f"t{i}", torch.zeros(16)) for i in range(4)], 64)):
            events.append(f"pack {i}")
            meta = ring.pack(entries)
            ring.reuse(meta.index, lambda i=i: events.append(f"read {i}"))
        ring.drain()
    # two buffers: bucket 2 reuses bucket 0's buffer and waits for its reader first
    assert events == ["pack 0", "pack 1", "pack 2", "read 0", "pack 3", "read 1", "read 2", "read 3"]


def test_each_transfer_starts_at_the_first_buffer_after_the_last_readers():
    """A model that fits one bucket goes through the same buffer every sync (a second buffer would pay its first
    touch again), numbered 0 within each transfer, and only once the previous transfer's reader is done."""
    events: list[str] = []
    with BucketRing.create("shm", 64, count=2) as ring:
        for sync in range(3):
            ring.restart()
            events.append(f"sync {sync}")
            meta = ring.pack([("w", torch.full((4,), float(sync)), None)])
            assert meta.index == 0 and meta.location == ring.locations[0]
            ring.reuse(meta.index, lambda s=sync: events.append(f"read {s}"))
            assert unpack(meta).__next__()[1].tolist() == [float(sync)] * 4
        ring.drain()
    assert events == ["sync 0", "read 0", "sync 1", "read 1", "sync 2", "read 2"]


def test_a_dead_senders_buffers_are_deleted_by_the_next_ring(tmp_path):
    import os
    import subprocess
    import sys

    from agentrl.weight_buckets import SHM_DIR, remove_orphaned_buffers

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = os.path.join(SHM_DIR, f"agentrl-weights-{int(dead.stdout)}-abcd1234-0")
    open(orphan, "wb").close()
    with BucketRing.create("shm", 1024) as ring:  # this process's own buffers stay
        assert not os.path.exists(orphan)
        assert all(os.path.exists(p) for p in ring.locations)
        assert remove_orphaned_buffers() == []
