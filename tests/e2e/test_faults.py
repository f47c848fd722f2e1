"""Faults against a real server: a SIGKILL while a tool streams progress to subscribers, the database cut off and
back while sessions run (PostgreSQL behind a TCP proxy of our own, on loopback), webhook backends that hang or reset
connections, and WebSocket clients that send what they must not.

The existing e2e tests already cover a SIGKILL mid-tool with a restart (test_field_scenarios), 4008 for a client
that never reads and non-JSON frames (test_streams), and 4401/4403 (test_auth_ws): not repeated here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import websockets
import yaml
from sqlalchemy.engine import make_url

from tests.waiting import WAIT_S

from .server import EventStream, Server
from .traffic import assert_gap_free, assert_valid_chat, check_session, gauges, quiesce, replay, wait_closed

pytestmark = pytest.mark.e2e

PG_URL = os.environ.get("SWITCHBOARD_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")


def progress_turn(steps: int, step_s: float) -> dict[str, Any]:
    return {"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": steps, "step_s": step_s}}]}


async def create(client: httpx.AsyncClient, turns: list[dict[str, Any]], **kw: Any) -> str:
    """Create a session; a 503 (a short request deadline on a loaded machine) is retried as a client should: same
    ``Idempotency-Key``, after ``Retry-After``."""
    body = {"agent": "tester", "llm": {"provider": "scripted", "turns": turns}, **kw}
    headers = {"Idempotency-Key": f"create-{uuid.uuid4()}"}
    for _ in range(5):
        r = await client.post("/v1/sessions", json=body, headers=headers)
        if r.status_code != 503:
            break
        await asyncio.sleep(float(r.headers.get("retry-after", "1")))
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


# -- SIGKILL mid-stream ----------------------------------------------------------------------------------------------


async def test_sigkill_mid_stream_then_subscribers_resume_without_loss_or_duplicate(tmp_path: Path):
    """While a tool streams progress to two subscribers (one session stream, one multi-session stream by cursor), the
    server is SIGKILLed; restarted on the same database, both resume from the last position they saw. Everything
    they saw before the crash was durable (it is in the log afterwards, unchanged), and the union is the log: no
    event lost or seen twice. The tool, cut off, ends `interrupted` with its output (I1, I5)."""
    first = Server(tmp_path).start()
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=WAIT_S) as client:
            sid = await create(client, [progress_turn(400, 0.01)])
            stream = await EventStream.open(first, sid)
            multi = EventStream(await websockets.connect(f"{first.ws_url}/v1/events?session_ids={sid}"))
            assert (await client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})).status_code == 202
            await stream.wait_for("tool.progress", lambda d: d["message"] == "step 40/400")
            await multi.wait_for("tool.progress", lambda d: d["message"] == "step 40/400")
            first.kill()  # mid-stream: progress events are being produced and delivered
        await wait_closed(stream)
        await wait_closed(multi)
    finally:
        first.kill()
    assert stream.closed is not None and stream.closed[0] != 1000  # an abnormal close, not a goodbye
    before, multi_before = list(stream.frames), list(multi.frames)
    assert_gap_free(before)
    steps_before = [f for f in before if f["type"] == "tool.progress"]
    assert steps_before and len(steps_before) < 400

    second = Server(tmp_path, database_url=first.database_url).start()
    try:
        async with httpx.AsyncClient(base_url=second.url, timeout=WAIT_S) as client:
            resumed = await EventStream.open(second, sid, since=before[-1]["seq"])
            cursor = multi_before[-1]["cursor"]
            multi_resumed = EventStream(
                await websockets.connect(f"{second.ws_url}/v1/events?session_ids={sid}&cursor={cursor}")
            )
            ended = await resumed.wait_for("tool.ended")
            assert ended["data"]["status"] == "interrupted" and ended["data"]["is_error"] is True
            await resumed.wait_for("session.recovered")
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
            assert await wait_closed(resumed) == (1000, "session closed")
            await multi_resumed.wait_for("session.closed")
            await multi_resumed.close()

            log = await replay(second.ws_url, sid)
            assert log[: len(before)] == before, "an event delivered before the crash is not in the log as it was"
            assert before + resumed.frames == log, "the resumed stream lost or repeated events"
            multi_union = multi_before + multi_resumed.frames
            cursors = [f["cursor"] for f in multi_union]
            assert cursors == sorted(set(cursors)), "the multi-session stream repeated or reordered a cursor"
            assert [{k: v for k, v in f.items() if k != "cursor"} for f in multi_union] == log
            steps = [f["data"]["message"] for f in log if f["type"] == "tool.progress"]
            assert steps == [f"step {i}/400" for i in range(1, len(steps) + 1)]
            await check_session(client, second.ws_url, sid)  # one terminal status, one output per call, valid chat
    finally:
        second.stop()


# -- the database goes away and comes back -------------------------------------------------------------------------


class TcpProxy:
    """A loopback TCP proxy that can cut the link: existing connections are dropped and new ones are accepted but
    never answered (a network partition, the hardest kind of outage: nothing fails fast), until ``restore()``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.cut_off = False
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self._held: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self._drop(self._links | self._held)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def cut(self) -> None:
        self.cut_off = True
        self._drop(self._links)

    def restore(self) -> None:
        self.cut_off = False
        self._drop(self._held)  # what connected during the outage fails now, and is retried

    @staticmethod
    def _drop(writers: set[asyncio.StreamWriter]) -> None:
        for w in list(writers):
            w.transport.abort()
        writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            self._held.add(writer)  # accepted, never answered
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._links |= {writer, up_writer}
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._links.discard(dst)
            dst.transport.abort()


