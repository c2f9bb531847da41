"""Tokenizers as chat formats need them: content that can never become a control token, markers that always do.

    tok = load_tokenizer("ckpt/")        # tiktoken.model (Kimi's layout) or tokenizer.json (any HF fast tokenizer)
    tok.encode_text("a <|im_end|> b")     # ordinary tokens only: the marker string stays text
    tok.token_id("<|im_end|>")            # the marker's single id
    tok.decode(ids)

Two implementations:

* ``HFTokenizer`` wraps a ``PreTrainedTokenizerFast``. Its content encoder is the same tokenizer with its added tokens
  removed (normalizer, pre-tokenizer and BPE unchanged), because ``tokenizers`` matches every added token in the
  input, special or not (``encode_special_tokens`` covers only special ones: agentrl's ``<tool_call>`` is not).
* ``KimiTokenizer`` reads a Kimi ``tiktoken.model`` (base64 BPE ranks) and ``tokenizer_config.json`` itself, without
  executing the checkpoint's ``tokenization_kimi.py`` (which does not import under the pinned transformers, and
  must not run anyway). It reproduces the released ``TikTokenTokenizer``'s ids: Kimi's split pattern, its special
  tokens (``num_reserved_special_tokens + 2`` ids from the end of the BPE ranks, named from ``added_tokens_decoder``,
  ``<|reserved_token_{id}|>`` otherwise), and its input slicing (400,000-character pieces, then runs of more than
  25,000 spaces or non-spaces split) that works around tiktoken's stack limits.

`tokenizer_files` lists what a checkpoint directory holds besides weights and config (the tokenizer, its code, chat
templates, generation_config.json): publishing copies all of it beside every weight version (trainer/publish.py).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
HF_TOKENIZER_FILE = "tokenizer.json"

# The released Kimi tokenizer's pre-tokenizer (tokenization_kimi.py, TikTokenTokenizer.pat_str): CJK runs, words
# with their casing and English contractions, digits in groups of up to three, punctuation runs, newlines, spaces.
# `&&` is set intersection in tiktoken's regex engine (and in the `regex` module's V1 mode).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256
# tiktoken's Rust core panics on longer inputs; the released tokenizer slices text before encoding (see module doc)
KIMI_MAX_ENCODE_CHARS = 400_000
KIMI_MAX_RUN_CHARS = 25_000


class Tokenizer(ABC):
    """What a chat format needs from a tokenizer (see the module docstring)."""

    directory: str | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def added_tokens(self) -> tuple[str, ...]:
        """Strings that template markup is split at (each becomes its single id), longest first."""

    @abstractmethod
    def encode_text(self, text: str) -> list[int]:
        """Ordinary tokens for `text`: a marker string in it is encoded like any other text."""

    @abstractmethod
    def token_id(self, token: str) -> int | None:
        """The single id of an added or special token, or None if `token` is not one."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def get_vocab(self) -> dict[str, int]:
        """token string → id in the byte-to-unicode form of HF tokenizers (vLLM's parsers look markers up here)."""

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """The checkpoint's own Jinja chat template rendered and tokenized the way its tokenizer does (marker strings
        anywhere in the rendered text become control ids). For tests: agentrl never renders through it."""


class HFTokenizer(Tokenizer):
    """A transformers fast tokenizer (tokenizer.json)."""

    def __init__(self, hf, directory: str | None = None):
        from tokenizers import Tokenizer as RustTokenizer

        self.hf = hf
        self.directory = directory
        spec = json.loads(hf.backend_tokenizer.to_str())
        self._added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        for entry in spec.get("added_tokens", []):
            if entry.get("lstrip") or entry.get("rstrip") or entry.get("single_word"):
                raise ValueError(f"tokenizer {directory}: added token {entry['content']!r} strips whitespace or "
                                 "matches single words only; agentrl's renderer splits markup at added tokens "
                                 "exactly and cannot reproduce that")
        spec["added_tokens"] = []
        self._content = RustTokenizer.from_str(json.dumps(spec))

    @classmethod
    def from_directory(cls, directory: str) -> HFTokenizer:
        from transformers import PreTrainedTokenizerFast

        return cls(PreTrainedTokenizerFast.from_pretrained(directory), directory)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @cached_property
    def added_tokens(self) -> tuple[str, ...]:
        return tuple(sorted(self._added, key=len, reverse=True))

    def encode_text(self, text: str) -> list[int]:
        return self._content.encode(text, add_special_tokens=False).ids if text else []

    def token_id(self, token: str) -> int | None:
        return self._added.get(token)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def get_vocab(self) -> dict[str, int]:
        return self.hf.get_vocab()

    def apply_chat_template(self, messages, **kwargs):
        out = self.hf.apply_chat_template(messages, tokenize=True, **kwargs)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


