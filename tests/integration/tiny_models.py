"""Tiny checkpoints built locally for the integration tests (no model hub is reachable): a tokenizer trained on the
envs' text, a Qwen3 model vLLM serves natively, and agentrl's hybrid model."""

from __future__ import annotations

import os

import torch

from agentrl.tokenizer import build_tokenizer


def make_tokenizer(directory: str, vocab_size: int = 1024):
    return build_tokenizer(directory, vocab_size=vocab_size, episodes_per_env=60)


def make_qwen3(directory: str, tokenizer, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> str:
    """A random tiny Qwen3 (fp32) with the tokenizer saved beside it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=8192, tie_word_embeddings=False,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float()
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
