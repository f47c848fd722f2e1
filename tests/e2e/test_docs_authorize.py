"""The API docs (/docs) of a server with API keys: Swagger UI offers Authorize for the credentials the document
describes, and an operation tried out from the page after authorizing with an API key is answered with it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.waiting import WAIT_S

from .console_support import launch_chromium, require_chromium
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

KEY = "docs-reader-key-0123456789abcdef"


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """Playwright's sync API runs its own loop in this thread (as in test_console.py)."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = json.dumps([{"key": KEY, "scopes": ["sessions:read"]}])
    server = Server(tmp_path_factory.mktemp("docs"), SWITCHBOARD_API_KEYS=keys).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require_chromium()
    with launch_chromium() as found:
        yield found


def test_authorize_with_an_api_key_then_try_an_operation(srv: Server, browser: Any) -> None:
    page = browser.new_page()
    sent: list[dict[str, str]] = []
    page.on("request", lambda r: sent.append(r.headers) if r.url.startswith(f"{srv.url}/v1/sessions") else None)
    try:
        page.goto(f"{srv.url}/docs")
        page.click("button.authorize", timeout=WAIT_S * 1000)
        schemes = page.locator(".modal-ux .auth-container")
        assert schemes.count() == 4  # apiKey, sessionToken, sessionTokenQuery, reportToken
        api_key = schemes.filter(has_text="apiKey (http, Bearer)")
        api_key.locator("input").fill(KEY)
        api_key.locator("button.authorize").click()
        page.click(".modal-ux button.btn-done")
        page.click("#operations-sessions-listSessions .opblock-summary")
        page.click("#operations-sessions-listSessions button.try-out__btn")
        page.click("#operations-sessions-listSessions button.execute")
        status = page.locator("#operations-sessions-listSessions .live-responses-table tbody .response-col_status")
        status.first.wait_for(timeout=WAIT_S * 1000)
        assert status.first.inner_text().strip() == "200"
        assert sent and sent[-1].get("authorization") == f"Bearer {KEY}"
    finally:
        page.close()
