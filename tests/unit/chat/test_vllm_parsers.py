"""agentrl's formats read turns as the installed vLLM's own tool parsers do (hermes, kimi_k2, kimi_k3), on generated
turns whose content spells no marker; and where content does spell one, the token-level reading stays right where
vLLM's text-level reading cannot."""

from __future__ import annotations

import json

import pytest

from agentrl.envs import AssistantTurn, ToolCall
from tests.unit.chat.conftest import FORMAT_NAMES, Conversations

pytest.importorskip("vllm")

PARSERS = {"agentrl": "hermes_tool_parser:Hermes2ProToolParser", "qwen3": "hermes_tool_parser:Hermes2ProToolParser",
           "kimi": "kimi_k2_tool_parser:KimiK2ToolParser", "kimi_k3": "kimi_k3_tool_parser:KimiK3ToolParser"}


def vllm_parser(chat, name):
    import importlib

    module, cls = PARSERS[name].split(":")
    tokenizer = getattr(chat.tokenizer, "hf", chat.tokenizer)  # vLLM takes the HF tokenizer, or any with get_vocab
    return getattr(importlib.import_module(f"vllm.tool_parsers.{module}"), cls)(tokenizer)


@pytest.fixture(scope="module")
def request_():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], model="m")


def vllm_text(chat, name, ids):
    """The text a vLLM server would hand its tool parser: the decoded turn (special tokens kept), after the
    reasoning parser took a thinking block off."""
    text = chat.tokenizer.decode(ids[:-1])
    return text.split("</think>", 1)[-1] if name == "qwen3" else text


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_agentrl_reads_a_turn_as_vllm_does(formats, name, request_):
    chat = formats[name]
    parser = vllm_parser(chat, name)
    gen = Conversations(seed=21, reasoning=name == "qwen3")
    compared = 0
    for _ in range(300):
        for turn in gen.conversation()[3]:
            if name == "agentrl" and turn.answer is not None:
                continue  # vLLM's hermes parser knows no <answer> tag
            ids = chat.render_turn(turn)
            ours = chat.parse_turn(ids)
            theirs = parser.extract_tool_calls(vllm_text(chat, name, ids), request_)
            assert theirs.tools_called == bool(ours.calls)
            assert [(c.function.name, json.loads(c.function.arguments)) for c in theirs.tool_calls] == \
                   [(c.name, c.arguments) for c in ours.calls]
            if name == "kimi":
                assert [c.id for c in theirs.tool_calls] == [c.id for c in ours.calls]
            expected = ours.answer if ours.answer is not None else ours.content
            assert (theirs.content or "").strip() == expected.strip()
            compared += 1
    assert compared >= 300


def test_a_string_value_spelling_a_closing_marker_stays_text_k3(formats, request_):
    """vLLM's K3 parser documents this limitation: raw string values that contain `<|close|>argument<|sep|>`."""
    chat = formats["kimi_k3"]
    turn = AssistantTurn(calls=(ToolCall("write", {"text": "a<|close|>argument<|sep|>b", "n": 1}),))
    ids = chat.render_turn(turn)
    assert [(c.name, c.arguments) for c in chat.parse_turn(ids).calls] == [("write", turn.calls[0].arguments)]
    theirs = vllm_parser(chat, "kimi_k3").extract_tool_calls(vllm_text(chat, "kimi_k3", ids), request_)
    assert json.loads(theirs.tool_calls[0].function.arguments) != turn.calls[0].arguments
