"""Checkpoints of an expert-parallel trainer in the non-EP layout, written shard by shard.

DeepSpeed's checkpoint keeps the optimizer state of every rank but the module state of rank 0 only, which under
expert parallelism holds only rank 0's experts. Beside it, `save_model_shards` writes `<tag>/model/` as a Kimi K3
Hugging Face checkpoint (checkpoint.py's layout, the one `HybridMoEForCausalLM.from_pretrained`, vLLM and a non-EP
trainer read), without gathering anything:
- rank 0 writes config.json and `model-dense.safetensors` (everything but the routed experts, buffers included);
- the first rank of each expert-data-parallel group (ranks 0..N−1) writes `model-experts-{r}-of-{N}.safetensors`
  with its experts under their global ids;
- rank 0 writes `model.safetensors.index.json` naming the file of every tensor.
`load_local_experts` reads back this rank's experts after DeepSpeed has loaded rank 0's module state into every rank.
"""

from __future__ import annotations

import json
import os
import re

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from agentrl.model.checkpoint import INDEX_FILE, from_checkpoint_tensors, to_checkpoint_tensors
from agentrl.model.expert_parallel import expert_parallel_layers, expert_parameter_names, renumber_local_experts

MODEL_DIR = "model"
DENSE_FILE = "model-dense.safetensors"


def _expert_file(ep_rank: int, ep_size: int) -> str:
    return f"model-experts-{ep_rank + 1:05d}-of-{ep_size:05d}.safetensors"


def save_model_shards(policy: nn.Module, config, directory: str, *, rank: int, ep_size: int) -> None:
    """Writes `directory` as described in the module docstring. Collective over all ranks."""
    os.makedirs(directory, exist_ok=True)
    sharded = expert_parameter_names(policy)
    names: list[tuple[str, str]] = []  # (tensor name, file)
    if rank < ep_size:  # the first expert-data-parallel replica of every expert shard
        layers = expert_parallel_layers(policy)
        first = next(iter(layers.values())).first_expert
        state = {k: v for k, v in policy.state_dict().items() if k in sharded}
        shard = renumber_local_experts(dict(to_checkpoint_tensors(state)), first)
        fname = _expert_file(rank, ep_size)
        save_file({k: v.detach().contiguous().cpu() for k, v in shard.items()}, os.path.join(directory, fname),
                  metadata={"format": "pt"})
        names += [(k, fname) for k in shard]
    if rank == 0:
        config.save_pretrained(directory)
        dense = {k: v for k, v in policy.state_dict().items() if k not in sharded}
        tensors = {k: v.detach().contiguous().cpu() for k, v in to_checkpoint_tensors(dense)}
        save_file(tensors, os.path.join(directory, DENSE_FILE), metadata={"format": "pt"})
        names += [(k, DENSE_FILE) for k in tensors]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    if rank == 0:
        weight_map = dict(sorted(pair for part in gathered for pair in part))
        total = sum(os.path.getsize(os.path.join(directory, f)) for f in set(weight_map.values()))
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    dist.barrier()


def saved_expert_parallel(checkpoint_dir: str) -> int:
    """The expert-parallel degree a trainer checkpoint (`<run>/checkpoints/<tag>`) was saved with (1: no shards)."""
    directory = os.path.join(checkpoint_dir, MODEL_DIR)
    if not os.path.isdir(directory):
        return 1
    found = (re.fullmatch(r"model-experts-\d+-of-(\d+)\.safetensors", f) for f in os.listdir(directory))
    degrees = {int(m[1]) for m in found if m}
    if len(degrees) != 1:
        raise ValueError(f"{directory} holds expert shards of several expert-parallel degrees: {sorted(degrees)}")
    return degrees.pop()


@torch.no_grad()
def load_local_experts(policy: nn.Module, directory: str) -> None:
    """Copies this rank's experts from a `save_model_shards` directory (or any checkpoint in that layout with an
    index) into the sharded parameters."""
    with open(os.path.join(directory, INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    for prefix, layer in expert_parallel_layers(policy).items():
        local = range(layer.first_expert, layer.first_expert + layer.num_local_experts)
        # global checkpoint name → the local name from_checkpoint_tensors stacks into this rank's [L, ...] tensors
        wanted = {f"{prefix}.{e}.{w}.weight": f"{prefix}.{e - layer.first_expert}.{w}.weight"
                  for e in local for w in ("w1", "w2", "w3")}
        tensors = {}
        for fname in sorted({weight_map[name] for name in wanted}):
            with safe_open(os.path.join(directory, fname), framework="pt") as shard:
                for name in wanted.keys() & set(shard.keys()):
                    tensors[wanted[name]] = shard.get_tensor(name)
        state = from_checkpoint_tensors(tensors)
        layer.w13_weight.copy_(state[f"{prefix}.w13_weight"])
        layer.w2_weight.copy_(state[f"{prefix}.w2_weight"])
