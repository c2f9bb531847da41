"""The ToolEnv episode contract: observations, termination, truncation, failures, state save/restore."""

import json

import pytest
from _toy_envs import TASKS, ToyEnv

from agentrl.chat import parse_text
from agentrl.envs import (AssistantTurn, AssistantTurns, Observations, ToolCall, ToolResults, answer, call, calls,
                          play)


def test_reset_returns_the_task_prompt_and_is_deterministic():
    env = ToyEnv()
    first = [env.reset(seed=s)[0] for s in range(6)]
    again = [env.reset(seed=s)[0] for s in range(6)]
    assert first == again
    assert len(set(first)) > 1  # different seeds pick different tasks
    prompt, info = env.reset(options={"task_index": 3})
    assert prompt == TASKS[3]["question"] and info["task_id"] == "toy-3" and info["status"] == "running"


@pytest.mark.parametrize("index", [-1, 10, "2", 1.0])
def test_bad_task_index_names_the_value(index):
    with pytest.raises(ValueError, match=repr(index).replace(".", r"\.")):
        ToyEnv().reset(options={"task_index": index})


def test_tool_step_returns_results_in_order_and_no_reward():
    env = ToyEnv()
    env.reset(options={"task_index": 2})
    obs, reward, terminated, truncated, info = env.step(
        calls(("double", {"x": 21}), ("shout", {"text": "hi", "times": 2}), content="Let me see."))
    assert isinstance(obs, ToolResults) and obs.errors == ()
    assert [(r.call_id, r.name, r.content, r.is_error) for r in obs.results] == [
        ("call_1_0", "double", "42", False), ("call_1_1", "shout", "HI HI", False)]
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["status"] == "running" and info["errors"] == [] and info["reward_components"] == {}
    assert [c["name"] for c in info["tool_calls"]] == ["double", "shout"]
    assert info["tool_calls"][1]["arguments"] == {"text": "hi", "times": 2}
    assert [r["content"] for r in info["tool_results"]] == ["42", "HI HI"]


def test_a_format_assigned_call_id_is_kept():
    env = ToyEnv()
    env.reset(options={"task_index": 2})
    obs, *_ = env.step(AssistantTurn(calls=(ToolCall("double", {"x": 1}, id="functions.double:0"),)))
    assert obs.results[0].call_id == "functions.double:0"


def test_final_answer_terminates_with_reward_components():
    env = ToyEnv()
    env.reset(options={"task_index": 4})
    obs, reward, terminated, truncated, info = env.step(answer("8"))
    assert (obs, reward, terminated, truncated) == (ToolResults(), 1.0, True, False)
    assert info["status"] == "completed" and info["reward_components"] == {"correct": 1.0} and info["answer"] == "8"
    env.reset(options={"task_index": 4})
    assert env.step(answer("9"))[1:3] == (0.0, True)


def test_step_takes_only_parsed_turns():
    env = ToyEnv()
    env.reset(seed=0)
    with pytest.raises(TypeError, match="parse_text"):
        env.step("<answer>0</answer>")


def test_model_mistakes_are_observations_not_exceptions():
    env = ToyEnv()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(AssistantTurn(calls=(
        ToolCall("nope"), ToolCall("double", {"x": "3"}), ToolCall("double"), ToolCall("double", {"x": 1, "y": 2}),
        ToolCall("reject", {"reason": "no"}), ToolCall("shout", {"text": "a", "style": "loud"}),
        ToolCall("double", error="arguments are not JSON"))))
    assert not terminated and not truncated and info["status"] == "running"
    errors = " | ".join(info["errors"])
    contents = " | ".join(r.content for r in obs.results)
    for expected in ["unknown tool 'nope'", "'x' must be integer, got string '3'", "missing required argument 'x'",
                     "unexpected argument 'y'", "refused: no", "must be one of ['upper', 'title']",
                     "arguments are not JSON"]:
        assert expected in errors and expected in contents
    assert all(r.is_error for r in obs.results) and len(obs.results) == 7
    assert env.state.extra == {}  # nothing ran


def test_format_errors_continue_the_episode_and_count_towards_the_penalty():
    env = ToyEnv(format_penalty=0.25)
    env.reset(options={"task_index": 1})
    for text in ["I think it is 2.", "<tool_call>{oops}</tool_call>"]:
        obs, reward, terminated, truncated, info = env.step(parse_text(text))
        assert obs.errors and obs.results == () and info["errors"] and not (terminated or truncated)
    obs, reward, terminated, truncated, info = env.step(answer("2"))
    assert terminated and info["reward_components"] == {"correct": 1.0, "format": -0.5}
    assert reward == pytest.approx(0.5)


def test_a_malformed_answer_is_not_scored():
    env = ToyEnv()
    env.reset(options={"task_index": 1})
    obs, reward, terminated, truncated, info = env.step(AssistantTurn(answer="2", errors=("answer not closed",)))
    assert not terminated and obs.errors == ("answer not closed",)


def test_calls_and_answer_together_is_an_error_and_nothing_runs():
    env = ToyEnv()
    env.reset(options={"task_index": 1})
    obs, reward, terminated, truncated, info = env.step(parse_text(
        '<tool_call>{"name": "double", "arguments": {"x": 1}}</tool_call><answer>2</answer>'))
    assert not terminated and info["tool_results"] == [] and any("not both" in e for e in obs.errors)
    assert env.state.extra == {}


