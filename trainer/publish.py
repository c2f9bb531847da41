"""Versioned weights for the rollout engines: `<run_dir>/weights/v{N}` in the model's checkpoint layout.

The contract with the serving side is the directory: `v{N}/` holds config.json and safetensors in the Kimi K3
layout (`HybridMoEForCausalLM.save_pretrained` format, which vLLM's Kimi loader and agentrl's plugin read) plus
`checksums.json` (sha256 of each stored tensor's bytes, with dtype and shape) and `version.json`. A version appears
atomically: it is written under a temporary name in the same directory and renamed; `weights/LATEST` (the name of
the newest version) is replaced atomically after the rename. Old versions beyond `keep_last` are deleted, oldest
first (an engine still loading one of them has `keep_last − 1` publishes of grace); versions above the one just
written (left by a run that resumed from an earlier checkpoint) are deleted, so LATEST always names a kept version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from agentrl.chat.tokenizers import copy_tokenizer_files
from agentrl.model.checkpoint import load_checkpoint_tensors, save_state_dict, to_checkpoint_tensors

WEIGHTS_DIR = "weights"
LATEST_FILE = "LATEST"
CHECKSUMS_FILE = "checksums.json"
VERSION_FILE = "version.json"


@dataclass(kw_only=True, slots=True)
class PublishedWeights:
    """One published version: where it is, what it holds, and what publishing cost."""

    version: int
    path: str
    checksums: dict[str, str]  # checkpoint tensor name → sha256
    num_bytes: int
    gather_s: float  # collecting the full state dict (ZeRO-3: all-gathers)
    write_s: float  # writing, fsync and rename


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes of a tensor."""
    t = tensor.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def checkpoint_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Checksums by checkpoint name of (name, tensor) pairs."""
    return {name: tensor_checksum(t) for name, t in named_tensors}


def state_dict_checksums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Checksums of a training-layout state dict, under the names its checkpoint stores."""
    return checkpoint_checksums(to_checkpoint_tensors(state))


def directory_checksums(path: str) -> dict[str, str]:
    """Checksums of the tensors stored in a weights directory (read back from disk)."""
    return checkpoint_checksums(load_checkpoint_tensors(path).items())


def write_weights(state: dict[str, torch.Tensor], config, run_dir: str, version: int, *, keep_last: int = 3,
                  gather_s: float = 0.0, tokenizer_dir: str | None = None) -> PublishedWeights:
    """Writes `state` (training layout) as `<run_dir>/weights/v{version}` atomically; returns what was written.

    With `tokenizer_dir`, every file it holds besides weights and config (the tokenizer, its code, chat templates,
    generation_config.json: agentrl.chat.tokenizers.tokenizer_files) is copied beside the weights: every published
    version is then a complete checkpoint (`agentrl eval --checkpoint`, `model.checkpoint`, vLLM load it without the
    run's policy dir) that tokenizes as its source did.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    start = time.perf_counter()
    root = os.path.join(run_dir, WEIGHTS_DIR)
    os.makedirs(root, exist_ok=True)
    final = weights_dir(run_dir, version)
    tmp = tempfile.mkdtemp(dir=root, prefix=f".tmp-v{version}-")
    try:
        save_state_dict(state, config, tmp)
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, tmp)
        checksums = state_dict_checksums(state)
        num_bytes = sum(t.numel() * t.element_size() for t in state.values())
        with open(os.path.join(tmp, CHECKSUMS_FILE), "w") as f:
            json.dump(checksums, f, indent=0, sort_keys=True)
        with open(os.path.join(tmp, VERSION_FILE), "w") as f:
            json.dump({"version": version, "num_bytes": num_bytes, "time": time.time()}, f)
        _fsync_tree(tmp)
        if os.path.exists(final):  # re-publishing a version (e.g. after resuming from a checkpoint)
            stale = tempfile.mkdtemp(dir=root, prefix=f".old-v{version}-")
            os.replace(final, os.path.join(stale, "v"))
            os.replace(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, version, keep_last)
    _write_atomic(os.path.join(root, LATEST_FILE), f"v{version}\n")
    return PublishedWeights(version=version, path=final, checksums=checksums, num_bytes=num_bytes,
                            gather_s=gather_s, write_s=time.perf_counter() - start)


def weights_dir(run_dir: str, version: int) -> str:
    """Where `write_weights` puts `version`."""
    return os.path.join(run_dir, WEIGHTS_DIR, f"v{version}")


def latest_weights(run_dir: str) -> tuple[int, str] | None:
    """(version, path) of the newest published weights, or None before the first publish."""
    path = os.path.join(run_dir, WEIGHTS_DIR, LATEST_FILE)
    if not os.path.exists(path):
        return None
    version = int(open(path).read().strip()[1:])  # "v{N}"
    return version, weights_dir(run_dir, version)


def _versions(root: str) -> list[int]:
    return sorted(int(n[1:]) for n in os.listdir(root) if n.startswith("v") and n[1:].isdigit())


def _prune(root: str, version: int, keep_last: int) -> None:
    """Keeps `version` and the `keep_last` − 1 versions below it. Versions above it are a future that did not happen
    (a run resumed from an earlier checkpoint publishes a lower version again) and go first; pruning by number alone
    would delete the version just written and leave LATEST naming it."""
    versions = _versions(root)
    stale = [v for v in versions if v > version]
    older = [v for v in versions if v <= version][:-keep_last]
    for v in stale + older:
        shutil.rmtree(os.path.join(root, f"v{v}"), ignore_errors=True)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())
