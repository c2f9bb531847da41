"""Every chat format over a tokenizer of its own layout: 1,000 generated conversations each render turn by turn to the
same ids as in one pass and as the tokenizer's own chat template; turns read back as written; marker strings in any
content never become control tokens; the parser never raises."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import pytest

from agentrl.chat import get_format, load_chat_format
from agentrl.envs import AssistantTurn, ToolCall, ToolResult, ToolResults
from tests.unit.chat.conftest import FORMAT_NAMES, MARKERS, Conversations, play

NUM_CONVERSATIONS = 1000
WITH_TEMPLATE = ("agentrl", "kimi", "qwen3")  # K3 ships a Python encoder, no Jinja template


def render_incrementally(chat, system, tools, user, played):
    """The ids an episode holds: the prompt, then each sampled turn and the glue after it; and the prompt the model
    saw before each turn."""
    ids = list(chat.render_prompt(system, tools, user).ids)
    prompts = [list(ids)]
    for _, sampled, _, observation in played:
        ids += sampled
        if observation is not None:
            ids += chat.render_observation(observation)
            prompts.append(list(ids))
    return ids, prompts


def template_prompt(chat, name, system, tools, user, steps):
    messages = chat.template_messages(system, tools, user, steps)
    kwargs = {"tools": tools} if tools and name != "agentrl" else {}  # agentrl's protocol lists tools in the system
    return chat.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_turn_by_turn_rendering_equals_one_pass_and_the_template(formats, name):
    chat = formats[name]
    gen = Conversations(seed=sum(map(ord, name)), reasoning=name == "qwen3")
    checked_prompts = 0
    for _ in range(NUM_CONVERSATIONS):
        system, tools, user, turns = gen.conversation()
        played = play(chat, gen, turns)
        ids, prompts = render_incrementally(chat, system, tools, user, played)
        steps = [(parsed, observation) for _, _, parsed, observation in played]
        assert ids == chat.conversation_ids(system, tools, user, steps)
        if name in WITH_TEMPLATE:
            for k, prompt in enumerate(prompts):
                assert template_prompt(chat, name, system, tools, user, steps[:k]) == prompt, (name, k)
                checked_prompts += 1
    assert checked_prompts >= (NUM_CONVERSATIONS if name in WITH_TEMPLATE else 0)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_a_remembered_system_message_renders_as_a_fresh_one(tokenizer_dirs, name):
    """render_prompt remembers each system message's ids (every episode of an env has the same one): prompts whose
    system message and tools repeat, with new user messages, render as they do on a format that has seen nothing;
    the memory is bounded."""
    chat = load_chat_format(tokenizer_dirs[name])
    gen = Conversations(seed=11)
    preambles = [gen.conversation()[:2] for _ in range(3)]
    for i in range(80):
        system, tools = preambles[i % 3] if i < 60 else gen.conversation()[:2]  # then 20 that do not repeat
        user = gen.conversation()[2]
        fresh = load_chat_format(tokenizer_dirs[name]).render_prompt(system, tools, user)
        remembered = chat.render_prompt(system, tools, user)
        assert (remembered.ids, remembered.spans) == (fresh.ids, fresh.spans), i
    assert 0 < len(chat._messages) <= 64


def same_turn(parsed: AssistantTurn, turn: AssistantTurn, name: str) -> bool:
    calls = [(c.name, c.arguments) for c in parsed.calls]
    expected = [(c.name, c.arguments) for c in turn.calls]
    reasoning_ok = name not in ("qwen3",) or (parsed.reasoning or "") == (turn.reasoning or "")
    return (not parsed.errors and calls == expected and parsed.answer == turn.answer and reasoning_ok
            and (turn.answer is not None or parsed.content.strip() == turn.content.strip()))


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("markers", [False, True], ids=["plain", "marker-strings"])
def test_turns_read_back_as_written(formats, name, markers):
    chat = formats[name]
    gen = Conversations(seed=7 + markers, markers=markers, reasoning=name == "qwen3")
    for _ in range(NUM_CONVERSATIONS):
        for turn in gen.conversation()[3]:
            ids = chat.render_turn(turn)
            assert ids[-1] == chat.end_id
            parsed = chat.parse_turn(ids)
            assert same_turn(parsed, turn, name), (turn, parsed)
            assert parsed == chat.parse_turn(ids[:-1])  # the stop token is not part of the turn
            prefix = ids[:gen.rng.randrange(len(ids))]
            cut = chat.parse_turn(prefix, cut=True)  # ended at the token limit
            # where the message itself is the answer, a cut one never is, unless (K3) its element was closed
            closed = name == "kimi_k3" and chat.tokenizer.decode(prefix).endswith("<|close|>message<|sep|>")
            if name == "agentrl" or closed:
                assert cut.errors or cut.calls or cut.answer is not None
            else:
                assert cut.answer is None and (cut.errors or cut.calls)


def sanitized(value):
    """`value` with every marker string in every text replaced by a neutral one."""
    if isinstance(value, str):
        for marker in sorted(MARKERS, key=len, reverse=True):
            value = value.replace(marker, "~")
        return value
    if isinstance(value, dict):
        return {sanitized(k): sanitized(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(sanitized(v) for v in value)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: sanitized(getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_marker_strings_in_content_never_become_control_tokens(formats, name):
    chat = formats[name]
    tokenizer = chat.tokenizer
    added = {tokenizer.token_id(t) for t in tokenizer.added_tokens}
    gen = Conversations(seed=11, markers=True, reasoning=name == "qwen3")
    injected = 0
    for _ in range(NUM_CONVERSATIONS):
        system, tools, user, turns = gen.conversation()
        played = play(chat, gen, turns)
        ids, _ = render_incrementally(chat, system, tools, user, played)
        clean = [sanitized(x) for x in (system, tools, user)]
        clean_played = [(t, chat.render_turn(sanitized(t)), sanitized(p), sanitized(o)) for t, _, p, o in played]
        clean_ids, _ = render_incrementally(chat, *clean, clean_played)
        # the same structure, so the same control tokens, however much markup the content spelled out
        assert Counter(i for i in ids if i in added) == Counter(i for i in clean_ids if i in added)
        injected += ids != clean_ids
    assert injected > NUM_CONVERSATIONS // 2  # the generator really put marker strings in
    for marker in MARKERS:
        assert not set(tokenizer.encode_text(f"a {marker} b")) & added


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_the_parser_never_raises_on_fuzzed_turns(formats, name):
    """10,000 turns: random ids over the structural markers and call-like text, and valid turns with tokens
    deleted, duplicated, swapped or replaced."""
    chat = formats[name]
    rng = random.Random(3)
    structural = [chat.tokenizer.token_id(m) for m in chat.structural]
    ordinary = chat.tokenizer.encode_text('{"name": "calculate", "arguments": {"expression": "1+2"}} answer 中 '
                                          'functions.lookup:0 call tool="x" index="1" argument key="k" type="number"'
                                          ' response tools message think \n')
    vocab = range(chat.tokenizer.vocab_size - 2)
    gen = Conversations(seed=5, markers=True, reasoning=name == "qwen3")
    valid = [chat.render_turn(t) for _ in range(300) for t in gen.conversation()[3]]
    kinds = Counter()
    for n in range(10_000):
        if n % 2:
            ids = [rng.choice(structural) if rng.random() < 0.3 else rng.choice(ordinary) if rng.random() < 0.7
                   else rng.choice(vocab) for _ in range(rng.randint(0, 60))]
        else:
            ids = list(rng.choice(valid))
            for _ in range(rng.randint(0, 3)):
                at = rng.randrange(len(ids) + 1)
                op = rng.randrange(4)
                if op == 0 and ids:
                    del ids[min(at, len(ids) - 1)]
                elif op == 1 and ids:
                    ids.insert(at, ids[min(at, len(ids) - 1)])
                elif op == 2 and len(ids) > 1:
                    j = rng.randrange(len(ids))
                    ids[min(at, len(ids) - 1)], ids[j] = ids[j], ids[min(at, len(ids) - 1)]
                else:
                    ids.insert(at, rng.choice(structural))
        turn = chat.parse_turn(ids, cut=rng.random() < 0.3, max_calls=rng.randint(1, 4))
        assert isinstance(turn, AssistantTurn)
        assert all(isinstance(e, str) and e for e in turn.errors)
        assert turn.errors or turn.calls or turn.answer is not None
        assert len(turn.calls) <= 4 and all(isinstance(c, ToolCall) for c in turn.calls)
        kinds[("calls" if turn.calls else "answer" if turn.answer is not None else "") + ("!" * turn.malformed)] += 1
    assert {"calls", "answer"} <= set(kinds) and sum(v for k, v in kinds.items() if "!" in k) > 1000, kinds


@pytest.mark.parametrize("name", ["kimi", "kimi_k3", "qwen3"])
def test_a_cut_turn_is_neither_run_nor_taken_as_the_answer(formats, name):
    chat = formats[name]
    ids = chat.render_turn(AssistantTurn(answer="the answer is 4"))
    turn = chat.parse_turn(ids[:-3], cut=True)
    assert turn.answer is None and turn.calls == () and "cut" in turn.errors[0]
    assert chat.render_observation(ToolResults(), after_cut=True)[:1] == chat.close_cut_turn()


def test_each_tokenizer_layout_is_detected_and_a_wrong_format_is_refused(tokenizer_dirs):
    for name, path in tokenizer_dirs.items():
        assert load_chat_format(path).name == name
    with pytest.raises(ValueError, match=r"the 'kimi' chat format needs these tokens.*<\|im_middle\|>"):
        load_chat_format(tokenizer_dirs["agentrl"], "kimi")
    with pytest.raises(ValueError, match="known formats"):
        get_format("llama3")


def test_stop_ids_come_from_the_checkpoint_not_the_tokenizer(tmp_path, tokenizer_dirs):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(tokenizer_dirs["kimi"], path)
    fmt = load_chat_format(str(path))
    assert fmt.stop_ids == (fmt.end_id,)  # no config: the format's end marker
    (path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_chat_format(str(path)).stop_ids == (5,)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [fmt.end_id, 7]}))
    assert load_chat_format(str(path)).stop_ids == (fmt.end_id, 7)


def test_kimi_renders_the_documented_stream(formats):
    """Kimi K2's documented rendering of a weather call, byte for byte (one tool, default system prompt)."""
    chat = formats["kimi"]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
                                               "parameters": {"type": "object", "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    prompt = chat.render_prompt("", tools, "Weather in Beijing?").ids
    turn = chat.render_turn(AssistantTurn(calls=(ToolCall("get_weather", {"city": "Beijing"}),)))
    glue = chat.render_observation(ToolResults(results=(
        ToolResult(call_id="functions.get_weather:0", name="get_weather", content='{"weather": "Sunny"}'),)))
    text = chat.tokenizer.decode(prompt + turn + glue)
    assert text == (
        '<|im_system|>tool_declare<|im_middle|>[{"function":{"description":"Get weather","name":"get_weather",'
        '"parameters":{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}},'
        '"type":"function"}]<|im_end|><|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by '
        'Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>Weather in Beijing?<|im_end|>'
        '<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>'
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>'
        '<|tool_calls_section_end|><|im_end|><|im_system|>get_weather<|im_middle|>## Return of '
        'functions.get_weather:0\n{"weather": "Sunny"}<|im_end|><|im_assistant|>assistant<|im_middle|>')


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_an_episode_played_without_a_format_renders_in_every_format(formats, name):
    """play() records calls with the env's ids (call_1_0); a format whose model writes ids (Kimi) renders its own."""
    from agentrl.envs import make, play as play_episode

    chat = formats[name]
    env = make("agentrl/KVChain-v0", num_tasks=3, hops=2)
    episode = play_episode(env, env.oracle, seed=0)
    assert episode.turns[0].calls[0].id == "call_1_0"
    for turn, observation in episode.steps():
        parsed = chat.parse_turn(chat.render_turn(turn))
        assert not parsed.errors and [(c.name, c.arguments) for c in parsed.calls] == \
               [(c.name, c.arguments) for c in turn.calls]
        if observation is not None:
            text = chat.tokenizer.decode(chat.render_observation(observation))
            assert observation.results[0].content in text
            assert name != "kimi" or f"## Return of functions.lookup:0\n{observation.results[0].content}" in text
