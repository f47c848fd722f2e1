"""The reference edge keeps each final transcript, with its id, until the session says it took it: sent again first
on the next connection, sent again in a moment after a ``command_failed``, given up after a refusal that sending again
cannot fix; and it numbers its connection attempts under one random edge id."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from websockets.asyncio.server import ServerConnection, serve

from switchboard.cli import edge as edge_cli
from switchboard.cli.edge import Edge, EdgeOptions, _Retry
from switchboard.client import AsyncClient
from switchboard.client.edge_memory import EdgeIdentity, PendingTranscripts
from switchboard.client.errors import Unavailable
from switchboard.client.media import media_url
from tests.waiting import WAIT_S, until


class Peer:
    """The service's side of media connections: the frames each one received, and frames to send on the last one."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.ws: ServerConnection | None = None

    async def handler(self, ws: ServerConnection) -> None:
        self.ws = ws
        async for raw in ws:
            await self.received.put(json.loads(raw))

    async def send(self, **frame: Any) -> None:
        assert self.ws is not None
        await self.ws.send(json.dumps(frame))

    async def next(self) -> dict[str, Any]:
        async with asyncio.timeout(WAIT_S):
            return await self.received.get()


@asynccontextmanager
async def edge_of(peer: Peer, options: EdgeOptions, lines: asyncio.Queue[str | None]) -> AsyncIterator[list[str]]:
    """One connection of the edge to ``peer``, its user pump reading ``lines``: what the edge said."""
    notes: list[str] = []
    async with serve(peer.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with AsyncClient(f"http://127.0.0.1:{port}") as sb, sb.media("s1") as conn:
            running = asyncio.create_task(Edge(conn, options, say=notes.append).run(lines))
            try:
                yield notes
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)


def options() -> EdgeOptions:
    return EdgeOptions(engine=None, out=None, player=None, barge_in=False)  # type: ignore[arg-type]


async def test_a_transcript_without_an_answer_is_sent_again_first_with_its_id_and_one_taken_is_not() -> None:
    said = options()
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    for line in ("book a table", "for four"):
        lines.put_nowait(line)
    first = Peer()
    async with edge_of(first, said, lines):
        sent = [await first.next(), await first.next()]
        assert [f["text"] for f in sent] == ["book a table", "for four"]
        assert all(f["type"] == "user.transcript" and f["final"] is True for f in sent)
        ids = [f["id"] for f in sent]
        assert len(set(ids)) == 2 and all(uuid.UUID(i).version == 4 for i in ids)
        await first.send(type="transcript.taken", id=ids[0], item_id="it-1")
        await until(lambda: len(said.transcripts) == 1)
    # the connection closed without an answer for the second: the next one sends it first, same id, then new lines
    lines.put_nowait("at eight")
    again = Peer()
    async with edge_of(again, said, lines):
        resent, new = await again.next(), await again.next()
    assert (resent["text"], resent["id"]) == ("for four", ids[1])
    assert new["text"] == "at eight" and new["id"] not in ids


async def test_command_failed_sends_it_again_in_a_moment_and_a_refusal_drops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(edge_cli, "RESEND_AFTER_S", 0.05)
    said = options()
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    lines.put_nowait("one")
    lines.put_nowait("two")
    peer = Peer()
    async with edge_of(peer, said, lines) as notes:
        one, two = await peer.next(), await peer.next()
        await peer.send(type="error", code="command_failed", detail="store unavailable", id=one["id"])
        await peer.send(type="error", code="transcript_id_reused", detail="another text", id=two["id"])
        again = await peer.next()  # on the same connection
        assert (again["text"], again["id"]) == ("one", one["id"])
        assert [t.text for t in said.transcripts.pending()] == ["one"]
        assert any(n.startswith(f"transcript {two['id']} dropped (transcript_id_reused)") for n in notes), notes


async def test_rate_limited_sends_it_again_after_the_wait_the_service_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(edge_cli, "RESEND_AFTER_S", 10 * WAIT_S)  # the wait named is the one taken, not this pause
    said = options()
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    lines.put_nowait("one")
    peer = Peer()
    async with edge_of(peer, said, lines):
        one = await peer.next()
        await peer.send(type="error", code="rate_limited", detail="over budget", id=one["id"], retry_after_s=0.05)
        again = await peer.next()  # kept, and sent again on the same connection once the wait is over
        assert (again["text"], again["id"]) == ("one", one["id"])
        assert [t.text for t in said.transcripts.pending()] == ["one"]


def test_the_pending_transcripts_are_bounded_and_the_oldest_is_given_up() -> None:
    kept = PendingTranscripts(limit=2)
    first, dropped = kept.add("a")
    assert dropped is None
    kept.add("b")
    _, dropped = kept.add("c")
    assert dropped == first
    assert [t.text for t in kept.pending()] == ["b", "c"]


def test_each_connect_url_carries_the_edge_id_and_the_attempt_number() -> None:
    ident = EdgeIdentity()
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", ident.edge_id)
    assert EdgeIdentity().edge_id != ident.edge_id
    queries = [
        parse_qs(urlsplit(media_url("http://h:1", "s 1", token="sbt_x", edge_id=ident.edge_id, connection=n)).query)
        for n in (ident.next_attempt(), ident.next_attempt())
    ]
    assert queries == [
        {"token": ["sbt_x"], "edge_id": [ident.edge_id], "connection": ["1"]},
        {"token": ["sbt_x"], "edge_id": [ident.edge_id], "connection": ["2"]},
    ]


def test_the_reference_edge_connects_again_after_the_database_was_unavailable() -> None:
    """A node that cannot reach its database closes the edge 1013 ("try again later"): a blip of the database, after
    which the session goes on; the reference edge connects again (it used to stop for good)."""
    retry = _Retry(for_s=30.0)
    assert retry.after(1013) is not None
    assert retry.after(4410) is not None
    assert retry.after(1000) is None and retry.after(4409) is None  # the session ended; another edge took over


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_a_handshake_answered_5xx_is_unavailable_and_retried(status: int) -> None:
    """A node stopping as it took the connection answered 500 (now 503), a balancer with no node for it answers 502 or
    503: the client library raised a plain error, on which the reference edge stopped for good during a rolling
    deploy. It is ``Unavailable``, which the edge retries once it has been connected."""

    def answer(connection: ServerConnection, request: Any) -> Any:
        return connection.respond(status, "not now\n")

    async def never(ws: ServerConnection) -> None:
        raise AssertionError("no connection is opened")

    async with serve(never, "127.0.0.1", 0, process_request=answer) as server:
        port = server.sockets[0].getsockname()[1]
        async with AsyncClient(f"http://127.0.0.1:{port}") as sb:
            with pytest.raises(Unavailable) as failed:
                async with sb.media("s1"):
                    pass
    assert failed.value.status == status
