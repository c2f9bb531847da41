"""The model's forward and backward in a form a CUDA graph can capture: no host reads, launches sized by shapes only.

A captured graph replays the kernels it recorded with the grids recorded, whatever the offsets hold at replay. So
inside `static_shapes()` nothing the host would derive from the offsets' values may size a launch or pick a path:

- `cu_seqlens` has a fixed number of entries and ends with at least one zero-length sequence
  (`cuda_graphs.pad_micro_batch` makes it so);
- fla's KDA runs in its graph mode (`use_graph`: its chunk list is built on the GPU with a fixed row count);
- fla's short convolution gets a chunk list of fixed length from `conv_chunk_indices`;
- the balancers recompute their histogram's range from the bias in every forward instead of caching it (a replay
  cannot refresh a cache; balancing.py).

Outside the context the model runs as before: these paths cost a few more kernels, which the host-bound eager step
does not need.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("agentrl_static_shapes", default=False)


def active() -> bool:
    """Whether the model is running for capture (or for the eager warm-up of a capture)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def static_shapes() -> Iterator[None]:
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def conv_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int, num_tokens: int) -> torch.Tensor:
    """(sequence, chunk within it) of every `chunk_size`-token chunk of the packed sequences, [R, 2] int64 with
    R = ⌈num_tokens / chunk_size⌉ + N − 1 rows (N sequences: the most chunks they can have), built on the device.

    fla's short-convolution kernels take this list in place of the one they build with a host read; they have no
    sentinel rows, so the rows past the real chunks name the last sequence, which must be empty: its chunk masks
    every load and store (the forward writes nothing, the backward a zero weight gradient for that row).
    """
    num_seqs = cu_seqlens.numel() - 1
    rows = -(-num_tokens // chunk_size) + num_seqs - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    first_chunk = torch.nn.functional.pad(torch.cumsum((lengths + chunk_size - 1) // chunk_size, 0), (1, 0))
    slots = torch.arange(rows, device=cu_seqlens.device, dtype=first_chunk.dtype)
    # right=True: the last sequence whose first chunk is at or before the slot, which skips empty sequences
    seq = torch.searchsorted(first_chunk, slots, right=True) - 1
    real = slots < first_chunk[-1]
    seq = torch.where(real, seq, num_seqs - 1)
    chunk = torch.where(real, slots - first_chunk[seq], 0)
    return torch.stack([seq, chunk], dim=1).to(torch.long)
