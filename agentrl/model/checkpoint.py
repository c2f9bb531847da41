"""Checkpoints in the Hugging Face layout of Kimi Linear / Kimi K3, which vLLM's Kimi loader and transformers read.

The module tree already carries the checkpoint names (`self_attn.q_conv1d`, `block_sparse_moe.gate`, AttnRes's
`self_attention_res_proj`, ...). Two things differ between the training layout and the files:
- routed experts train as stacked tensors (w13 [E, 2I, M], w2 [E, M, I]) but are stored per expert as
  `experts.{e}.w1.weight` (gate), `w3.weight` (up) and `w2.weight` (down);
- KDA's `A_log` is stored as [1, 1, H, 1] (the shape of the released Kimi Linear checkpoints, which transformers
  loads as is and vLLM's loader flattens).
Files are safetensors shards with a `model.safetensors.index.json` when there is more than one, plus config.json.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_W13 = re.compile(r"(.*\.experts)\.w13_weight$")
_W2 = re.compile(r"(.*\.experts)\.w2_weight$")
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
SHARD_BYTES = 4 * 1024**3
INDEX_FILE = "model.safetensors.index.json"


def to_checkpoint_tensors(state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Training-layout tensors → (checkpoint name, tensor), in a deterministic order."""
    for name, tensor in state_dict.items():
        if m := _W13.match(name):
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                yield f"{m[1]}.{e}.w1.weight", gate[e]
                yield f"{m[1]}.{e}.w3.weight", up[e]
        elif m := _W2.match(name):
            for e in range(tensor.shape[0]):
                yield f"{m[1]}.{e}.w2.weight", tensor[e]
        elif name.endswith(".A_log"):
            yield name, tensor.view(1, 1, -1, 1)
        else:
            yield name, tensor


def from_checkpoint_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names → the training layout (inverse of `to_checkpoint_tensors`)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if m := _PER_EXPERT.match(name):
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = tensor
        elif name.endswith(".A_log"):
            out[name] = tensor.reshape(-1)
        else:
            out[name] = tensor
    for prefix, parts in experts.items():
        missing = {k for k in ("w1", "w2", "w3") if k not in parts}
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)} for {prefix}")
        num = len(parts["w1"])
        if any(sorted(parts[k]) != list(range(num)) for k in ("w1", "w2", "w3")):
            raise ValueError(f"checkpoint has an incomplete set of experts under {prefix}")
        w1 = torch.stack([parts["w1"][e] for e in range(num)])
        w3 = torch.stack([parts["w3"][e] for e in range(num)])
        out[f"{prefix}.w13_weight"] = torch.cat([w1, w3], dim=1)
        out[f"{prefix}.w2_weight"] = torch.stack([parts["w2"][e] for e in range(num)])
    return out


def save_checkpoint(model: torch.nn.Module, directory: str, *, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Writes config.json and safetensors shards; returns the shard file names."""
    return save_state_dict(model.state_dict(), model.config, directory, shard_bytes=shard_bytes)


def save_state_dict(state: dict[str, torch.Tensor], config, directory: str, *,
                    shard_bytes: int = SHARD_BYTES) -> list[str]:
    """`save_checkpoint` from a training-layout state dict (e.g. one gathered from ZeRO-3 shards) and its config."""
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in to_checkpoint_tensors(state):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname in os.listdir(directory):  # a re-save must not leave stale shards behind
        if fname.endswith(".safetensors") or fname == INDEX_FILE:
            os.remove(os.path.join(directory, fname))
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {name: fname for fname, shard in zip(names, shards) for name in shard}
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return names


def iter_checkpoint_tensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of a checkpoint directory, one shard in memory at a time."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or {INDEX_FILE} in {directory}")
    for fname in files:
        with safe_open(os.path.join(directory, fname), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)


def load_checkpoint_tensors(directory: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, by checkpoint name."""
    return dict(iter_checkpoint_tensors(directory))


def load_state_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Loads checkpoint-named tensors into a model strictly: every missing or unexpected name is an error."""
    state = from_checkpoint_tensors(tensors)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"checkpoint does not match the model: missing {result.missing_keys[:8]}, "
                         f"unexpected {result.unexpected_keys[:8]}")
