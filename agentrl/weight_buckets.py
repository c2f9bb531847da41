"""Weight buckets: tensors handed from a trainer process to an inference engine's process in memory, bucket by bucket.

    ring = BucketRing.create("shm", capacity=1 << 30)          # sender: two shared buffers, used in turn
    for part in split_into_buckets(named_tensors, ring.capacity, dtype=torch.float32):
        meta = ring.pack(part)                                # copies (and casts) the tensors into the next buffer
        ...send meta.to_dict() to the engine; it calls...
    for name, view in unpack(BucketMeta.from_dict(d)): ...    # receiver: views into the same memory, no copy
    ring.close()

A bucket is one contiguous byte buffer that both processes see: a file in /dev/shm mapped by both on CPU ("shm", the
same node only), or a CUDA tensor opened through a CUDA IPC handle on GPU ("cuda_ipc", the same device). Only its
`BucketMeta` — where the buffer is, and each tensor's name, dtype, shape, byte offset and rows — travels through the
control channel (Ray calls, vLLM's RPCs), so nothing large is pickled. Two buffers alternate: the sender fills one
while the engine reads the other, and waits for a buffer's reader before filling it again (`BucketRing.reuse`).

A tensor larger than a bucket travels in row ranges (`Part.rows`) over several buckets; the receiver writes each
range into its rows, so neither side ever holds more than a bucket of it. Memory is bounded by 2 x `capacity` plus
what the caller holds to produce the tensors.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

KINDS = ("shm", "cuda_ipc")
ALIGN = 64  # bytes: every tensor starts on a cache line, so its view can be read (and vectorised) as is
SHM_DIR = "/dev/shm"


@dataclass(kw_only=True, slots=True)
class Part:
    """One tensor, or rows [rows[0], rows[1]) of one, in a bucket."""

    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: list[int]  # of this part (rows first)
    offset: int  # bytes from the buffer's start
    rows: list[int] | None = None  # [start, stop) of the full tensor's first dim; None: the whole tensor
    full_rows: int | None = None  # the full tensor's first dim, when `rows` is set
    source: Any = None  # cuda_ipc by reference: torch's rebuild arguments of the sender's own tensor (no copy made)


@dataclass(kw_only=True, slots=True)
class BucketMeta:
    """Where a bucket is and what it holds: what the control channel carries."""

    kind: str
    location: Any  # shm: the file path; cuda_ipc: torch's rebuild arguments for the buffer
    nbytes: int
    index: int  # bucket number within the transfer
    parts: list[Part] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BucketMeta:
        return cls(kind=d["kind"], location=d["location"], nbytes=d["nbytes"], index=d["index"],
                   parts=[Part(**p) for p in d["parts"]])


def split_into_buckets(named: Iterable[tuple[str, torch.Tensor]], capacity: int, *,
                       dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor, tuple | None]]]:
    """Groups (name, tensor) into lists that fit `capacity` bytes each (in `dtype`, the tensors' own if None),
    yielding each list as soon as it is full. A tensor that does not fit an empty bucket is cut into row ranges:
    entries are (name, tensor or rows of it, (start, stop, full rows) or None)."""
    if capacity < ALIGN:
        raise ValueError(f"bucket capacity must be at least {ALIGN} bytes, got {capacity}")
    bucket: list[tuple[str, torch.Tensor, tuple | None]] = []
    used = 0  # bytes taken, each part starting at an aligned offset (as BucketRing.pack lays them out)
    for name, tensor in named:
        itemsize = (dtype or tensor.dtype).itemsize
        nbytes = tensor.numel() * itemsize
        if nbytes <= capacity:
            if used + nbytes > capacity:
                yield bucket
                bucket, used = [], 0
            bucket.append((name, tensor, None))
            used = _aligned(used + nbytes)
            continue
        row_bytes = tensor[0].numel() * itemsize if tensor.dim() else nbytes
        if row_bytes > capacity:
            raise ValueError(f"{name}: one row of {tuple(tensor.shape)} does not fit a bucket of {capacity} bytes; "
                             "raise the bucket size")
        start = 0
        while start < tensor.shape[0]:
            room = (capacity - used) // row_bytes if used < capacity else 0
            if room == 0:
                yield bucket
                bucket, used = [], 0
                continue
            stop = min(tensor.shape[0], start + room)
            bucket.append((name, tensor[start:stop], (start, stop, tensor.shape[0])))
            used = _aligned(used + (stop - start) * row_bytes)
            start = stop
    if bucket:
        yield bucket


class BucketRing:
    """The sender's buffers: `pack` fills them in turn; `reuse(i, wait)` registers how to wait for the reader of
    buffer i before it is filled again."""

    def __init__(self, kind: str, buffers: list[torch.Tensor], locations: list[Any], paths: list[str]):
        self.kind, self.buffers, self.locations, self._paths = kind, buffers, locations, paths
        self.capacity = buffers[0].numel()
        self._count = 0
        self._pending: list[Callable[[], None] | None] = [None] * len(buffers)

    @classmethod
    def create(cls, kind: str, capacity: int, *, count: int = 2, device: torch.device | None = None) -> BucketRing:
        if kind not in KINDS:
            raise ValueError(f"weight bucket kind {kind!r} is not one of {KINDS}")
        buffers, locations, paths = [], [], []
        if kind == "shm":
            remove_orphaned_buffers()
        for i in range(count):
            if kind == "shm":
                path = os.path.join(SHM_DIR, f"agentrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}")
                with open(path, "wb") as f:
                    f.truncate(capacity)
                buffers.append(torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8))
                locations.append(path)
                paths.append(path)
            else:
                from torch.multiprocessing.reductions import reduce_tensor

                buf = torch.empty(capacity, dtype=torch.uint8, device=device or torch.device("cuda"))
                buffers.append(buf)
                locations.append(reduce_tensor(buf)[1])
        return cls(kind, buffers, locations, paths)

    def pack(self, entries: list[tuple[str, torch.Tensor, tuple | None]], *, dtype: torch.dtype | None = None,
             by_reference: bool = False) -> BucketMeta:
        """Copies `entries` (one `split_into_buckets` list) into the next buffer, waiting for its last reader.

        `by_reference` (cuda_ipc): a contiguous CUDA tensor already in `dtype` is not copied — the receiver opens the
        sender's own memory — so the caller must keep it alive and unchanged until that reader is done (`reuse`);
        a copy costs as much HBM traffic as the receiver's read, so this halves what a sync moves."""
        i = self._count % len(self.buffers)
        if self._pending[i] is not None:
            self._pending[i]()
            self._pending[i] = None
        buf, used, end, parts, views, sources = self.buffers[i], 0, 0, [], [], []
        for name, tensor, rows in entries:
            target_dtype = dtype or tensor.dtype
            if (by_reference and self.kind == "cuda_ipc" and tensor.is_cuda and tensor.is_contiguous()
                    and tensor.dtype == target_dtype):
                from torch.multiprocessing.reductions import reduce_tensor

                parts.append(Part(name=name, dtype=str(target_dtype).removeprefix("torch."),
                                  shape=list(tensor.shape), offset=0, rows=[rows[0], rows[1]] if rows else None,
                                  full_rows=rows[2] if rows else None, source=reduce_tensor(tensor.detach())[1]))
                continue
            nbytes = tensor.numel() * target_dtype.itemsize
            if used + nbytes > self.capacity:
                raise ValueError(f"bucket overflow at {name}: {used + nbytes} > {self.capacity} bytes")
            views.append(buf[used:used + nbytes].view(target_dtype).view(tensor.shape))
            sources.append(tensor.detach())
            parts.append(Part(name=name, dtype=str(target_dtype).removeprefix("torch."), shape=list(tensor.shape),
                              offset=used, rows=[rows[0], rows[1]] if rows else None,
                              full_rows=rows[2] if rows else None))
            end = used + nbytes
            used = _aligned(end)
        if views:
            torch._foreach_copy_(views, sources)  # on CUDA: a few fused launches instead of one per tensor
        if self.kind == "cuda_ipc":
            torch.cuda.current_stream(buf.device).synchronize()  # the reader is another process: copies must land
        meta = BucketMeta(kind=self.kind, location=self.locations[i], nbytes=end, index=self._count, parts=parts)
        self._count += 1
        return meta

    def restart(self) -> None:
        """Starts a new transfer: waits for every reader, then numbers buckets from 0 and fills buffer 0 first again.
        A transfer of one bucket then reuses the same buffer every time; a fresh /dev/shm buffer's first fill pays
        for its pages (~0.5 s for 300 MB here), so alternating buffers across transfers paid that twice."""
        self.drain()
        self._count = 0

    def reuse(self, index: int, wait: Callable[[], None]) -> None:
        """Buffer of bucket `index` may be refilled once `wait()` returns (its reader is done)."""
        self._pending[index % len(self.buffers)] = wait

    def drain(self) -> None:
        """Waits for every reader."""
        for i, wait in enumerate(self._pending):
            if wait is not None:
                wait()
                self._pending[i] = None

    def close(self) -> None:
        self.buffers.clear()
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> BucketRing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remove_orphaned_buffers() -> list[str]:
    """Deletes the /dev/shm buffers of senders that died without closing their ring (a killed trainer rank): the
    memory of a file in /dev/shm is only freed when it is deleted. Returns the paths removed."""
    removed = []
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        parts = name.split("-")
        if len(parts) >= 3 and name.startswith("agentrl-weights-") and parts[2].isdigit() and \
                not _alive(int(parts[2])):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_mapped: dict[str, torch.Tensor] = {}  # receiver: buffers opened once (a transfer reuses its two buffers)


def unpack(meta: BucketMeta) -> Iterator[tuple[Part, torch.Tensor]]:
    """The receiver's views of a bucket's parts, in the sender's memory (no copy)."""
    if meta.kind == "shm":
        buf = _mapped.get(meta.location)
        if buf is None:
            buf = torch.from_file(meta.location, shared=True, size=os.path.getsize(meta.location), dtype=torch.uint8)
            _mapped[meta.location] = buf
    elif meta.kind == "cuda_ipc":
        buf = _opened_ipc(meta.location)
    else:
        raise ValueError(f"unknown weight bucket kind {meta.kind!r}")
    for part in meta.parts:
        if part.source is not None:  # the sender's own tensor
            yield part, _opened_ipc(part.source)
            continue
        dtype = getattr(torch, part.dtype)
        nbytes = dtype.itemsize
        for n in part.shape:
            nbytes *= n
        yield part, buf[part.offset:part.offset + nbytes].view(dtype).view(part.shape)


def _opened_ipc(location: tuple) -> torch.Tensor:
    """The sender's CUDA buffer, opened once per process (opening an IPC handle costs milliseconds)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    key = repr(location)
    buf = _mapped.get(key)
    if buf is None:
        buf = _mapped[key] = rebuild_cuda_tensor(*location)
    return buf


def forget_mapped(path: str | None = None) -> None:
    """Forgets the buffers this process opened (all, or `path`'s), so that deleted files and freed CUDA buffers go."""
    for key in [path] if path else list(_mapped):
        _mapped.pop(key, None)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
