"""What each config key means, read from the config classes themselves: `agentrl config show`.

The typed dataclasses are the schema and their source is the documentation: a field is described by its class
docstring's ``Args:`` entry (``TrainerConfig``, ``LossConfig``) or else by the comment on its line or on the lines just
above it (``RolloutConfig``). Reading them here keeps one description per key instead of a second copy that
drifts; `tests/unit/test_config_show.py` fails when a key has none.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import typing
from typing import Any

_ARG = re.compile(r"^(\s*)([A-Za-z_][\w, ]*):\s*(.*)$")


@dataclasses.dataclass(frozen=True, slots=True)
class KeyDoc:
    key: str  # dotted, e.g. "rollout.engine.dtype"
    value: Any  # in the resolved config
    default: Any  # the typed default
    description: str


def field_descriptions(cls: type) -> dict[str, str]:
    """Field name -> one-line description of a config dataclass (empty where the source says nothing)."""
    out = _docstring_args(inspect.getdoc(cls) or "")
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    class_def = ast.parse(source).body[0]
    body, previous_end = class_def.body, class_def.lineno
    for stmt in body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id not in out:
            lines = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
            above, n = [], stmt.lineno - 1
            while n > previous_end and n in comments:  # a comment block directly above the field
                above.insert(0, comments[n])
                n -= 1
            out[stmt.target.id] = " ".join(above + lines)
        previous_end = stmt.end_lineno
    return out


def describe(cls: type, resolved: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> list[KeyDoc]:
    """Every key of the config dataclass `cls` (sections recursively) with its value in `resolved`, its value in
    `defaults` (both plain nested dicts) and its meaning."""
    hints = typing.get_type_hints(cls)
    texts = field_descriptions(cls)
    rows = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        section = _dataclass_of(hints[f.name])
        if section is not None and not _is_list(hints[f.name]):
            rows += describe(section, resolved.get(f.name) or {}, defaults.get(f.name) or {}, key + ".")
            continue
        rows.append(KeyDoc(key=key, value=resolved.get(f.name), default=defaults.get(f.name),
                           description=texts.get(f.name, "")))
    return rows


def format_rows(rows: list[KeyDoc]) -> str:
    """`key: value  # description (default X)`, grouped by section; descriptions aligned unless a value is long."""
    width = min(44, max(len(r.key) + 2 + len(_show(r.value)) for r in rows))
    lines, section = [], None
    for r in rows:
        head = r.key.rsplit(".", 1)[0] if "." in r.key else ""
        if head != section:
            if section is not None:
                lines.append("")
            section = head
        note = r.description
        if _show(r.value) != _show(r.default):
            note = f"{note} (default: {_show(r.default)})".strip()
        lines.append((f"{r.key}: {_show(r.value)}".ljust(width) + (f"  # {note}" if note else "")).rstrip())
    return "\n".join(lines)


def _docstring_args(doc: str) -> dict[str, str]:
    """`name: text` entries of a Google-style ``Args:`` section; `a, b: text` describes both."""
    out: dict[str, str] = {}
    if "Args:" not in doc:
        return out
    current: list[str] = []
    for line in doc.split("Args:", 1)[1].splitlines():
        match = _ARG.match(line)
        if match and len(match.group(1)) <= 4:
            current = [n.strip() for n in match.group(2).split(",")]
            for name in current:
                out[name] = match.group(3).strip()
        elif line.strip() and current:  # a continuation line
            for name in current:
                out[name] += " " + line.strip()
        elif not line.strip() and current and out[current[0]]:
            current = []
    return out


def _dataclass_of(hint: Any) -> type | None:
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _is_list(hint: Any) -> bool:
    return typing.get_origin(hint) in (list, tuple)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple, dict)):
        return str(list(value) if isinstance(value, tuple) else value)
    return str(value)


def show(args: list[str]) -> str:
    """`agentrl config show [CONFIG] [key=value ...]`: the resolved config, every key with its default and meaning."""
    from omegaconf import OmegaConf

    from agentrl.config import JobConfig, load_config

    path = args[0] if args and "=" not in args[0] else None
    overrides = args[1:] if path is not None else args
    _, resolved = load_config(path, overrides)
    _, defaults = load_config(None)
    rows = describe(JobConfig, OmegaConf.to_container(resolved, resolve=True),
                    OmegaConf.to_container(defaults, resolve=True))
    return f"# {path or 'the defaults'}{' with ' + ' '.join(overrides) if overrides else ''}\n" + format_rows(rows)
