"""Helpers for the browser tests: Debian's Chromium driven by Playwright, and reading a session's log directly."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.waiting import WAIT_S

from .server import Server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_chromium() -> None:
    """Skip without a browser on a developer machine; fail under CI, where .ci/run installs it."""
    problem = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        problem = "the playwright package is not installed (pip install -e '.[test]')"
    if problem is None and not CHROMIUM.exists():
        problem = f"{CHROMIUM} is missing (apt-get install chromium)"
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"browser tests cannot run: {problem}")
        pytest.skip(f"browser tests need Chromium: {problem}")


@contextmanager
def launch_chromium() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def checked_page(
    browser: Any, *, timeout_ms: int = 8000, init_script: str | None = None, **context: Any
) -> Iterator[Any]:
    """A page in a new browser context that fails the test on any uncaught error or Content-Security-Policy refusal
    (the service's policy must allow everything the console does; Chromium logs each refusal)."""
    ctx = browser.new_context(**context)
    if init_script:
        ctx.add_init_script(init_script)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.on("console", lambda msg: errors.append(msg.text) if "Content Security Policy" in msg.text else None)
    page.set_default_timeout(timeout_ms)
    try:
        yield page
    finally:
        ctx.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def open_session(page: Any, server: Server, sid: str) -> None:
    """Open session ``sid`` in the console, and wait for its timeline."""
    page.goto(f"{server.url}/console/#session={sid}")
    page.wait_for_selector("[data-type='session.started']")


def api_keys(*keys: tuple[str, str, list[str]]) -> str:
    """``SWITCHBOARD_API_KEYS`` for ``(key, name, scopes)`` each."""
    return json.dumps([{"key": key, "name": name, "scopes": scopes} for key, name, scopes in keys])


@contextmanager
def console_server(tmp_path_factory: pytest.TempPathFactory, name: str, keys: str) -> Iterator[Server]:
    """A server for a console test file (its keys, speech at 10 words a second, so that speeches last)."""
    tmp = tmp_path_factory.mktemp(name)
    with Server(tmp, SWITCHBOARD_API_KEYS=keys, SWITCHBOARD_WORDS_PER_SECOND="10").start(timeout=60) as server:
        yield server


@contextmanager
def signed_in_page(browser: Any, server: Server, key: str, **context: Any) -> Iterator[Any]:
    """A checked page (``checked_page``) of the console, signed in with ``key``."""
    context.setdefault("viewport", {"width": 1400, "height": 900})
    with checked_page(browser, timeout_ms=15000, **context) as page:
        page.goto(f"{server.url}/console/")
        page.wait_for_selector("#auth-form:visible")
        page.fill("#auth-key", key)
        page.press("#auth-key", "Enter")
        yield page


def create_session(client: httpx.Client, turns: list[dict[str, Any]], *, sid: str | None = None, **kw: Any) -> str:
    llm = {"provider": "scripted", "turns": turns, **kw.pop("llm_extra", {})}
    body: dict[str, Any] = {"agent": "tester", "llm": llm, **kw}
    if sid:
        body["id"] = sid
    r = client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def server_events(server: Server, sid: str, *, key: str | None = None, idle_s: float = 0.3) -> list[dict[str, Any]]:
    """Every event of a session, straight from its stream (read until it is quiet for `idle_s`; resumes after 4008)."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    frames: list[dict[str, Any]] = []
    while True:
        since = frames[-1]["seq"] if frames else 0
        with connect(f"{server.ws_url}/v1/sessions/{sid}/events?since={since}", additional_headers=headers) as ws:
            try:
                while True:
                    frames.append(json.loads(ws.recv(timeout=idle_s)))
            except TimeoutError:
                return frames
            except ConnectionClosed as closed:
                if closed.rcvd is None or closed.rcvd.code != 4008:
                    return frames


def wait_until(check: Callable[[], Any], timeout: float = WAIT_S, interval: float = 0.02, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(interval)


def row_seqs(page: Any) -> list[int]:
    """The data-seq of every timeline row, in document order."""
    return [int(s) for s in page.eval_on_selector_all(".timeline [data-seq]", "els => els.map(e => e.dataset.seq)")]
