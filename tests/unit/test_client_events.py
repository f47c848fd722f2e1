"""The Python client's event streams against a scripted WebSocket server: each event once, in order, whatever the
connection does (a missing frame, a 4008, a drop), and a final close raised as its typed error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from websockets.asyncio.server import ServerConnection, serve

from switchboard.client import AsyncClient, Client, NotFound, Unauthorized, Unavailable

Handler = Callable[[ServerConnection, dict[str, str], int], Awaitable[None]]


def frame(seq: int, type: str = "agent.state", cursor: int | None = None, sid: str = "s1") -> str:
    body: dict[str, Any] = {"seq": seq, "session_id": sid, "type": type, "at": "2026-01-01T00:00:00+00:00", "data": {}}
    if cursor is not None:
        body["cursor"] = cursor
    return json.dumps(body)


@asynccontextmanager
async def scripted_server(handler: Handler) -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """A WebSocket server calling ``handler(ws, query, n)`` for its n-th connection; yields its URL and each query."""
    queries: list[dict[str, str]] = []

    async def serve_one(ws: ServerConnection) -> None:
        assert ws.request is not None
        query = {k: v[0] for k, v in parse_qs(urlsplit(ws.request.path).query).items()}
        queries.append(query)
        await handler(ws, query, len(queries))

    async with serve(serve_one, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", queries


async def collect(url: str, **kw: Any) -> list[int]:
    async with AsyncClient(url, reconnect_for_s=kw.pop("reconnect_for_s", 5.0)) as sb:
        return [e.seq async for e in sb.events("s1", **kw)]


async def test_a_4008_resumes_at_once_from_where_the_reason_says():
    async def handler(ws: ServerConnection, query: dict[str, str], n: int) -> None:
        since = int(query["since"])
        if n == 1:
            for seq in (1, 2, 3):
                await ws.send(frame(seq))
            await ws.close(4008, "too slow; resume with since=3")
        else:
            for seq in range(since + 1, 6):
                await ws.send(frame(seq, "session.closed" if seq == 5 else "agent.state"))
            await ws.close(1000, "session closed")

    async with scripted_server(handler) as (url, queries):
        assert await collect(url) == [1, 2, 3, 4, 5]
    assert [q["since"] for q in queries] == ["0", "3"]


async def test_a_drop_reconnects_from_the_last_seq_and_skips_what_was_seen():
    async def handler(ws: ServerConnection, query: dict[str, str], n: int) -> None:
        if n == 1:
            for seq in (1, 2):
                await ws.send(frame(seq))
            ws.transport.abort()  # no close frame: a lost connection (1006)
        elif n == 2:
            for seq in (1, 2, 3):  # a replay that overlaps what was yielded
                await ws.send(frame(seq))
            await ws.send(json.dumps({"type": "pong"}))
            await ws.send(frame(4, "session.closed"))
            await ws.close(1000, "session closed")

    async with scripted_server(handler) as (url, queries):
        assert await collect(url) == [1, 2, 3, 4]
    assert [q["since"] for q in queries] == ["0", "2"]


async def test_a_missing_seq_is_read_again():
    async def handler(ws: ServerConnection, query: dict[str, str], n: int) -> None:
        seqs = (1, 3) if n == 1 else (2, 3, 4)
        for seq in seqs:
            await ws.send(frame(seq, "session.closed" if seq == 4 else "agent.state"))
        if n == 1:
            await ws.wait_closed()
        else:
            await ws.close(1000, "session closed")

    async with scripted_server(handler) as (url, queries):
        assert await collect(url) == [1, 2, 3, 4]
    assert [q["since"] for q in queries] == ["0", "1"]


async def test_with_a_type_filter_gaps_are_expected_and_the_types_are_sent():
    async def handler(ws: ServerConnection, query: dict[str, str], n: int) -> None:
        for seq in (3, 7):
            await ws.send(frame(seq, "tool.progress"))
        await ws.close(1000, "session closed")

    async with scripted_server(handler) as (url, queries):
        assert await collect(url, since=2, types=["tool.*", "speech.done"]) == [3, 7]
    assert queries == [{"since": "2", "types": "tool.*,speech.done"}]


@pytest.mark.parametrize(("code", "error"), [(4404, NotFound), (4401, Unauthorized)])
async def test_a_final_close_raises_its_error(code: int, error: type[Exception]):
    async def handler(ws: ServerConnection, query: dict[str, str], n: int) -> None:
        await ws.close(code, "nope")

    async with scripted_server(handler) as (url, queries):
        with pytest.raises(error):
            await collect(url)
    assert len(queries) == 1


async def test_reconnecting_gives_up_after_reconnect_for_s():
    async def handler(ws: ServerConnection, query: dict[str, str], n: int) -> None:
        await ws.close(1011, "internal error")

    async with scripted_server(handler) as (url, queries):
        with pytest.raises(Unavailable) as err:
            await collect(url, reconnect_for_s=0.5)
    assert err.value.code == "stream_lost"
    assert 2 <= len(queries) <= 10  # retried with backoff, not in a tight loop


async def test_the_multi_session_stream_resumes_by_cursor():
    async def handler(ws: ServerConnection, query: dict[str, str], n: int) -> None:
        start = int(query["cursor"]) if query["cursor"] != "now" else 10
        for cursor in range(start + 1, start + 3):
            await ws.send(frame(cursor, cursor=cursor, sid=f"s{cursor % 2}"))
        await ws.close(1012, "restarting")

    async with scripted_server(handler) as (url, queries), AsyncClient(url) as sb:
        stream = sb.all_events(cursor="now", session_ids=["s0", "s1"], types=["tool.*"])
        got = []
        async with stream:
            async for event in stream:
                got.append(event.cursor)
                if len(got) == 6:
                    break
        assert stream.position == 16
    assert got == [11, 12, 13, 14, 15, 16]
    assert [q["cursor"] for q in queries] == ["now", "12", "14"]
    assert queries[0]["session_ids"] == "s0,s1" and queries[0]["types"] == "tool.*"


async def test_the_blocking_stream_resumes_the_same_way():
    async def handler(ws: ServerConnection, query: dict[str, str], n: int) -> None:
        since = int(query["since"])
        for seq in range(since + 1, since + 3):
            await ws.send(frame(seq, "session.closed" if seq == 6 else "agent.state"))
        if since + 2 < 6:
            await ws.close(4008, f"too slow; resume with since={since + 2}")
        else:
            await ws.close(1000, "session closed")

    def read_all(url: str) -> list[int]:
        with Client(url, api_key="k") as sb, sb.events("s1") as stream:
            return [e.seq for e in stream]

    async with scripted_server(handler) as (url, queries):
        assert await asyncio.to_thread(read_all, url) == [1, 2, 3, 4, 5, 6]
    assert [q["since"] for q in queries] == ["0", "2", "4"]