def test_too_many_calls_run_the_first_ones():
    env = ToyEnv(max_calls_per_turn=2)
    env.reset(seed=0)
    obs, *_ = env.step(AssistantTurn(calls=tuple(ToolCall("double", {"x": i}) for i in range(5))))
    assert [r.content for r in obs.results] == ["0", "2"] and "At most 2 tool calls" in obs.errors[0]


def test_turn_budget_truncates_with_zero_reward():
    env = ToyEnv(max_turns=3)
    env.reset(seed=0)
    results = [env.step(call("double", x=1)) for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True]
    assert results[-1][4]["status"] == "truncated" and results[-1][4]["reward_components"] == {"correct": 0.0}
    with pytest.raises(RuntimeError, match="reset"):
        env.step(answer("0"))


def test_observation_budget_truncates_the_episode():
    env = ToyEnv(max_observation_chars=1000, max_tool_output_chars=600)
    env.reset(seed=0)
    obs, _, _, truncated, info = env.step(call("flood", n=500))
    assert not truncated and obs.num_chars == 500
    obs, reward, terminated, truncated, info = env.step(call("flood", n=500))
    assert truncated and not terminated and info["status"] == "truncated"
    assert env.state.observation_chars == 1000 and obs.results[0].content == "x" * 500
    obs_texts = [r.content for r in obs.results]
    assert obs_texts == ["x" * 500] and any("observation budget" in e for e in info["errors"])


def test_the_budget_cuts_the_results_that_do_not_fit():
    env = ToyEnv(max_observation_chars=700)
    env.reset(seed=0)
    obs, _, _, truncated, _ = env.step(calls(("flood", {"n": 500}), ("flood", {"n": 500})))
    assert truncated and [len(r.content) for r in obs.results] == [500, 200]


def test_tool_output_is_truncated_to_its_limit():
    env = ToyEnv(max_tool_output_chars=100)
    env.reset(seed=0)
    obs, *_ = env.step(call("flood", n=5000))
    text = obs.results[0].content
    assert "x" * 100 in text and "x" * 101 not in text and "4900 more characters" in text


@pytest.mark.parametrize("tool, boundary", [("crash", "tool"), ("sandbox_down", "sandbox")])
def test_system_failures_end_the_episode_as_failed_with_the_boundary(tool, boundary):
    env = ToyEnv()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(calls(("double", {"x": 1}), (tool, {})))
    assert info["status"] == "failed" and info["failure"]["boundary"] == boundary
    assert truncated and not terminated and reward == 0.0 and env.state.done


def test_a_scoring_bug_is_an_env_failure_not_a_wrong_answer():
    env = ToyEnv()
    env.reset(seed=0)
    _, _, terminated, truncated, info = env.step(answer("explode"))
    assert info["status"] == "failed" and info["failure"]["boundary"] == "env"
    assert "bug in score" in info["failure"]["message"] and truncated and not terminated


def test_state_round_trips_through_json_and_resumes_in_a_fresh_env():
    env = ToyEnv(format_penalty=0.1)
    env.reset(seed=5)
    env.step(parse_text("no tags here"))
    env.step(call("double", x=2))
    saved = json.loads(json.dumps(env.get_state()))
    fresh = ToyEnv(format_penalty=0.1)
    fresh.set_state(saved)
    assert fresh.task == env.task and fresh.state.extra == {"doubled": 1} and fresh.state.malformed_turns == 1
    for e in (env, fresh):
        obs, reward, terminated, _, info = e.step(answer(e.task["answer"]))
        assert terminated and reward == pytest.approx(0.9) and info["turn"] == 3
    assert fresh.np_random.random() == env.np_random.random()


def test_set_state_rejects_foreign_data():
    with pytest.raises(ValueError, match="get_state"):
        ToyEnv().set_state({"episode": {"bogus": 1}})


def test_spaces_hold_turns_prompts_and_results():
    env = ToyEnv()
    assert isinstance(env.action_space, AssistantTurns) and isinstance(env.observation_space, Observations)
    assert env.action_space.contains(answer("x")) and not env.action_space.contains("<answer>x</answer>")
    for obs in ["", "héllo <tool_call>{}</tool_call>\n\t😀", ToolResults()]:
        assert env.observation_space.contains(obs)
    assert not env.observation_space.contains(b"bytes") and not env.observation_space.contains(3)
    env.action_space.seed(7)
    samples = [env.action_space.sample() for _ in range(50)]
    env.action_space.seed(7)
    assert samples == [env.action_space.sample() for _ in range(50)]
    assert any(c.name in env.tools for s in samples for c in s.calls)  # sampled calls reach the env's own tools


def test_system_prompt_is_the_env_instructions_and_schemas_list_every_tool():
    env = ToyEnv()
    names = [s["function"]["name"] for s in env.tool_schemas()]
    assert sorted(names) == ["crash", "double", "flood", "reject", "sandbox_down", "shout"]
    assert env.system_prompt() == ""  # ToyEnv has no instructions; no format markup in the env


def test_play_records_the_conversation():
    env = ToyEnv()
    episode = play(env, env.oracle, seed=1)
    assert episode.status == "completed" and episode.reward == 1.0
    messages = episode.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["id"] == messages[3]["tool_call_id"] == "call_1_0"


@pytest.mark.parametrize("kwargs", [{"max_turns": 0}, {"max_observation_chars": -1}, {"format_penalty": -0.5},
                                    {"render_mode": "human"}, {"tasks": []}])
def test_bad_constructor_arguments_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        ToyEnv(**kwargs)
