"""Request limits: oversize bodies (413, with or without Content-Length), oversize text (413), invalid bodies (422),
and slow bodies (408 or a closed connection, against a real server and a raw socket): a chunk that does not come in
time, or a trickle whose every chunk is in time but whose whole body is not (slow loris)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import exc as sa_exc

from switchboard.api.app import create_app
from switchboard.runtime.agent import AgentRegistry
from tests.e2e.server import Server

from .conftest import Api, make_settings

MAX_BODY = 2048
MAX_TEXT = 100
READ_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 1.5


@pytest.fixture
async def api(tmp_path: Any, registry: AgentRegistry) -> AsyncIterator[Api]:
    settings = make_settings(tmp_path, max_body_bytes=MAX_BODY, max_text_chars=MAX_TEXT)
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield Api(client, app)


def assert_problem(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert body["status"] == status and body["code"] == code, body
    return dict(body)


def oversized_session_body() -> bytes:
    return json.dumps({"agent": "tester", "metadata": {"blob": "x" * (MAX_BODY + 10)}}).encode()


async def test_body_over_limit_with_content_length(api: Api):
    body = oversized_session_body()
    r = await api.client.post("/v1/sessions", content=body, headers={"content-type": "application/json"})
    assert_problem(r, 413, "body_too_large")
    assert r.headers.get("connection") == "close"
    assert (await api.client.get("/v1/sessions")).json()["items"] == []  # nothing was created


async def test_body_over_limit_chunked_without_content_length(api: Api):
    body = oversized_session_body()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 256):
            yield body[i : i + 256]

    r = await api.client.post("/v1/sessions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert_problem(r, 413, "body_too_large")
    assert (await api.client.get("/v1/sessions")).json()["items"] == []


async def test_body_within_limit_chunked_is_accepted(api: Api):
    body = json.dumps({"agent": "tester", "id": "chunky", "metadata": {"blob": "x" * (MAX_BODY // 2)}}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 100):
            yield body[i : i + 100]

    r = await api.client.post("/v1/sessions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "chunky"


async def test_text_over_the_max_text_size(api: Api):
    sid = (await api.create())["id"]
    for path in ("input", "say"):
        r = await api.client.post(f"/v1/sessions/{sid}/{path}", json={"text": "y" * (MAX_TEXT + 1)})
        body = assert_problem(r, 413, "text_too_long")
        assert str(MAX_TEXT) in body["detail"]
    r = await api.client.post(f"/v1/sessions/{sid}/say", json={"text": "y" * MAX_TEXT})
    assert r.status_code == 202, r.text  # exactly the limit is fine
    chat = (await api.client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
    assert not [i for i in chat if i.get("role") == "user"]  # the oversize input was not committed


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/sessions", b"{not json"),
        ("/v1/sessions", b'{"agent": ""}'),
        ("/v1/sessions", b'{"agent": "tester", "unknown_field": 1}'),
        ("/v1/sessions", b'{"agent": "tester", "max_tool_steps": "many"}'),
        ("/v1/sessions", b'{"agent": "tester", "id": "has spaces"}'),
        ("/v1/sessions", b"[1, 2, 3]"),
        ("/v1/sessions/{sid}/input", b"{}"),
        ("/v1/sessions/{sid}/input", b'{"text": ""}'),
        ("/v1/sessions/{sid}/input", b'{"text": "hi", "role": "root"}'),
        ("/v1/sessions/{sid}/say", b'{"text": 5}'),
        ("/v1/sessions/{sid}/interrupt", b'{"force": "maybe"}'),
    ],
)
async def test_invalid_bodies_are_422(api: Api, path: str, body: bytes):
    sid = (await api.create())["id"]
    r = await api.client.post(path.format(sid=sid), content=body, headers={"content-type": "application/json"})
    problem = assert_problem(r, 422, "invalid_request")
    assert problem["errors"] and all({"loc", "msg", "type"} <= set(e) for e in problem["errors"])


# -- slow bodies against a real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("limits")
    srv = Server(
        tmp, SWITCHBOARD_BODY_READ_TIMEOUT_S=str(READ_TIMEOUT_S), SWITCHBOARD_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S)
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


async def _slow_request(server: Server, head: bytes, first: bytes, trickle: list[bytes], gap_s: float) -> bytes:
    """Send the head and a first piece of body, then the rest a piece every `gap_s`; return what the server sent
    before closing (or an empty reply if it just closed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)

    async def dribble() -> None:
        for piece in trickle:
            await asyncio.sleep(gap_s)
            writer.write(piece)
            await writer.drain()

    writer.write(head + first)
    await writer.drain()
    feeder = asyncio.create_task(dribble())
    try:
        async with asyncio.timeout(READ_TIMEOUT_S * 8):
            return await reader.read()  # until the server closes the connection
    finally:
        feeder.cancel()
        try:
            await feeder
        except (asyncio.CancelledError, ConnectionError):
            pass
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


