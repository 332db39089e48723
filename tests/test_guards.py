"""API keys on every spelling of a model route, body limits, CORS off by default."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from server.api.app import create_app
from server.api.serving import ServingContext
from server.config import ServerConfig

KEYS = ["key-one", "key-two"]


@pytest.fixture
async def secured(tiny_ctx: ServingContext) -> AsyncIterator[httpx.AsyncClient]:
    config = ServerConfig(api_keys=KEYS, max_body_bytes=2048)
    app = create_app(ctx=tiny_ctx, config=config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c


BODY = {"prompt": "Hi", "max_tokens": 1}


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "//v1/completions",
        "/v1//completions",
        "/v1/completions/",
        "/v1/%63ompletions",
        "/v1/completions%2F",
        "/V1/completions",
        "/v1/./completions",
        "/x/../v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/engine/stats",
        "/docs",
        "/openapi.json",
        "/nothing",
    ],
)
async def test_every_spelling_of_a_route_needs_a_key(secured: httpx.AsyncClient, path: str) -> None:
    r = await secured.post(path, json=BODY) if "completions" in path else await secured.get(path)
    assert r.status_code == 401, (path, r.status_code)
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "header",
    [
        "Bearer wrong",
        "Bearer key-on",
        "Bearer key-one-x",
        "Basic key-one",
        "key-one",
        "Bearer ",
        "",
    ],
)
async def test_wrong_keys_are_refused(secured: httpx.AsyncClient, header: str) -> None:
    r = await secured.post("/v1/completions", json=BODY, headers={"Authorization": header})
    assert r.status_code == 401


@pytest.mark.parametrize("key", KEYS)
async def test_each_configured_key_works(secured: httpx.AsyncClient, key: str) -> None:
    r = await secured.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    r = await secured.post("/v1/completions", json=BODY, headers={"authorization": f"bearer {key}"})
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/health", {"status": "ok"}),
        ("/ready", {"status": "ready"}),
        ("/%68ealth", {"status": "ok"}),  # routed on the decoded path, like the guard's check
    ],
)
async def test_public_paths_need_no_key(secured: httpx.AsyncClient, path: str, body: dict) -> None:
    r = await secured.get(path)
    assert r.status_code == 200, (path, r.status_code)
    assert r.json() == body


async def test_metrics_is_public(secured: httpx.AsyncClient) -> None:
    r = await secured.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE beamline:num_requests_running gauge" in r.text


@pytest.mark.parametrize("path", ["/health/", "/ready/", "/metrics/"])
async def test_a_trailing_slash_on_a_public_path_redirects_without_a_key(
    secured: httpx.AsyncClient, path: str
) -> None:
    """The guard lets the spelling through (it normalises the path); the router answers with a
    307 to the canonical route, which is public as well."""
    r = await secured.get(path)
    assert r.status_code == 307, (path, r.status_code)
    assert r.headers["location"] == f"http://t{path.rstrip('/')}"
    r = await secured.get(path, follow_redirects=True)
    assert r.status_code == 200 and r.url.path == path.rstrip("/")


async def test_public_paths_are_configurable(tiny_ctx: ServingContext) -> None:
    app = create_app(ctx=tiny_ctx, config=ServerConfig(api_keys=KEYS, public_paths=["/health"]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 401


async def test_api_key_file(tiny_ctx: ServingContext, tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("from-file\n\n")
    app = create_app(ctx=tiny_ctx, config=ServerConfig(api_key_file=path))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/v1/models")).status_code == 401
        assert (
            await c.get("/v1/models", headers={"Authorization": "Bearer from-file"})
        ).status_code == 200


async def test_bodies_over_the_limit_get_413(secured: httpx.AsyncClient) -> None:
    auth = {"Authorization": "Bearer key-one"}
    r = await secured.post("/v1/completions", json={"prompt": "x" * 5000}, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'

    r = await secured.post(
        "/v1/completions", content=chunks(), headers={**auth, "content-type": "application/json"}
    )
    assert r.status_code == 413


async def test_cors_is_off_unless_configured(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    r = await client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    app = create_app(ctx=tiny_ctx, config=ServerConfig(cors_allow_origins=["https://ok.example"]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get("/v1/models", headers={"Origin": "https://ok.example"})
        assert r.headers["access-control-allow-origin"] == "https://ok.example"
