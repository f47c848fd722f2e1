"""One budget per caller at the media edge, on a real server with a small budget: a key's edges on several sessions
(one of them through a session token the key minted) share one budget for the transcripts they have stored, final
transcripts over it are refused with when to send them again and taken then (nothing lost, each logged in the audit
trail), and another key's edge is unaffected.

The finding it replays: a `media:connect` key, the edge of many sessions at 100 frames a second each, had 279 interim
transcripts a second stored as `user.input` events (up to 8,000 characters each, 22 MB in 10 s), against 20 commands
a second over REST, and none of its final transcripts was in the audit trail.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from switchboard.api.media.budget import MIN_COST_CHARS
from tests.waiting import WAIT_S

from .edge_client import Edge
from .server import EventStream, Server

pytestmark = pytest.mark.e2e

GATEWAY = "gateway-key-0123456789abcdef"
OTHER = "other-gateway-0123456789abcdef"
SCOPES = ["sessions:read", "sessions:write", "sessions:control", "media:connect"]
ADMIN = "admin-key-0123456789abcdef"  # watches the sessions' events
KEYS = [
    {"key": GATEWAY, "name": "gateway", "scopes": SCOPES},
    {"key": OTHER, "name": "other", "scopes": SCOPES},
    {"key": ADMIN, "scopes": ["sessions:read", "sessions:control", "events:read"]},
]
CHARS_PER_S = 1000  # a bucket of 2,000 characters: 20 short transcripts, interim ones only while 10 are left
PER_S = CHARS_PER_S / MIN_COST_CHARS
INTERIM_BURST = PER_S  # interim transcripts spend only the first half of the bucket
SESSIONS = 3
FLOOD = 60  # interim transcripts per edge, within the edge's own frame rate (100 a second, a burst of 200)
# final transcripts of 600 characters each: the bucket holds 3, and takes 1.7 more a second, however slowly they are
# applied on a loaded machine
FINALS, FINAL_CHARS = 10, 600


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        tmp_path_factory.mktemp("media_budgets"),
        SWITCHBOARD_API_KEYS=json.dumps(KEYS),
        SWITCHBOARD_MEDIA_TRANSCRIPT_CHARS_PER_S=str(CHARS_PER_S),
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def new_session(client: httpx.AsyncClient, key: str) -> str:
    turns = [{"text": "Noted."}] * (FINALS + 5)
    body = {"agent": "tester", "llm": {"provider": "scripted", "turns": turns}}
    r = await client.post("/v1/sessions", json=body, headers=bearer(key))
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def events(server: Server, client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    """The session's user input and audit trail so far: everything emitted before a marker the operator sends now."""
    marker = f"marker {uuid.uuid4()}"
    r = await client.post(f"/v1/sessions/{sid}/input", json={"text": marker, "final": False}, headers=bearer(ADMIN))
    assert r.status_code == 202, r.text
    stream = await EventStream.open(server, sid, types="user.input,operator.action", additional_headers=bearer(ADMIN))
    try:
        await stream.wait_for("user.input", lambda d: d["text"] == marker)
        frames = stream.frames
        return frames[: next(i for i, f in enumerate(frames) if f["data"].get("text") == marker)]
    finally:
        await stream.close()


def of_type(log: list[dict[str, Any]], kind: str, **data: Any) -> list[dict[str, Any]]:
    return [e for e in log if e["type"] == kind and all(e["data"].get(k) == v for k, v in data.items())]


async def flood(edge: Edge, n: int) -> None:
    """``n`` interim transcripts as fast as they go, then a ping: its pong says every one of them was handled."""
    for i in range(n):
        await edge.send({"type": "user.transcript", "text": f"interim {i}", "final": False})
    pongs = len(edge.of_type("pong"))
    await edge.send({"type": "ping"})
    await edge.wait_for("pong", lambda f: len(edge.of_type("pong")) > pongs, timeout=WAIT_S)


