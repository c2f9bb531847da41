"""The chat-format interface, and the one renderer all formats share.

A format writes each message as a list of pieces: ``Markup`` (its template's own text, where marker strings stand
for their control tokens) and ``Content`` (message text: a system prompt, a task, a tool's output, a model's words,
encoded as ordinary tokens whatever it contains, so a tool that prints ``<|im_end|>`` cannot end a turn or forge a
message). ``encode_pieces`` turns pieces into ids: markup is split at the tokenizer's added tokens, and the plain
text between two control tokens, markup and content alike, is encoded as one run, exactly as a tokenizer encodes a
rendered template. Rendering a conversation turn by turn therefore gives the same ids as rendering it whole wherever
a turn boundary sits next to a control token (every format's boundaries but the agentrl format's generation prompt;
see agentrl_format.py).

Parsing works on token ids: the turn is split at the format's structural marker ids and only the text between them
is decoded, so marker *strings* the model copied from a tool's output are text, never structure. ``parse_turn``
never raises: whatever the model wrote, it returns the calls it could read and errors saying what was wrong.
"""

from __future__ import annotations

import functools
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agentrl.chat.tokenizers import Tokenizer
from agentrl.envs.turns import AssistantTurn, ToolResults

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Markup:
    """Template text: marker strings in it become their control ids."""

    text: str


@dataclass(frozen=True, slots=True)
class Content:
    """Message text: ordinary tokens only."""

    text: str


Piece = Markup | Content


@dataclass(frozen=True, slots=True)
class Marker:
    """A structural control token in a parsed turn."""

    text: str


Segment = str | Marker  # a parsed turn: decoded text between markers, and the markers

# formats whose final answer is the message itself never take a turn cut at its token limit as the answer
CUT_TURN = "The message was cut at the token limit before it ended: it is not taken as the final answer."


@dataclass(kw_only=True, slots=True)
class RenderedPrompt:
    """A rendered prompt: its ids, the messages it holds as (role, start, end, text) spans, and where generation
    starts (the assistant header after the last span)."""

    ids: list[int]
    spans: list[tuple[str, int, int, str]] = field(default_factory=list)


def encode_pieces(tokenizer: Tokenizer, pieces: Sequence[Piece]) -> list[int]:
    """Ids of `pieces`: markup split at added tokens; the text between control tokens encoded as one run."""
    ids: list[int] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            ids.extend(tokenizer.encode_text("".join(run)))
            run.clear()

    pattern = _markup_pattern(tokenizer.added_tokens)
    for piece in pieces:
        if isinstance(piece, Content):
            run.append(piece.text)
            continue
        for text, token in _split_markup(piece.text, pattern):
            if token is None:
                run.append(text)
            else:
                flush()
                ids.append(tokenizer.token_id(token))
    flush()
    return ids


