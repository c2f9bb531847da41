"""Tiny tokenizers of every chat format's layout (built once per test session) and a generator of conversations."""

from __future__ import annotations

import random

import pytest

from agentrl.chat import load_chat_format
from agentrl.chat.tiny_tokenizers import build_format_tokenizer
from agentrl.envs import AssistantTurn, ToolCall, ToolResult, ToolResults, with_call_ids

FORMAT_NAMES = ("agentrl", "kimi", "kimi_k3", "qwen3")


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    dirs = {}
    for name in FORMAT_NAMES:
        dirs[name] = str(root / name)
        build_format_tokenizer(dirs[name], name, vocab_size=1024, episodes_per_env=40)
    return dirs


@pytest.fixture(scope="session")
def formats(tokenizer_dirs):
    """name -> the format over its tiny tokenizer (qwen3 in thinking mode, its default)."""
    return {name: load_chat_format(path) for name, path in tokenizer_dirs.items()}


# ---- conversations ----------------------------------------------------------------------------------------------
WORDS = ["the", "tool", "Result", "naïve", "café", "数字", "计算器", "مرحبا", "😀", "x", "42", "3.14", "-7", "1e9",
         "def f(x):", "return x * 2", "{'a': 1}", "[1, 2]", "a\\b", 'say "hi"', "tab\there", "über", "Ω", "∑"]
MARKERS = ["<|im_end|>", "<|im_start|>", "</tool_response>", "<tool_call>", "</tool_call>", "<answer>", "<think>",
           "</think>", "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>",
           "<|im_system|>", "<|close|>argument<|sep|>", "<tool_response>", "[EOS]", "<|endoftext|>"]


class Conversations:
    """Random multi-turn tool conversations: nested and unicode JSON arguments, several calls per turn, tool errors,
    turn-level errors, reasoning. `markers=True` sprinkles marker strings into every kind of content."""

    def __init__(self, seed: int, *, markers: bool = False, reasoning: bool = False):
        self.rng = random.Random(seed)
        self.markers = markers
        self.reasoning = reasoning

    def text(self, max_words: int = 8, *, lead: bool = True) -> str:
        r = self.rng
        words = [r.choice(WORDS) for _ in range(r.randint(1, max_words))]
        if self.markers and r.random() < 0.6:
            words.insert(r.randrange(len(words) + 1), r.choice(MARKERS))
        sep = r.choice([" ", " ", "\n", ", "])
        out = sep.join(words)
        return out.lstrip() if not lead else out

    def value(self, depth: int = 0):
        r = self.rng
        kind = r.randrange(8 if depth < 3 else 5)
        if kind == 0:
            return self.text(4)
        if kind == 1:
            return r.randint(-10**6, 10**6)
        if kind == 2:
            return r.choice([0.5, -2.25, 1e-3, 3.0])
        if kind == 3:
            return r.choice([True, False])
        if kind == 4:
            return None if r.random() < 0.5 else ""
        if kind in (5, 6):
            return {self.key(): self.value(depth + 1) for _ in range(r.randint(0, 3))}
        return [self.value(depth + 1) for _ in range(r.randint(0, 3))]

    def key(self) -> str:
        return self.rng.choice(["a", "key", "expression", "path", "数", "x_y", "n"])

    def tools(self) -> list[dict]:
        r = self.rng
        out = []
        for name in r.sample(["calculate", "lookup", "search", "open", "run_python"], r.randint(0, 3)):
            props = {self.key(): {"type": r.choice(["string", "number", "object"]), "description": self.text(5)}
                     for _ in range(r.randint(1, 3))}
            out.append({"type": "function", "function": {"name": name, "description": self.text(10),
                                                         "parameters": {"type": "object", "properties": props,
                                                                        "required": sorted(props)[:1]}}})
        return out

    def turn(self, last: bool) -> AssistantTurn:
        r = self.rng
        reasoning = self.text(6, lead=False).strip() or "hm" if self.reasoning else None
        content = self.text(6, lead=False).strip() if r.random() < 0.6 else ""
        if last or r.random() < 0.15:
            return AssistantTurn(answer=self.text(5, lead=False).strip() or "0", reasoning=reasoning)
        calls = tuple(ToolCall(name=r.choice(["calculate", "lookup", "search"]),
                               arguments={self.key(): self.value() for _ in range(r.randint(0, 3))})
                      for _ in range(r.randint(1, 3)))
        return AssistantTurn(content=content, calls=calls, reasoning=reasoning)

    def results(self, turn: AssistantTurn) -> ToolResults:
        r = self.rng
        results = tuple(ToolResult(call_id=c.id, name=c.name, content=self.text(12), is_error=r.random() < 0.2)
                        for c in turn.calls)
        errors = (f"sampled problem {r.randint(0, 99)}",) if r.random() < 0.1 else ()
        return ToolResults(results=results, errors=errors)

    def conversation(self):
        r = self.rng
        system = self.text(10) if r.random() < 0.8 else ""
        return system, self.tools(), self.text(12), [self.turn(last=k == n - 1) for n in [r.randint(1, 5)]
                                                      for k in range(n)]


def play(chat, conversations: Conversations, turns: list[AssistantTurn]):
    """Each structured turn rendered as the model would sample it and read back by the format (what the env would
    get from a policy that wrote those tokens), then answered with random results:
    [(structured turn, sampled ids, parsed turn with call ids, observation or None after the last turn)]."""
    out = []
    for number, turn in enumerate(turns, 1):
        ids = chat.render_turn(turn)
        parsed = with_call_ids(chat.parse_turn(ids), number)
        observation = conversations.results(parsed) if number < len(turns) else None
        out.append((turn, ids, parsed, observation))
    return out
