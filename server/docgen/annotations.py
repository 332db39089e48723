"""Type, bound and default of a pydantic field, written the way the reference tables show them."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
_LENGTHS = (("min_length", "min length"), ("max_length", "max length"))
INT64_MAX = 2**63 - 1


def type_name(annotation: Any) -> str:
    """`int | None` -> `int \\| null`, `list[Annotated[int, ...]]` -> `list[int]`; models by name;
    every `|` escaped for a Markdown table cell."""
    return " | ".join(_members(annotation)).replace("|", "\\|")


def _members(annotation: Any) -> list[str]:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _members(args[0])
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        out: list[str] = []
        for arg in args:
            out += [m for m in _members(arg) if m not in out]
        return out
    if origin is typing.Literal:
        return [json.dumps(a) for a in args]
    if annotation is type(None):
        return ["null"]
    if annotation is Any:
        return ["any"]
    if origin in (list, tuple, set, frozenset):
        return [f"list[{' | '.join(_members(args[0])) if args else 'any'}]"]
    if origin is dict:
        key, value = (" | ".join(_members(a)) for a in args) if args else ("any", "any")
        return [f"dict[{key}, {value}]"]
    if isinstance(annotation, type):
        return [annotation.__name__]
    return [str(annotation).replace("typing.", "")]


def bounds(info: FieldInfo) -> str:
    """`≥ 0, ≤ 2` from the field's own constraints (ge, gt, le, lt, lengths, pattern)."""
    parts = []
    for meta in info.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {_number(value)}")
        for attr, what in _LENGTHS:
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{what} {value}")
        pattern = getattr(meta, "pattern", None)
        if pattern is not None:
            parts.append(f"pattern `{pattern}`")
    return ", ".join(parts)


def _number(value: object) -> str:
    if isinstance(value, int) and abs(value) >= INT64_MAX:
        return f"{'-' if value < 0 else ''}2^63{'' if value < 0 else ' - 1'}"
    return str(value)


def default_text(info: FieldInfo) -> str:
    """`required`, or the default as JSON (`null`, `true`, `"left"`, `[]`)."""
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_none=True)
    try:
        return f"`{json.dumps(value, default=str)}`"
    except TypeError:
        return f"`{value}`"


def nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names, in order (through unions, lists, Annotated)."""
    found: list[type[BaseModel]] = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    for arg in typing.get_args(annotation):
        found += [m for m in nested_models(arg) if m not in found]
    return found


def md_text(text: str) -> str:
    """Plain text from the code (descriptions, help) as one Markdown table cell or paragraph."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|").replace("\n", " ")
