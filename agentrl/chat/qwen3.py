"""The `qwen3` chat format: Qwen3's ChatML template with Hermes tool calls and a thinking block.

    <|im_start|>system\\n{system}\\n\\n# Tools\\n\\n...<tools>\\n{schema per line}\\n</tools>\\n\\n...<|im_end|>\\n
    <|im_start|>user\\n{task}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{text}\\n<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>\\n<tool_response>...<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n...\\n</think>\\n\\n{final answer}<|im_end|>

Thinking mode (Qwen3's default, `thinking=True`): the model writes its think block, then the reply. With
`thinking=False` the empty think block is part of the generation prompt, as the template's `enable_thinking=false`
writes it. Results of one turn share one user message; problems with the turn as a whole are a last
`<tool_response>` holding the errors. A message without calls is the final answer.

Against the template: Qwen3's template drops the think block of every assistant turn before the last one when its
reasoning is empty (and of every turn before the last real user message). Turn-by-turn rendering keeps what the
model saw, so a conversation equals the template's rendering when every turn but the last carries reasoning (what
a thinking model writes); with `thinking=False` or empty reasoning the template would re-render history the model
never saw, which agentrl never does.

The parser splits on `<think>`, `</think>`, `<tool_call>` and `</tool_call>` ids and reads each call body as vLLM's
`hermes` parser does (a JSON object with "name" and "arguments", stringified arguments accepted).
"""

from __future__ import annotations

import json

from agentrl.chat.agentrl_format import _blocks, _capped, _parse_call
from agentrl.chat.base import CUT_TURN, ChatFormat, Content, Marker, Markup, Piece, Segment, segments_text
from agentrl.envs.turns import AssistantTurn, ToolCall, ToolResults

IM_START, IM_END, EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")
FORMAT_HELP = (f'Call a tool with {TOOL_CALL_OPEN}\\n{{"name": "<tool>", "arguments": {{...}}}}\\n{TOOL_CALL_CLOSE}; '
               "a message without calls is the final answer.")


class Qwen3Format(ChatFormat):
    name = "qwen3"
    markers = (IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, THINK_OPEN,
               THINK_CLOSE)
    structural = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, THINK_OPEN, THINK_CLOSE)
    end_marker = IM_END

    def __init__(self, tokenizer=None, *, stop_ids=None, thinking: bool = True):
        super().__init__(tokenizer, stop_ids=stop_ids)
        self.thinking = thinking

    # --- rendering -------------------------------------------------------------------------------------------------
    def prompt_pieces(self, system, tools, user):
        messages: list[tuple[str, list[Piece]]] = []
        if tools:
            pieces: list[Piece] = [Markup(f"{IM_START}system\n")]
            if system:
                pieces += [Content(system), Markup("\n\n")]
            pieces.append(Markup(TOOLS_HEADER))
            for schema in tools:
                pieces += [Markup("\n"), Content(json.dumps(schema, ensure_ascii=False))]
            messages.append(("system", pieces + [Markup(TOOLS_FOOTER + f"{IM_END}\n")]))
        elif system:
            messages.append(("system", [Markup(f"{IM_START}system\n"), Content(system), Markup(f"{IM_END}\n")]))
        messages.append(("user", [Markup(f"{IM_START}user\n"), Content(user), Markup(f"{IM_END}\n")]))
        messages.append(("generation", self._generation()))
        return messages

    def _generation(self) -> list[Piece]:
        return [Markup(f"{IM_START}assistant\n" + ("" if self.thinking else f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"))]

    def turn_pieces(self, turn: AssistantTurn) -> list[Piece]:
        text = turn.answer if turn.answer is not None else turn.content
        pieces: list[Piece] = []
        if self.thinking:
            pieces += [Markup(f"{THINK_OPEN}\n"), Content((turn.reasoning or "").strip("\n")),
                       Markup(f"\n{THINK_CLOSE}\n\n")]
            text = text.lstrip("\n")
        if text:
            pieces.append(Content(text))
        for i, call in enumerate(turn.calls):
            if i or text:
                pieces.append(Markup("\n"))
            pieces += [Markup(f'{TOOL_CALL_OPEN}\n{{"name": "'), Content(call.name), Markup('", "arguments": '),
                       Content(json.dumps(call.arguments, ensure_ascii=False)), Markup(f"}}\n{TOOL_CALL_CLOSE}")]
        return pieces + [Markup(IM_END)]

    def observation_pieces(self, observation: ToolResults) -> list[Piece]:
        contents = [r.content for r in observation.results]
        if observation.errors:
            contents.append("\n".join(f"Error: {e}" for e in observation.errors))
        if not contents:  # nothing to report: the next assistant message follows directly
            return [Markup("\n")] + self._generation()
        pieces: list[Piece] = [Markup(f"\n{IM_START}user")]
        for content in contents:
            pieces += [Markup(f"\n{RESPONSE_OPEN}\n"), Content(content), Markup(f"\n{RESPONSE_CLOSE}")]
        return pieces + [Markup(f"{IM_END}\n")] + self._generation()

    def errors_message(self, errors):
        return {"role": "tool", "content": "\n".join(f"Error: {e}" for e in errors)}

    # --- parsing ---------------------------------------------------------------------------------------------------
    def parse_segments(self, segments: list[Segment], *, cut: bool, max_calls: int) -> AssistantTurn:
        errors: list[str] = []
        reasoning = None
        close = Marker(THINK_CLOSE)
        if close in segments:
            at = segments.index(close)
            head = segments[:at]
            if Marker(THINK_OPEN) in head:
                head = head[head.index(Marker(THINK_OPEN)) + 1:]
            reasoning = segments_text(head).strip("\n")
            segments = segments[at + 1:]
        elif Marker(THINK_OPEN) in segments:
            at = segments.index(Marker(THINK_OPEN))
            reasoning = segments_text(segments[at + 1:]).strip("\n")
            return AssistantTurn(reasoning=reasoning, errors=(
                CUT_TURN if cut else f"The {THINK_OPEN} block is not closed with {THINK_CLOSE}.",))
        if any(s in (Marker(THINK_OPEN), close) for s in segments):
            errors.append(f"Only one {THINK_OPEN} block is allowed, before the reply.")
        bodies = _blocks(segments, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, errors, FORMAT_HELP)
        first = next((i for i, s in enumerate(segments) if s == Marker(TOOL_CALL_OPEN)), len(segments))
        content = segments_text([s for s in segments[:first] if not isinstance(s, Marker)]).lstrip("\n")
        if first < len(segments) and content.endswith("\n"):
            content = content[:-1]
        calls: list[ToolCall] = []
        for index, body in enumerate(bodies):
            if index >= max_calls:
                errors.append(f"At most {max_calls} tool calls are allowed per message; {len(bodies)} were given "
                              f"and only the first {max_calls} were considered.")
                break
            call, error = _parse_call(body.strip(), index, FORMAT_HELP)
            if error:
                errors.append(error)
            else:
                calls.append(call)
        if bodies or errors:
            return AssistantTurn(content=content, calls=tuple(calls), reasoning=reasoning, errors=_capped(errors))
        if cut:
            return AssistantTurn(content=content, reasoning=reasoning, errors=(CUT_TURN,))
        return AssistantTurn(content=content, answer=content.strip(), reasoning=reasoning)
