"""Feeds a checkpoint directory to upstream vLLM's Kimi K3 weight loader and reports missing/unexpected tensors.

    python scripts/check_vllm_loader.py CHECKPOINT_DIR

Builds vLLM's own `KimiLinearForCausalLM` (vllm/models/kimi_k3, the path that serves K3 on GPUs) from the
checkpoint's config.json and runs its `load_weights` over every tensor of the checkpoint. On CPU only loading is
possible: the model's KDA, MLA and AttnRes kernels are Triton/CUDA-only, so no forward pass is attempted.

Prints one JSON line: {"loaded": n, "params": n, "missing": [...], "error": null | "..."}; exits 1 on any problem.
The CUDA stream/event stubs below only let the constructor run on a machine without CUDA; run this in its own process.
"""

from __future__ import annotations

import json
import os
import sys


def _stub_cuda_streams() -> None:
    import torch

    class _NoStream:  # KimiLinearModel, latent MoE, KDA and MLA create CUDA streams/events in __init__
        def __init__(self, *args, **kwargs):
            pass

        def record(self, *args, **kwargs):
            pass

        def wait(self, *args, **kwargs):
            pass

    if not torch.cuda.is_available():
        torch.cuda.Stream = _NoStream
        torch.cuda.Event = _NoStream


def check(checkpoint_dir: str) -> dict:
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")  # else vLLM imports cutlass's cute_dsl
    os.environ.setdefault("VLLM_ENABLE_GEMM_RS", "0")
    _stub_cuda_streams()
    import torch
    from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from agentrl.model.checkpoint import load_checkpoint_tensors

    model_config = ModelConfig(model=checkpoint_dir, tokenizer=None, skip_tokenizer_init=True, dtype="float32",
                               max_model_len=256, enforce_eager=True)
    # Prefix caching off from the start: on a CPU without AMX vLLM turns it off for MLA models only after the hybrid
    # (KDA) config step has sized the KDA state blocks for it, and then refuses its own config (seen on a Xeon
    # without AMX; one with AMX keeps prefix caching on). Loading weights needs no cache at all.
    vllm_config = VllmConfig(model_config=model_config, cache_config=CacheConfig(enable_prefix_caching=False),
                             load_config=LoadConfig(load_format="safetensors"))
    from vllm.models.kimi_k3 import KimiLinearForCausalLM

    if not torch.cuda.is_available():
        # vLLM's CPU MoE backend oracle refuses SiTU; the backend itself is never run here
        import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as unquantized
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
        unquantized.select_unquantized_moe_backend = (
            lambda *a, **k: (UnquantizedMoeBackend.CPU, CPUUnquantizedExperts))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method="tcp://127.0.0.1:0", backend="gloo")
        initialize_model_parallel(1, 1)
        model = KimiLinearForCausalLM(vllm_config=vllm_config, prefix="")
    params = dict(model.named_parameters())
    tensors = load_checkpoint_tensors(checkpoint_dir)
    try:
        loaded = model.load_weights(iter(tensors.items()))
        error = None
    except (KeyError, ValueError) as e:  # vLLM raises on a tensor name it has no parameter for
        loaded, error = set(), f"{type(e).__name__}: {e}"
    return {"loaded": len(loaded), "params": len(params), "tensors": len(tensors),
            "missing": sorted(set(params) - set(loaded)), "error": error}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    report = check(sys.argv[1])
    print(json.dumps(report))
    sys.exit(1 if report["missing"] or report["error"] else 0)


if __name__ == "__main__":
    main()
