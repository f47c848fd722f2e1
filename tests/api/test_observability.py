"""Observability: what /metrics exposes (sessions, speeches, tool calls, interrupt latency, WebSocket streams and the
slow consumers dropped), log records carrying session and call ids, and logs that never hold a credential."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchboard.api.app import create_app
from switchboard.api.auth import issue_token
from switchboard.api.request_metrics import SLOW_REQUEST_S, access_level
from switchboard.api.streams import events as event_routes
from switchboard.control import logs
from switchboard.control.settings import ALL_SCOPES, ApiKey
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.events import Event
from tests.waiting import WAIT_S, until

from .conftest import Api, make_settings

WS_BUFFER = 10
LONG = " ".join(f"w{i}" for i in range(300))


@pytest.fixture
async def api(tmp_path: Any, registry: AgentRegistry) -> AsyncIterator[Api]:
    app = create_app(make_settings(tmp_path, ws_buffer=WS_BUFFER), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield Api(client, app)


async def scrape(api: Api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    r = await api.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def create(api: Api, turns: list[dict[str, Any]], **kw: Any) -> str:
    return str((await api.create(llm={"provider": "scripted", "turns": turns}, **kw))["id"])


async def ended_calls(api: Api, sid: str) -> list[dict[str, Any]]:
    items = (await api.client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
    return [c for c in items if c["status"] != "running"]


# -- an in-process WebSocket client speaking ASGI directly --------------------------------------------------------


class AsgiWebSocket:
    """Drives the app's WebSocket endpoint in-process. ``stall()`` makes every event frame the app sends block, like
    a client that stopped reading; the close message always goes through."""

    def __init__(self, app: Any, path: str, query: str = "", headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.frames: list[dict[str, Any]] = []
        self.close: dict[str, Any] | None = None
        self.accepted = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        scope = {
            "type": "websocket",
            "asgi": {"version": "3.0"},
            "scheme": "ws",
            "http_version": "1.1",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": query.encode(),
            "headers": headers or [],
            "client": ("127.0.0.1", 50000),
            "server": ("test", 80),
            "subprotocols": [],
        }
        self.inbox.put_nowait({"type": "websocket.connect"})
        self.task = asyncio.create_task(app(scope, self.inbox.get, self._send), name="asgi-ws")

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "websocket.accept":
            self.accepted = True
        elif message["type"] == "websocket.send":
            await self._flowing.wait()
            self.frames.append(json.loads(message["text"]))
        elif message["type"] == "websocket.close":
            self.close = message

    def stall(self) -> None:
        self._flowing.clear()

    async def closed(self, timeout: float = WAIT_S) -> tuple[int, str]:
        async with asyncio.timeout(timeout):
            await asyncio.shield(self.task)
        assert self.close is not None
        return int(self.close.get("code", 1000)), str(self.close.get("reason", ""))

    async def disconnect(self) -> None:
        self.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
        async with asyncio.timeout(WAIT_S):
            await asyncio.shield(self.task)


# -- metrics -------------------------------------------------------------------------------------------------------


async def test_metrics_sessions_speeches_and_tool_calls(api: Api):
    before = await scrape(api)
    assert sample(before, "switchboard_sessions_live") == 0
    turns = [
        {"text": "Booking.", "tool_calls": [{"name": "book", "arguments": {"what": "a table"}}]},
        {"text": "Booked. Now failing.", "tool_calls": [{"name": "fail", "arguments": {}}]},
        {"text": "That failed."},
    ]
    sid = await create(api, turns)
    other = await create(api, [])
    assert sample(await scrape(api), "switchboard_sessions_live") == 2
    await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "book"})
    await until(lambda: _count_ended(api, sid, 2))
    r = await api.client.post(f"/v1/sessions/{other}/say", json={"text": "Hello."})
    assert r.status_code == 202

    async def settled() -> dict[Any, float] | None:
        m = await scrape(api)
        done = sample(m, "switchboard_speeches_total", source="reply") >= 1
        return m if done and sample(m, "switchboard_speeches_total", source="say") >= 1 else None

    after = await until(settled)
    assert sample(after, "switchboard_speeches_total", source="say") == 1
    assert sample(after, "switchboard_tool_calls_total", status="completed") == 1
    assert sample(after, "switchboard_tool_calls_total", status="failed") == 1
    assert sample(after, "switchboard_events_total") > 0
    assert (await api.client.delete(f"/v1/sessions/{other}")).status_code == 204
    assert sample(await scrape(api), "switchboard_sessions_live") == 1


async def _count_ended(api: Api, sid: str, n: int) -> bool:
    return len(await ended_calls(api, sid)) >= n


async def test_interrupt_latency_histogram_counts_interrupts(api: Api):
    sid = await create(api, [{"text": LONG}], playout={"words_per_second": 5})
    m = await scrape(api)
    assert sample(m, "switchboard_interrupt_latency_seconds_count") == 0
    # nothing is speaking: no interruption, nothing observed
    r = await api.client.post(f"/v1/sessions/{sid}/interrupt")
    assert r.status_code == 200 and r.json()["interrupted"] is False
    assert sample(await scrape(api), "switchboard_interrupt_latency_seconds_count") == 0

    await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "talk"})

    async def speaking() -> bool:
        return (await api.client.get(f"/v1/sessions/{sid}")).json()["agent_state"] == "speaking"

    await until(speaking)
    r = await api.client.post(f"/v1/sessions/{sid}/interrupt")
    assert r.status_code == 200 and r.json()["interrupted"] is True
    m = await scrape(api)
    assert sample(m, "switchboard_interrupt_latency_seconds_count") == 1
    assert sample(m, "switchboard_interrupt_latency_seconds_sum") > 0
    assert sample(m, "switchboard_interrupt_latency_seconds_bucket", le="+Inf") == 1
    # counted from the speech.interrupted event, once durable (which may be just after the response)
    await until(lambda: _gauge(api, "switchboard_speech_interruptions_total", 1))


async def test_websocket_connections_and_dropped_slow_consumers(api: Api):
    sid = await create(
        api, [{"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 40, "step_s": 0}}]}]
    )
    path = f"/v1/sessions/{sid}/events"
    a, b = AsgiWebSocket(api.app, path), AsgiWebSocket(api.app, "/v1/events")
    await until(lambda: _gauge(api, "switchboard_ws_connections", 2))
    assert sample(await scrape(api), "switchboard_event_subscribers") == 2
    assert sample(await scrape(api), "switchboard_ws_slow_consumers_dropped_total") == 0

    slow = AsgiWebSocket(api.app, path)
    slow.stall()  # stops reading before the first frame
    await until(lambda: _gauge(api, "switchboard_ws_connections", 3))
    await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})
    code, reason = await slow.closed()
    assert (code, reason) == (4008, "too slow; resume with since=0")  # nothing was delivered: resume from the start

    # The readers that keep up get every event in order. With a buffer of 10, one of them can be dropped too on a
    # loaded machine (two commit batches published before its sender ran): then it was told so (4008), and the
    # metric counts it as well. It counts exactly the streams closed as too slow.
    def settled(ws: AsgiWebSocket) -> bool:
        return ws.task.done() or any(f["type"] == "tool.ended" for f in ws.frames)

    await until(lambda: settled(a) and settled(b))
    dropped = [ws for ws in (a, b) if ws.task.done()]
    assert all(ws.close is not None and ws.close.get("code") == 4008 for ws in dropped), [ws.close for ws in dropped]
    m = await scrape(api)
    assert sample(m, "switchboard_ws_slow_consumers_dropped_total") == 1 + len(dropped)
    assert sample(m, "switchboard_ws_connections") == 2 - len(dropped)
    if a not in dropped:
        assert [f["seq"] for f in a.frames] == list(range(1, len(a.frames) + 1))
    for ws in (a, b):
        if ws not in dropped:
            await ws.disconnect()
    m = await scrape(api)
    assert sample(m, "switchboard_ws_connections") == 0 and sample(m, "switchboard_event_subscribers") == 0
    # every connection accepted, counted by its route template
    assert sample(m, "switchboard_websocket_connections_total", route="/v1/sessions/{sid}/events") == 2
    assert sample(m, "switchboard_websocket_connections_total", route="/v1/events") == 1


async def test_a_stalled_send_is_a_slow_consumer_too(api: Api, monkeypatch: pytest.MonkeyPatch):
    """A client that stops reading on a quiet session: no buffer overflows, but the send times out. It is closed
    with 4008 and the seq to resume from (not a plain 1000, which would tell it the stream is over)."""
    monkeypatch.setattr(event_routes, "SEND_TIMEOUT_S", 0.2)
    sid = await create(api, [])
    ws = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/events")
    await until(lambda: _has(ws, "agent.state"))
    delivered = ws.frames[-1]["seq"]
    ws.stall()
    await api.client.post(f"/v1/sessions/{sid}/say", json={"text": "Hello."})
    assert await ws.closed() == (4008, f"too slow; resume with since={delivered}")
    assert sample(await scrape(api), "switchboard_ws_slow_consumers_dropped_total") == 1


async def test_a_burst_larger_than_the_buffer_closes_4008_not_1011(api: Api, caplog: pytest.LogCaptureFixture):
    """The hub delivers a burst bigger than the buffer to an idle stream: the pump and the overflow watch both end
    at once; the close must be the resumable 4008, never an 'internal error'."""
    sid = await create(api, [])
    streams = [AsgiWebSocket(api.app, f"/v1/sessions/{sid}/events") for _ in range(6)]
    await until(lambda: _gauge(api, "switchboard_ws_connections", len(streams)))
    for ws in streams:
        await until(lambda ws=ws: _has(ws, "agent.state"))
    await asyncio.sleep(0.05)  # every pump is now waiting for live events
    for sub in api.app.state.services.hub._by_session[sid]:
        sub.direct = None  # the pumps take the burst (an idle stream whose socket takes it all gets it: below)
    last = max(f["seq"] for f in streams[0].frames)
    burst = [
        (10_000 + i, Event(seq=last + 1 + i, session_id=sid, type="tool.progress", data={"message": str(i)}))
        for i in range(WS_BUFFER + 5)
    ]
    api.app.state.services.hub.publish(burst)
    for ws in streams:
        assert await ws.closed() == (4008, f"too slow; resume with since={last}")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_burst_larger_than_the_buffer_reaches_idle_streams_whole(api: Api):
    """Sent from the hub's publish itself while the streams wait idle (as a broadcast would), a burst bigger than the
    buffer is delivered in full, in order: only a stream that cannot take it is dropped."""
    sid = await create(api, [])
    streams = [AsgiWebSocket(api.app, f"/v1/sessions/{sid}/events") for _ in range(3)]
    for ws in streams:
        await until(lambda ws=ws: _has(ws, "agent.state"))
    await asyncio.sleep(0.05)
    last = max(f["seq"] for f in streams[0].frames)
    burst = [
        (10_000 + i, Event(seq=last + 1 + i, session_id=sid, type="tool.progress", data={"message": str(i)}))
        for i in range(WS_BUFFER + 5)
    ]
    api.app.state.services.hub.publish(burst)
    for ws in streams:

        async def whole(ws: AsgiWebSocket = ws) -> bool:
            return any(f["seq"] == last + WS_BUFFER + 5 for f in ws.frames)

        await until(whole)
        assert [f["seq"] for f in ws.frames if f["seq"] > last] == [e.seq for _, e in burst]
        assert not ws.task.done()
        await ws.disconnect()


async def _gauge(api: Api, name: str, value: float) -> bool:
    return sample(await scrape(api), name) == value


async def _has(ws: AsgiWebSocket, event_type: str) -> bool:
    if ws.task.done():
        raise AssertionError(f"stream closed: {ws.close}")
    return any(f["type"] == event_type for f in ws.frames)


# -- logs ----------------------------------------------------------------------------------------------------------


async def test_tool_failures_are_logged_with_session_and_call_ids(api: Api, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    turns = [
        {"text": "Trying.", "tool_calls": [{"name": "fail", "arguments": {"expected": True}}]},
        {"text": "Trying harder.", "tool_calls": [{"name": "fail", "arguments": {"expected": False}}]},
        {"text": "Both failed."},
    ]
    sid = await create(api, turns)
    await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
    calls = await until(lambda: _ended(api, sid, 2))
    expected, unexpected = sorted(calls, key=lambda c: c["arguments"]["expected"], reverse=True)
    assert expected["output"] == "that did not work" and expected["status"] == "failed"
    assert "secret internal detail" not in unexpected["output"]  # details stay in the logs

    def records_for(call_id: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "call_id", None) == call_id]

    tool_error = records_for(expected["call_id"])
    assert tool_error, [r.getMessage() for r in caplog.records]
    assert all(getattr(r, "session_id", None) == sid for r in tool_error)
    assert tool_error[0].levelno == logging.WARNING and tool_error[0].exc_info is None  # expected: no traceback
    assert "that did not work" in tool_error[0].getMessage()
    crash = records_for(unexpected["call_id"])
    assert crash and crash[0].levelno == logging.ERROR and getattr(crash[0], "session_id", None) == sid
    assert crash[0].exc_info is not None and "secret internal detail" in str(crash[0].exc_info[1])


async def _ended(api: Api, sid: str, n: int) -> list[dict[str, Any]] | None:
    calls = await ended_calls(api, sid)
    return calls if len(calls) >= n else None


def test_log_lines_carry_ids_and_hide_credentials(monkeypatch: pytest.MonkeyPatch):
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        for json_lines in (False, True):
            stream = io.StringIO()
            monkeypatch.setattr("sys.stderr", stream)
            logs.configure("DEBUG", json_lines=json_lines)
            log = logging.getLogger("switchboard.test")
            log.warning("tool %s failed", "book", extra={"session_id": "s1", "call_id": "c1"})
            logging.getLogger("uvicorn.error").info(
                '%s - "WebSocket %s" [accepted]', "127.0.0.1:5", "/v1/events?session_ids=s1&token=sbt_abc.def"
            )
            logging.getLogger("uvicorn.error").debug("< authorization: Bearer my-secret-key-0123456789")
            out = stream.getvalue()
            lines = out.strip().splitlines()
            assert len(lines) == 3, out
            if json_lines:
                first = json.loads(lines[0])
                assert first["session_id"] == "s1" and first["call_id"] == "c1" and first["level"] == "WARNING"
            else:
                assert lines[0].endswith("tool book failed session_id=s1 call_id=c1")
            assert "sbt_abc" not in out and "my-secret-key" not in out and "[redacted]" in lines[1]
            assert "/v1/events?session_ids=s1&token=" in out  # the rest of the line is kept
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


ADMIN = "admin-key-0123456789abcdef"
READER = "reader-key-0123456789abcdef"


async def test_logs_never_hold_an_api_key_or_token(
    tmp_path: Any, registry: AgentRegistry, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG)
    keys = [ApiKey(key=ADMIN, scopes=list(ALL_SCOPES)), ApiKey(key=READER, scopes=["sessions:read", "events:read"])]
    settings = make_settings(tmp_path, api_keys=keys)
    app = create_app(settings, registry=registry)
    secrets = [ADMIN, READER, settings.token_secret]
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            admin, reader = {"Authorization": f"Bearer {ADMIN}"}, {"Authorization": f"Bearer {READER}"}
            turns = [{"text": "Failing.", "tool_calls": [{"name": "fail", "arguments": {"expected": False}}]}]
            r = await client.post(
                "/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}}, headers=admin
            )
            sid = r.json()["id"]
            token = (await client.post(f"/v1/sessions/{sid}/tokens", headers=reader)).json()["token"]
            expired, _ = issue_token(settings, sid, ttl_s=-5)
            secrets += [token, expired]
            assert (
                await client.post(f"/v1/sessions/{sid}/input", json={"text": "x"}, headers=reader)
            ).status_code == 403
            assert (
                await client.post(f"/v1/sessions/{sid}/input", json={"text": "go"}, headers=admin)
            ).status_code == 202
            assert (
                await client.get(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {token}"})
            ).status_code == 200
            assert (
                await client.get(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {expired}"})
            ).status_code == 401
            assert (
                await client.get("/v1/sessions", headers={"Authorization": f"Bearer {token[:-2]}xx"})
            ).status_code == 401
            ok = AsgiWebSocket(app, f"/v1/sessions/{sid}/events", f"token={token}")
            await until(lambda: _has(ok, "tool.ended"))
            await ok.disconnect()
            for query in (f"token={expired}", f"token={READER[:-1]}", f"token={token}"):
                ws = AsgiWebSocket(app, "/v1/events", query)
                assert (await ws.closed())[0] in (4401, 4403)
            ws = AsgiWebSocket(
                app, f"/v1/sessions/{sid}/events", headers=[(b"authorization", f"Bearer {ADMIN}".encode())]
            )
            await until(lambda: _has(ws, "tool.ended"))
            await ws.disconnect()
            await client.delete(f"/v1/sessions/{sid}", headers=admin)
    server_side = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    assert any(r.name.startswith("switchboard") for r in server_side)  # the service did log (the failing tool)
    for record in server_side:
        text = f"{record.getMessage()} {record.__dict__!r}"
        for secret in secrets:
            assert secret not in text, f"{record.name}: {record.getMessage()}"


async def test_metrics_have_no_created_series(api: Api):
    sid = await create(api, [])
    await api.client.post(f"/v1/sessions/{sid}/say", json={"text": "Hello."})
    text = (await api.client.get("/metrics")).text
    assert "switchboard_http_requests_total" in text and "switchboard_speeches_total" in text
    assert [line for line in text.splitlines() if "_created" in line] == []


async def test_requests_are_counted_and_timed_by_their_route_template(api: Api):
    sid = await create(api, [])
    assert (await api.client.get(f"/v1/sessions/{sid}")).status_code == 200
    assert (await api.client.get("/v1/sessions/no-such-session")).status_code == 404
    assert (await api.client.get(f"/no/such/{sid}")).status_code == 404
    assert (await api.client.request("BREW", f"/v1/sessions/{sid}")).status_code == 405
    assert (await api.client.get("/console/")).status_code == 200
    m = await scrape(api)
    session = "/v1/sessions/{sid}"
    assert sample(m, "switchboard_http_requests_total", method="POST", route="/v1/sessions", status="201") == 1
    assert sample(m, "switchboard_http_requests_total", method="GET", route=session, status="200") == 1
    assert sample(m, "switchboard_http_requests_total", method="GET", route=session, status="404") == 1
    assert sample(m, "switchboard_http_requests_total", method="GET", route="unmatched", status="404") == 1
    assert sample(m, "switchboard_http_requests_total", method="other", route=session, status="405") == 1
    assert sample(m, "switchboard_http_requests_total", method="GET", route="/console/{path:path}", status="200") == 1
    timed = {"method": "GET", "route": session, "status": "2xx"}
    assert sample(m, "switchboard_http_request_duration_seconds_count", **timed) == 1
    assert sample(m, "switchboard_http_request_duration_seconds_bucket", le="+Inf", **timed) == 1
    assert sample(m, "switchboard_http_request_duration_seconds_sum", **timed) > 0
    assert not [key for key in m if any(sid in value for _, value in key[1])]  # never a raw path


async def test_a_poll_is_logged_at_debug_a_write_or_an_error_at_info(api: Api, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG, logger="switchboard.access")
    sid = await create(api, [])
    await api.client.get("/v1/sessions")  # what the console polls
    await api.client.get(f"/v1/sessions/{sid}/tool-calls")
    await api.client.get("/v1/sessions/no-such-session")
    levels = {r.getMessage().split('"')[1]: r.levelname for r in caplog.records if r.name == "switchboard.access"}
    assert levels == {
        "POST /v1/sessions HTTP/1.1": "INFO",
        "GET /v1/sessions HTTP/1.1": "DEBUG",
        f"GET /v1/sessions/{sid}/tool-calls HTTP/1.1": "DEBUG",
        "GET /v1/sessions/no-such-session HTTP/1.1": "INFO",
    }


def test_a_slow_read_is_logged_at_info():
    assert access_level("GET", 200, 0.2) == logging.DEBUG
    assert access_level("GET", 304, 0.2) == logging.DEBUG
    assert access_level("GET", 200, SLOW_REQUEST_S) == logging.INFO
    assert access_level("GET", 503, 0.01) == logging.INFO
    assert access_level("DELETE", 204, 0.01) == logging.INFO
