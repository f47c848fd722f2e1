"""The console's attention queue in Chromium marks a reason that was alerted, with the sinks it went to and how each
delivery went: one sink that takes it (a real receiver on 127.0.0.1 that verifies the Standard Webhooks signature),
one that is down."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from tests.alert_receiver import make_secret
from tests.ports import free_port

from .console_support import checked_page, create_session, wait_until
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(240)]

SECRET = make_secret()


class _Receiver(BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        try:
            payload = Webhook(SECRET).verify(body, {k.lower(): v for k, v in self.headers.items()})
        except WebhookVerificationError:
            self.send_response(401)
        else:
            self.received.append(dict(payload))
            self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """These tests run no event loop of their own (see test_console.py)."""


@pytest.fixture(scope="module")
def receiver() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, receiver: ThreadingHTTPServer) -> Iterator[Server]:
    sinks = [
        {"name": "ops", "url": f"http://127.0.0.1:{receiver.server_address[1]}/", "secret": SECRET},
        {"name": "down", "url": f"http://127.0.0.1:{free_port()}/", "secret": SECRET},  # nothing listens there
    ]
    env = {
        "SWITCHBOARD_ALERT_SINKS": json.dumps(sinks),
        "SWITCHBOARD_ALERT_INTERVAL_S": "0.2",
        "SWITCHBOARD_ALERT_MAX_ATTEMPTS": "2",
        "SWITCHBOARD_ALERT_BACKOFF_S": "0.1",
        "SWITCHBOARD_ATTENTION_STALL_S": "1",
    }
    server = Server(tmp_path_factory.mktemp("alerts"), **env).start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


def alerted(page: Any, sid: str, code: str) -> dict[str, str] | None:
    selector = f"#attention > li[data-session-id='{sid}'] .reasons li[data-code='{code}'] .alerted"
    found: dict[str, str] | None = page.evaluate(
        f"""() => {{ const el = document.querySelector("{selector}");
            return el ? {{ text: el.textContent, sinks: el.dataset.sinks, id: el.dataset.alertId }} : null; }}"""
    )
    return found


def test_an_alerted_reason_shows_its_sinks_and_their_deliveries(browser: Any, srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=10) as client, checked_page(browser) as page:
        sid = create_session(client, [{"text": "late", "ttft_ms": 600_000}], sid="stalls")
        assert client.post(f"/v1/sessions/{sid}/input", json={"text": "hello?"}).status_code == 202
        page.goto(f"{srv.url}/console/")

        def settled() -> dict[str, str] | None:
            found = alerted(page, sid, "speech_stalled")
            sinks = set((found or {}).get("sinks", "").split(","))
            return found if {"ops:delivered", "down:failed"} <= sinks else None

        shown = wait_until(settled, what="the alerted reason")
        assert shown["text"] == "Alerted: down (failed), ops (delivered)"  # sinks by name
        [alert] = [a for a in client.get("/v1/alerts").json()["items"] if a["session_id"] == sid]
        assert shown["id"] == alert["id"] and alert["reason"] == "speech_stalled"
        assert [m["data"]["alert_id"] for m in _Receiver.received] == [alert["id"]]
        # every sink takes every reason here: the caller's silence is alerted too
        wait_until(lambda: alerted(page, sid, "silence_after_input"), what="the other reason alerted")

        assert client.delete(f"/v1/sessions/{sid}").status_code == 204  # closed: both alerts clear
        wait_until(lambda: page.query_selector(f"#attention > li[data-session-id='{sid}']") is None, what="cleared")
        wait_until(lambda: len(_Receiver.received) == 4, what="two opened, two cleared")
        assert sorted(m["type"] for m in _Receiver.received) == ["alert.cleared"] * 2 + ["alert.opened"] * 2
