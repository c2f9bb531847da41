"""The `kimi` chat format: Kimi Linear and Kimi K2 Instruct's template and native tool calls.

    <|im_system|>tool_declare<|im_middle|>[{...tool schemas, keys sorted, compact...}]<|im_end|>
    <|im_system|>system<|im_middle|>{system}<|im_end|>
    <|im_user|>user<|im_middle|>{task}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{text}<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{json}<|tool_call_end|> ...
    <|tool_calls_section_end|><|im_end|>
    <|im_system|>{name}<|im_middle|>## Return of functions.{name}:{index}\\n{result}<|im_end|>  (one per result)
    <|im_assistant|>assistant<|im_middle|>{final answer}<|im_end|>

No separators between messages; without a system prompt the template's default one ("You are Kimi, ...") is
rendered. The tool declaration is the released tokenizer's: schemas with their keys sorted at every level
(`TikTokenTokenizer.apply_chat_template`), dumped with compact separators. A call's id is `functions.{name}:{index}`
(index 0-based within the turn), which is where vLLM's `kimi_k2` parser reads the name from (a call or result whose
id has another format's form is rendered with that canonical id); arguments are the JSON the model wrote. A message without a tool-call section is the final answer: Kimi models have no answer tag. Problems
with a turn as a whole go back as a system message after the results; a call whose id was read but whose arguments
were not becomes an error result for that id.

The parser splits on the section and call marker ids (vLLM's parser engine matches them in decoded text, so a
marker string a tool returned and the model copied would read as structure there, and as text here); otherwise it
reads a turn as vLLM does: the text before the section is content, the id before `<|tool_call_argument_begin|>`
must look like `...:N`, empty arguments are `{}`, text after the section is ignored.
"""

from __future__ import annotations

import json
import re
from agentrl.chat.base import CUT_TURN, ChatFormat, Content, Marker, Markup, Piece, Segment, segments_text
from agentrl.chat.tokenizers import deep_sorted
from agentrl.envs.turns import AssistantTurn, ToolCall, ToolResults

IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
_CALL_ID = re.compile(r".+:\d+", re.S)
MAX_CALL_CHARS = 20_000


def call_id(name: str, index: int, given: str = "") -> str:
    """The id a Kimi model writes for call `index` of a turn: `given` if it has Kimi's form (the model wrote it),
    else `functions.{name}:{index}` (a call from an oracle, or named by another format's convention)."""
    return given if _CALL_ID.fullmatch(given) else f"functions.{name}:{index}"


class KimiFormat(ChatFormat):
    name = "kimi"
    markers = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END, SECTION_BEGIN, SECTION_END, CALL_BEGIN,
               ARGUMENT_BEGIN, CALL_END)
    structural = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
    end_marker = IM_END

    # --- rendering -------------------------------------------------------------------------------------------------
    def prompt_pieces(self, system, tools, user):
        messages: list[tuple[str, list[Piece]]] = []
        declare: list[Piece] = []
        if tools:
            schemas = json.dumps(deep_sorted(tools), separators=(",", ":"), ensure_ascii=False)
            declare = [Markup(f"{IM_SYSTEM}tool_declare{IM_MIDDLE}"), Content(schemas), Markup(IM_END)]
        messages.append(("system", declare + _message(IM_SYSTEM, "system", system or DEFAULT_SYSTEM)))
        messages.append(("user", _message(IM_USER, "user", user)))
        messages.append(("generation", [Markup(f"{IM_ASSISTANT}assistant{IM_MIDDLE}")]))
        return messages

    def turn_pieces(self, turn: AssistantTurn) -> list[Piece]:
        text = turn.answer if turn.answer is not None else turn.content
        pieces: list[Piece] = [Content(text)] if text else []
        if turn.calls:
            pieces.append(Markup(SECTION_BEGIN))
            for i, call in enumerate(turn.calls):
                pieces += [Markup(CALL_BEGIN), Content(call_id(call.name, i, call.id)), Markup(ARGUMENT_BEGIN),
                           Content(json.dumps(call.arguments, ensure_ascii=False)), Markup(CALL_END)]
            pieces.append(Markup(SECTION_END))
        return pieces + [Markup(IM_END)]

    def observation_pieces(self, observation: ToolResults) -> list[Piece]:
        pieces: list[Piece] = []
        for i, result in enumerate(observation.results):  # one result per call, in call order
            pieces += [Markup(IM_SYSTEM), Content(result.name or "tool"), Markup(f"{IM_MIDDLE}## Return of "),
                       Content(call_id(result.name, i, result.call_id)), Markup("\n"), Content(result.content),
                       Markup(IM_END)]
        if observation.errors:
            pieces += _message(IM_SYSTEM, "system", "\n".join(f"Error: {e}" for e in observation.errors))
        return pieces + [Markup(f"{IM_ASSISTANT}assistant{IM_MIDDLE}")]

    # --- parsing ---------------------------------------------------------------------------------------------------
    def parse_segments(self, segments: list[Segment], *, cut: bool, max_calls: int) -> AssistantTurn:
        begin = Marker(SECTION_BEGIN)
        if begin not in segments:
            content = segments_text(segments)
            stray = [s.text for s in segments if isinstance(s, Marker)]
            if stray:
                return AssistantTurn(content=content, errors=(
                    f"{stray[0]} appeared outside a tool call section; write calls as {_FORMAT_HELP}.",))
            if cut:
                return AssistantTurn(content=content, errors=(CUT_TURN,))
            return AssistantTurn(content=content, answer=content.strip())
        at = segments.index(begin)
        content = segments_text(segments[:at])
        errors: list[str] = []
        if any(isinstance(s, Marker) for s in segments[:at]):
            errors.append(f"Tool call markers appeared before {SECTION_BEGIN}.")
        section = segments[at + 1:]
        if Marker(SECTION_END) in section:
            section = section[:section.index(Marker(SECTION_END))]  # text after the section is ignored
        else:
            errors.append(CUT_TURN if cut else f"The tool call section is not closed with {SECTION_END}.")
        calls = _read_calls(section, errors)
        if not calls and not errors:
            errors.append(f"The tool call section holds no call; write calls as {_FORMAT_HELP}.")
        if len(calls) > max_calls:
            errors.append(f"At most {max_calls} tool calls are allowed per message; {len(calls)} were given and only "
                          f"the first {max_calls} were considered.")
            calls = calls[:max_calls]
        return AssistantTurn(content=content, calls=tuple(calls), errors=tuple(errors[:8]))


