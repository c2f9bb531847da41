"""The policy directory a job starts from: a fresh preset with a tokenizer trained here, or a checkpoint brought in.

    agentrl init-model --preset tiny --out runs/tiny                        # agentrl's own format
    agentrl init-model --preset kimi-linear-tiny --chat-format kimi --out runs/kimi   # Kimi's tiktoken layout

No model hub is reachable here, so a fresh policy is a preset with random weights and a tokenizer trained on the
environments' text in the layout of the chosen chat format (agentrl/chat/tiny_tokenizers.py); the quickstart then
warm-starts it by SFT on oracle trajectories. The directory is a complete checkpoint: config.json (its vocabulary and
pad/bos/eos ids the tokenizer's), safetensors, the tokenizer files, generation_config.json (the format's stop ids).

`import_checkpoint` brings a released checkpoint into a job when agentrl must change it: a Kimi K3 directory (nested
config, `language_model.` names, MXFP4 experts) is rewritten in agentrl's layout; training-knob overrides (the load
balancer) rewrite the config beside links to the original weight files. Any other checkpoint is used where it is.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch

from agentrl.model.config import HybridMoEConfig, preset_config
from agentrl.model.modeling import HybridMoEForCausalLM

# the chat format a preset's fresh tokenizer is built in, when the job does not name one
PRESET_FORMATS = {"kimi-linear-tiny": "kimi", "kimi-linear-48b-a3b": "kimi"}
# (bos, pad) tokens of each format's tokenizer layout; eos is the format's first stop token
LAYOUT_TOKENS = {"agentrl": ("<|endoftext|>", "<|endoftext|>"), "kimi": ("[BOS]", "[PAD]"),
                 "kimi_k3": ("[BOS]", "[PAD]"), "qwen3": ("<|endoftext|>", "<|endoftext|>")}
STOP_TOKENS = {"agentrl": ("<|im_end|>",), "kimi": ("<|im_end|>",), "kimi_k3": ("<|end_of_msg|>",),
               "qwen3": ("<|im_end|>", "<|endoftext|>")}
# config keys a job may change on a checkpoint it did not build: training knobs that leave the weights' meaning alone
CHECKPOINT_OVERRIDES = ("moe_balancing", "moe_balancing_bins", "moe_balancing_sign_rate")


def init_model(out_dir: str, *, preset: str = "tiny", overrides: dict[str, Any] | None = None,
               tokenizer_dir: str | None = None, vocab_size: int = 1024,
               env_ids: Iterable[str] = ("agentrl/Calc-v0", "agentrl/KVChain-v0"),
               env_kwargs: dict[str, dict[str, Any]] | None = None, seed: int = 0,
               chat_format: str | None = None) -> str:
    """Writes a fresh checkpoint (config, safetensors, tokenizer, generation config) to `out_dir` and returns it.

    `chat_format` picks the tokenizer layout (None: the preset's family, agentrl's own for agentrl's presets);
    `tokenizer_dir` uses an existing tokenizer instead of training one (its format detected unless named); else one is
    trained on the oracle episodes of `env_ids`, each env built with its `env_kwargs` entry.
    """
    from agentrl.chat import detect_format, load_tokenizer
    from agentrl.chat.tokenizers import copy_tokenizer_files
    from agentrl.chat.tiny_tokenizers import build_format_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    if tokenizer_dir is None:
        chat_format = chat_format or PRESET_FORMATS.get(preset, "agentrl")
        tokenizer = build_format_tokenizer(out_dir, chat_format, vocab_size=vocab_size, env_ids=env_ids,
                                           env_kwargs=env_kwargs)
    else:
        tokenizer = load_tokenizer(tokenizer_dir)
        chat_format = chat_format or detect_format(tokenizer, tokenizer_dir)
        copy_tokenizer_files(tokenizer_dir, out_dir)
    bos, pad = (tokenizer.token_id(t) for t in LAYOUT_TOKENS[chat_format])
    stops = [tokenizer.token_id(t) for t in STOP_TOKENS[chat_format]]
    if None in (bos, pad, *stops):
        raise ValueError(f"the tokenizer lacks the {chat_format} layout's special tokens "
                         f"{LAYOUT_TOKENS[chat_format] + STOP_TOKENS[chat_format]}")
    fields = dict(overrides or {})
    fields.update(vocab_size=model_vocab_size(tokenizer), pad_token_id=pad, eos_token_id=stops[0], bos_token_id=bos)
    torch.manual_seed(seed)
    model = HybridMoEForCausalLM(preset_config(preset, **fields)).float()
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": stops, "pad_token_id": pad}, f, indent=1)
    return out_dir


def model_vocab_size(tokenizer) -> int:
    """The embedding rows a tokenizer needs: its whole vocabulary, except Kimi's layout, whose two ids past the 256
    reserved special tokens the model never holds (the released 163,840 for 163,584 ranks)."""
    from agentrl.chat.tokenizers import KIMI_NUM_RESERVED_SPECIAL_TOKENS, KimiTokenizer

    if isinstance(tokenizer, KimiTokenizer):
        return tokenizer.num_base_tokens + KIMI_NUM_RESERVED_SPECIAL_TOKENS
    return tokenizer.vocab_size


def needs_import(checkpoint: str, overrides: dict[str, Any] | None = None) -> bool:
    """Whether a job must bring `checkpoint` in with `import_checkpoint` rather than use it where it is."""
    from agentrl.model import released

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    return bool(overrides) or released.is_k3_config(config) or bool(config.get("quantization_config"))


def import_checkpoint(checkpoint: str, out_dir: str, overrides: dict[str, Any] | None = None) -> str:
    """`checkpoint` as a directory agentrl trains from (see the module docstring); returns `out_dir`.

    `overrides` may set only CHECKPOINT_OVERRIDES (ValueError naming any other key: the weights fix the rest).
    """
    from agentrl.chat.tokenizers import copy_tokenizer_files
    from agentrl.model import released
    from agentrl.model.checkpoint import INDEX_FILE, iter_checkpoint_tensors, write_checkpoint

    overrides = dict(overrides or {})
    refused = sorted(set(overrides) - set(CHECKPOINT_OVERRIDES))
    if refused:
        raise ValueError(f"model.overrides {refused} cannot change a checkpoint (its weights fix them); a "
                         f"checkpoint takes only {list(CHECKPOINT_OVERRIDES)}")
    config = HybridMoEConfig.from_pretrained(checkpoint)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.validate()
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(checkpoint, "config.json")) as f:
        raw = json.load(f)
    if released.is_k3_config(raw) or raw.get("quantization_config"):
        write_checkpoint(iter_checkpoint_tensors(checkpoint), config, tmp)  # dequantized, renamed, shard by shard
    else:
        config.save_pretrained(tmp)
        for name in os.listdir(checkpoint):  # the weights stay where they are
            if name.endswith(".safetensors") or name == INDEX_FILE:
                os.symlink(os.path.abspath(os.path.join(checkpoint, name)), os.path.join(tmp, name))
    copy_tokenizer_files(checkpoint, tmp)
    os.replace(tmp, out_dir)
    return out_dir