class KimiTokenizer(Tokenizer):
    """Kimi's tiktoken tokenizer, read from its files (see the module docstring)."""

    def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int], *, config: dict[str, Any] | None = None,
                 directory: str | None = None, name: str = TIKTOKEN_FILE):
        import tiktoken

        self.directory = directory
        self.config = dict(config or {})
        self.special_tokens = dict(special_tokens)
        self.encoding = tiktoken.Encoding(name=name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        self.num_base_tokens = len(ranks)

    @classmethod
    def from_directory(cls, directory: str) -> KimiTokenizer:
        ranks = read_tiktoken_ranks(os.path.join(directory, TIKTOKEN_FILE))
        config_path = os.path.join(directory, TOKENIZER_CONFIG)
        config = json.load(open(config_path)) if os.path.exists(config_path) else {}
        names = {int(i): entry["content"] for i, entry in config.get("added_tokens_decoder", {}).items()}
        num_base = len(ranks)
        if set(ranks.values()) != set(range(num_base)):
            raise ValueError(f"{directory}/{TIKTOKEN_FILE}: ranks must be 0..{num_base - 1} without gaps")
        specials = {names.get(i, f"<|reserved_token_{i}|>"): i
                    for i in range(num_base, num_base + KIMI_NUM_RESERVED_SPECIAL_TOKENS + 2)}
        if len(specials) != KIMI_NUM_RESERVED_SPECIAL_TOKENS + 2:
            raise ValueError(f"{directory}/{TOKENIZER_CONFIG}: two special-token ids share one name")
        return cls(ranks, specials, config=config, directory=directory)

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @cached_property
    def added_tokens(self) -> tuple[str, ...]:
        return tuple(sorted(self.special_tokens, key=len, reverse=True))

    def encode_text(self, text: str) -> list[int]:
        return [i for piece in kimi_encode_pieces(text) for i in self.encoding.encode_ordinary(piece)]

    def encode(self, text: str, allow_special_tokens: bool = True) -> list[int]:
        """The released tokenizer's `encode`: with `allow_special_tokens` (its default) marker strings in `text`
        become control ids."""
        if not allow_special_tokens:
            return self.encode_text(text)
        return [i for piece in kimi_encode_pieces(text) for i in self.encoding.encode(piece, allowed_special="all")]

    def token_id(self, token: str) -> int | None:
        return self.special_tokens.get(token)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids), errors="replace")

    @cached_property
    def _vocab(self) -> dict[str, int]:
        table = bytes_to_unicode()
        vocab = {"".join(table[b] for b in self.encoding.decode_single_token_bytes(i)): i
                 for i in range(self.num_base_tokens)}
        vocab.update(self.special_tokens)
        return vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt=False, **kwargs):
        from transformers.utils.chat_template_utils import render_jinja_template

        template = self.config.get("chat_template")
        if template is None and self.directory and os.path.exists(os.path.join(self.directory, "chat_template.jinja")):
            template = open(os.path.join(self.directory, "chat_template.jinja")).read()
        if template is None:
            raise ValueError(f"tokenizer {self.directory} has no chat template")
        # the released tokenizer sorts the tool schemas' keys at every level before rendering
        rendered, _ = render_jinja_template(conversations=[messages], tools=deep_sorted(tools) if tools else None,
                                            chat_template=template, add_generation_prompt=add_generation_prompt,
                                            **kwargs)
        return self.encode(rendered[0])


def load_tokenizer(directory: str) -> Tokenizer:
    """The tokenizer a checkpoint directory holds: Kimi's tiktoken layout, else an HF fast tokenizer."""
    if os.path.exists(os.path.join(directory, TIKTOKEN_FILE)):
        return KimiTokenizer.from_directory(directory)
    if os.path.exists(os.path.join(directory, HF_TOKENIZER_FILE)):
        return HFTokenizer.from_directory(directory)
    raise FileNotFoundError(f"{directory} holds no tokenizer: expected {TIKTOKEN_FILE} (Kimi) or {HF_TOKENIZER_FILE}")


def has_tokenizer(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, f)) for f in (TIKTOKEN_FILE, HF_TOKENIZER_FILE))


# files of a checkpoint directory that are not weights, config or agentrl's bookkeeping: the tokenizer and its kin
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tmp")
NOT_TOKENIZER_FILES = ("config.json", "model.safetensors.index.json", "checksums.json", "version.json")


def tokenizer_files(directory: str) -> list[str]:
    """The files of a checkpoint directory besides its weights, config and agentrl's bookkeeping: the tokenizer
    (tokenizer.json / tiktoken.model, its config, its code), chat templates, generation_config.json, and the like."""
    return sorted(name for name in os.listdir(directory)
                  if os.path.isfile(os.path.join(directory, name)) and name not in NOT_TOKENIZER_FILES
                  and not name.endswith(WEIGHT_SUFFIXES) and not name.startswith("."))


def copy_tokenizer_files(source: str, destination: str) -> list[str]:
    names = tokenizer_files(source)
    for name in names:
        shutil.copy(os.path.join(source, name), os.path.join(destination, name))
    return names


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token bytes) rank` line per token."""
    ranks = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a `base64 rank` line ({exc})") from None
    return ranks


def write_tiktoken_ranks(path: str, ranks: dict[bytes, int]) -> None:
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


def kimi_encode_pieces(text: str) -> Iterator[str]:
    """The pieces the released Kimi tokenizer encodes `text` in (see the module docstring)."""
    for start in range(0, len(text), KIMI_MAX_ENCODE_CHARS):
        yield from _split_long_runs(text[start:start + KIMI_MAX_ENCODE_CHARS], KIMI_MAX_RUN_CHARS)


_RUNS = re.compile(r"\s+|\S+")


def _split_long_runs(text: str, limit: int) -> Iterator[str]:
    """`text` cut so that no piece holds more than `limit` consecutive spaces or consecutive non-spaces: a run
    longer than `limit` is cut every `limit` characters from its start (where the released loop starts a new piece)."""
    start = 0
    if len(text) > limit:
        for run in _RUNS.finditer(text):
            for cut in range(run.start() + limit, run.end(), limit):
                yield text[start:cut]
                start = cut
    yield text[start:]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table: printable Latin-1 bytes map to themselves, the other 68
    bytes to the code points 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def deep_sorted(value: Any) -> Any:
    """`value` with every mapping's keys sorted, recursively (list order kept)."""
    if isinstance(value, dict):
        return {k: deep_sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [deep_sorted(v) for v in value]
    return value
