"""The request-field tables of docs/reference/request-fields.md, from the pydantic models.

One table lists every top-level field of the three generating endpoints with its type, bounds,
default, the endpoints that take it and what it does here (field_notes.py for OpenAI's and the
Responses API's fields, server/api/extension_fields.py for the rest); then one table per nested
body part (stream options, response formats, messages, tools, input items...); and the form
fields of the audio routes.
"""

from __future__ import annotations

from pydantic import BaseModel

from server.api.audio_forms import TranscriptionForm
from server.api.extension_fields import FIELDS
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.responses_protocol import ResponsesRequest
from server.docgen.annotations import bounds, default_text, nested_models, type_name
from server.docgen.field_notes import NOTES

ENDPOINTS: dict[str, type[BaseModel]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
    "responses": ResponsesRequest,
}
SHOWN = {"completions": "completions", "chat": "chat", "responses": "Responses"}


def field_names(model: type[BaseModel]) -> list[str]:
    """The names a client sends (aliases where a field has one: `schema`, `json`)."""
    return [info.alias or name for name, info in model.model_fields.items()]


def _info(model: type[BaseModel], sent_name: str):  # noqa: ANN202 - pydantic's FieldInfo
    for name, info in model.model_fields.items():
        if (info.alias or name) == sent_name:
            return info
    raise KeyError(sent_name)


def note(name: str, endpoint: str) -> str | None:
    """What `name` does on `endpoint`: field_notes.py first, then the extension-field list (the
    Responses API takes chat's decoding fields, so it falls back to chat's entry)."""
    if f"{endpoint}:{name}" in NOTES:
        return NOTES[f"{endpoint}:{name}"]
    if name in NOTES:
        return NOTES[name]
    lookup = "chat" if endpoint == "responses" else endpoint
    for f in FIELDS:
        if f.name == name and lookup in f.endpoints:
            return f.meaning
    return None


def _per_endpoint(values: dict[str, str]) -> str:
    """One value when every endpoint agrees, else `completions: A<br>chat, Responses: B`."""
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    grouped: dict[str, list[str]] = {}
    for endpoint, value in values.items():
        grouped.setdefault(value, []).append(SHOWN[endpoint])
    return "<br>".join(f"{', '.join(eps)}: {value}" for value, eps in grouped.items())


def _type_cell(model: type[BaseModel], name: str) -> str:
    info = _info(model, name)
    limits = bounds(info)
    return f"{type_name(info.annotation)}{f' ({limits})' if limits else ''}"


def render_all_fields() -> str:
    names = sorted({n for model in ENDPOINTS.values() for n in field_names(model)})
    lines = [
        "| field | type | default | endpoints | what it does here |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        where = {ep: m for ep, m in ENDPOINTS.items() if name in field_names(m)}
        kind = _per_endpoint({ep: _type_cell(m, name) for ep, m in where.items()})
        default = _per_endpoint({ep: default_text(_info(m, name)) for ep, m in where.items()})
        what = _per_endpoint({ep: note(name, ep) or "" for ep in where})
        endpoints = ", ".join(SHOWN[ep] for ep in where)
        lines.append(f"| `{name}` | {kind} | {default} | {endpoints} | {_cell(what)} |")
    return "\n".join(lines)


def body_parts() -> list[type[BaseModel]]:
    """Every model nested in the request models, in the order first met."""
    found: list[type[BaseModel]] = []
    todo: list[type[BaseModel]] = list(ENDPOINTS.values())
    while todo:
        model = todo.pop(0)
        for info in model.model_fields.values():
            for part in nested_models(info.annotation):
                if part not in found and part not in ENDPOINTS.values():
                    found.append(part)
                    todo.append(part)
    return found


def render_body_parts() -> str:
    sections = []
    for part in body_parts():
        lines = [f"### `{part.__name__}`", "", "| field | type | default |", "|---|---|---|"]
        for name in field_names(part):
            default = default_text(_info(part, name))
            lines.append(f"| `{name}` | {_type_cell(part, name)} | {default} |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def render_audio_fields() -> str:
    """The audio routes' form fields (`file` aside), with their descriptions."""
    lines = ["| field | type | default | what it does |", "|---|---|---|---|"]
    for name, info in TranscriptionForm.model_fields.items():
        what = info.description or ""
        lines.append(
            f"| `{name}` | {_type_cell(TranscriptionForm, name)} | {default_text(info)} "
            f"| {_cell(what)} |"
        )
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
