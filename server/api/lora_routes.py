"""vLLM's runtime LoRA routes, served when `allow_runtime_lora_updating` is on (behind the API key
like every route): POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter, with vLLM's
bodies and its plain-text success answers; failures are OpenAI-shaped errors. A loaded adapter is
served by its name at once (its `model`); an unloaded one is refused from then on (404), while
requests already running with it finish."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import Field

from server.api.context import ServingContext
from server.api.errors import APIError
from server.api.openai_model import OpenAIModel
from server.engine.client import AdapterLoadError, UnknownAdapter


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)  # a directory or a hub id


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's internal id: accepted, the name decides


def install_lora_routes(app: FastAPI, require: Callable[[], ServingContext]) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        ctx = require()
        name = body.lora_name
        if name == ctx.model_name or name in ctx.named_models:
            whose = "the served model's" if name == ctx.model_name else "an extra model's"
            raise APIError(
                400,
                f"a LoRA adapter may not be named {name!r}: that is {whose} name",
                param="lora_name",
                code="invalid_value",
            )
        if name in ctx.engine.adapter_names():  # replacing one: unload it first
            raise APIError(
                400,
                f"the LoRA adapter {name!r} has already been loaded",
                param="lora_name",
                code="adapter_exists",
            )
        try:
            await ctx.engine.load_adapter(name, body.lora_path)
        except AdapterLoadError as exc:
            raise APIError(400, str(exc), param="lora_path", code="invalid_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        ctx = require()
        try:
            ctx.engine.unload_adapter(body.lora_name)
        except UnknownAdapter:
            raise APIError(
                404,
                f"the LoRA adapter {body.lora_name!r} cannot be found",
                param="lora_name",
                code="model_not_found",
            ) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
