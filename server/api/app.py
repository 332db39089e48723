"""The FastAPI application: OpenAI-compatible routes, health, engine stats.

The model loads in a background thread after the server starts listening, so `/health` can answer
503 while it loads and 200 once the engine loop runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.api import serving
from server.api.errors import APIError, install_error_handlers
from server.api.middleware import RequestIdMiddleware
from server.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.api.serving import ServingContext

log = logging.getLogger(__name__)


class ServingState:
    """Holds the serving context once loaded (or the error that stopped loading)."""

    def __init__(self) -> None:
        self.ctx: ServingContext | None = None
        self.load_error: BaseException | None = None
        self.draining = False

    def require(self) -> ServingContext:
        if self.ctx is None:
            reason = f"model failed to load: {self.load_error}" if self.load_error else "model is loading"
            raise APIError(503, reason, code="not_ready", headers={"Retry-After": "5"})
        if not self.ctx.engine.alive:
            raise APIError(503, "engine is not running", code="engine_dead")
        return self.ctx


def create_app(
    ctx: ServingContext | None = None,
    loader: Callable[[], ServingContext] | None = None,
) -> FastAPI:
    """App over an already built context (tests) or one `loader` builds in the background."""
    state = ServingState()
    state.ctx = ctx

    def load() -> None:
        try:
            state.ctx = loader()  # type: ignore[misc]
        except BaseException as exc:
            log.exception("model failed to load")
            state.load_error = exc

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if loader is not None and state.ctx is None:
            threading.Thread(target=load, name="beamline-loader", daemon=True).start()
        yield
        if state.ctx is not None:
            await asyncio.to_thread(state.ctx.engine.shutdown)

    app = FastAPI(title="beamline", version="0.1.0", lifespan=lifespan)
    app.state.serving = state
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app, on_client_error=lambda: _count_validation_failure(state))

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
        c = state.require()
        return ModelList(data=[ModelCard(id=c.model_name, max_model_len=c.max_model_len)])

    @app.get("/v1/engine/stats")
    async def engine_stats() -> JSONResponse:
        c = state.require()
        e = c.engine.engine
        s = e.stats
        return JSONResponse({
            "num_requests_running": e.num_running,
            "num_requests_waiting": e.num_waiting,
            "kv_blocks_total": e.pool.num_blocks,
            "kv_blocks_free": e.pool.num_free,
            "peak_kv_blocks_used": s.peak_blocks_used,
            "steps": s.steps,
            "tokens_computed": s.tokens_computed,
            "tokens_generated": s.tokens_generated,
            "max_seqs_in_step": s.max_seqs_in_step,
            "preemptions": s.preemptions,
        })

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request):
        c = state.require()
        jobs = serving.completion_jobs(c, body)
        request_id = serving.new_request_id("completion")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = serving.stream_events(
                c, request_id, jobs, include_usage, serving.completion_chunk_maker(c, request_id)
            )
            return StreamingResponse(events, media_type="text/event-stream")
        return await serving.completion_response(c, request_id, jobs)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        c = state.require()
        job = serving.chat_job(c, body)
        request_id = serving.new_request_id("chat")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            make, first = serving.chat_chunk_maker(c, request_id)
            events = serving.stream_events(c, request_id, [job], include_usage, make, first)
            return StreamingResponse(events, media_type="text/event-stream")
        return await serving.chat_response(c, request_id, job)

    return app


def _count_validation_failure(state: ServingState) -> None:
    if state.ctx is not None and state.ctx.metrics is not None:
        state.ctx.metrics.record_request_failure(reason="validation")
