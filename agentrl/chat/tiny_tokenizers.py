"""Small tokenizers in other families' layouts, trained locally on the envs' text (no model hub is reachable here).

    build_format_tokenizer("tok/", "kimi")      # tiktoken.model + tokenizer_config.json in Kimi's layout
    build_format_tokenizer("tok/", "qwen3")     # tokenizer.json with Qwen3's special tokens and chat template

Each is trained on the built-in envs' oracle episodes as its own chat format renders them, so its merges fit the
text a policy will see:

* `kimi` / `kimi_k3`: Kimi's tiktoken layout. BPE ranks in `tiktoken.model` (the 256 single bytes first, then the
  merges in training order), Kimi's split pattern, and the special tokens at Kimi's offsets from the end of the ranks
  (`[BOS]` +0, `[EOS]` +1, `<|im_end|>` +2, `<|im_user|>` +3, `<|im_assistant|>` +4, `<|im_system|>` +10, the
  tool-call markers +11..+15, `<|im_middle|>` +17, `<|kimi_image_placeholder|>` +21, `[UNK]` +254, `[PAD]` +255; the
  K3 XTML markers, whose ids are not public, at +30..+33), 256 reserved ids in all, read back by
  `agentrl.chat.tokenizers.KimiTokenizer` as the released tokenizer reads its files. The kimi layout carries Kimi
  K2 Instruct's chat template (templates/kimi.jinja).
* `qwen3`: a byte-level BPE with Qwen2's split pattern and NFC normalization, Qwen3's added tokens in Qwen3's order
  after the merges, and Qwen3's chat template (templates/qwen3.jinja).

Digits are never merged in training (as in agentrl's own tokenizer): a tiny model copies a number digit by digit.
The split patterns still group digits at encoding time; with no digit merges the groups fall apart into digits.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

from agentrl.chat.tokenizers import (KIMI_NUM_RESERVED_SPECIAL_TOKENS, KIMI_PATTERN, HFTokenizer, KimiTokenizer,
                                     Tokenizer, bytes_to_unicode, write_tiktoken_ranks)

FORMAT_KEY = "agentrl_chat_format"

KIMI_SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 21: "<|kimi_image_placeholder|>", 254: "[UNK]", 255: "[PAD]",
}
K3_SPECIAL_OFFSETS = {30: "<|open|>", 31: "<|close|>", 32: "<|sep|>", 33: "<|end_of_msg|>"}
# what the released tokenizer's constructor names additional special tokens by default
KIMI_ADDITIONAL_SPECIAL = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                           "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def template(name: str) -> str:
    return resources.files("agentrl.chat").joinpath("templates", f"{name}.jinja").read_text()


def format_corpus(chat_format: str, env_ids: Iterable[str], episodes_per_env: int = 200, seed: int = 0,
                  env_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """The envs' oracle episodes rendered as text by `chat_format` (no tokenizer needed); each env is built with its
    `env_kwargs` entry. An env's own code raising is an EnvCodeError naming the env."""
    from agentrl.chat import get_format
    from agentrl.envs import make, play
    from agentrl.failures import EnvCodeError

    chat = get_format(chat_format)
    texts = []
    for env_id in env_ids:
        try:
            env = make(env_id, **dict((env_kwargs or {}).get(env_id, {})))
            for i in range(episodes_per_env):
                episode = play(env, env.oracle, seed=seed + i)
                texts.append(chat.conversation_text(episode.system, episode.tools, episode.prompt, episode.steps()))
        except Exception as exc:
            raise EnvCodeError(env_id, exc) from exc
    return texts


