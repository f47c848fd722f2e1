"""A real `switchboard serve`: its access log leaves out the console's polls at INFO and keeps writes and errors;
its /metrics have no `*_created` series and count requests by their route template."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.waiting import WAIT_S, wait_until

from .server import Server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("access"), SWITCHBOARD_LOG_LEVEL="INFO").start()
    try:
        yield server
    finally:
        server.stop()


def access_lines(server: Server) -> list[str]:
    return [line for line in server.logs().splitlines() if '" HTTP/' in line or "HTTP/1.1" in line]


def test_a_poll_is_not_an_info_line_while_a_write_and_an_error_are(srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=WAIT_S) as client:
        for _ in range(3):  # what the console does every few seconds
            assert client.get("/v1/sessions").status_code == 200
            assert client.get("/v1/agents").status_code == 200
        created = client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": []}})
        assert created.status_code == 201, created.text
        assert client.get("/v1/sessions/no-such-session").status_code == 404
    sid = created.json()["id"]
    wait_until(lambda: any('"GET /v1/sessions/no-such-session HTTP/1.1" 404' in line for line in access_lines(srv)))
    lines = access_lines(srv)
    [post] = [line for line in lines if '"POST /v1/sessions HTTP/1.1" 201' in line]
    [missing] = [line for line in lines if "/v1/sessions/no-such-session" in line]
    for line in (post, missing):
        assert re.search(r" INFO switchboard\.access: 127\.0\.0\.1:\d+ - \"", line), line
        assert re.search(r" \d+\.\d ms$", line), line
    assert not [line for line in lines if '"GET /v1/sessions HTTP/1.1"' in line or "/v1/agents" in line], lines
    assert "uvicorn.access" not in srv.logs()
    assert sid not in "\n".join(line for line in lines if "GET" in line)


def test_metrics_count_requests_by_route_template_without_created_series(srv: Server, tmp_path: Path) -> None:
    with httpx.Client(base_url=srv.url, timeout=WAIT_S) as client:
        created = client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": []}})
        sid = created.json()["id"]
        assert client.get(f"/v1/sessions/{sid}").status_code == 200
        assert client.get(f"/no/such/path/{sid}").status_code == 404
        text = client.get("/metrics").text
    assert not [line for line in text.splitlines() if "_created" in line]
    assert sid not in text  # no raw path in a label
    count = r'switchboard_http_requests_total\{method="GET",route="/v1/sessions/\{sid\}",status="200"\} [1-9]'
    assert re.search(count, text), text
    timed = r'switchboard_http_request_duration_seconds_count\{method="GET",route="/v1/sessions/\{sid\}",status="2xx"\}'
    assert re.search(timed + " [1-9]", text)
    assert re.search(r'switchboard_http_requests_total\{method="GET",route="unmatched",status="404"\} [1-9]', text)
