"""The worker-side routing recorder on scripted engine steps: recomputation after preemption, prefix-cache hits
read from the slot store, vLLM's internal request ids, and the cap on untaken records. (The engine tests in
test_serving.py check the same recorder against agentrl's routing end to end.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: E402

from agentrl.rollout.routing import RoutingRecorder, RoutingUnavailable  # noqa: E402
from agentrl.rollout.vllm_model import StepRouting  # noqa: E402

BLOCK = 4
LAYERS, TOP_K = 2, 2


class FakeRunner:
    """What the recorder reads from vLLM's V1 model runner: the model's last step, the batch and its block tables."""

    def __init__(self):
        self.model = SimpleNamespace(num_moe_layers=LAYERS, top_k=TOP_K, last_step=None)
        mamba = MambaSpec(shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32), block_size=BLOCK)
        attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
        self.kv_cache_config = SimpleNamespace(num_blocks=16, kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=mamba), SimpleNamespace(kv_cache_spec=attention)])
        self.tables = np.zeros((8, 16), dtype=np.int32)
        table = SimpleNamespace(block_size=BLOCK, block_table=SimpleNamespace(np=self.tables))
        self.input_batch = SimpleNamespace(req_ids=[], block_table=[None, table])
        self.steps = 0

    def get_model(self):
        return self.model

    def step(self, recorder, batch: list[tuple[str, list[int], list[int], np.ndarray]], finished=()):
        """batch: (request id, block ids, positions, experts [n, L, k]) per request, in batch order."""
        out = SimpleNamespace(finished_req_ids=set(finished), num_scheduled_tokens={})
        recorder.before_step(out)
        self.input_batch.req_ids = [rid for rid, *_ in batch]
        for row, (rid, blocks, positions, _) in enumerate(batch):
            self.tables[row, :len(blocks)] = blocks
            out.num_scheduled_tokens[rid] = len(positions)
        self.steps += 1
        self.model.last_step = StepRouting(
            index=self.steps, experts_TLK=torch.from_numpy(np.concatenate([e for *_, e in batch])),
            positions_T=torch.tensor([p for _, _, positions, _ in batch for p in positions]))
        recorder.after_step(out)


def experts(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, (n, LAYERS, TOP_K)).astype(np.int64)


def test_recomputation_prefix_hits_and_request_ids():
    runner = FakeRunner()
    recorder = RoutingRecorder(runner)
    a_prompt, b_prompt = experts(6, 1), experts(3, 2)
    runner.step(recorder, [("a-1111", [3, 5], list(range(6)), a_prompt), ("b-2222", [7], [0, 1, 2], b_prompt)])
    a_decode = experts(1, 3)
    runner.step(recorder, [("a-1111", [3, 5], [6], a_decode)])
    # b was preempted and runs again from the start (e.g. after an in-flight weight update)
    b_again = experts(4, 4)
    runner.step(recorder, [("b-2222", [9], [0, 1, 2, 3], b_again)])
    # c shares a's first block (a prefix-cache hit on block 3): it starts at position 4
    c_rest = experts(2, 5)
    runner.step(recorder, [("c-3333", [3, 11], [4, 5], c_rest)])
    got = recorder.take(["a", "b", "c-3333"])  # external ids or vLLM's internal ones
    np.testing.assert_array_equal(got["a"], np.concatenate([a_prompt, a_decode]))
    np.testing.assert_array_equal(got["b"], b_again)
    np.testing.assert_array_equal(got["c-3333"], np.concatenate([a_prompt[:4], c_rest]))
    assert all(rows.dtype == np.int16 for rows in got.values())
    with pytest.raises(RoutingUnavailable, match="already taken"):
        recorder.take(["a"])


def test_untaken_finished_records_are_capped_oldest_first():
    runner = FakeRunner()
    rows_bytes = 4 * LAYERS * TOP_K * 2  # four int16 rows
    recorder = RoutingRecorder(runner, max_finished_bytes=2 * rows_bytes)
    for i, rid in enumerate(("x-1", "y-1", "z-1")):
        runner.step(recorder, [(rid, [i + 1], [0, 1, 2, 3], experts(4, 10 + i))])
    for i, rid in enumerate(("x-1", "y-1", "z-1")):  # they finish one step after another, x first
        runner.step(recorder, [("w-1", [6], [i], experts(1, 20 + i))], finished=(rid,))
    with pytest.raises(RoutingUnavailable, match="capped"):
        recorder.take(["x"])
    assert set(recorder.take(["y", "z", "w"])) == {"y", "z", "w"}
    assert recorder.finished_bytes == 0
