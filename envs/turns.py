"""What an environment exchanges with the policy, free of any chat format: parsed assistant turns and tool results.

A chat format (``agentrl.chat``) turns the model's sampled tokens into an ``AssistantTurn`` and renders the env's
``ToolResults`` back into tokens; the env itself never sees markup. So one env runs unchanged under every model
family's template, and an oracle writes its gold turns once, as data::

    [call("calculate", expression="3 * (4 + 5)"), answer("27")]

``ToolCall.error`` carries a problem the format found in one call it could still attribute (a call whose name the
format read but whose arguments are not JSON): the env answers that call with the error instead of running it.
Problems with the turn as a whole (no call and no answer, unbalanced markup, too many calls) are
``AssistantTurn.errors``; the env shows them to the model in ``ToolResults.errors``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the tool's name and JSON arguments; ``id`` is the format's call id ("" until a format assigns one)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    error: str | None = None  # the format could not read this call's arguments: the env replies with this error

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "name": self.name, "arguments": self.arguments}
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True, slots=True)
class AssistantTurn:
    """One assistant message, parsed.

    ``calls`` non-empty: the turn calls tools (``answer`` is None). ``answer`` set: the final answer. ``content`` is
    the visible text around the calls (for formats whose final answer is the message itself, the answer's text);
    ``reasoning`` a thinking channel's text where the format has one. ``errors`` non-empty means the turn was (partly)
    malformed: the env neither runs nor scores anything the errors concern and shows them to the model.
    """

    content: str = ""
    calls: tuple[ToolCall, ...] = ()
    answer: str | None = None
    reasoning: str | None = None
    errors: tuple[str, ...] = ()

    @property
    def malformed(self) -> bool:
        return bool(self.errors) or any(c.error is not None for c in self.calls)


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What one call returned (or the mistake it made, with ``is_error``), for the call with id ``call_id``."""

    call_id: str
    name: str
    content: str
    is_error: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.call_id, "name": self.name, "content": self.content, "is_error": self.is_error}


@dataclass(frozen=True, slots=True)
class ToolResults:
    """An env's observation after an assistant turn: one result per call, in call order, and the turn-level problems
    the model should hear about."""

    results: tuple[ToolResult, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def num_chars(self) -> int:
        return sum(len(r.content) for r in self.results) + sum(len(e) for e in self.errors)


def with_call_ids(turn: AssistantTurn, turn_number: int) -> AssistantTurn:
    """``turn`` with every call that has no id named ``call_{turn_number}_{index}`` (what ``ToolEnv.step`` does)."""
    if all(c.id for c in turn.calls):
        return turn
    return replace(turn, calls=tuple(c if c.id else replace(c, id=f"call_{turn_number}_{i}")
                                     for i, c in enumerate(turn.calls)))


def call(name: str, /, **arguments: Any) -> AssistantTurn:
    """A turn that makes one tool call (for oracles): ``call("lookup", key="key-3f9a1c")``."""
    return AssistantTurn(calls=(ToolCall(name=name, arguments=arguments),))


def calls(*tool_calls: tuple[str, dict[str, Any]], content: str = "") -> AssistantTurn:
    """A turn that makes several calls, with optional text before them: ``calls(("a", {...}), ("b", {...}))``."""
    return AssistantTurn(content=content, calls=tuple(ToolCall(name=n, arguments=dict(a)) for n, a in tool_calls))


def answer(text: str, /) -> AssistantTurn:
    """The final answer turn (for oracles)."""
    return AssistantTurn(answer=text)
