"""Checkpoints in the Hugging Face layout of Kimi Linear / Kimi K3, which vLLM's Kimi loader and transformers read.

The module tree already carries the checkpoint names (`self_attn.q_conv1d`, `block_sparse_moe.gate`, AttnRes's
`self_attention_res_proj`, ...). Two things differ between the training layout and the files:
- routed experts train as stacked tensors (w13 [E, 2I, M], w2 [E, M, I]) but are stored per expert as
  `experts.{e}.w1.weight` (gate), `w3.weight` (up) and `w2.weight` (down);
- KDA's `A_log` is stored as [1, 1, H, 1] (the shape of the released Kimi Linear checkpoints, which transformers
  loads as is and vLLM's loader flattens).
Files are safetensors shards with a `model.safetensors.index.json` when there is more than one, plus config.json.
Released checkpoints in other layouts (Kimi K3's multimodal directory, MXFP4 experts) are read through released.py.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agentrl.model import released

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
    return write_checkpoint(to_checkpoint_tensors(state), config, directory, shard_bytes=shard_bytes)


def write_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]], config, directory: str, *,
                     shard_bytes: int = SHARD_BYTES) -> list[str]:
    """config.json and safetensors shards of ≤ `shard_bytes` from checkpoint-named tensors, each shard written as it
    fills (so a converted checkpoint never sits in memory whole); returns the shard file names."""
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    for fname in os.listdir(directory):  # a re-save must not leave stale shards behind
        if fname.endswith(".safetensors") or fname == INDEX_FILE:
            os.remove(os.path.join(directory, fname))
    written: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = os.path.join(directory, f".shard-{len(written):05d}.tmp")
        save_file(shard, path, metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = tensor.detach().contiguous().cpu()
        size += nbytes
        total += nbytes
    if shard or not written:
        flush()
    names = (["model.safetensors"] if len(written) == 1 else
             [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))])
    for (path, _), fname in zip(written, names):
        os.replace(path, os.path.join(directory, fname))
    if len(written) > 1:
        weight_map = {tensor: fname for (_, tensors), fname in zip(written, names) for tensor in tensors}
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return names


def iter_checkpoint_tensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of a checkpoint directory, one shard in memory at a time, in agentrl's names: a Kimi
    K3 directory's language-model tensors and dequantized MXFP4 experts (released.py)."""
    config = _config_dict(directory)
    if config is not None and (released.is_k3_config(config) or config.get("quantization_config")):
        flat = released.flatten_config(config) if released.is_k3_config(config) else config
        released.check_quantization(config.get("quantization_config"))
        return released.normalize_names(_iter_files(directory), int(flat["num_hidden_layers"]))
    return _iter_files(directory)


def _config_dict(directory: str) -> dict | None:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _iter_files(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
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
    """Loads checkpoint-named tensors into a model strictly: any missing, unexpected or misshapen tensor is a
    ValueError naming them (all of them, up to 20 per kind), before anything is copied."""
    state = from_checkpoint_tensors(tensors)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = sorted(f"{n} {tuple(state[n].shape)} (model: {tuple(expected[n].shape)})"
                       for n in set(state) & set(expected) if state[n].shape != expected[n].shape)
    if missing or unexpected or misshapen:
        raise ValueError("checkpoint does not match the model built from its config: "
                         + "; ".join(f"{len(names)} {kind}: {', '.join(names[:20])}"
                                     for kind, names in (("missing", missing), ("unexpected", unexpected),
                                                         ("of another shape", misshapen)) if names))
    model.load_state_dict(state, strict=True)
