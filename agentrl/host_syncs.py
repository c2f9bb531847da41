"""Where the host waits for the GPU, by the code that asked.

A host sync (`.item()`, `.tolist()`, a blocking copy between host and GPU, `nonzero`, `repeat_interleave` without
an output size, ...) holds the host until the GPU has run everything queued before it. A step whose kernels take
less time than the host needs to launch them (a short micro-batch) then loses whatever lead the host had built.
torch's sync debug mode warns at each such op; `sync_sites` runs a function under it and attributes every warning
to the innermost caller outside torch, and to the innermost frame of agentrl's own tree that led there.
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

# agentrl's own tree: the package and the checkout it lives in (trainer/, rollout/, envs/ join the package there)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_PREFIXES = ("agentrl/", "trainer/", "rollout/", "envs/")


@dataclass(frozen=True)
class SyncSite:
    caller: str  # "path:line function" of the innermost frame outside torch ("(no Python caller)" if none)
    via: str  # the innermost frame of agentrl's tree on the way there; "" when the caller is one itself

    @property
    def ours(self) -> bool:
        """Whether agentrl's own code made the synchronising call."""
        return self.caller.startswith(_OWN_PREFIXES)


def source_path(filename: str) -> str:
    """A source file's path as imported: relative to the checkout for agentrl's files, to the sys.path entry it was
    found under for a library's (fla/ops/..., deepspeed/runtime/..., torch/...)."""
    path = os.path.abspath(filename)
    for base in sorted({_ROOT, *(os.path.abspath(p) for p in sys.path if p)}, key=len, reverse=True):
        if path.startswith(base + os.sep):
            return os.path.relpath(path, base).replace(os.sep, "/")
    return os.path.basename(path)


def sync_sites(fn: Callable[[], object]) -> collections.Counter[SyncSite]:
    """How often each caller made the host wait for the GPU during one call of `fn` (CUDA's current device).

    Autograd's engine replays the warnings of its C++ backward ops at the `backward()` call, so those count there;
    the backward of a Python autograd Function (fla's, agentrl's kernels) keeps its own stack."""
    sites: collections.Counter[SyncSite] = collections.Counter()

    def where(frame: traceback.FrameSummary) -> str:
        return f"{source_path(frame.filename)}:{frame.lineno} {frame.name}"

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        outside = [f for f in frames if not source_path(f.filename).startswith("torch/")]
        ours = [f for f in outside if source_path(f.filename).startswith(_OWN_PREFIXES)]
        caller = where(outside[-1]) if outside else "(no Python caller)"
        via = where(ours[-1]) if ours and ours[-1] is not outside[-1] else ""
        sites[SyncSite(caller, via)] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")  # which itself warns once, before anything is measured
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites
