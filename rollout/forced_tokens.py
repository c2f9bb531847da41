"""Forced generation: a request that names its tokens gets exactly those from the engine, one decode step each.

    SamplingParams(max_tokens=len(ids), extra_args={FORCED_TOKENS: ids}, ...)

The engine still runs every step of the request — the prefill of its prompt from the prefix cache, the decode of each
forced token over the whole context, the KDA state updates, the routing capture — only the sampler's choice is
replaced: every other token's logit is −inf at each step. That drives a known episode (an oracle's turns, a recorded
trajectory) through the real serving stack, e.g. to measure what an episode of a million tokens costs the engine
before a policy can write one (scripts/bench_long_episodes.py). The log-probabilities returned for forced tokens
are those of the masked distribution (0), not the model's.

`engine_kwargs` installs the processor in every agentrl engine; a request without `extra_args[FORCED_TOKENS]` is
left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCED_TOKENS = "agentrl_forced_tokens"  # the SamplingParams.extra_args key


class ForcedTokens(AdapterLogitsProcessor):
    """vLLM logits processor: the i-th generated token of a request is `extra_args[FORCED_TOKENS][i]`."""

    def is_argmax_invariant(self) -> bool:
        return False  # it decides greedy requests too

    def new_req_logits_processor(self, params) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        forced = (params.extra_args or {}).get(FORCED_TOKENS)
        if not forced:
            return None
        return _Force(list(forced))


class _Force:
    def __init__(self, ids: Sequence[int]):
        self.ids = ids

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        i = len(output_ids)
        if i >= len(self.ids):  # past the forced tokens: max_tokens should have stopped it
            return logits
        out = torch.full_like(logits, float("-inf"))
        out[self.ids[i]] = 0.0
        return out
