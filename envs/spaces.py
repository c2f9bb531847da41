"""Gymnasium spaces of a ``ToolEnv``: ``AssistantTurns`` (its actions), ``Observations`` (a prompt or tool results) and
``AnyText`` (any string).

gymnasium's ``spaces.Text`` only contains strings over a fixed character set (alphanumerics by default), so a model
reply with a space, a brace or an emoji would not be "in" it and ``check_env`` would reject text envs. ``AnyText``
contains every ``str`` up to ``max_length`` characters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from agentrl.envs.turns import AssistantTurn, ToolCall, ToolResult, ToolResults

# What sample() draws from: enough variety (markup, JSON punctuation, non-ASCII) to exercise a text env's parser.
_SAMPLE_ALPHABET = list("abcxyz XYZ019 \n\t{}[]\":,<>/_-.'\\é€中😀")


class AnyText(spaces.Space[str]):
    """Any Python string of at most ``max_length`` characters."""

    def __init__(self, max_length: int = 1_000_000, seed: int | np.random.Generator | None = None) -> None:
        if max_length <= 0:
            raise ValueError(f"AnyText max_length must be > 0, got {max_length!r}")
        self.max_length = max_length
        super().__init__(shape=None, dtype=None, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """A random short string (up to 64 characters) drawn from a mixed alphabet; masks are not supported."""
        if mask is not None or probability is not None:
            raise ValueError("AnyText.sample does not support mask or probability")
        length = int(self.np_random.integers(0, min(64, self.max_length) + 1))
        return "".join(self.np_random.choice(_SAMPLE_ALPHABET, size=length))

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"AnyText(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnyText) and other.max_length == self.max_length


class AssistantTurns(spaces.Space[AssistantTurn]):
    """Every ``AssistantTurn``: the action space of a ``ToolEnv``.

    ``sample()`` draws turns that exercise an env's whole step path: calls to its own tools (``tool_names``) and to
    unknown ones with random arguments, several calls at once, final answers, malformed turns and calls.
    """

    def __init__(self, tool_names: tuple[str, ...] = (), seed: int | np.random.Generator | None = None) -> None:
        self.tool_names = tuple(tool_names)
        self._text = AnyText(max_length=64)
        super().__init__(shape=None, dtype=None, seed=seed)

    def seed(self, seed: int | None = None) -> list[int]:
        seeds = super().seed(seed)
        self._text.seed(int(self.np_random.integers(1 << 31)))
        return seeds

    def contains(self, x: Any) -> bool:
        return isinstance(x, AssistantTurn)

    def sample(self, mask: Any = None, probability: Any = None) -> AssistantTurn:
        if mask is not None or probability is not None:
            raise ValueError("AssistantTurns.sample does not support mask or probability")
        rng, text = self.np_random, self._text
        kind = int(rng.integers(4))
        if kind == 0:
            return AssistantTurn(answer=text.sample())
        if kind == 1:
            return AssistantTurn(content=text.sample(), errors=("sampled malformed turn",))
        names = [*self.tool_names, text.sample()]
        tool_calls = []
        for i in range(int(rng.integers(1, 4))):
            name = names[int(rng.integers(len(names)))]
            arguments = {text.sample(): text.sample() for _ in range(int(rng.integers(0, 3)))}
            error = "sampled unreadable arguments" if kind == 3 and i == 0 else None
            tool_calls.append(ToolCall(name=name, arguments=arguments, id=f"call_sample_{i}", error=error))
        return AssistantTurn(content=text.sample(), calls=tuple(tool_calls))

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"AssistantTurns(tool_names={self.tool_names})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AssistantTurns) and other.tool_names == self.tool_names


class Observations(spaces.Space[Any]):
    """A ``ToolEnv``'s observations: the task's prompt (a string, from ``reset``) or ``ToolResults`` (from ``step``)."""

    def __init__(self, max_length: int = 1_000_000, seed: int | np.random.Generator | None = None) -> None:
        self.max_length = max_length
        self._text = AnyText(max_length=max_length)
        super().__init__(shape=None, dtype=None, seed=seed)

    def contains(self, x: Any) -> bool:
        if isinstance(x, str):
            return len(x) <= self.max_length
        return isinstance(x, ToolResults) and x.num_chars <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> Any:
        if mask is not None or probability is not None:
            raise ValueError("Observations.sample does not support mask or probability")
        if self.np_random.integers(2):
            return self._text.sample()
        return ToolResults(results=(ToolResult(call_id="call_0_0", name="tool", content=self._text.sample()),))

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Observations(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Observations) and other.max_length == self.max_length