@contextlib.asynccontextmanager
async def pg_database() -> AsyncIterator[str]:
    """A fresh PostgreSQL database of its own (dropped afterwards); skipped when PostgreSQL is unreachable, except
    under CI=true where that fails (a CI run must not pass by silently not testing PostgreSQL)."""
    url = make_url(PG_URL)
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        admin = await asyncpg.connect(dsn, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError) as err:
        problem = f"PostgreSQL at {url.render_as_string()} is unreachable: {err!r}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{problem} (CI=true: the PostgreSQL tests must run)")
        pytest.skip(problem)
    name = f"sbfault_{uuid.uuid4().hex[:10]}"
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield name
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def _timed(coro: Any) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = await coro
    return r, time.monotonic() - started


@pytest.mark.postgres
async def test_database_outage_answers_503_then_recovers_without_restart(tmp_path: Path):
    request_timeout_s = 1.5
    bound_s = request_timeout_s + 1.0 + 3.0  # the backstop deadline (+1 s) and slack for a busy machine
    url = make_url(PG_URL)
    async with pg_database() as dbname, TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        db_url = url.set(host="127.0.0.1", port=proxy.port, database=dbname).render_as_string(hide_password=False)
        server = Server(tmp_path, database_url=db_url, SWITCHBOARD_REQUEST_TIMEOUT_S=str(request_timeout_s))
        await asyncio.to_thread(server.start)  # the proxy runs in this loop: never block it
        streams: dict[str, EventStream] = {}
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                turns = [progress_turn(30, 0.05), {"text": "Done counting."}]
                sids = [await create(client, turns) for _ in range(3)]
                closed = await create(client, [])
                assert (await client.delete(f"/v1/sessions/{closed}")).status_code == 204
                for sid in sids:
                    streams[sid] = await EventStream.open(server, sid)
                    assert (await client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})).status_code == 202
                for sid in sids:
                    await streams[sid].wait_for("tool.progress", lambda d: d["message"] == "step 3/30")

                proxy.cut()
                outage_started = time.monotonic()
                results = await asyncio.gather(
                    _timed(client.get("/readyz")),
                    _timed(client.post(f"/v1/sessions/{sids[0]}/input", json={"text": "during the outage"})),
                    _timed(client.get("/v1/sessions")),  # a read that goes to the database
                    _timed(client.get(f"/v1/sessions/{closed}/chat")),  # a closed session: read from the database
                    _timed(client.post("/v1/sessions", json={"agent": "tester"})),
                )
                for r, elapsed in results:
                    assert r.status_code == 503, (r.request.method, r.request.url, r.status_code, r.text)
                    assert int(r.headers["retry-after"]) >= 1, r.headers
                    assert elapsed < bound_s, (r.request.url, elapsed)
                for r, _ in results[1:]:
                    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
                assert (await client.get("/healthz")).status_code == 200  # the process itself is fine
                await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - outage_started)))
                proxy.restore()

                async with asyncio.timeout(WAIT_S):  # recovers by itself, no restart
                    while (await client.get("/readyz")).status_code != 200:
                        await asyncio.sleep(0.2)
                for sid in sids:
                    await streams[sid].wait_for("tool.ended", timeout=WAIT_S)
                    await streams[sid].wait_for("chat.item", lambda d: d["item"].get("text") == "Done counting.")
                    r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "still there?"})
                    assert r.status_code == 202, r.text
                    await streams[sid].wait_for("chat.item", lambda d: d["item"].get("text") == "OK.", timeout=WAIT_S)
                assert (await client.get(f"/v1/sessions/{closed}/chat")).status_code == 200
                for sid in sids:
                    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
                    assert await wait_closed(streams[sid]) == (1000, "session closed")
                for sid in sids:
                    # gap-free, ends session.closed, and the live stream (across the outage) is exactly the log
                    check = await check_session(client, server.ws_url, sid, live_frames=streams[sid].frames)
                    assert check.tool_calls == {"completed": 1}, check
                    steps = [f["data"]["message"] for f in streams[sid].frames if f["type"] == "tool.progress"]
                    assert steps == [f"step {i}/30" for i in range(1, 31)]
                    users = [
                        i["text"]
                        for i in (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
                        if i["type"] == "message" and i["role"] == "user"
                    ]
                    # the input answered 503 may still have been applied (once at most): 503 means "retry"
                    assert users.count("during the outage") <= (1 if sid == sids[0] else 0), users
        finally:
            for stream in streams.values():
                if stream.closed is None:
                    await stream.close()
            await asyncio.to_thread(server.stop)
        assert "Traceback" not in server.logs(), server.logs()[-4000:]


# -- webhook backends that hang or reset -----------------------------------------------------------------------------


class RawBackend:
    """A loopback HTTP backend written on raw sockets: ``hang`` reads a request and never answers (except cancel
    notices, answered 204), ``reset`` aborts every connection with a TCP RST as soon as it is accepted."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.port = 0
        self.connections = 0
        self.requests: list[str] = []  # request lines
        self.closed_by_client = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> RawBackend:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        await self._server.wait_closed()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # linger 0: the close is a RST
            return
        self._writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].decode()
            self.requests.append(line)
            length = next(
                (int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")), 0
            )
            await reader.readexactly(length)
            if line.split()[1].endswith("/cancel"):
                writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
                await writer.drain()
                return
            await reader.read()  # hang: answer nothing, until the client gives up and closes
            self.closed_by_client += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        finally:
            self._writers.discard(writer)
            writer.transport.abort()


async def test_webhook_backend_that_hangs_or_resets_fails_the_call_and_the_session_answers(tmp_path: Path):
    secret = "fault-webhook-secret-0123456789abcdef"
    async with RawBackend("hang") as hang, RawBackend("reset") as reset:
        obj = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}
        tools = [
            {"kind": "webhook", "name": name, "description": f"{name} tool", "parameters": obj, "url": url,
             "timeout_s": timeout_s, "secret_env": "FAULT_WEBHOOK_SECRET"}
            for name, url, timeout_s in (
                ("hanging", hang.url("/tools/hanging"), 0.6),
                ("resetting", reset.url("/tools/resetting"), 3.0),  # time for retries on a loaded machine
            )
        ]  # fmt: skip
        agents = tmp_path / "agents.yaml"
        agents.write_text(yaml.safe_dump([{"name": "hooks", "instructions": "Use the tools.", "tools": tools}]))
        server = Server(tmp_path, SWITCHBOARD_AGENTS_FILE=str(agents), FAULT_WEBHOOK_SECRET=secret)
        await asyncio.to_thread(server.start)
        try:
            turns = [
                {"text": "Looking.", "tool_calls": [{"name": "hanging", "arguments": {"order_id": "A-1"}}]},
                {"text": "First: {{tool_output:hanging}}"},
                {"text": "Again.", "tool_calls": [{"name": "resetting", "arguments": {"order_id": "A-2"}}]},
                {"text": "Second: {{tool_output:resetting}}"},
            ]
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                body = {
                    "agent": "hooks",
                    "llm": {"provider": "scripted", "turns": turns, "fallback": {"text": "Here."}},
                }
                r = await client.post("/v1/sessions", json=body)
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                events = await EventStream.open(server, sid)
                await client.post(f"/v1/sessions/{sid}/input", json={"text": "look it up"})
                hung = await events.wait_for("tool.ended", lambda d: d["name"] == "hanging")
                assert hung["data"]["status"] == "failed"
                assert hung["data"]["output"] == "hanging failed: no result from its backend within 0.6 s."
                await events.wait_for("chat.item", lambda d: d["item"].get("text", "").startswith("First: hanging"))
                await client.post(f"/v1/sessions/{sid}/input", json={"text": "try the other"})
                rst = await events.wait_for("tool.ended", lambda d: d["name"] == "resetting")
                assert rst["data"]["status"] == "failed"
                assert rst["data"]["output"].startswith(
                    "resetting failed: its backend could not be reached within 3 s ("
                ), rst["data"]
                assert reset.connections >= 2, "a reset connection is retried"
                await events.wait_for("chat.item", lambda d: d["item"].get("text", "").startswith("Second: resetting"))
                # the session still answers, at once
                await client.post(f"/v1/sessions/{sid}/input", json={"text": "are you there?"})
                await events.wait_for("chat.item", lambda d: d["item"].get("text") == "Here.")
                # the hanging backend got the call, so it is told the call timed out; its connection was let go
                async with asyncio.timeout(WAIT_S):
                    while not any("/cancel" in line for line in hang.requests) or hang.closed_by_client < 1:
                        await asyncio.sleep(0.05)
                assert hang.requests[0].startswith("POST /tools/hanging ")
                assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
                await wait_closed(events)
                check = await check_session(client, server.ws_url, sid, live_frames=events.frames)
                assert check.tool_calls == {"failed": 2}
                assert (await client.get("/healthz")).status_code == 200
        finally:
            await asyncio.to_thread(server.stop)
    assert secret not in server.logs()  # webhook secrets are never logged, even when deliveries fail


# -- WebSocket clients that misbehave ------------------------------------------------------------------------------


async def _closed_after(url: str, send: Any) -> tuple[int, str]:
    async with asyncio.timeout(WAIT_S):
        async with websockets.connect(url, max_size=None) as ws:
            await ws.recv()  # session.started: the stream works before the bad frame
            await send(ws)
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await ws.recv()
            assert ws.close_code is not None
            return ws.close_code, ws.close_reason or ""


async def test_malformed_websocket_frames_are_closed_and_the_server_stays_healthy(tmp_path: Path):
    server = Server(tmp_path, SWITCHBOARD_WS_MAX_MESSAGE_BYTES="8192")
    await asyncio.to_thread(server.start)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
            baseline = await gauges(client)
            sid = await create(client, [progress_turn(20, 0.02)])
            url = f"{server.ws_url}/v1/sessions/{sid}/events"

            async def binary(ws: Any) -> None:
                await ws.send(b"\x00\x01\x02 not text")

            async def huge(ws: Any) -> None:
                await ws.send(json.dumps({"type": "ping", "pad": "x" * 100_000}))

            async def bad_utf8(ws: Any) -> None:
                # a text frame that is not UTF-8, written below the client library (which would refuse to)
                async with ws.send_context():
                    ws.protocol.send_text(b"\xc3\x28 not utf-8")

            assert await _closed_after(url, binary) == (1003, "binary frames are not supported")
            assert (await _closed_after(url, huge))[0] == 1009
            assert (await _closed_after(url, bad_utf8))[0] == 1007
            # after all that, the server is healthy: streams work, nothing is left open
            ok = await EventStream.open(server, sid)
            assert (await client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})).status_code == 202
            await ok.wait_for("tool.ended")
            await ok.close()
            assert (await client.get("/healthz")).status_code == 200
            now = await quiesce(client, baseline, ("ws_connections", "subscribers"))
            assert now["ws_connections"] == 0 and now["subscribers"] == 0, now
            assert_valid_chat((await client.get(f"/v1/sessions/{sid}/chat")).json()["items"])
    finally:
        await asyncio.to_thread(server.stop)
    # uvicorn itself logs the bad UTF-8 frame with a traceback (its own code path, before the app sees anything);
    # the service logs no error and no request failed
    logs = server.logs()
    assert " ERROR switchboard" not in logs and "Exception in ASGI application" not in logs, logs[-3000:]


def _upgrade(path: str, extra_headers: str = "") -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{extra_headers}\r\n"
    ).encode()


def _answer_until_closed(port: int, request: bytes, timeout_s: float = WAIT_S) -> bytes:
    """What the server answers ``request`` before it closes the connection (a TimeoutError if it never does)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


async def test_a_websocket_handshake_too_large_to_read_is_answered_and_closed(tmp_path: Path):
    """A handshake the WebSocket parser cannot read (a request line or a header over 8 KiB, too many headers) got no
    answer and its connection stayed open for good (one file descriptor each, before any credential is checked);
    at shutdown the server then failed on it and ended with a traceback."""
    server = Server(tmp_path, SWITCHBOARD_API_KEYS=json.dumps([{"key": "k" * 32, "scopes": ["events:read"]}]))
    await asyncio.to_thread(server.start)
    try:
        too_large = {
            b"414": _upgrade("/v1/events?session_ids=" + "x" * 9000),
            b"431": _upgrade("/v1/events", f"X-Pad: {'x' * 9000}\r\n"),
            b"431 ": _upgrade("/v1/events", "".join(f"X-Pad-{i}: x\r\n" for i in range(200))),
        }
        for status, request in too_large.items():
            answer = await asyncio.to_thread(_answer_until_closed, server.port, request)
            assert answer.startswith(b"HTTP/1.1 " + status.strip()), answer[:200]
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
            assert (await client.get("/healthz")).status_code == 200
    finally:
        await asyncio.to_thread(server.stop)
    assert "Traceback" not in server.logs(), server.logs()[-3000:]
