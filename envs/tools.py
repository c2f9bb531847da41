"""Tools as typed methods: the ``@tool`` decorator, JSON schemas from signatures, and argument validation.

A tool is a method of a ``ToolEnv`` marked ``@tool``. Its schema (OpenAI function style, the form chat templates'
``tools=`` argument and vLLM expect) is built once per class from:

* the first docstring paragraph -> the tool description;
* the type hints -> JSON types: ``str``, ``int``, ``float``, ``bool``, ``list[T]``, ``dict[str, T]``,
  ``Literal[...]`` (an enum) and ``T | None`` (nullable);
* an ``Args:`` section (Google style, ``name: text``) -> per-argument descriptions;
* parameters without a default -> ``required``.

An annotation outside that list raises ``ValueError`` when the class is defined, not when the model first calls the
tool. Arguments the model sends are checked against the schema before the method runs, so a tool body can trust its
types; every mistake becomes a message for the model (``validate_arguments``), never an exception.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_MARK = "__agentrl_tool__"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool: the name the model calls, the method that runs it, and its JSON schema."""

    name: str
    method: str
    description: str
    parameters: dict[str, Any]  # a JSON-schema object: {"type": "object", "properties", "required", ...}

    def schema(self) -> dict[str, Any]:
        """OpenAI function-calling form: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def tool(fn: Callable | None = None, *, name: str | None = None) -> Any:
    """Mark a ``ToolEnv`` method as a tool. ``name`` overrides the method name (e.g. a tool called "open")."""

    def mark(f: Callable) -> Callable:
        setattr(f, _MARK, name or f.__name__)
        return f

    return mark(fn) if fn is not None else mark


def collect_tools(cls: type) -> dict[str, ToolSpec]:
    """The tools of ``cls`` (including inherited ones), by tool name. Raises ``ValueError`` for a bad signature."""
    specs: dict[str, ToolSpec] = {}
    for attr in dir(cls):
        fn = inspect.getattr_static(cls, attr, None)
        tool_name = getattr(fn, _MARK, None)
        if tool_name is None:
            continue
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", tool_name):
            raise ValueError(f"{cls.__name__}.{attr}: tool name {tool_name!r} must be 1-64 characters of "
                             "letters, digits, '_', '.', '-'")
        if tool_name in specs:
            raise ValueError(f"{cls.__name__}: two tools are named {tool_name!r}")
        specs[tool_name] = build_spec(fn, tool_name, owner=cls.__name__)
    return specs


def build_spec(fn: Callable, name: str, *, owner: str = "") -> ToolSpec:
    where = f"{owner}.{fn.__name__}" if owner else fn.__name__
    doc = inspect.getdoc(fn) or ""
    description, arg_docs = _parse_docstring(doc)
    if not description:
        raise ValueError(f"tool {where} needs a docstring: its first paragraph is the description the model sees")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - unresolvable forward references, etc.
        raise ValueError(f"tool {where}: cannot resolve its type hints ({exc})") from exc
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in list(inspect.signature(fn).parameters.values())[1:]:  # skip self
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ValueError(f"tool {where}: parameter {param.name!r} must be a plain or keyword-only parameter, "
                             f"not {param.kind.description}")
        if param.name not in hints:
            raise ValueError(f"tool {where}: parameter {param.name!r} needs a type annotation")
        try:
            prop = json_schema(hints[param.name])
        except ValueError as exc:
            raise ValueError(f"tool {where}: parameter {param.name!r}: {exc}") from None
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        if param.default is param.empty:
            required.append(param.name)
        else:
            prop["default"] = param.default
        properties[param.name] = prop
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return ToolSpec(name=name, method=fn.__name__, description=description, parameters=parameters)


def json_schema(annotation: Any) -> dict[str, Any]:
    """JSON schema for a Python annotation; ``ValueError`` for one tools do not support."""
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is list or origin is list:
        return {"type": "array", **({"items": json_schema(args[0])} if args else {})}
    if annotation is dict or origin is dict:
        if args and args[0] is not str:
            raise ValueError(f"dict keys must be str in JSON, got {annotation!r}")
        return {"type": "object", **({"additionalProperties": json_schema(args[1])} if args else {})}
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in _JSON_TYPES:
            raise ValueError(f"Literal values must share one of str/int/float/bool, got {annotation!r}")
        return {"type": _JSON_TYPES[next(iter(kinds))], "enum": list(args)}
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = json_schema(next(a for a in args if a is not type(None)))
        if isinstance(inner.get("type"), str):
            return {**inner, "type": [inner["type"], "null"]}
    raise ValueError(f"unsupported annotation {annotation!r}; use str, int, float, bool, list[T], dict[str, T], "
                     "Literal[...] or T | None")


def validate_arguments(spec: ToolSpec, arguments: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Check ``arguments`` against ``spec``: (arguments ready to call with, problems for the model).

    Integers are accepted where a number is expected and passed as floats; nothing else is coerced.
    """
    props, errors = spec.parameters["properties"], []
    for key in arguments:
        if key not in props:
            errors.append(f"{spec.name}: unexpected argument {_short(key)}; it takes "
                          f"{', '.join(props) or 'no arguments'}")
    for key in spec.parameters["required"]:
        if key not in arguments:
            errors.append(f"{spec.name}: missing required argument {key!r}")
    values = {}
    for key, value in arguments.items():
        if key in props:
            problem = _type_problem(value, props[key], key)
            if problem:
                errors.append(f"{spec.name}: {problem}")
            values[key] = float(value) if _accepts(props[key], "number") and type(value) is int else value
    return values, errors


def _accepts(schema: Mapping[str, Any], json_type: str) -> bool:
    kind = schema.get("type")
    return kind == json_type or (isinstance(kind, list) and json_type in kind)


def _type_problem(value: Any, schema: Mapping[str, Any], where: str) -> str | None:
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if not any(_is_type(value, kind) for kind in kinds):
        return f"argument {where!r} must be {' or '.join(kinds)}, got {_json_type_name(value)} {_short(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"argument {where!r} must be one of {schema['enum']}, got {_short(value)}"
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problem = _type_problem(item, schema["items"], f"{where}[{i}]")
            if problem:
                return problem
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, item in value.items():
            problem = _type_problem(item, schema["additionalProperties"], f"{where}.{k}")
            if problem:
                return problem
    return None


def _is_type(value: Any, kind: str | None) -> bool:
    return {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
        "null": value is None,
    }.get(kind, False)


def _json_type_name(value: Any) -> str:
    for kind in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _is_type(value, kind):
            return kind
    return type(value).__name__


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph as one line, {arg: description}) from a Google-style docstring."""
    paragraphs = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)
    head = paragraphs[0] if paragraphs and not paragraphs[0].lstrip().startswith("Args:") else ""
    description = " ".join(head.split())
    arg_docs: dict[str, str] = {}
    section = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?|\s*\n)*)", doc, flags=re.M)
    if section:
        current = None
        for line in section.group(1).splitlines():
            match = re.match(r"^\s{1,8}(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if match and (current is None or len(line) - len(line.lstrip()) <= _indent(section.group(1))):
                current = match.group(1)
                arg_docs[current] = match.group(2).strip()
            elif current and line.strip():
                arg_docs[current] = f"{arg_docs[current]} {line.strip()}".strip()
    return description, arg_docs


def _indent(block: str) -> int:
    first = next((line for line in block.splitlines() if line.strip()), "")
    return len(first) - len(first.lstrip())
