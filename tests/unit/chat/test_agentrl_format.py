"""The `agentrl` format's tag protocol read from text: well-formed calls and answers, and a specific error for each
kind of malformed message."""

import json

import pytest

from agentrl.chat.agentrl_format import AgentRLFormat, render_tools
from agentrl.envs.turns import with_call_ids

parse_turn = AgentRLFormat().parse_text


def test_single_call_with_surrounding_reasoning():
    parsed = parse_turn('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>\n')
    assert parsed.errors == () and parsed.answer is None and parsed.content == "Let me compute."
    (call,) = with_call_ids(parsed, 3).calls
    assert (call.id, call.name, call.arguments) == ("call_3_0", "calc", {"x": 1})


def test_several_calls_keep_their_order():
    text = "".join(f'<tool_call>{{"name": "t{i}", "arguments": {{}}}}</tool_call> and ' for i in range(3))
    assert [c.name for c in parse_turn(text).calls] == ["t0", "t1", "t2"]


def test_answer_is_stripped():
    parsed = parse_turn("Reasoning...\n<answer>\n  42 apples \n</answer>")
    assert parsed.answer == "42 apples" and parsed.calls == () and not parsed.malformed


def test_stringified_and_missing_arguments_are_accepted():
    parsed = parse_turn('<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call>'
                        '<tool_call>{"name": "b"}</tool_call>')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", {"k": 2}), ("b", {})]


@pytest.mark.parametrize("text, expected", [
    ("The answer is 4.", "No tool call or answer"),
    ("", "No tool call or answer"),
    ('<tool_call>{"name": "a", "arguments": {}}', "not closed"),
    ('{"name": "a"}</tool_call>', "without a matching"),
    ("<tool_call>{name: a}</tool_call>", "not valid JSON"),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "is 100000 characters long"),
    ("<tool_call>" + "[" * 5_000 + "]" * 5_000 + "</tool_call>", "nested too deeply"),
    ('<tool_call>["a"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
    ('<tool_call>{"name": 3}</tool_call>', 'needs a "name"'),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "a", "arguments": "{bad"}</tool_call>', "is a string that is not valid JSON"),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><answer>1</answer>', "not both"),
    ("<answer>1</answer><answer>2</answer>", "exactly one"),
    ("<answer>1", "not closed"),
    ('<tool_call><tool_call>{"name": "a"}</tool_call>', "cannot be nested"),
    ('<tool_call>{"name": "a", "arguments": {"n": ' + "9" * 5000 + "}}</tool_call>", "not valid JSON"),
])
def test_malformed_messages_give_a_specific_error(text, expected):
    parsed = parse_turn(text)
    assert parsed.malformed and any(expected in e for e in parsed.errors), parsed.errors


def test_non_text_is_an_error_not_an_exception():
    for value in (None, 3, b"<answer>1</answer>", ["<answer>1</answer>"]):
        parsed = parse_turn(value)
        assert parsed.malformed and parsed.calls == () and parsed.answer is None


def test_too_many_calls_runs_the_first_ones():
    text = '<tool_call>{"name": "a"}</tool_call>' * 12
    parsed = parse_turn(text, max_calls=8)
    assert len(parsed.calls) == 8 and any("At most 8" in e for e in parsed.errors)


def test_good_calls_survive_a_bad_neighbour():
    parsed = parse_turn('<tool_call>{"name": "a"}</tool_call><tool_call>oops</tool_call>')
    assert [c.name for c in parsed.calls] == ["a"] and len(parsed.errors) == 1


def test_thousands_of_stray_tags_give_a_bounded_error_list():
    parsed = parse_turn("</tool_call>" * 10_000)
    assert len(parsed.errors) == 9 and "9992 more" in parsed.errors[-1]


def test_render_tools_puts_one_schema_per_line():
    schemas = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    lines = render_tools(schemas).splitlines()
    assert lines[0] == "<tools>" and lines[-1] == "</tools>"
    assert [json.loads(line) for line in lines[1:-1]] == schemas


def test_the_quickstart_layout_is_byte_identical_to_before_formats_existed():
    """The quickstart's tokenizer (tests/data) on a Calc oracle episode: the format's ids equal what agentrl wrote
    before chat formats: each message's ChatML text encoded whole, the oracle's tag strings as the assistant turns."""
    from pathlib import Path

    from agentrl.chat import load_chat_format
    from agentrl.chat.agentrl_format import PROTOCOL_INSTRUCTIONS
    from agentrl.envs import make
    from agentrl.envs.calculator import evaluate, format_number
    from agentrl.rollout.oracle import oracle_trajectory

    directory = str(Path(__file__).resolve().parents[2] / "data" / "quickstart-warm-start")
    chat = load_chat_format(directory)
    hf = chat.tokenizer.hf
    env = make("agentrl/Calc-v0", max_turns=3, kinds=[0, 3], max_operand=9)
    traj = oracle_trajectory(env, chat, env_id="agentrl/Calc-v0", task_index=5, seed=5)
    task = env.tasks[5]
    system = (PROTOCOL_INSTRUCTIONS + "\n\nAvailable tools:\n" + render_tools(env.tool_schemas()) + "\n\n"
              + env.instructions)
    call_text = json.dumps({"name": "calculate", "arguments": {"expression": task["expression"]}})
    result = format_number(evaluate(task["expression"]))
    before = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{task['question']}<|im_end|>\n"
              f"<|im_start|>assistant\nI will compute it.\n<tool_call>{call_text}</tool_call><|im_end|>"
              f"\n<|im_start|>tool\n<tool_response>\n{result}\n</tool_response>"
              f"<|im_end|>\n<|im_start|>assistant\n<answer>{result}</answer><|im_end|>")
    assert traj.reward == 1.0
    assert traj.tokens == hf.encode(before, add_special_tokens=False)
