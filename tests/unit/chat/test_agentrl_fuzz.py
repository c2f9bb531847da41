"""The `agentrl` format's parser under fuzzing: 10,000+ generated malformed or adversarial messages (as text) give
error observations from the env, never exceptions."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.chat.agentrl_format import AgentRLFormat
from agentrl.envs import ToolResults, make

parse_turn = AgentRLFormat().parse_text

NUM_EXAMPLES = 10_000

FRAGMENTS = ["<tool_call>", "</tool_call>", "<answer>", "</answer>", "<tool_response>", "<tool_call >", "<TOOL_CALL>",
             "{", "}", "[", "]", '"', ":", ",", "\\", "\\u0000", "\x00", "\ud800", "name", '"name"', "arguments",
             '"arguments"', "null", "true", "1e999", "NaN", "-0", '"lookup"', '{"key": ', "key-000000", "😀", "\n",
             "[" * 3000, "9" * 5000]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=5)

wrappers = st.sampled_from([
    lambda body: f"<tool_call>{body}</tool_call>",
    lambda body: f"Thinking...<tool_call>\n{body}\n</tool_call> done",
    lambda body: f"<tool_call>{body}",  # unclosed
    lambda body: f"<tool_call>{body[: len(body) // 2]}</tool_call>",  # cut JSON
    lambda body: f"<tool_call>{body}</tool_call><answer>{body}</answer>",  # both
    lambda body: f"<tool_call>{body}</tool_call>" * 9,  # too many
    lambda body: body,  # no tags
])

call_like = st.builds(
    lambda name, arguments, wrap: wrap(json.dumps({"name": name, "arguments": arguments})),
    name=st.sampled_from(["lookup", "nope", "", "LOOKUP", "lookup "]) | st.text(max_size=8),
    arguments=json_values | st.dictionaries(st.sampled_from(["key", "k", ""]), json_values, max_size=3),
    wrap=wrappers)

huge = st.integers(10_000, 300_000).map(
    lambda n: '<tool_call>{"name": "lookup", "arguments": {"key": "' + "k" * n + '"}}</tool_call>')

messages = st.one_of(st.text(), st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6), max_size=24).map("".join),
                     call_like, huge, json_values.map(json.dumps))


def test_fuzzed_messages_never_raise():
    env = make("agentrl/KVChain-v0", num_tasks=4, hops=3)
    env.reset(seed=0)
    seen = {"examples": 0, "malformed": 0}

    @settings(max_examples=NUM_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(messages)
    def check(text):
        seen["examples"] += 1
        parsed = parse_turn(text)
        assert all(isinstance(e, str) and e for e in parsed.errors)
        assert parsed.malformed or parsed.calls or parsed.answer is not None
        if env.state.done:
            env.reset(seed=seen["examples"])
        observation, reward, terminated, truncated, info = env.step(parsed)
        assert isinstance(observation, ToolResults) and info["status"] in ("running", "completed", "truncated")
        if parsed.malformed:
            seen["malformed"] += 1
            assert not terminated and info["errors"]
            if not truncated:
                assert observation.errors or any(r.is_error for r in observation.results)

    check()
    assert seen["examples"] >= NUM_EXAMPLES
    assert seen["malformed"] >= NUM_EXAMPLES // 2  # the generator really is adversarial