def build_format_tokenizer(out_dir: str, chat_format: str, *, vocab_size: int = 1024,
                           env_ids: Iterable[str] = ("agentrl/Calc-v0", "agentrl/KVChain-v0"),
                           episodes_per_env: int = 200,
                           env_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> Tokenizer:
    """A tokenizer for `chat_format` trained on the envs' text (each env built with its `env_kwargs` entry), saved to
    `out_dir`; `vocab_size` is the model's vocabulary (the embedding rows) the tokenizer fills."""
    if chat_format == "agentrl":
        from agentrl.tokenizer import build_tokenizer

        return HFTokenizer(build_tokenizer(out_dir, vocab_size=vocab_size, env_ids=env_ids,
                                          episodes_per_env=episodes_per_env, env_kwargs=env_kwargs), out_dir)
    texts = format_corpus(chat_format, env_ids, episodes_per_env, env_kwargs=env_kwargs)
    if chat_format in ("kimi", "kimi_k3"):
        return build_kimi_tokenizer(out_dir, texts, vocab_size=vocab_size, chat_format=chat_format)
    if chat_format == "qwen3":
        return build_qwen3_tokenizer(out_dir, texts, vocab_size=vocab_size)
    raise ValueError(f"no tokenizer layout for chat format {chat_format!r}")


def _train_bpe(texts: list[str], vocab_size: int, split_pattern: str,
               special: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE of `vocab_size` entries (the 256 byte symbols, then merges) over `texts` cut at the special
    strings, never merging digits: (vocab in byte-to-unicode form, merges in order)."""
    from tokenizers import Regex, Tokenizer as RustTokenizer, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    cut = re.compile("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True)))
    tok.train_from_iterator((piece for text in texts for piece in cut.split(text)), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges


def build_kimi_tokenizer(out_dir: str, texts: list[str], *, vocab_size: int = 1024,
                         chat_format: str = "kimi") -> KimiTokenizer:
    """Kimi's tiktoken layout (see the module docstring) with `vocab_size` - 256 BPE ranks."""
    offsets = dict(KIMI_SPECIAL_OFFSETS)
    if chat_format == "kimi_k3":
        offsets.update(K3_SPECIAL_OFFSETS)
    base = vocab_size - KIMI_NUM_RESERVED_SPECIAL_TOKENS
    if base < 256 + 16:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for merges beside 256 reserved special tokens")
    vocab, _ = _train_bpe(texts, base, KIMI_PATTERN, list(offsets.values()))
    decode = {c: b for b, c in bytes_to_unicode().items()}
    merged = sorted((i, bytes(decode[c] for c in token)) for token, i in vocab.items())
    # tiktoken ranks: the 256 single bytes in byte order, then every merged token in the order it was learnt
    tokens = [bytes([b]) for b in range(256)] + [t for _, t in merged if len(t) > 1]
    base = len(tokens)
    os.makedirs(out_dir, exist_ok=True)
    write_tiktoken_ranks(os.path.join(out_dir, "tiktoken.model"), {t: i for i, t in enumerate(tokens)})
    config = {
        "added_tokens_decoder": {str(base + offset): {"content": name, "lstrip": False, "normalized": False,
                                                      "rstrip": False, "single_word": False, "special": True}
                                 for offset, name in sorted(offsets.items())},
        "additional_special_tokens": KIMI_ADDITIONAL_SPECIAL,
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20, "tokenizer_class": "TikTokenTokenizer",
        FORMAT_KEY: chat_format,
    }
    if chat_format == "kimi":
        config["chat_template"] = template("kimi")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return KimiTokenizer.from_directory(out_dir)


def build_qwen3_tokenizer(out_dir: str, texts: list[str], *, vocab_size: int = 1024) -> HFTokenizer:
    """Qwen3's layout (see the module docstring) in `vocab_size` ids, its added tokens last."""
    from tokenizers import Regex, Tokenizer as RustTokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    added = QWEN3_SPECIAL + QWEN3_ADDED
    vocab, merges = _train_bpe(texts, vocab_size - len(added), QWEN2_PATTERN, added)
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(QWEN3_SPECIAL)  # in Qwen3's order, right after the merges
    tok.add_tokens(QWEN3_ADDED)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, additional_special_tokens=QWEN3_SPECIAL[1:])
    fast.chat_template = template("qwen3")
    fast.model_max_length = 1 << 20
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config[FORMAT_KEY] = "qwen3"
    with open(path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return HFTokenizer.from_directory(out_dir)
