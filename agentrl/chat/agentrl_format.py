"""The `agentrl` chat format: ChatML messages and the Hermes-style tag protocol of agentrl's own small models.

    <|im_start|>system\\n{protocol}\\n\\nAvailable tools:\\n<tools>\\n{schema per line}\\n</tools>\\n\\n{instructions}<|im_end|>\\n
    <|im_start|>user\\n{task}<|im_end|>\\n
    <|im_start|>assistant\\n{text}\\n<tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n<tool_response>\\n{result}\\n</tool_response>\\n...\\nError: {problem}<|im_end|>\\n
    <|im_start|>assistant\\n<answer>{answer}</answer><|im_end|>

The tags are single added tokens of agentrl's tokenizer (agentrl/tokenizer.py), so a small model sees the protocol as
a few symbols. Rendering is byte-identical to what agentrl wrote before formats existed (the quickstart's checkpoints
and tokenizer are unchanged) with one deliberate difference: message content (task text, tool schemas and outputs,
the model's own words inside a call) is encoded as ordinary tokens, so a tool output containing `</tool_response>`
or `<|im_end|>` no longer becomes those control tokens. The protocol's own instructions, and the turn-level errors
the parser and the env write (no model or tool text in them: anything derived from the model's words is a call's
error, rendered as that call's result), are template text as before.

One seam is not marker-bounded: the generation prompt ends in the text `assistant\\n`, so a turn whose text starts
with whitespace may tokenize differently when a whole conversation is re-tokenized (the byte-level BPE can merge
`\\n` with following spaces). The rollout never re-tokenizes; only a comparison with `apply_chat_template` sees it.

The parser works on token ids like every format's, and `parse_text` reads the same protocol from text. vLLM's
`hermes` parser reads the same call bodies from decoded text; it knows no `<answer>` tag.
"""

from __future__ import annotations

import json
from typing import Any

from agentrl.chat.base import ChatFormat, Content, Marker, Markup, Piece, Segment, pieces_text, segments_text
from agentrl.envs.turns import AssistantTurn, ToolCall, ToolResults

IM_START, IM_END, EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
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

MAX_CALL_CHARS = 20_000
MAX_ERRORS = 8


def render_tools(schemas: list[dict[str, Any]]) -> str:
    """The tool list for the system prompt: one JSON schema per line between ``<tools>`` tags (Qwen's layout)."""
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return f"<tools>\n{lines}\n</tools>"


class AgentRLFormat(ChatFormat):
    name = "agentrl"
    markers = (IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, RESPONSE_OPEN,
               RESPONSE_CLOSE)
    structural = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
    end_marker = IM_END

    # --- rendering -------------------------------------------------------------------------------------------------
    def prompt_pieces(self, system, tools, user):
        system_pieces: list[Piece] = [Markup(f"{IM_START}system\n{PROTOCOL_INSTRUCTIONS}\n\nAvailable tools:\n"),
                                      Content(render_tools(tools))]
        if system:
            system_pieces += [Markup("\n\n"), Content(system)]
        system_pieces.append(Markup(f"{IM_END}\n"))
        return [("system", system_pieces),
                ("user", [Markup(f"{IM_START}user\n"), Content(user), Markup(f"{IM_END}\n")]),
                ("generation", [Markup(f"{IM_START}assistant\n")])]

    def turn_pieces(self, turn: AssistantTurn) -> list[Piece]:
        pieces: list[Piece] = []
        blocks: list[list[Piece]] = [[Markup(TOOL_CALL_OPEN), Content(_call_json(c)), Markup(TOOL_CALL_CLOSE)]
                                     for c in turn.calls]
        if turn.answer is not None:
            blocks.append([Markup(ANSWER_OPEN), Content(turn.answer), Markup(ANSWER_CLOSE)])
        if turn.content:
            pieces.append(Content(turn.content))
            if blocks:
                pieces.append(Markup("\n"))
        for i, block in enumerate(blocks):
            pieces += ([Markup("\n")] if i else []) + block
        return pieces + [Markup(IM_END)]

    def observation_pieces(self, observation: ToolResults) -> list[Piece]:
        pieces: list[Piece] = [Markup(f"\n{IM_START}tool\n")]
        for i, result in enumerate(observation.results):
            pieces += [Markup(("\n" if i else "") + f"{RESPONSE_OPEN}\n"), Content(result.content),
                       Markup(f"\n{RESPONSE_CLOSE}")]
        if observation.errors:
            # turn-level errors hold no model or tool text (see the module docstring): template text, as before
            pieces.append(Markup(("\n" if observation.results else "")
                                 + "\n".join(f"Error: {e}" for e in observation.errors)))
        return pieces + [Markup(f"{IM_END}\n{IM_START}assistant\n")]

    def template_messages(self, system, tools, user, steps):
        """ChatML messages with text content (the protocol and the tools inside the system message, the tags inside
        the assistant and tool messages), as agentrl's tokenizer's template (agentrl/tokenizer.py) takes them."""
        (_, system_pieces), (_, user_pieces), _ = self.prompt_pieces(system, tools, user)
        messages = [{"role": "system", "content": _unwrap(system_pieces, "system")},
                    {"role": "user", "content": _unwrap(user_pieces, "user")}]
        for turn, observation in steps:
            messages.append({"role": "assistant", "content": pieces_text(self.turn_pieces(turn))[:-len(IM_END)]})
            if observation is not None:
                glue = pieces_text(self.observation_pieces(observation))
                messages.append({"role": "tool", "content": glue[len(f"\n{IM_START}tool\n"):
                                                                 -len(f"{IM_END}\n{IM_START}assistant\n")]})
        return messages

    # --- parsing ---------------------------------------------------------------------------------------------------
    def parse_segments(self, segments: list[Segment], *, cut: bool, max_calls: int) -> AssistantTurn:
        """The tag protocol (`cut` changes nothing: a cut turn is read like any other). A turn with both calls and
        an answer, or with neither, is an error; so are unbalanced or nested tags and broken call JSON."""
        errors: list[str] = []
        bodies = _blocks(segments, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, errors)
        answers = _blocks(segments, ANSWER_OPEN, ANSWER_CLOSE, errors)
        first = next((i for i, s in enumerate(segments) if isinstance(s, Marker)), len(segments))
        content = segments_text(segments[:first])
        content = content[:-1] if first < len(segments) and content.endswith("\n") else content
        calls: list[ToolCall] = []
        for index, body in enumerate(bodies):
            if index >= max_calls:
                errors.append(f"At most {max_calls} tool calls are allowed per message; {len(bodies)} were given "
                              f"and only the first {max_calls} were considered.")
                break
            call, error = _parse_call(body, index)
            if error:
                errors.append(error)
            else:
                calls.append(call)
        if len(answers) > 1:
            errors.append(f"Give exactly one {ANSWER_OPEN}...{ANSWER_CLOSE}; this message has {len(answers)}.")
        answer = answers[0].strip() if len(answers) == 1 else None
        if bodies and answers:
            errors.append(f"A message must either call tools or give the final answer, not both. {FORMAT_HELP}")
            return AssistantTurn(content=content, errors=_capped(errors))
        if not bodies and not answers and not errors:
            errors.append(f"No tool call or answer was found. {FORMAT_HELP}")
        return AssistantTurn(content=content, calls=tuple(calls), answer=answer, errors=_capped(errors))


