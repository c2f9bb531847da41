"""The `kimi_k3` chat format: Kimi K3's XTML encoding, in instruct mode.

Every structure is an element `<|open|>tag attr="value"<|sep|> ... <|close|>tag<|sep|>` made of three control tokens
and plain text (the tag and its attributes; `&` and `"` escaped in attribute values), and every message ends with
`<|end_of_msg|>`:

    <|open|>message role="system" type="tool-declare"<|sep|># Tools\\n...```json\\n{schemas}\\n```<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="system"<|sep|>{system}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>{task}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>response<|sep|>{text}<|close|>response<|sep|>
        <|open|>tools<|sep|><|open|>call tool="{name}" index="1"<|sep|>
            <|open|>argument key="{key}" type="string"<|sep|>{raw text}<|close|>argument<|sep|>
            <|open|>argument key="{key}" type="number"<|sep|>{JSON}<|close|>argument<|sep|> ...
        <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" tool="{name}" index="1"<|sep|>{result}<|close|>message<|sep|><|end_of_msg|>

as K3's encoder writes them and vLLM's `kimi_k3` tool and reasoning parsers read them: the generation prompt opens
the assistant message and its response channel; argument values of type string are raw text, every other type is
JSON (integers have type "number"); tool schemas are dumped with sorted keys and compact separators; a tool result
names its tool and its call's 1-based index. A reply without a tools channel is the final answer. Problems with a
turn as a whole go back as a system message.

agentrl renders instruct mode (K3's `thinking=False`); a think channel the model writes anyway is read as
reasoning. K3 ships no Jinja template (its encoder is Python code in the checkpoint), so there is no
`apply_chat_template` to compare with; the tests compare turns with vLLM's own K3 parser instead.

Token-level parsing fixes the ambiguity vLLM's text parser documents: a raw string value containing
`<|close|>argument<|sep|>` is ordinary text here, since only the control ids are structure.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agentrl.chat.base import CUT_TURN, ChatFormat, Content, Marker, Markup, Piece, Segment, segments_text
from agentrl.chat.tokenizers import deep_sorted
from agentrl.envs.turns import AssistantTurn, ToolCall, ToolResults

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
TOOLS_DECLARATION = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
_ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')
MAX_ARGUMENT_CHARS = 20_000


def escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def open_tag(tag: str, *attributes: tuple[str, Any]) -> list[Piece]:
    """`<|open|>tag key="value" ...<|sep|>`: attribute values are data (escaped, ordinary tokens)."""
    pieces: list[Piece] = [Markup(OPEN + tag)]
    for key, value in attributes:
        pieces += [Markup(f' {key}="'), Content(escape(value)), Markup('"')]
    return pieces + [Markup(SEP)]


def close_tag(tag: str) -> list[Piece]:
    return [Markup(f"{CLOSE}{tag}{SEP}")]


def xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


class KimiK3Format(ChatFormat):
    name = "kimi_k3"
    markers = (OPEN, CLOSE, SEP, END_OF_MSG)
    structural = (OPEN, CLOSE, SEP)
    end_marker = END_OF_MSG

    # --- rendering -------------------------------------------------------------------------------------------------
    def prompt_pieces(self, system, tools, user):
        pieces: list[Piece] = []
        if tools:
            schemas = json.dumps(deep_sorted(tools), separators=(",", ":"), ensure_ascii=False)
            pieces += [*open_tag("message", ("role", "system"), ("type", "tool-declare")), Markup(TOOLS_DECLARATION),
                       Content(schemas), Markup("\n```"), *_end_message()]
        if system:
            pieces += [*open_tag("message", ("role", "system")), Content(system), *_end_message()]
        return [("system", pieces),
                ("user", [*open_tag("message", ("role", "user")), Content(user), *_end_message()]),
                ("generation", _generation())]

    def turn_pieces(self, turn: AssistantTurn) -> list[Piece]:
        text = turn.answer if turn.answer is not None else turn.content
        pieces: list[Piece] = [Content(text), *close_tag("response")] if text else close_tag("response")
        if turn.calls:
            pieces += open_tag("tools")
            for i, call in enumerate(turn.calls):
                pieces += open_tag("call", ("tool", call.name), ("index", i + 1))
                for key, value in call.arguments.items():
                    rendered = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                    pieces += [*open_tag("argument", ("key", key), ("type", xtml_type(value))), Content(rendered),
                               *close_tag("argument")]
                pieces += close_tag("call")
            pieces += close_tag("tools")
        return pieces + _end_message()

    def observation_pieces(self, observation: ToolResults) -> list[Piece]:
        pieces: list[Piece] = []
        for i, result in enumerate(observation.results):
            pieces += [*open_tag("message", ("role", "tool"), ("tool", result.name), ("index", i + 1)),
                       Content(result.content), *_end_message()]
        if observation.errors:
            pieces += [*open_tag("message", ("role", "system")),
                       Content("\n".join(f"Error: {e}" for e in observation.errors)), *_end_message()]
        return pieces + _generation()

    # --- parsing ---------------------------------------------------------------------------------------------------
    def parse_segments(self, segments: list[Segment], *, cut: bool, max_calls: int) -> AssistantTurn:
        """The reply after the generation prompt: [think element] response text, its close, an optional tools
        element, the message's close. Never raises (parse_turn guards it)."""
        reader = _Reader(segments)
        errors: list[str] = []
        reasoning = None
        if reader.at_open("think"):
            reasoning = reader.element_text("think", errors)
        if reader.at_open("response"):  # tolerated: the prompt already opened it
            reader.open_tag()
        content = reader.text()
        if not reader.close("response"):
            if cut:
                return AssistantTurn(content=content, reasoning=reasoning, errors=(CUT_TURN,))
            errors.append(f"The response is not closed with {CLOSE}response{SEP}.")
        calls: list[ToolCall] = []
        if reader.at_open("tools"):
            reader.open_tag()
            calls = _read_calls(reader, errors, cut)
        reader.text()
        closed = reader.close("message")
        rest = reader.rest()
        if cut and not closed and not calls and not errors:
            errors.append(CUT_TURN)
        elif rest and not errors:
            errors.append(f"Unexpected structure after the reply: {rest[:80]!r}.")
        if len(calls) > max_calls:
            errors.append(f"At most {max_calls} tool calls are allowed per message; {len(calls)} were given and only "
                          f"the first {max_calls} were considered.")
            calls = calls[:max_calls]
        if calls or errors:
            return AssistantTurn(content=content, calls=tuple(calls), reasoning=reasoning, errors=tuple(errors[:8]))
        return AssistantTurn(content=content, answer=content.strip(), reasoning=reasoning)


