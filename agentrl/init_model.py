"""Building a fresh policy locally: a tokenizer trained on the environments' text and a preset model sized to it.

    agentrl init-model --preset tiny --out runs/tiny        # checkpoint + tokenizer in one directory

No model hub is reachable here, so the quickstart starts from random weights of a preset (then an SFT warm start on
the environments' oracle trajectories). The checkpoint directory holds the tokenizer too, as vLLM and transformers
expect.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.tokenizer import IM_END, build_tokenizer


def init_model(out_dir: str, *, preset: str = "tiny", overrides: dict[str, Any] | None = None,
               tokenizer_dir: str | None = None, vocab_size: int = 1024,
               env_ids: Iterable[str] = ("agentrl/Calc-v0", "agentrl/KVChain-v0"), seed: int = 0) -> str:
    """Writes a checkpoint (config, safetensors, tokenizer) to `out_dir` and returns it.

    The model's vocabulary is the tokenizer's size; its pad/eos ids are the tokenizer's.
    """
    from transformers import AutoTokenizer

    if tokenizer_dir is None:
        tokenizer = build_tokenizer(os.path.join(out_dir, "tokenizer"), vocab_size=vocab_size, env_ids=env_ids)
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fields = dict(overrides or {})
    fields.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.convert_tokens_to_ids(IM_END), bos_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = HybridMoEForCausalLM(preset_config(preset, **fields)).float()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