async def say_finals(edge: Edge, texts: list[str]) -> dict[str, float]:
    """Final transcripts with ids, each kept until ``transcript.taken`` and sent again after a ``rate_limited``
    refusal's ``retry_after_s``, as the reference edges do; returns the refusals' waits by transcript id."""
    pending = {str(uuid.uuid4()): text for text in texts}
    waits: dict[str, float] = {}
    resends: set[asyncio.Task[None]] = set()

    async def again(tid: str, wait_s: float) -> None:
        await asyncio.sleep(wait_s)
        await edge.send({"type": "user.transcript", "text": pending[tid], "id": tid})

    for tid, text in pending.items():
        await edge.send({"type": "user.transcript", "text": text, "id": tid})
    seen = 0
    try:
        async with asyncio.timeout(WAIT_S):
            while pending:
                for frame in edge.frames[seen:]:
                    seen += 1
                    if frame["type"] == "transcript.taken":
                        pending.pop(frame["id"], None)
                    elif frame["type"] == "error":
                        assert frame["code"] == "rate_limited" and frame["id"] in pending, frame
                        assert frame["retry_after_s"] > 0, frame
                        waits[frame["id"]] = frame["retry_after_s"]
                        resends.add(asyncio.create_task(again(frame["id"], frame["retry_after_s"])))
                await asyncio.sleep(0.01)
    finally:
        for task in resends:
            task.cancel()
        await asyncio.gather(*resends, return_exceptions=True)
    return waits


async def test_a_keys_edges_share_one_transcript_budget_and_lose_no_final(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        mine = [await new_session(client, GATEWAY) for _ in range(SESSIONS)]
        theirs = await new_session(client, OTHER)
        edges = [await Edge.connect(server.ws_url, sid, additional_headers=bearer(GATEWAY)) for sid in mine[:-1]]
        # a session token the key minted (a browser's Talk page) spends the key's budget too
        r = await client.post(
            f"/v1/sessions/{mine[-1]}/tokens", json={"scopes": ["media:connect"]}, headers=bearer(GATEWAY)
        )
        assert r.status_code == 201, r.text
        edges.append(await Edge.connect(server.ws_url, mine[-1], token=r.json()["token"]))
        other = await Edge.connect(server.ws_url, theirs, additional_headers=bearer(OTHER))
        try:
            await _check(server, client, mine, theirs, edges, other)
        finally:
            for edge in [*edges, other]:
                await edge.close()


async def _check(
    server: Server, client: httpx.AsyncClient, mine: list[str], theirs: str, edges: list[Edge], other: Edge
) -> None:
    started = time.monotonic()
    await asyncio.gather(*(flood(edge, FLOOD) for edge in edges))
    elapsed = time.monotonic() - started
    stored = [len(of_type(await events(server, client, sid), "user.input", final=False)) for sid in mine]
    # interim transcripts over the budget are coalesced, not stored, and never an error nor a close
    assert sum(stored) <= INTERIM_BURST + PER_S * elapsed + 1, (stored, elapsed)
    assert all(e.of_type("error") == [] and e.closed is None for e in edges)

    # the other key's edge spends a budget of its own
    await flood(other, 5)
    assert len(of_type(await events(server, client, theirs), "user.input", final=False)) == 5

    # final transcripts over the budget are refused with when to send them again, and taken then
    texts = [f"final {i} " + "x" * (FINAL_CHARS - 10) for i in range(FINALS)]
    waits = await say_finals(edges[0], texts)
    assert waits, "no final transcript was refused: this test would prove nothing"
    log = await events(server, client, mine[0])
    finals = of_type(log, "user.input", final=True)
    assert sorted(e["data"]["text"] for e in finals) == sorted(texts)  # each once: nothing lost or doubled
    trail = of_type(log, "operator.action", action="transcript", actor="gateway")
    assert len(trail) == FINALS and {e["data"]["item_id"] for e in trail} == {e["data"]["item_id"] for e in finals}
    taken = {f["id"] for f in edges[0].of_type("transcript.taken")}
    assert {e["data"]["idempotency_key"] for e in trail} == taken

    # a final sent again after it was taken (its answer lost, a new connection) is answered again, never charged:
    # with the bucket spent, copies were refused rate_limited and spent the budget a second time
    copies = sorted(taken)[:3]
    answered = len(edges[0].of_type("transcript.taken"))
    errors = len(edges[0].of_type("error"))
    text_of = {f["id"]: e["data"]["text"] for f in edges[0].of_type("transcript.taken") for e in finals
               if e["data"]["item_id"] == f["item_id"]}  # fmt: skip
    for tid in copies:
        await edges[0].send({"type": "user.transcript", "text": text_of[tid], "id": tid})
    await edges[0].wait_for(
        "transcript.taken",
        lambda f: len(edges[0].of_type("transcript.taken")) >= answered + len(copies),
        timeout=WAIT_S,
    )
    assert len(edges[0].of_type("error")) == errors, edges[0].of_type("error")[errors:]
