"""vLLM general plugin: registers agentrl's hybrid model with vLLM's model registry, and agentrl's weight-transfer
backend (rollout/weight_transfer.py) with vLLM's.

vLLM calls `register()` in every process it starts (front end, engine core, workers) through the entry point

    [project.entry-points."vllm.general_plugins"]
    agentrl = "agentrl.rollout.vllm_plugin:register"

Which implementation serves a checkpoint: agentrl checkpoints say `architectures: ["KimiLinearForCausalLM"]`, the
name of upstream vLLM's Kimi Linear / K3 class. The plugin registers its own name, `AgentRLHybridForCausalLM`, and
does not take over `KimiLinearForCausalLM`: a plain `LLM(model=checkpoint)` keeps meaning upstream's class (GPU
only), and the plugin is chosen per engine by `hf_overrides` (`engine.make_llm` does this; on CPU it is the only
choice, on GPU `implementation="upstream"` keeps vLLM's class). Overriding the Kimi name on CPU would not be enough
anyway: vLLM marks the "kimi_linear" model type as MLA, which the plugin's overrides also have to undo.
"""

from __future__ import annotations

import multiprocessing
import os
import threading

ARCHITECTURE = "AgentRLHybridForCausalLM"
# Any model type outside vLLM's MLA list (vllm/transformers_utils/model_arch_config_convertor.py) will do.
MODEL_TYPE = "agentrl_hybrid"


def register() -> None:
    end_with_parent()
    from vllm import ModelRegistry
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"agentrl.rollout.vllm_model:{ARCHITECTURE}")
    try:  # in-memory weight syncs (rollout/weight_transfer.py), loaded when an engine asks for the backend
        WeightTransferEngineFactory.register_engine("agentrl", "agentrl.rollout.weight_transfer",
                                                    "AgentrlWeightTransfer")
    except ValueError:
        pass  # registered already in this process


def end_with_parent() -> None:
    """In a process vLLM started (engine core, CPU worker): exit as soon as the process that started it is gone.

    vLLM's engine core outlives a rollout worker that dies abruptly (its raylet killed, kill -9): it was found running
    on, reparented to init, holding ~1.7 GB. A multiprocessing child holds a pipe from its parent that reads EOF when
    the parent ends, whatever ended it; a daemon thread waits on it. The front end (the rollout worker, a user's
    script) is no multiprocessing child and is left alone."""
    parent = multiprocessing.parent_process()
    if parent is None or getattr(end_with_parent, "watching", False):
        return
    end_with_parent.watching = True

    def watch() -> None:
        parent.join()  # returns when the parent's end of the sentinel pipe closes
        os._exit(1)

    threading.Thread(target=watch, name="agentrl-end-with-parent", daemon=True).start()
