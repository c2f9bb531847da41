"""Typed tool methods become JSON schemas; arguments are validated against them."""

from typing import Literal

import pytest

from agentrl.envs import ToolEnv, tool
from agentrl.envs.tools import build_spec, json_schema, validate_arguments


class Search(ToolEnv):
    @tool
    def find(self, query: str, limit: int = 5, exact: bool = False, scale: float | None = None,
             tags: list[str] | None = None, mode: Literal["fast", "deep"] = "fast",
             weights: dict[str, float] | None = None) -> str:
        """Find documents that match a query.

        Longer explanation that is not part of the description.

        Args:
            query: words to look for; a longer description
                that continues on the next line.
            limit (int): how many results.
        """
        return query

    @tool(name="open")
    def open_document(self, doc_id: str) -> str:
        """Open a document."""
        return doc_id


def test_schema_from_signature_and_docstring():
    (find,) = [s for s in Search.tools.values() if s.name == "find"]
    schema = find.schema()
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["description"] == "Find documents that match a query."
    params = function["parameters"]
    assert params["required"] == ["query"] and params["additionalProperties"] is False
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "words to look for; a longer description that "
                                                              "continues on the next line."}
    assert props["limit"] == {"type": "integer", "description": "how many results.", "default": 5}
    assert props["exact"] == {"type": "boolean", "default": False}
    assert props["scale"] == {"type": ["number", "null"], "default": None}
    assert props["tags"] == {"type": ["array", "null"], "items": {"type": "string"}, "default": None}
    assert props["mode"] == {"type": "string", "enum": ["fast", "deep"], "default": "fast"}
    assert props["weights"]["additionalProperties"] == {"type": "number"}


def test_tool_name_override():
    assert set(Search.tools) == {"find", "open"} and Search.tools["open"].method == "open_document"


@pytest.mark.parametrize("annotation", [tuple, set[int], dict[int, str], object, Literal["a", 1], int | str])
def test_unsupported_annotations_are_rejected(annotation):
    with pytest.raises(ValueError, match="annotation|Literal|dict keys"):
        json_schema(annotation)


def test_bad_tool_definitions_fail_when_the_class_is_defined():
    with pytest.raises(ValueError, match="parameter 'x' needs a type annotation"):
        class NoHint(ToolEnv):
            @tool
            def f(self, x) -> str:
                """Doc."""
    with pytest.raises(ValueError, match="needs a docstring"):
        class NoDoc(ToolEnv):
            @tool
            def f(self, x: int) -> str:
                return ""
    with pytest.raises(ValueError, match=r"parameter 'args'.*variadic"):
        class Star(ToolEnv):
            @tool
            def f(self, *args: int) -> str:
                """Doc."""
    with pytest.raises(ValueError, match="'bad name!'"):
        class BadName(ToolEnv):
            @tool(name="bad name!")
            def f(self) -> str:
                """Doc."""


def test_validation_reports_each_problem_and_passes_good_arguments():
    spec = Search.tools["find"]
    values, errors = validate_arguments(spec, {"query": "q", "limit": 3, "scale": 2, "tags": ["a"], "mode": "deep"})
    assert errors == [] and values["scale"] == 2.0 and isinstance(values["scale"], float)
    _, errors = validate_arguments(spec, {"limit": True, "tags": ["a", 1], "mode": "slow", "extra": 1,
                                          "weights": {"a": "x"}})
    text = " | ".join(errors)
    assert "missing required argument 'query'" in text
    assert "'limit' must be integer, got boolean True" in text
    assert "'tags[1]' must be string" in text
    assert "must be one of ['fast', 'deep']" in text
    assert "unexpected argument 'extra'" in text
    assert "'weights.a' must be number" in text


def test_build_spec_on_a_plain_function():
    def area(self, width: float, height: float = 1.0) -> str:
        """Area of a rectangle."""
    spec = build_spec(area, "area")
    assert spec.parameters["properties"]["width"] == {"type": "number"} and spec.parameters["required"] == ["width"]
