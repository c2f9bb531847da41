"""The tool-call protocol: how the model calls tools and answers, and how results come back.

The format is the Hermes/Qwen one that open chat templates and vLLM's ``hermes`` tool parser already use::

    Some reasoning, then one or more calls:
    <tool_call>{"name": "calculate", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>

    ...and, in a later message, the final answer with no tool calls:
    <answer>27</answer>

Each result comes back in order, one ``<tool_response>`` block per call. ``parse_turn`` never raises: whatever the
model wrote (missing or unbalanced tags, broken or deeply nested JSON, huge arguments, too many calls, a call and an
answer together, not even a string) it returns the well-formed calls plus a list of errors that say what was wrong,
which the env shows the model as its next observation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

FORMAT_HELP = (f'Call a tool with {TOOL_CALL_OPEN}{{"name": "<tool>", "arguments": {{...}}}}{TOOL_CALL_CLOSE}, '
               f"or give the final answer with {ANSWER_OPEN}...{ANSWER_CLOSE}.")

PROTOCOL_INSTRUCTIONS = f"""\
You solve the task by calling tools. To call a tool, write a JSON object with the tool's name and arguments between \
{TOOL_CALL_OPEN} and {TOOL_CALL_CLOSE} tags:
{TOOL_CALL_OPEN}{{"name": "<tool name>", "arguments": {{"<argument>": <value>}}}}{TOOL_CALL_CLOSE}
You may call several tools in one message; each result comes back in order inside \
{RESPONSE_OPEN}{RESPONSE_CLOSE} tags.
When you know the final answer, reply with {ANSWER_OPEN}your answer{ANSWER_CLOSE} and no tool calls."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One well-formed call: its id (``call_<turn>_<index>``), tool name and JSON arguments."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """What an assistant message contained. ``errors`` non-empty means the message was (partly) malformed."""

    calls: tuple[ToolCall, ...] = ()
    answer: str | None = None
    errors: tuple[str, ...] = field(default=())

    @property
    def malformed(self) -> bool:
        return bool(self.errors)


def parse_turn(text: Any, *, turn: int = 0, max_calls: int = 8, max_call_chars: int = 20_000) -> ParsedTurn:
    """Parse one assistant message. Never raises.

    Calls beyond ``max_calls`` and call bodies over ``max_call_chars`` are errors. A message with both calls and an
    answer is an error (nothing runs and nothing is answered), as is one with neither.
    """
    if not isinstance(text, str):
        return ParsedTurn(errors=(f"The message must be text, got {type(text).__name__}. {FORMAT_HELP}",))
    errors: list[str] = []
    bodies = _blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, errors)
    answers = _blocks(text, ANSWER_OPEN, ANSWER_CLOSE, errors)
    calls: list[ToolCall] = []
    for index, body in enumerate(bodies):
        if index >= max_calls:
            errors.append(f"At most {max_calls} tool calls are allowed per message; {len(bodies)} were given and "
                          f"only the first {max_calls} were considered.")
            break
        call, error = _parse_call(body, index, turn, max_call_chars)
        if error:
            errors.append(error)
        else:
            calls.append(call)
    if len(answers) > 1:
        errors.append(f"Give exactly one {ANSWER_OPEN}...{ANSWER_CLOSE}; this message has {len(answers)}.")
    answer = answers[0].strip() if len(answers) == 1 else None
    if bodies and answers:
        errors.append(f"A message must either call tools or give the final answer, not both. {FORMAT_HELP}")
        return ParsedTurn(errors=_capped(errors))
    if not bodies and not answers and not errors:
        errors.append(f"No tool call or answer was found. {FORMAT_HELP}")
    return ParsedTurn(calls=tuple(calls), answer=answer, errors=_capped(errors))


def _blocks(text: str, open_tag: str, close_tag: str, errors: list[str]) -> list[str]:
    """Bodies between balanced tags, scanning left to right in linear time; reports stray and unclosed tags."""
    bodies, pos = [], 0
    while True:
        start = text.find(open_tag, pos)
        stray = text.find(close_tag, pos)
        if stray != -1 and (start == -1 or stray < start):
            errors.append(f"Found {close_tag} without a matching {open_tag}. {FORMAT_HELP}")
            pos = stray + len(close_tag)
            continue
        if start == -1:
            return bodies
        end = text.find(close_tag, start + len(open_tag))
        if end == -1:
            errors.append(f"A {open_tag} tag is not closed with {close_tag}. {FORMAT_HELP}")
            return bodies
        body = text[start + len(open_tag):end]
        if open_tag in body:
            errors.append(f"{open_tag} tags cannot be nested; close each one with {close_tag} before the next.")
            body = body[body.rfind(open_tag) + len(open_tag):]
        bodies.append(body)
        pos = end + len(close_tag)


def _parse_call(body: str, index: int, turn: int, max_chars: int) -> tuple[ToolCall | None, str | None]:
    where = f"Tool call {index + 1}"
    if len(body) > max_chars:
        return None, f"{where} is {len(body)} characters long; the limit is {max_chars}."
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: deeply nested brackets
        return None, f"{where} is not valid JSON ({_describe(exc)}). {FORMAT_HELP}"
    if not isinstance(obj, dict):
        return None, f'{where} must be a JSON object like {{"name": ..., "arguments": {{...}}}}, got {_kind(obj)}.'
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f'{where} needs a "name" string naming the tool.'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models send OpenAI-style stringified arguments
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return None, f'{where}: "arguments" is a string that is not valid JSON ({_describe(exc)}).'
    if not isinstance(arguments, dict):
        return None, f'{where}: "arguments" must be a JSON object, got {_kind(arguments)}.'
    return ToolCall(id=f"call_{turn}_{index}", name=name, arguments=arguments), None


def _capped(errors: list[str], limit: int = 8) -> tuple[str, ...]:
    """At most ``limit`` errors: a message with thousands of stray tags must not yield a huge observation."""
    if len(errors) <= limit:
        return tuple(errors)
    return (*errors[:limit], f"...and {len(errors) - limit} more problems of the same kinds.")


def _describe(exc: BaseException) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def render_tools(schemas: Iterable[Mapping[str, Any]]) -> str:
    """The tool list for a system prompt: one JSON schema per line between ``<tools>`` tags (Qwen's layout)."""
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return f"<tools>\n{lines}\n</tools>"


def render_response(content: str) -> str:
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def render_errors(errors: Iterable[str]) -> str:
    return "\n".join(f"Error: {error}" for error in errors)