def _assert_timed_out(reply: bytes) -> None:
    if reply:  # a 408 problem; a bare close is also acceptable
        status_line, _, rest = reply.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 408"), reply[:300]
        assert b"body_timeout" in rest
        assert b'"title":"Request Timeout"' in rest


@pytest.mark.e2e
async def test_slow_body_with_content_length_times_out(slow_server: Server):
    body = json.dumps({"agent": "tester", "id": "slowloris"}).encode()
    head = (
        f"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    reply = await _slow_request(slow_server, head, body[:5], [bytes([b]) for b in body[5:]], READ_TIMEOUT_S * 3)
    elapsed = time.monotonic() - started
    _assert_timed_out(reply)
    assert elapsed < READ_TIMEOUT_S * 6, elapsed  # bounded: not the whole trickle (which would take ~1 minute)
    async with httpx.AsyncClient(base_url=slow_server.url) as client:
        assert (await client.get("/v1/sessions/slowloris")).status_code == 404  # never created
        assert (await client.get("/healthz")).status_code == 200  # the server is fine


@pytest.mark.e2e
async def test_slow_chunked_body_times_out(slow_server: Server):
    head = (
        b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    started = time.monotonic()
    reply = await _slow_request(slow_server, head, b'5\r\n{"age\r\n', [b"1\r\nn\r\n"] * 50, READ_TIMEOUT_S * 3)
    elapsed = time.monotonic() - started
    _assert_timed_out(reply)
    assert elapsed < READ_TIMEOUT_S * 6, elapsed


@pytest.mark.e2e
async def test_a_trickle_in_time_chunk_by_chunk_still_ends_at_the_body_deadline(slow_server: Server):
    """One byte every READ_TIMEOUT_S / 3: no chunk is late, but the body would take ~20 s. The whole-body deadline
    ends it (408) instead of letting it hold the request open for as long as the client likes."""
    body = json.dumps({"agent": "tester", "id": "trickle", "metadata": {"pad": "x" * 40}}).encode()
    head = (
        f"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    reply = await _slow_request(slow_server, head, body[:1], [bytes([b]) for b in body[1:]], READ_TIMEOUT_S / 3)
    elapsed = time.monotonic() - started
    _assert_timed_out(reply)
    assert BODY_TIMEOUT_S * 0.9 <= elapsed < BODY_TIMEOUT_S + 2.0, elapsed
    async with httpx.AsyncClient(base_url=slow_server.url) as client:
        assert (await client.get("/v1/sessions/trickle")).status_code == 404  # never created


# -- the request deadline and an unreachable database ---------------------------------------------------------------

DEADLINE_S = 0.3  # request_timeout_s: the backstop deadline is this + 1 s


@pytest.fixture
async def quick(tmp_path: Any, registry: AgentRegistry) -> AsyncIterator[Api]:
    app = create_app(make_settings(tmp_path, request_timeout_s=DEADLINE_S), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield Api(client, app)


async def test_a_read_that_hangs_is_cancelled_and_answered_503(quick: Api, monkeypatch: pytest.MonkeyPatch):
    cancelled = asyncio.Event()

    async def hang(*args: Any, **kw: Any) -> Any:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(quick.app.state.services.store, "list_sessions", hang)
    started = time.monotonic()
    r = await quick.client.get("/v1/sessions")
    elapsed = time.monotonic() - started
    assert_problem(r, 503, "deadline_exceeded")
    assert r.headers["retry-after"] == "1"
    assert DEADLINE_S + 1.0 <= elapsed < DEADLINE_S + 3.0, elapsed
    assert cancelled.is_set()  # a safe request is not left running
    assert (await quick.client.get("/healthz")).status_code == 200


async def test_a_write_past_the_deadline_finishes_and_its_idempotent_retry_gets_the_outcome(
    quick: Api, monkeypatch: pytest.MonkeyPatch
):
    store = quick.app.state.services.store
    real_reserve = store.idempotency.reserve
    slow = [True]

    async def slow_once(*args: Any, **kw: Any) -> Any:
        if slow.pop() if slow else False:
            await asyncio.sleep(DEADLINE_S + 1.5)  # past the backstop deadline, then carries on
        return await real_reserve(*args, **kw)

    monkeypatch.setattr(store.idempotency, "reserve", slow_once)
    headers = {"Idempotency-Key": "create-once"}
    first = await quick.client.post("/v1/sessions", json={"agent": "tester"}, headers=headers)
    problem = assert_problem(first, 503, "deadline_exceeded")
    assert "Idempotency-Key" in problem["detail"]
    retry = await quick.client.post("/v1/sessions", json={"agent": "tester"}, headers=headers)
    assert retry.status_code == 201 and retry.headers.get("idempotent-replayed") == "true", retry.text
    sessions = (await quick.client.get("/v1/sessions")).json()["items"]
    assert [s["id"] for s in sessions] == [retry.json()["id"]]  # created once, by the request answered 503


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (ConnectionRefusedError(111, "Connection refused"), 503, "database_unavailable"),
        (OSError("no route to host"), 503, "database_unavailable"),
        (
            sa_exc.OperationalError("SELECT 1", {}, Exception("server closed the connection")),
            503,
            "database_unavailable",
        ),
        (sa_exc.IntegrityError("INSERT", {}, Exception("duplicate key")), 500, "internal_error"),
    ],
)
async def test_database_errors_on_reads(
    quick: Api, monkeypatch: pytest.MonkeyPatch, error: Exception, status: int, code: str
):
    async def fail(*args: Any, **kw: Any) -> Any:
        raise error

    monkeypatch.setattr(quick.app.state.services.store, "get_session", fail)
    r = await quick.client.get("/v1/sessions/not-live/chat")
    assert_problem(r, status, code)
    assert ("retry-after" in r.headers) == (status == 503)


async def test_an_input_cut_off_by_the_deadline_in_a_stalled_database_is_applied_once_and_its_retry_replays_it(
    quick: Api, monkeypatch: pytest.MonkeyPatch
):
    await quick.client.post("/v1/sessions", json={"agent": "tester"})  # warm-up: the first build may miss 0.3 s
    sid = (await quick.create())["id"]
    session = quick.app.state.services.host.live(sid)
    chat_store = session.writes.store
    real_commit = chat_store.commit
    stalls = [True]

    async def stalled_once(session_id: str, commit: Any) -> None:
        if commit.items and stalls:
            stalls.pop()
            await asyncio.sleep(DEADLINE_S + 1.5)  # a table lock: past the route's and the request's deadlines
        await real_commit(session_id, commit)

    monkeypatch.setattr(chat_store, "commit", stalled_once)
    headers = {"Idempotency-Key": "input-once"}
    body = {"text": "table for two"}
    first = await quick.client.post(f"/v1/sessions/{sid}/input", json=body, headers=headers)
    assert first.status_code == 503, first.text
    retry = await quick.client.post(f"/v1/sessions/{sid}/input", json=body, headers=headers)
    assert retry.status_code == 202 and retry.headers.get("idempotent-replayed") == "true", retry.text
    accepted = retry.json()
    items = (await quick.client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
    assert [i["id"] for i in items if i.get("text") == "table for two"] == [accepted["item_id"]]
    stored = await quick.app.state.services.store.chat_items(sid)
    assert [i.id for i in stored if getattr(i, "text", None) == "table for two"] == [accepted["item_id"]]
    speech = await quick.client.get(f"/v1/sessions/{sid}/speeches/{accepted['speech_id']}")
    assert speech.status_code == 200, speech.text
