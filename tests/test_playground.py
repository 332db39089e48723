"""The decoding playground page: static files (ETag, caching, gzip, CSP, the switch), the API
extensions it needs (beam scores and groups in choices, limits in /v1/models), and the page
itself in a real headless Chromium against a live server."""

from __future__ import annotations

import base64
import gzip
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.api.app import create_app
from server.api.playground import FILES, PAGE_DIR
from server.api.serving import ServingContext
from tests.conftest import make_engine, serving_context
from tests.live_server import free_port, live_server
from tests.test_deployment import require_binary

PROMPT = "The sea is"


@pytest.mark.parametrize("path", list(FILES))
async def test_page_files_are_served_with_etag_cache_control_gzip_and_csp(
    client: httpx.AsyncClient, path: str
) -> None:
    name, media_type = FILES[path]
    raw = (PAGE_DIR / name).read_bytes()
    r = await client.get(path, headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200
    assert r.content == raw and r.headers["content-type"] == media_type
    assert r.headers["cache-control"] == "no-cache"
    assert "content-encoding" not in r.headers
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "connect-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    etag = r.headers["etag"]
    zipped = await client.get(path, headers={"Accept-Encoding": "gzip, deflate"})
    assert zipped.headers["content-encoding"] == "gzip"
    assert zipped.headers["vary"] == "Accept-Encoding"
    assert zipped.headers["etag"] == etag
    assert zipped.content == raw  # httpx undid the gzip
    assert int(zipped.headers["content-length"]) == len(gzip.compress(raw, mtime=0)) < len(raw)
    again = await client.get(path, headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    assert again.headers["etag"] == etag


async def test_the_page_needs_nothing_from_outside(client: httpx.AsyncClient) -> None:
    html = (await client.get("/")).text
    js = (await client.get("/playground/app.js")).text
    for text in (html, js):
        assert "http://" not in text and "https://" not in text
    assert "innerHTML" not in js  # model output goes in as text


@asynccontextmanager
async def configured_client(model_dir: Path, **config: object) -> AsyncIterator[httpx.AsyncClient]:
    ctx = serving_context(make_engine(model_dir), **config)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(ctx=ctx)), base_url="http://t"
        ) as c:
            yield c
    finally:
        ctx.engine.shutdown()


async def test_the_switch_turns_the_page_off(llama_dir: Path) -> None:
    async with configured_client(llama_dir, playground=False) as c:
        for path in FILES:
            assert (await c.get(path)).status_code == 404


async def test_the_page_is_public_and_the_api_keeps_its_key(llama_dir: Path) -> None:
    async with configured_client(llama_dir, api_keys=["k1"]) as c:
        for path in FILES:
            assert (await c.get(path)).status_code == 200
        assert (await c.get("/v1/models")).status_code == 401
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200


