"""Chat formats: the only code that knows a model family's template and tool-call grammar.

    fmt = load_chat_format("ckpt/")                  # detected from the checkpoint's tokenizer, or name="kimi"
    prompt = fmt.render_prompt(env.system_prompt(), env.tool_schemas(), task_text)      # ids + message spans
    turn = fmt.parse_turn(sampled_ids)               # an AssistantTurn for env.step; never raises
    glue = fmt.render_observation(tool_results)      # ids to append after the sampled turn
    fmt.stop_ids                                     # from generation_config.json / config.json

Formats (one module each): `agentrl` (ChatML + the tag protocol of agentrl's own models), `kimi` (Kimi Linear and
Kimi K2), `kimi_k3` (K3's XTML), `qwen3` (Qwen3's Hermes template). base.py holds the interface and the renderer
they share; tokenizers.py reads a checkpoint's tokenizer (HF fast, or Kimi's tiktoken files without its remote code).
"""

from __future__ import annotations

import json
import os
from typing import Any

from agentrl.chat.agentrl_format import AgentRLFormat
from agentrl.chat.base import ChatFormat, Content, Marker, Markup, RenderedPrompt
from agentrl.chat.kimi import KimiFormat
from agentrl.chat.kimi_k3 import KimiK3Format
from agentrl.chat.qwen3 import Qwen3Format
from agentrl.chat.tokenizers import HFTokenizer, KimiTokenizer, Tokenizer, has_tokenizer, load_tokenizer

FORMATS: dict[str, type[ChatFormat]] = {cls.name: cls for cls in (AgentRLFormat, KimiFormat, KimiK3Format,
                                                                   Qwen3Format)}
# tokenizer_config.json may name its format (agentrl's builders write it); else it is detected from the tokens
FORMAT_KEY = "agentrl_chat_format"


def format_names() -> list[str]:
    return sorted(FORMATS)


def detect_format(tokenizer: Tokenizer, directory: str | None = None) -> str:
    """The format a checkpoint's tokenizer speaks: its tokenizer_config's `agentrl_chat_format`, else the first
    format (most specific first) whose marker tokens it all has. ValueError when none fits."""
    if directory is not None:
        named = _tokenizer_config(directory).get(FORMAT_KEY)
        if named is not None:
            if named not in FORMATS:
                raise ValueError(f"{directory}/tokenizer_config.json names chat format {named!r}, which is not one "
                                 f"of {format_names()}")
            return named
    for name in _DETECTION_ORDER:
        if name in FORMATS and all(tokenizer.token_id(m) is not None for m in FORMATS[name].markers):
            return name
    raise ValueError(f"cannot tell the chat format of {directory or 'this tokenizer'}: it has the marker tokens of "
                     f"none of {format_names()}; set model.chat_format")


_DETECTION_ORDER = ("kimi_k3", "kimi", "agentrl", "qwen3")


def checkpoint_stop_ids(directory: str) -> list[int]:
    """The ids that end a generation: generation_config.json's `eos_token_id`, else config.json's (int or list)."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
        if value is None and name == "config.json":
            with open(path) as f:
                value = json.load(f).get("text_config", {}).get("eos_token_id")
        if value is not None:
            return [value] if isinstance(value, int) else list(value)
    return []


def get_format(name: str, tokenizer: Tokenizer | None = None, *, stop_ids: list[int] | None = None,
               **options: Any) -> ChatFormat:
    """The format `name` over `tokenizer` (None: text rendering only). ValueError naming the known formats."""
    if name not in FORMATS:
        raise ValueError(f"unknown chat format {name!r}; known formats: {format_names()}")
    return FORMATS[name](tokenizer, stop_ids=stop_ids, **options)


def load_chat_format(directory: str, name: str | None = None, **options: Any) -> ChatFormat:
    """The chat format of the checkpoint (or tokenizer) directory `directory`: its tokenizer, its stop ids, and the
    format `name` or the one detected from the tokenizer."""
    tokenizer = load_tokenizer(directory)
    return get_format(name or detect_format(tokenizer, directory), tokenizer,
                      stop_ids=checkpoint_stop_ids(directory), **options)


def parse_text(text: Any, name: str = "agentrl") -> Any:
    """An AssistantTurn from text in a format's markup (default: agentrl's tag protocol), for humans and tests."""
    return get_format(name).parse_text(text)


def _tokenizer_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


__all__ = [
    "ChatFormat", "Content", "FORMATS", "HFTokenizer", "KimiTokenizer", "Marker", "Markup", "RenderedPrompt",
    "Tokenizer", "detect_format", "format_names", "get_format", "has_tokenizer", "load_chat_format",
    "load_tokenizer", "parse_text", "checkpoint_stop_ids",
]
