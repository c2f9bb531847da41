"""vLLM worker extension: in-place weight updates with a served version, and the routing-capture RPCs.

vLLM mixes `WorkerExtension` into its worker class (`worker_extension_cls="agentrl.rollout.weight_sync.
WorkerExtension"`, set by `engine.make_llm`); its methods are called through `collective_rpc`, one call per worker.
`engine.py` wraps those calls (`update_weights`, `served_version`, `take_routed_experts`), including the prefix-cache
reset that must follow a weight change and happens in the scheduler, not here.

Weight updates copy tensors into the running model's parameters (agentrl's vLLM model uses plain PyTorch modules,
so nothing is repacked and nothing needs re-processing). Sources:
- a checkpoint directory written by `HybridMoEForCausalLM.save_pretrained` (read shard by shard);
- buckets streamed from the trainer through vLLM's weight-transfer API (weight_transfer.py), committed with
  `agentrl_commit_weights`;
- any iterable of (checkpoint name, tensor) with an in-process engine (over RPC the tensors would travel pickled,
  which a multi-process engine refuses: use the transfer API).
A full update must cover every parameter (and the routers' selection biases); `strict=False` allows a subset.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from agentrl.model.checkpoint import iter_checkpoint_tensors
from agentrl.rollout.cpu_seeds import prepare_step_generators
from agentrl.rollout.routing import RoutingRecorder


def load_weights_in_place(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                          strict: bool = True) -> int:
    """Copies checkpoint-named tensors into `model` (agentrl's vLLM model); returns how many tensors it wrote.

    With `strict`, every parameter and selection bias must be written, else ValueError naming the missing ones (the
    tensors that did arrive are already in place: stream the full set again to repair).
    """
    with torch.inference_mode(False):
        written = model.load_weights(weights)
    if strict:
        expected = {n for n, _ in model.named_parameters()}
        expected |= {n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")}
        missing = sorted(expected - written)
        if missing:
            raise ValueError(f"weight update left {len(missing)} tensors at their old values, e.g. {missing[:5]}: "
                             "the model now mixes two weight sets; send every tensor (or pass strict=False for a "
                             "deliberate partial update)")
    return len(written)


class WorkerExtension:
    """Methods vLLM adds to its worker; names carry an `agentrl_` prefix (vLLM rejects clashes with its own)."""

    def agentrl_setup(self, capture_routing: bool = True, version: int = 0) -> dict:
        """Sets the served version and wraps the model runner's step (once): routing capture if asked, and on CPU
        rewindable sampling generators (cpu_seeds.py)."""
        self._agentrl_version = version
        if getattr(self, "_agentrl_hooked", False):
            return {"version": version, "capture_routing": self._agentrl_routing is not None}
        runner = self.model_runner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if not isinstance(runner, GPUModelRunner):
            raise ValueError(f"agentrl's worker hooks wrap vLLM's V1 model runner, not {type(runner).__name__}; "
                             "set VLLM_USE_V2_MODEL_RUNNER=0")
        recorder = RoutingRecorder(runner) if capture_routing else None
        on_cpu = runner.device.type == "cpu"
        step = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            if getattr(runner.get_model(), "agentrl_transfer", None) is not None and \
                    scheduler_output.total_num_scheduled_tokens:  # never sample from a mix of two weight versions
                raise RuntimeError("the engine was asked to run while its weights are mid-update (a transfer began "
                                   "and was not committed): restore complete weights first")
            if recorder is not None:
                recorder.before_step(scheduler_output)
            out = step(scheduler_output, *args, **kwargs)
            if recorder is not None:
                recorder.after_step(scheduler_output)
            if on_cpu:
                prepare_step_generators(runner)
            return out

        runner.execute_model = execute_model
        self._agentrl_routing = recorder
        self._agentrl_hooked = True
        return {"version": version, "capture_routing": recorder is not None}

    def agentrl_weight_version(self) -> int:
        return self._agentrl_version

    def agentrl_transfer_state(self) -> dict:
        """The served version, and whether an in-memory transfer is open (the engine refuses to run until it is
        committed or complete weights are loaded) with how many tensors it still lacks."""
        model = self.model_runner.get_model()
        transfer = getattr(model, "agentrl_transfer", None)
        return {"version": self._agentrl_version, "transfer_open": transfer is not None,
                "missing": len(transfer.missing(model)) if transfer is not None else 0}

    def agentrl_update_weights_from_checkpoint(self, directory: str, version: int, strict: bool = True) -> int:
        """Loads a checkpoint directory in place and serves it as `version`; returns the tensor count. A complete
        load also ends a transfer that stopped half way (weight_transfer.py)."""
        model = self.model_runner.get_model()
        count = load_weights_in_place(model, iter_checkpoint_tensors(directory), strict=strict)
        if strict:
            model.agentrl_transfer = None
        self._agentrl_version = version
        return count

    def agentrl_commit_weights(self, version: int) -> int:
        """Ends an in-memory transfer (weight_transfer.py): serves `version` if every tensor arrived, else raises
        ValueError naming the missing ones and keeps refusing to run. Returns the buckets received."""
        model = self.model_runner.get_model()
        transfer = getattr(model, "agentrl_transfer", None)
        if transfer is None:
            raise RuntimeError(f"no weight transfer to commit as version {version}")
        missing = transfer.missing(model)
        if missing:
            raise ValueError(f"weight transfer to version {version} is missing {len(missing)} tensors, e.g. "
                             f"{missing[:5]}: the engine keeps refusing to run until complete weights are loaded")
        model.agentrl_transfer = None
        self._agentrl_version = version
        return transfer.buckets

    def agentrl_update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int,
                               strict: bool = True) -> int:
        """Loads (checkpoint name, tensor) pairs in place and serves them as `version`."""
        count = load_weights_in_place(self.model_runner.get_model(), named_tensors, strict=strict)
        self._agentrl_version = version
        return count

    def agentrl_take_routed_experts(self, request_ids: list[str]) -> dict[str, tuple[list[int], bytes]]:
        """{request id: (shape, int16 bytes)}: raw bytes cross vLLM's RPC serialization intact and cheaply
        (numpy arrays arrive as nested lists when the engine runs in another process)."""
        recorder = getattr(self, "_agentrl_routing", None)
        if recorder is None:
            raise ValueError("routing capture is off: create the engine with capture_routing=True")
        return {rid: (list(rows.shape), rows.tobytes()) for rid, rows in recorder.take(list(request_ids)).items()}
