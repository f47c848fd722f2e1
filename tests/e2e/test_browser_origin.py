"""A web page on another origin, in a real browser, cannot reach a service running with auth off: its WebSocket to
the service is closed with 1008 before any frame, its form and text POSTs are refused, and a DNS-rebound page (a
foreign name now resolving to 127.0.0.1) cannot read or write the API under its own name. "evil.test" is mapped to
loopback by the browser's resolver, as a rebinding attacker's name is once its short-lived record flips."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.waiting import WAIT_S

from .console_support import CHROMIUM, CHROMIUM_ARGS, create_session, require_chromium, server_events
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

# Chromium's own local-network checks refuse some of these requests before the service sees them; other browsers
# have no such checks, and the service must not rely on them
LNA_OFF = "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests"


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """Playwright's sync API runs its own loop in this thread (as in test_console.py)."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("origin")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # "evil.test" resolves to loopback, as a rebinding attacker's name does once its short-lived record flips
        args = [*CHROMIUM_ARGS, "--host-resolver-rules=MAP evil.test 127.0.0.1", LNA_OFF]
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=args)
        try:
            yield b
        finally:
            b.close()


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>a page on another origin</title>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def evil_origin() -> Iterator[str]:
    """Where the attacker's page is served (a loopback listener, reached under the name evil.test)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://evil.test:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def evil_page(browser: Any, origin: str) -> Any:
    page = browser.new_context().new_page()
    page.set_default_timeout(8000)
    page.goto(f"{origin}/")
    return page


def test_a_cross_origin_page_cannot_stream_or_command(srv: Server, browser: Any, evil_origin: str) -> None:
    with httpx.Client(base_url=srv.url, timeout=10) as client:
        sid = create_session(client, [{"text": "A secret transcript.", "word_ms": 50}])
        assert client.post(f"/v1/sessions/{sid}/input", json={"text": "hello"}).status_code == 202
        page = evil_page(browser, evil_origin)
        stream = page.evaluate(
            """url => new Promise(resolve => {
                const frames = [];
                const ws = new WebSocket(url);
                ws.onmessage = e => frames.push(e.data);
                ws.onclose = e => resolve({code: e.code, frames});
                setTimeout(() => resolve({code: null, frames}), 3000);
            })""",
            f"{srv.ws_url}/v1/events",
        )
        assert stream["frames"] == [] and stream["code"] == 1008, stream
        # a "simple" form POST needs no preflight: the browser sends it; the service must not act on it
        for path, body in (("say", "text=pwned"), ("interrupt", "force=true")):
            page.evaluate(
                """([url, body]) => fetch(url, {method: "POST", mode: "no-cors", body: body,
                    headers: {"content-type": "text/plain"}})""",
                [f"{srv.url}/v1/sessions/{sid}/{path}", body],
            )
        page.context.close()
        kinds = [(e["type"], e["data"].get("source")) for e in server_events(srv, sid)]
        assert ("speech.created", "say") not in kinds and ("speech.interrupted", None) not in kinds, kinds


def test_a_rebound_name_cannot_read_the_api(srv: Server, browser: Any) -> None:
    """The attacker's page was loaded from evil.test:<port> while the name pointed at the attacker (here: served by
    the browser's request routing); now the name points at the service, and the page reads "its own" origin."""
    with httpx.Client(base_url=srv.url, timeout=10) as client:
        create_session(client, [])
    rebound = f"http://evil.test:{srv.port}"
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(8000)
    html = "<!doctype html><title>the attacker's page</title>"
    page.route(f"{rebound}/", lambda route: route.fulfill(body=html, content_type="text/html"))
    page.goto(f"{rebound}/")
    got = page.evaluate("() => fetch('/v1/sessions').then(async r => [r.status, await r.text()])")
    assert got[0] == 403 and "host_not_allowed" in got[1], got
    got = page.evaluate(
        """() => fetch('/v1/sessions', {method: 'POST', headers: {'content-type': 'application/json'},
            body: JSON.stringify({agent: 'tester'})}).then(r => r.status)"""
    )
    assert got == 403
    context.close()


def test_the_docs_page_works_from_this_origin_alone(srv: Server, browser: Any) -> None:
    """/docs used to load Swagger UI from a CDN, unchecked, on the console's origin: now every file comes from the
    service and the page's policy refuses anything else. The page still shows every operation, and nothing it needs
    is refused by that policy."""
    context = browser.new_context()
    page = context.new_page()
    elsewhere: list[str] = []
    refused: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(srv.url) else elsewhere.append(r.url))
    page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    try:
        page.goto(f"{srv.url}/docs")
        page.wait_for_selector(".opblock", timeout=WAIT_S * 1000)
        spec = httpx.get(f"{srv.url}/openapi.json", timeout=WAIT_S).json()
        operations = sum(len(methods) for methods in spec["paths"].values())
        assert page.locator(".opblock").count() == operations
        assert not elsewhere and not refused, (elsewhere, refused)
    finally:
        context.close()