_FORMAT_HELP = (f"{SECTION_BEGIN}{CALL_BEGIN}functions.NAME:0{ARGUMENT_BEGIN}{{...JSON arguments...}}{CALL_END}"
                f"{SECTION_END}")


def _message(start: str, role: str, text: str) -> list[Piece]:
    return [Markup(f"{start}{role}{IM_MIDDLE}"), Content(text), Markup(IM_END)]


def _read_calls(section: list[Segment], errors: list[str]) -> list[ToolCall]:
    """The calls of a section: CALL_BEGIN id ARGUMENT_BEGIN json CALL_END, repeated; whitespace between is fine."""
    calls: list[ToolCall] = []
    i, index = 0, -1
    while i < len(section):
        segment = section[i]
        if not isinstance(segment, Marker):
            if segment.strip():
                errors.append(f"Text between tool calls was ignored: {segment.strip()[:60]!r}.")
            i += 1
            continue
        if segment.text != CALL_BEGIN:
            errors.append(f"{segment.text} appeared where {CALL_BEGIN} was expected.")
            i += 1
            continue
        index += 1
        header, rest = _until(section, i + 1, ARGUMENT_BEGIN)
        if rest is None:
            errors.append(f"Tool call {index + 1} has no {ARGUMENT_BEGIN}.")
            return calls
        body, end = _until(section, rest + 1, CALL_END)
        if end is None:
            errors.append(f"Tool call {index + 1} is not closed with {CALL_END}.")
            return calls
        call = _call(header, body, index, errors)
        if call is not None:
            calls.append(call)
        i = end + 1
    return calls


def _until(section: list[Segment], start: int, marker: str) -> tuple[str, int | None]:
    """The text from `start` to the next `marker` (and its index); (text, None) if another marker or the end comes
    first."""
    parts = []
    for j in range(start, len(section)):
        segment = section[j]
        if isinstance(segment, Marker):
            return "".join(parts), (j if segment.text == marker else None)
        parts.append(segment)
    return "".join(parts), None


def _call(header: str, body: str, index: int, errors: list[str]) -> ToolCall | None:
    where = f"Tool call {index + 1}"
    identifier = header.strip()
    if not _CALL_ID.fullmatch(identifier):
        errors.append(f"{where}: its id {identifier[:80]!r} is not of the form functions.NAME:INDEX.")
        return None
    name = identifier.split(":")[0].removeprefix("functions.")
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(name, {}, identifier, f"{where}: the arguments are {len(body)} characters long; the limit is "
                                              f"{MAX_CALL_CHARS}.")
    try:
        arguments = json.loads(body.strip() or "{}")
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        return ToolCall(name, {}, identifier, f"{where}: the arguments are not valid JSON ({reason}).")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, identifier, f"{where}: the arguments must be a JSON object.")
    return ToolCall(name, arguments, identifier)
