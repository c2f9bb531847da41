"""Device tensors → host copies for publishing and checkpoints: bucketed, one transfer per bucket.

Copying a state dict tensor by tensor (`t.cpu()`) pays a synchronising, pageable transfer per tensor: hundreds of
small ones for a MoE model. Here the tensors of one dtype are packed into a flat device buffer of at most
`bucket_bytes`, copied at once into pinned host memory and split there: each result is a host tensor of its own
(safetensors refuses tensors that share storage), a memory copy on the host instead of a transfer. On CPU every
tensor is simply cloned.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

BUCKET_BYTES = 1 << 30  # extra device memory a bucket takes while it is packed


def to_host(tensors: Mapping[str, torch.Tensor], *, bucket_bytes: int = BUCKET_BYTES) -> dict[str, torch.Tensor]:
    """Host copies of `tensors` (same names, dtypes, shapes and values; contiguous), in the input's order."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: dict[str, torch.Tensor] = {}
    on_device: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, t in tensors.items():
        if t.device.type == "cpu":
            out[name] = t.detach().clone(memory_format=torch.contiguous_format)
        else:
            on_device.setdefault((t.device, t.dtype), []).append(name)
    for names in on_device.values():
        for bucket in _buckets(names, tensors, bucket_bytes):
            _copy_bucket(bucket, tensors, out)
    return {name: out[name] for name in tensors}


def _buckets(names: list[str], tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    buckets: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def _copy_bucket(names: list[str], tensors: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    parts = [tensors[n].detach().reshape(-1) for n in names]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    torch.cuda.current_stream(flat.device).synchronize()
    offset = 0
    for name in names:
        t = tensors[name]
        out[name] = host[offset:offset + t.numel()].view(t.shape).clone()
        offset += t.numel()