@functools.lru_cache(maxsize=32)
def _markup_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    """An alternation of `tokens`, longest first: at the leftmost position where any matches, the longest wins."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) or r"(?!)")


def _split_markup(text: str, pattern: re.Pattern) -> list[tuple[str, str | None]]:
    """`text` as (plain text, None) and (marker, marker) parts, taking the leftmost and then longest marker."""
    out: list[tuple[str, str | None]] = []
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            out.append((text[pos:match.start()], None))
        out.append((match.group(), match.group()))
        pos = match.end()
    if pos < len(text):
        out.append((text[pos:], None))
    return out


def pieces_text(pieces: Sequence[Piece]) -> str:
    """The text `pieces` render to (what a Jinja template would produce)."""
    return "".join(p.text for p in pieces)


class ChatFormat(ABC):
    """One model family's template and tool-call grammar (see the module docstring).

    A subclass declares `markers` (strings that must each be one token of the tokenizer), `structural` (the markers
    its parser splits on) and `end_marker` (what closes an assistant turn), and writes the pieces of a prompt, of an
    assistant turn as the model samples it, and of the glue that follows a sampled turn; and parses segments.
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]
    structural: ClassVar[tuple[str, ...]]
    end_marker: ClassVar[str]

    def __init__(self, tokenizer: Tokenizer | None = None, *, stop_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        self._messages: dict[tuple[Piece, ...], tuple[tuple[int, ...], str]] = {}  # see _encoded_message
        if tokenizer is None:
            self.stop_ids: tuple[int, ...] = tuple(stop_ids or ())
            return
        missing = [m for m in self.markers if tokenizer.token_id(m) is None]
        if missing:
            raise ValueError(f"the {self.name!r} chat format needs these tokens, which the tokenizer of "
                             f"{tokenizer.directory or 'this checkpoint'} lacks: {missing}; choose the model's own "
                             "format with model.chat_format")
        self._structural_ids = {tokenizer.token_id(m): m for m in self.structural}
        self.end_id = tokenizer.token_id(self.end_marker)
        self.stop_ids = tuple(stop_ids) if stop_ids else (self.end_id,)

    # --- what a format writes ------------------------------------------------------------------------------------
    @abstractmethod
    def prompt_pieces(self, system: str, tools: list[dict[str, Any]], user: str) -> list[tuple[str, list[Piece]]]:
        """The prompt as (role, pieces) messages, then ("generation", the assistant header the model continues)."""

    @abstractmethod
    def turn_pieces(self, turn: AssistantTurn) -> list[Piece]:
        """An assistant turn as the model would write it after the header, ending with `end_marker`."""

    @abstractmethod
    def observation_pieces(self, observation: ToolResults) -> list[Piece]:
        """What follows a closed assistant turn: the tool results (and errors), then the next assistant header."""

    @abstractmethod
    def parse_segments(self, segments: list[Segment], *, cut: bool, max_calls: int) -> AssistantTurn:
        """An assistant turn from its segments (`cut`: it ended at the token limit, not at a stop token)."""

    def template_messages(self, system: str, tools: list[dict[str, Any]], user: str,
                          steps: Sequence[tuple[AssistantTurn, ToolResults | None]]) -> list[dict[str, Any]]:
        """The conversation as the chat messages the model's Jinja template takes (for tests against
        `apply_chat_template`, which gets `tools` separately): OpenAI-style with structured `tool_calls`."""
        messages: list[dict[str, Any]] = ([{"role": "system", "content": system}] if system else [])
        messages.append({"role": "user", "content": user})
        for turn, observation in steps:
            message: dict[str, Any] = {"role": "assistant",
                                       "content": turn.answer if turn.answer is not None else turn.content}
            if turn.reasoning is not None:
                message["reasoning_content"] = turn.reasoning
            if turn.calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in turn.calls]
            messages.append(message)
            if observation is not None:
                messages += [{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content}
                             for r in observation.results]
                if observation.errors:
                    messages.append(self.errors_message(observation.errors))
        return messages

    def errors_message(self, errors: Sequence[str]) -> dict[str, Any]:
        """The chat message a turn's errors are rendered as (a system message unless the format says otherwise)."""
        return {"role": "system", "content": "\n".join(f"Error: {e}" for e in errors)}

    # --- ids -------------------------------------------------------------------------------------------------------
    def render_prompt(self, system: str, tools: list[dict[str, Any]], user: str) -> RenderedPrompt:
        """The prompt's ids (ending with the assistant header); its messages' spans carry their decoded text."""
        ids: list[int] = []
        spans = []
        for role, pieces in self.prompt_pieces(system, tools, user):
            start = len(ids)
            if role == "user":
                ids += self.encode(pieces)
                text = self.tokenizer.decode(ids[start:])
            else:
                message_ids, text = self._encoded_message(tuple(pieces))
                ids += message_ids
            if role != "generation":
                spans.append((role, start, len(ids), text))
        return RenderedPrompt(ids=ids, spans=spans)

    def _encoded_message(self, pieces: tuple[Piece, ...]) -> tuple[tuple[int, ...], str]:
        """(ids, decoded text) of a message's pieces, remembered: every episode of an env renders the same system
        message with the same tool schemas (half of a prompt's render time is the tool JSON's encoding), and the same
        generation header. Each message is encoded on its own, so a remembered one has the ids rendering gives."""
        hit = self._messages.get(pieces)
        if hit is None:
            if len(self._messages) >= 64:  # an env whose system message varies per task: bounded, not a leak
                self._messages.clear()
            ids = self.encode(pieces)
            hit = self._messages[pieces] = (tuple(ids), self.tokenizer.decode(ids))
        return hit

    def render_turn(self, turn: AssistantTurn) -> list[int]:
        return self.encode(self.turn_pieces(turn))

    def close_cut_turn(self) -> list[int]:
        """What closes a turn that ended at its token limit instead of a stop token (appended as prompt tokens)."""
        return [self.end_id]

    def render_observation(self, observation: ToolResults, *, after_cut: bool = False) -> list[int]:
        """The glue after a sampled turn; `after_cut`: the turn ended at its token limit and is closed first."""
        return (self.close_cut_turn() if after_cut else []) + self.encode(self.observation_pieces(observation))

    def encode(self, pieces: Sequence[Piece]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"the {self.name!r} chat format was built without a tokenizer: it renders text only")
        return encode_pieces(self.tokenizer, pieces)

    def parse_turn(self, ids: Sequence[int], *, cut: bool = False, max_calls: int = 8) -> AssistantTurn:
        """An assistant turn from its sampled ids (the end marker and stop ids, if present, are not part of it).
        Never raises."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        try:
            return self.parse_segments(self.segments(ids), cut=cut, max_calls=max_calls)
        except Exception as exc:  # noqa: BLE001 - a parser bug must reach the model as an error, not crash the loop
            log.exception("the %s parser failed on a turn of %d tokens", self.name, len(ids))
            return AssistantTurn(content=self.tokenizer.decode(ids), errors=(f"The message could not be read "
                                                                             f"({type(exc).__name__}).",))

    def parse_text(self, text: Any, *, cut: bool = False, max_calls: int = 8) -> AssistantTurn:
        """An assistant turn from text, marker strings read as markers (for humans and tests). Never raises."""
        if not isinstance(text, str):
            return AssistantTurn(errors=(f"The message must be text, got {type(text).__name__}.",))
        segments: list[Segment] = []
        for part, marker in _split_markup(text, _markup_pattern(tuple(self.structural))):
            segments.append(Marker(marker) if marker else part)
        return self.parse_segments(segments, cut=cut, max_calls=max_calls)

    def segments(self, ids: Sequence[int]) -> list[Segment]:
        """`ids` split at the structural marker ids; the text between decoded."""
        out: list[Segment] = []
        start = 0
        for i, token in enumerate(ids):
            marker = self._structural_ids.get(token)
            if marker is not None:
                if i > start:
                    out.append(self.tokenizer.decode(ids[start:i]))
                out.append(Marker(marker))
                start = i + 1
        if start < len(ids):
            out.append(self.tokenizer.decode(ids[start:]))
        return out

    # --- text (no tokenizer needed) --------------------------------------------------------------------------------
    def conversation_text(self, system: str, tools: list[dict[str, Any]], user: str,
                          steps: Sequence[tuple[AssistantTurn, ToolResults | None]]) -> str:
        """A whole conversation rendered as text (what its template would print), e.g. for tokenizer training."""
        parts = [pieces_text(p) for _, p in self.prompt_pieces(system, tools, user)]
        for turn, observation in steps:
            parts.append(pieces_text(self.turn_pieces(turn)))
            if observation is not None:
                parts.append(pieces_text(self.observation_pieces(observation)))
        return "".join(parts)

    def conversation_ids(self, system: str, tools: list[dict[str, Any]], user: str,
                         steps: Sequence[tuple[AssistantTurn, ToolResults | None]]) -> list[int]:
        """A whole conversation rendered at once (one encoding pass over all its pieces)."""
        pieces: list[Piece] = []
        for role, p in self.prompt_pieces(system, tools, user):
            pieces += p
        for turn, observation in steps:
            pieces += self.turn_pieces(turn)
            if observation is not None:
                pieces += self.observation_pieces(observation)
        return self.encode(pieces)


def segments_text(segments: Sequence[Segment]) -> str:
    return "".join(s.text if isinstance(s, Marker) else s for s in segments)
