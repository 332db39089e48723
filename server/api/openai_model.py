"""The base of every request body part: OpenAI's rules for unknown fields, nulls and types."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

TokenIds = list[Annotated[int, Field(ge=0)]]


class OpenAIModel(BaseModel):
    """Base of every request body part.

    - An unknown field is a 400 naming it: a field we do not implement must never be silently
      ignored. The harmless ones are declared (server/api/extension_fields.py lists them all).
    - An explicit null means "use the default" (clients send it for any nullable field); only a
      required field cannot be null.
    - Strict types: "0.5" is not a temperature and true is not a token count (ints still pass as
      floats).
    """

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drop the nulls of optional fields; an unknown field stays, null or not, to be
        refused by name."""
        if not isinstance(data, dict):
            return data
        optional = {
            key
            for name, info in cls.model_fields.items()
            if not info.is_required()
            for key in (name, info.alias)
            if key
        }
        return {k: v for k, v in data.items() if v is not None or k not in optional}

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The OpenAPI document says what the server takes: every optional field may be null."""
        json_schema = handler(core_schema)
        target = handler.resolve_ref_schema(json_schema)
        required = set(target.get("required", ()))
        properties = target.get("properties", {})
        for name, prop in properties.items():
            if name not in required and not _allows_null(prop):
                outer = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
                properties[name] = {"anyOf": [prop, {"type": "null"}], **outer}
        return json_schema


def _allows_null(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    branches = schema.get("anyOf", []) + schema.get("oneOf", [])
    return any(isinstance(b, dict) and _allows_null(b) for b in branches)


class NoEffectFields(OpenAIModel):
    """OpenAI's fields that change nothing in what this server returns: accepted, and ignored
    (server/api/extension_fields.py says why for each)."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