def _unwrap(pieces: list[Piece], role: str) -> str:
    """A ChatML message's content: its text without `<|im_start|>{role}\\n` and `<|im_end|>\\n`."""
    return pieces_text(pieces)[len(f"{IM_START}{role}\n"):-len(f"{IM_END}\n")]


def _call_json(call: ToolCall) -> str:
    return json.dumps({"name": call.name, "arguments": call.arguments})


def _blocks(segments: list[Segment], open_tag: str, close_tag: str, errors: list[str],
            help_text: str = FORMAT_HELP) -> list[str]:
    """Bodies between balanced tags in one left-to-right pass; reports stray, nested and unclosed tags."""
    opener, closer = Marker(open_tag), Marker(close_tag)
    bodies: list[str] = []
    start: int | None = None
    nested = False
    for i, segment in enumerate(segments):
        if segment == opener:
            nested = start is not None
            start = i + 1  # a nested opener restarts the body: the innermost block is the call
        elif segment == closer:
            if start is None:
                errors.append(f"Found {close_tag} without a matching {open_tag}. {help_text}")
                continue
            if nested:
                errors.append(f"{open_tag} tags cannot be nested; close each one with {close_tag} before the next.")
            bodies.append(segments_text(segments[start:i]))
            start, nested = None, False
    if start is not None:
        errors.append(f"A {open_tag} tag is not closed with {close_tag}. {help_text}")
    return bodies


def _parse_call(body: str, index: int, help_text: str = FORMAT_HELP) -> tuple[ToolCall | None, str | None]:
    where = f"Tool call {index + 1}"
    if len(body) > MAX_CALL_CHARS:
        return None, f"{where} is {len(body)} characters long; the limit is {MAX_CALL_CHARS}."
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: deeply nested brackets
        return None, f"{where} is not valid JSON ({_describe(exc)}). {help_text}"
    return _call_from_object(obj, where)


def _call_from_object(obj: Any, where: str) -> tuple[ToolCall | None, str | None]:
    """A `{"name": ..., "arguments": {...}}` object as a call (the Hermes body, shared with qwen3)."""
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
    return ToolCall(name=name, arguments=arguments), None


def _capped(errors: list[str], limit: int = MAX_ERRORS) -> tuple[str, ...]:
    """At most `limit` errors: a message with thousands of stray tags must not yield a huge observation."""
    if len(errors) <= limit:
        return tuple(errors)
    return (*errors[:limit], f"...and {len(errors) - limit} more problems of the same kinds.")


def _describe(exc: BaseException) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
