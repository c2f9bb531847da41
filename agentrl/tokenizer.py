"""The tokenizer of agentrl's own small models (the `agentrl` chat format), trained locally.

No model hub is reachable from these machines, so the quickstart and the tests build their tokenizer here: a
byte-level BPE (`tokenizers`) trained on the built-in environments' oracle episodes as the `agentrl` chat format
renders them (agentrl/chat/agentrl_format.py), wrapped as a `PreTrainedTokenizerFast` that vLLM and transformers load
from a directory. Its chat template (ChatML, one message per block, roles system / user / assistant / tool) prints
what the format renders:

    <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n

`<|im_end|>` ends an assistant turn (the engine's stop token). The tool-call protocol's tags (`<tool_call>`,
`<answer>`, `<tool_response>` and their closers) are single added tokens, so a small model sees the format as a few
symbols. Tokenizers for other families' layouts (Kimi's tiktoken, Qwen3's) are in agentrl/chat/tiny_tokenizers.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agentrl.chat.agentrl_format import (ANSWER_CLOSE, ANSWER_OPEN, EOS, IM_END, IM_START, RESPONSE_CLOSE,
                                         RESPONSE_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN)

SPECIAL_TOKENS = [EOS, IM_START, IM_END]
PROTOCOL_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Byte-level BPE over `texts`; every byte is in the alphabet, so any text encodes."""
    num_reserved = len(SPECIAL_TOKENS) + len(PROTOCOL_TOKENS)
    if vocab_size < 256 + num_reserved:
        raise ValueError(f"vocab_size={vocab_size} is below the byte alphabet plus {num_reserved} reserved tokens")
    tok = Tokenizer(models.BPE())
    # One token per digit: a number then reads the same in a question, a tool call, a tool's result and an answer
    # (merged BPE digits split " 77" and "77" differently), so copying a number is copying digits.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=SPECIAL_TOKENS + PROTOCOL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=EOS, bos_token=None,
                                   unk_token=None, additional_special_tokens=[IM_START])
    fast.add_tokens(PROTOCOL_TOKENS)  # already in the vocab; marks them as added (not split, not special)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 20
    return fast


def environment_corpus(env_ids: Iterable[str] = ("agentrl/Calc-v0", "agentrl/KVChain-v0"),
                       episodes_per_env: int = 200, seed: int = 0,
                       env_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """Oracle episodes of the given environments (system prompt, task, gold tool calls and answers) as the `agentrl`
    format renders them, each closed by the template's newline after its last message (as this tokenizer was always
    trained: the trained merges, and so the quickstart's tokenizer, stay as they were)."""
    from agentrl.chat.tiny_tokenizers import format_corpus

    return [text + "\n" for text in format_corpus("agentrl", env_ids, episodes_per_env, seed, env_kwargs)]


def build_tokenizer(out_dir: str, *, vocab_size: int = 2048,
                    env_ids: Iterable[str] = ("agentrl/Calc-v0", "agentrl/KVChain-v0"),
                    episodes_per_env: int = 200,
                    env_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> PreTrainedTokenizerFast:
    """Trains the tokenizer on the environments' text (each env built with its `env_kwargs` entry) and saves it (with
    its chat template) to `out_dir`."""
    tok = train_tokenizer(environment_corpus(env_ids, episodes_per_env, env_kwargs=env_kwargs), vocab_size=vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(out_dir)
    return tok


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A merge-free byte tokenizer (every token one byte): tokenization is unique, which tests that compare token ids
    after decoding and re-encoding need."""
    return train_tokenizer([], vocab_size=256 + len(SPECIAL_TOKENS) + len(PROTOCOL_TOKENS))
