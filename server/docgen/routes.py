"""The routes page: every route of the FastAPI app (with its default configuration), each with
what it does. ROUTES is that text; tests/test_docs_reference.py holds it to the app's routes."""

from __future__ import annotations

from fastapi.routing import APIRoute
from starlette.routing import Route

from server.api.app import create_app
from server.config import ServerConfig

ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1/completions"): "text completion; `prompt` is a string, a list of strings, "
    "token ids or a list of token-id lists (one choice per prompt)",
    ("POST", "/v1/chat/completions"): "chat completion through the model's chat template "
    "(Gemma's turn template when a GGUF file carries none)",
    ("POST", "/v1/responses"): "OpenAI's Responses API (`client.responses.create` / `.stream` / "
    "`.parse`) over the chat path",
    ("POST", "/v1/audio/transcriptions"): "a speech model's (Whisper) transcript of an uploaded "
    "audio file, a multipart form as the openai SDK sends it; json, text, srt, vtt, "
    "verbose_json or streamed events ([speech to text](../guides/speech.md))",
    ("POST", "/v1/audio/translations"): "the same, translated into English (multilingual models)",
    ("GET", "/v1/responses/{response_id}"): "a stored response (`client.responses.retrieve`); "
    "404 once it has left the store",
    ("GET", "/v1/models"): "the served model (`id`, `max_model_len`), the sampling defaults that "
    "apply and, a beamline extension, the server's `limits` (`max_n`, `max_best_of`, "
    "`max_num_beams`, `max_logprobs`, ...); then each LoRA adapter, its `parent` the served "
    "model and its `root` where its files came from",
    ("POST", "/v1/load_lora_adapter"): "vLLM's: `{lora_name, lora_path}` serves a LoRA adapter "
    "(a directory or a hub id) under that name; 400 when its files do not fit the model; only "
    "with `allow_runtime_lora_updating`",
    ("POST", "/v1/unload_lora_adapter"): "vLLM's: `{lora_name}` stops serving it (requests "
    "already running finish with it); 404 for a name not served; only with "
    "`allow_runtime_lora_updating`",
    ("POST", "/tokenize"): "vLLM's shape: `{prompt}` gives the ids `/v1/completions` runs, "
    "`{messages, tools, ...}` the ids `/v1/chat/completions` runs; answers `{count, "
    "max_model_len, tokens, token_strs}`",
    ("POST", "/detokenize"): "`{tokens: [ids]}` -> `{prompt: text}`; an id outside the "
    "vocabulary is a 400",
    ("GET", "/tokenizer_info"): "what a client needs to tokenize as the server does: special "
    "tokens and their ids, `add_bos_token`, `vocab_size`, `model_max_length`, `chat_template` "
    "(lm-evaluation-harness reads it)",
    ("GET", "/health"): "liveness: 200 once the model is loaded and the engine loop runs; 503 "
    "before, and once the loop has died",
    ("GET", "/ready"): "readiness: as `/health`, and 503 while draining after SIGTERM",
    ("GET", "/metrics"): "Prometheus metrics (see Metrics)",
    ("GET", "/v1/engine/stats"): "engine counters: running / waiting, KV blocks total / free / "
    "peak / cached, steps, busy seconds, preemptions, prefix-cache hit rate, speculation and "
    "constraint-mask counters",
    ("GET", "/"): "the decoding playground page; public; off with `playground: false`",
    ("GET", "/playground/app.js"): "the playground's script",
    ("GET", "/playground/style.css"): "the playground's style sheet",
    ("GET", "/openapi.json"): "the OpenAPI document, as the server behaves",
    ("GET", "/docs"): "Swagger UI over the OpenAPI document (FastAPI's)",
    ("GET", "/docs/oauth2-redirect"): "Swagger UI's OAuth2 redirect page (FastAPI's)",
    ("GET", "/redoc"): "ReDoc over the OpenAPI document (FastAPI's)",
}


def app_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the app built with the default configuration, and the
    routes only a setting turns on."""
    found = []
    for route in create_app(config=ServerConfig(allow_runtime_lora_updating=True)).routes:
        if isinstance(route, (APIRoute, Route)):
            for method in sorted((route.methods or set()) - {"HEAD"}):
                found.append((method, route.path))
    return found


def render_routes() -> str:
    lines = ["| method | path | what |", "|---|---|---|"]
    for method, path in app_routes():
        text = ROUTES.get((method, path), "**not documented**")
        lines.append(f"| {method} | `{path}` | {text} |")
    return "\n".join(lines)
