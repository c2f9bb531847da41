"""Routing capture in the vLLM worker: the experts chosen for every token of every request, for routing replay.

Legend: T = tokens of one engine step, L = MoE layers, k = experts per token, S = KV-cache slots (blocks × block size).

What a caller gets: for a finished request, an int16 array [n, L, k] in agentrl's `routed_experts` layout
(`HybridMoEForCausalLM(ids).routed_experts`), row i for position i of prompt + generated tokens, with
n = prompt tokens + generated tokens − 1: the last sampled token never went through the model, so it has no routing
(vLLM's own routed-experts output has the same length). Through the engine: `engine.take_routed_experts(llm, ids)`.

vLLM 0.32 has built-in capture (`enable_return_routed_experts`), but only in its V2 model runner, which needs Triton:
on CPU the V1 runner runs and the built-in path refuses to start. So the worker extension wraps the V1 runner's
`execute_model`: after each forward, the model's `last_step` (experts and positions of the step's tokens, in the
runner's batch order) is split by request and appended to that request's record.

Prefix-cache hits: tokens served from the cache are not recomputed, so their routing is not in the step. Every
step's rows are therefore also written to a slot store indexed like the KV cache of the MLA layers (block id ×
block size + offset, through the request's block table); a request that starts at position p > 0 reads positions
[0, p) from its cached blocks there. A block's slots are rewritten whenever its KV is, and vLLM hits only blocks
whose KV is valid under the current weights (weight updates reset the prefix cache), so the stored rows are the
routing of those very tokens. A model without MLA layers has no token-indexed blocks; there, requests that hit the
prefix cache report missing rows as an error rather than guessing.

Memory: the slot store holds S·L·k int16 (a KV capacity of 1M tokens with 60 MoE layers of top-16: 1.9 GB of host
memory); records of finished requests are kept until taken, up to `max_finished_bytes` in all (oldest dropped first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


class RoutingUnavailable(RuntimeError):
    """Routing was asked for a request the worker has no (complete) record of."""


@dataclass(kw_only=True, slots=True)
class _Record:
    chunks: list[np.ndarray] = field(default_factory=list)  # consecutive rows [n_i, L, k] from position 0
    end: int = 0  # positions [0, end) are recorded
    gap: bool = False  # a prefix-cache hit could not be filled

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)

    def truncate(self, position: int) -> None:
        """Drops rows at and after `position` (a recomputation after preemption rewrites them)."""
        rows = np.concatenate(self.chunks)[:position] if self.chunks else None
        self.chunks = [rows] if rows is not None and len(rows) else []
        self.end = position


class RoutingRecorder:
    """Per-request routing of one vLLM V1 model runner whose model exposes `last_step` (see vllm_model.py)."""

    def __init__(self, runner, *, max_finished_bytes: int = 1 << 30):
        model = runner.get_model()
        self.runner = runner
        self.model = model
        self.shape = (model.num_moe_layers, model.top_k)
        self.max_finished_bytes = max_finished_bytes
        self.records: dict[str, _Record] = {}
        self.finished: OrderedDict[str, int] = OrderedDict()  # finished request id -> its record's bytes
        self.finished_bytes = 0
        self._last_index = model.last_step.index if model.last_step is not None else 0
        self.group, block_size, num_slots = self._attention_group(runner)
        self.block_size = block_size
        self.slots_SLK = np.zeros((num_slots, *self.shape), dtype=np.int16) if num_slots else None

    @staticmethod
    def _attention_group(runner) -> tuple[int | None, int, int]:
        """(KV-cache group of the MLA layers, its block-table block size, slot count); (None, 0, 0) without one."""
        from vllm.v1.kv_cache_interface import AttentionSpec

        config = runner.kv_cache_config
        for group_id, group in enumerate(config.kv_cache_groups):
            if isinstance(group.kv_cache_spec, AttentionSpec):
                block_size = runner.input_batch.block_table[group_id].block_size
                return group_id, block_size, config.num_blocks * group.kv_cache_spec.block_size
        return None, 0, 0

    # --- called around the runner's execute_model --------------------------------------------------------------
    def before_step(self, scheduler_output) -> None:
        for request_id in scheduler_output.finished_req_ids:
            if request_id in self.records and request_id not in self.finished:
                self.finished[request_id] = self.records[request_id].nbytes
                self.finished_bytes += self.finished[request_id]
        while self.finished_bytes > self.max_finished_bytes:
            dropped, nbytes = self.finished.popitem(last=False)
            self.finished_bytes -= nbytes
            self.records.pop(dropped, None)

    def after_step(self, scheduler_output) -> None:
        step = self.model.last_step
        if step is None or step.index == self._last_index:
            return  # no forward in this step
        self._last_index = step.index
        batch = self.runner.input_batch
        spans = []  # (request id, batch row, first token row, token count)
        start = 0
        for row, request_id in enumerate(batch.req_ids):
            count = scheduler_output.num_scheduled_tokens.get(request_id, 0)
            if count:
                spans.append((request_id, row, start, count))
                start += count
        experts_TLK = step.experts_TLK[:start].to("cpu").numpy().astype(np.int16)
        positions_T = step.positions_T[:start].to("cpu").numpy()
        table = batch.block_table[self.group].block_table.np if self.group is not None else None
        if table is not None:  # publish the whole step first: a request may hit blocks computed in this very step
            for _, row, first, count in spans:
                pos = positions_T[first:first + count]
                self.slots_SLK[self._slot_ids(table[row], pos)] = experts_TLK[first:first + count]
        for request_id, row, first, count in spans:
            record = self.records.setdefault(request_id, _Record())
            position = int(positions_T[first])
            if position < record.end:
                record.truncate(position)
            elif position > record.end:
                if table is None:
                    record.gap = True
                else:
                    cached = np.arange(record.end, position)
                    record.chunks.append(self.slots_SLK[self._slot_ids(table[row], cached)])
            record.chunks.append(experts_TLK[first:first + count])
            record.end = position + count

    def _slot_ids(self, block_row: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return block_row[positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size

    # --- read out ------------------------------------------------------------------------------------------------
    def take(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """Routing of the given requests ([n, L, k] int16 each), removed from the worker.

        Ids are those the caller gave vLLM (`RequestOutput.request_id`); vLLM's internal ids add a random suffix.
        Raises RoutingUnavailable for an id with no record or a record with a gap.
        """
        by_external: dict[str, str] = {}
        for internal in self.records:
            by_external.setdefault(internal.rsplit("-", 1)[0], internal)
            by_external.setdefault(internal, internal)
        out: dict[str, np.ndarray] = {}
        for request_id in request_ids:
            internal = by_external.get(request_id)
            if internal is None:
                raise RoutingUnavailable(f"no routing recorded for request {request_id!r} (never run, already taken, "
                                         f"or dropped: untaken records are capped at {self.max_finished_bytes} bytes)")
            record = self.records.pop(internal)
            self.finished_bytes -= self.finished.pop(internal, 0)
            if record.gap:
                raise RoutingUnavailable(f"request {request_id!r} hit the prefix cache in a model without MLA layers; "
                                         "its cached tokens' routing is unknown")
            rows = np.concatenate(record.chunks) if record.chunks else np.zeros((0, *self.shape), np.int16)
            out[request_id] = rows
        return out