def _generation() -> list[Piece]:
    return [*open_tag("message", ("role", "assistant")), *open_tag("response")]


def _end_message() -> list[Piece]:
    return [*close_tag("message"), Markup(END_OF_MSG)]


def _read_calls(reader: _Reader, errors: list[str], cut: bool) -> list[ToolCall]:
    calls: list[ToolCall] = []
    while True:
        stray = reader.text()
        if stray.strip():
            errors.append(f"Text between tool calls was ignored: {stray.strip()[:60]!r}.")
        if reader.close("tools"):
            return calls
        if not reader.at_open("call"):
            errors.append(CUT_TURN if cut and reader.done()
                          else f"The tools channel is not closed with {CLOSE}tools{SEP}.")
            return calls
        attributes = reader.open_tag()
        name = attributes.get("tool", "")
        where = f"Tool call {len(calls) + 1}"
        arguments: dict[str, Any] = {}
        problem = None
        while not reader.close("call"):
            if reader.text().strip():
                problem = problem or f"{where}: text outside an argument element."
            if reader.at_open("argument"):
                attrs = reader.open_tag()
                value = reader.text()
                if not reader.close("argument"):
                    errors.append(CUT_TURN if cut and reader.done() else f"{where}: an argument is not closed.")
                    return calls
                key, kind = attrs.get("key", ""), attrs.get("type", "string")
                if len(value) > MAX_ARGUMENT_CHARS:
                    problem = problem or f"{where}: argument {key!r} is {len(value)} characters long."
                elif kind == "string":
                    arguments[key] = value
                else:
                    try:
                        arguments[key] = json.loads(value)
                    except (ValueError, RecursionError):
                        problem = problem or f"{where}: argument {key!r} of type {kind} is not valid JSON."
            elif reader.at_open("json"):
                reader.open_tag()
                value = reader.text()
                reader.close("json")
                try:
                    loaded = json.loads(value)
                except (ValueError, RecursionError):
                    loaded = None
                if isinstance(loaded, dict):
                    arguments.update(loaded)
                else:
                    problem = problem or f"{where}: its json block is not a valid JSON object."
            else:
                errors.append(CUT_TURN if cut and reader.done() else f"{where} is not closed with {CLOSE}call{SEP}.")
                return calls
        if not name:
            errors.append(f"{where} names no tool (tool=\"...\").")
            continue
        calls.append(ToolCall(name, arguments if problem is None else {}, error=problem))


class _Reader:
    """A cursor over segments with the XTML element grammar."""

    def __init__(self, segments: list[Segment]):
        self.segments, self.i = segments, 0

    def done(self) -> bool:
        return self.i >= len(self.segments)

    def text(self) -> str:
        parts = []
        while self.i < len(self.segments) and not isinstance(self.segments[self.i], Marker):
            parts.append(self.segments[self.i])
            self.i += 1
        return "".join(parts)

    def _tag_at(self, marker: str) -> str | None:
        """The head text of the element `marker head <|sep|>` at the cursor, or None."""
        s, i = self.segments, self.i
        if i + 2 < len(s) and s[i] == Marker(marker) and isinstance(s[i + 1], str) and s[i + 2] == Marker(SEP):
            return s[i + 1]
        return None

    def at_open(self, tag: str) -> bool:
        head = self._tag_at(OPEN)
        return head is not None and head.split(" ", 1)[0].strip() == tag

    def open_tag(self) -> dict[str, str]:
        head = self._tag_at(OPEN) or ""
        self.i += 3
        return {k: unescape(v) for k, v in _ATTRIBUTE.findall(head)}

    def close(self, tag: str) -> bool:
        head = self._tag_at(CLOSE)
        if head is not None and head.strip() == tag:
            self.i += 3
            return True
        return False

    def element_text(self, tag: str, errors: list[str]) -> str:
        self.open_tag()
        text = self.text()
        if not self.close(tag):
            errors.append(f"The {tag} channel is not closed with {CLOSE}{tag}{SEP}.")
        return text

    def rest(self) -> str:
        rest = segments_text(self.segments[self.i:])
        self.i = len(self.segments)
        return rest
