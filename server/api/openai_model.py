"""The base of every request body part: OpenAI's rules for unknown fields, nulls and types."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
        if not isinstance(data, dict):
            return data
        required = {
            key
            for name, info in cls.model_fields.items()
            if info.is_required()
            for key in (name, info.alias)
            if key
        }
        return {k: v for k, v in data.items() if v is not None or k in required}
