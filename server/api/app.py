"""The FastAPI application: OpenAI-compatible routes, health, readiness, metrics, engine stats.

The model loads in a background thread after the server starts listening, so `/health` can answer
503 while it loads and 200 once the engine loop runs. Admission is bounded: at most
`max_num_seqs + max_waiting_requests` engine requests are in flight, beyond that 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.api import (
    playground,
    responses,
    responses_api,
    responses_stream,
    serving,
    streaming,
    tokenization,
    transcriptions,
)
from server.api.audio_forms import TranscriptionForm, TranslationForm, read_form
from server.api.errors import APIError, install_error_handlers
from server.api.guards import APIKeyGuard, BodySizeGuard
from server.api.lora_routes import install_lora_routes
from server.api.middleware import RequestIdMiddleware
from server.api.models_route import ModelList, model_list
from server.api.openapi import describe_as_served
from server.api.protocol import ChatCompletionRequest, CompletionRequest, new_id
from server.api.response_store import ResponseStore
from server.api.serving import Job, ServingContext
from server.api.tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizePromptRequest
from server.config import ServerConfig

log = logging.getLogger(__name__)
AUDIO_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")


class ServingState:
    """The serving context once loaded (or the error that stopped loading), admission, draining."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ctx: ServingContext | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.in_flight = 0  # engine requests admitted and not yet finished

    def require(self) -> ServingContext:
        if self.ctx is None:
            reason = (
                f"model failed to load: {self.load_error}"
                if self.load_error
                else "model is loading"
            )
            raise APIError(503, reason, code="not_ready", headers={"Retry-After": "5"})
        if not self.ctx.engine.alive:
            raise APIError(503, "engine is not running", code="engine_dead")
        return self.ctx

    def admit(self, ctx: ServingContext, count: int) -> None:
        """Reserve `count` engine requests or refuse with 503 (draining or queue full)."""
        if self.draining:
            raise APIError(
                503, "server is shutting down", code="draining", headers={"Retry-After": "10"}
            )
        capacity = self.config.max_num_seqs + self.config.max_waiting_requests
        if count > capacity:  # could never be admitted: retrying would not help
            raise APIError(
                400,
                f"this request has {count} prompts but the server admits at most "
                f"{capacity} at once",
                param="prompt",
                code="too_many_prompts",
            )
        if self.in_flight + count > capacity:
            if ctx.metrics is not None:
                ctx.metrics.record_request_failure(reason="overloaded")
            raise APIError(
                503,
                f"server is overloaded ({self.in_flight} requests in flight); retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self.in_flight += count

    def release(self, count: int) -> None:
        self.in_flight -= count


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _unless_disconnected(request: Request, work: Awaitable[object]) -> object:
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(
                status_code=499
            )  # nobody is listening; the status is for the access log
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


def create_app(
    ctx: ServingContext | None = None,
    loader: Callable[[], ServingContext] | None = None,
    config: ServerConfig | None = None,
) -> FastAPI:
    """App over an already built context (tests) or one `loader` builds in the background."""
    config = config or (ctx.config if ctx is not None else ServerConfig())
    state = ServingState(config)
    state.ctx = ctx
    response_store = ResponseStore(config.responses_store_size)

    def load(build: Callable[[], ServingContext]) -> None:
        try:
            state.ctx = build()
        except BaseException as exc:
            log.error("model failed to load: %s", exc)  # one line; the traceback at debug level
            log.debug("model failed to load", exc_info=True)
            state.load_error = exc

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if loader is not None and state.ctx is None:
            threading.Thread(
                target=load, args=(loader,), name="beamline-loader", daemon=True
            ).start()
        yield
        if state.ctx is not None:
            await asyncio.to_thread(state.ctx.engine.shutdown)

    app = FastAPI(title="beamline", version="0.1.0", lifespan=lifespan)
    describe_as_served(app)
    app.state.serving = state
    # Added innermost first: the request id wraps everything, CORS answers preflights before auth.
    app.add_middleware(
        BodySizeGuard,
        max_bytes=config.max_body_bytes,
        by_path={path: config.max_audio_bytes for path in AUDIO_ROUTES},
    )
    public = [*config.public_paths, *(playground.PUBLIC_PATHS if config.playground else ())]
    app.add_middleware(APIKeyGuard, keys=config.all_api_keys(), public_paths=public)
    if config.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors_allow_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app, on_client_error=lambda: _count_validation_failure(state))

    if config.playground:
        playground.install_playground(app)
    if config.allow_runtime_lora_updating:
        install_lora_routes(app, state.require)

    @app.get("/health")
    async def health() -> JSONResponse:
        state.require()
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        state.require()
        if state.draining:
            raise APIError(503, "server is draining", code="draining")
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        c = state.require()
        if c.metrics is None:
            raise APIError(404, "metrics are not enabled")
        body, content_type = c.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return model_list(state.require())

    @app.get("/v1/engine/stats")
    async def engine_stats() -> JSONResponse:
        stats = state.require().engine.stats()
        return JSONResponse(  # the front end's admissions go next to the engine's queues
            {
                "num_requests_running": stats.pop("num_requests_running"),
                "num_requests_waiting": stats.pop("num_requests_waiting"),
                "num_requests_in_flight": state.in_flight,
                **stats,
            }
        )

    # vLLM's tokenizer routes: clients that count tokens themselves use the server's tokenizer.
    @app.post("/tokenize")
    async def tokenize(body: TokenizePromptRequest | TokenizeChatRequest) -> JSONResponse:
        c = state.require()
        serving.check_model(c, body.model)
        return JSONResponse(tokenization.tokenize(c, body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        c = state.require()
        serving.check_model(c, body.model)
        return JSONResponse(tokenization.detokenize(c, body))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenization.tokenizer_info(state.require()))

    async def run(
        request: Request,
        c: ServingContext,
        jobs: list[Job],
        stream: Callable[[], AsyncIterator[str]] | None,
        complete: Callable[[], Awaitable[object]],
    ) -> object:
        """Admit, then stream or complete; the admission is released however the request ends."""
        state.admit(c, len(jobs))
        if stream is None:
            try:
                return await _unless_disconnected(request, complete())
            finally:
                state.release(len(jobs))

        async def events() -> AsyncIterator[str]:
            try:
                async for event in stream():
                    yield event
            finally:
                state.release(len(jobs))

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request):
        c = state.require()
        jobs = serving.completion_jobs(c, body)
        await serving.compile_constraints(c, jobs)
        request_id = serving.new_request_id("completion", body.request_id)
        stream = (
            (
                lambda: streaming.stream_events(
                    c,
                    request_id,
                    jobs,
                    body.include_usage,
                    streaming.completion_chunk_maker(
                        c, request_id, serving.reported_model(c, jobs[0])
                    ),
                    continuous_usage=body.continuous_usage,
                )
            )
            if body.stream
            else None
        )
        return await run(
            request, c, jobs, stream, lambda: responses.completion_response(c, request_id, jobs)
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        c = state.require()
        job = serving.chat_job(c, body)
        await serving.compile_constraints(c, [job])
        request_id = serving.new_request_id("chat", body.request_id)
        make, first = streaming.chat_chunk_maker(
            c, request_id, body.n, job.tool_plan, serving.reported_model(c, job)
        )
        stream = (
            (
                lambda: streaming.stream_events(
                    c,
                    request_id,
                    [job],
                    body.include_usage,
                    make,
                    first,
                    continuous_usage=body.continuous_usage,
                )
            )
            if body.stream
            else None
        )
        return await run(
            request, c, [job], stream, lambda: responses.chat_response(c, request_id, job)
        )

    @app.post("/v1/responses", response_model=None)
    async def create_response(body: dict[str, Any], request: Request):
        call = await responses_api.prepare(state.require(), response_store, body)
        stream = (lambda: responses_stream.stream_response(call)) if call.streams else None
        return await run(request, call.ctx, [call.job], stream, lambda: responses_api.respond(call))

    async def audio_route(request: Request, task: str):
        c = state.require()
        form_class = TranslationForm if task == "translate" else TranscriptionForm
        form, data, _ = await read_form(request, form_class)
        call = await transcriptions.prepare(c, form, data, task)
        request_id = new_id("trsc")
        stream = (lambda: transcriptions.stream(c, request_id, call)) if form.stream else None
        return await run(
            request, c, [call.job], stream, lambda: transcriptions.respond(c, request_id, call)
        )

    @app.post("/v1/audio/transcriptions", response_model=None)
    async def create_transcription(request: Request):
        return await audio_route(request, "transcribe")

    @app.post("/v1/audio/translations", response_model=None)
    async def create_translation(request: Request):
        return await audio_route(request, "translate")

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(response_store.get(response_id))

    return app


def _count_validation_failure(state: ServingState) -> None:
    if state.ctx is not None and state.ctx.metrics is not None:
        state.ctx.metrics.record_request_failure(reason="validation")