async def test_models_lists_the_servers_limits(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    card = (await client.get("/v1/models")).json()["data"][0]
    cfg = tiny_ctx.config
    assert card["max_model_len"] == tiny_ctx.max_model_len
    assert card["limits"] == {
        "max_n": cfg.max_n,
        "max_best_of": cfg.max_best_of,
        "max_num_beams": cfg.max_num_beams,
        "max_logprobs": cfg.max_logprobs,
        "max_stop_sequences": cfg.max_stop_sequences,
        "max_prompts_per_request": cfg.max_prompts_per_request,
        "max_scored_prompt_tokens": cfg.max_scored_prompt_tokens,
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_beam_choices_carry_their_score_and_diverse_beams_their_group(
    client: httpx.AsyncClient, stream: bool
) -> None:
    base = {"prompt": PROMPT, "max_tokens": 6, "stream": stream}

    async def choices(**fields: object) -> list[dict]:
        body = {**base, **fields}
        if not stream:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"]
        got = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    got += [c for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
        return got

    beams = await choices(num_beams=4, n=4)
    scores = [c["beam_score"] for c in beams]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)
    assert all(s < 0 for s in scores) and all("beam_group" not in c for c in beams)
    diverse = await choices(num_beams=4, num_beam_groups=2, diversity_penalty=1.0, n=4)
    assert {c["beam_group"] for c in diverse} == {0, 1}
    assert all(isinstance(c["beam_score"], float) for c in diverse)
    greedy = await choices(temperature=0)
    assert all("beam_score" not in c and "beam_group" not in c for c in greedy)


# ---- a real browser ----------------------------------------------------------------------------
# Both drivers speak WebDriver's locator strategies, so one flow drives either browser.
CSS = "css selector"


@dataclass
class Browser:
    driver: Any  # a Selenium WebDriver or a Marionette session
    open: Callable[[str], None]
    save_screenshot: Callable[[Path], None]


def chromium() -> Iterator[Browser]:
    """Debian's chromium through Debian's chromedriver (Selenium downloads nothing then)."""
    binary = require_binary("chromium", "apt-get install chromium chromium-driver")
    driver_path = require_binary("chromedriver", "apt-get install chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,900")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield Browser(driver, driver.get, lambda path: driver.save_screenshot(str(path)))
    finally:
        driver.quit()


def firefox(profile: Path) -> Iterator[Browser]:
    """Debian's firefox-esr through its built-in Marionette server (Debian has no geckodriver)."""
    binary = require_binary("firefox-esr", "apt-get install firefox-esr")
    from marionette_driver.marionette import Marionette

    port = free_port()
    profile.mkdir()
    (profile / "user.js").write_text(f'user_pref("marionette.port", {port});\n')
    args = ["--headless", "--marionette", "--profile", str(profile), "--width", "1280"]
    process = subprocess.Popen(
        [binary, *args, "--height", "900", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "Firefox's Marionette did not start"
                time.sleep(0.2)
        session = Marionette(host="127.0.0.1", port=port)
        session.start_session()
        try:
            yield Browser(
                session,
                session.navigate,
                lambda path: path.write_bytes(base64.b64decode(session.screenshot())),
            )
        finally:
            session.delete_session()
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture(params=["chromium", "firefox"])
def browser(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Browser]:
    if request.param == "chromium":
        yield from chromium()
    else:
        yield from firefox(tmp_path / "firefox-profile")


@pytest.mark.browser
def test_the_page_runs_greedy_and_beam_columns_in_a_browser(
    browser: Browser, tiny_ctx: ServingContext, tmp_path: Path
) -> None:
    driver = browser.driver
    with live_server(create_app(ctx=tiny_ctx)) as base:
        browser.open(base + "/")
        prompt = driver.find_element(CSS, "#prompt")
        prompt.clear()
        prompt.send_keys(PROMPT)
        max_tokens = driver.find_element(CSS, "#max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("12")
        columns = driver.find_elements(CSS, ".column")
        assert [c.get_attribute("data-strategy") for c in columns] == ["greedy", "beam"]
        deadline = time.monotonic() + 10
        while "Model tiny" not in driver.find_element(CSS, "#model-info").text:
            assert time.monotonic() < deadline, "the page did not read /v1/models"
            time.sleep(0.05)
        driver.find_element(CSS, "#run").click()
        deadline = time.monotonic() + 60
        while any(c.get_attribute("data-state") != "done" for c in columns):
            states = [c.get_attribute("data-state") for c in columns]
            assert "error" not in states, [c.text for c in columns]
            assert time.monotonic() < deadline, f"columns still {states}"
            time.sleep(0.1)
        expected = httpx.post(
            base + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0},
        ).json()["choices"][0]["text"]
        greedy, beam = columns
        (greedy_choice,) = greedy.find_elements(CSS, ".choice-text")
        assert greedy_choice.get_property("textContent") == expected
        assert greedy_choice.find_elements(CSS, ".tok[data-logprob]")  # shaded by logprob
        hypotheses = beam.find_elements(CSS, ".choice[data-score]")
        assert len(hypotheses) == 4
        scores = [float(h.get_attribute("data-score")) for h in hypotheses]
        assert scores == sorted(scores, reverse=True)
        assert all("score" in h.text for h in hypotheses)
        assert "tok/s" in greedy.find_element(CSS, ".status").text
        out = Path(os.environ.get("BEAMLINE_TEST_ARTIFACTS", tmp_path))
        out.mkdir(parents=True, exist_ok=True)
        name = "firefox" if "marionette" in type(driver).__module__ else "chromium"
        browser.save_screenshot(out / f"playground-{name}.png")
