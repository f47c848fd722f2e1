"""Resuming a media edge over the wire: an edge whose connection drops mid-speech connects again with the last frame
it consumed (`resume`) and is sent the rest of the speech, nothing twice; a final transcript it had no answer for is
sent again on the resumed connection and taken once; a player's position in milliseconds is heard text."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.waiting import WAIT_S, until

from .edge_client import Edge
from .server import EventStream, Server
from .test_media_edge import WORDS, assistant_messages, create

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("media-resume")).start()
    try:
        yield srv
    finally:
        srv.stop()


def numbered(connection: int, resume: int) -> dict[str, Any]:
    return {"edge_id": "edge-resume-1", "connection": connection, "resume": resume}


async def test_an_edge_dropped_mid_speech_resumes_and_gets_the_rest_without_repeats(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": WORDS, "word_ms": 100}])
        events = await EventStream.open(server, sid, types="speech.*")
        edge = await Edge.connect(server.ws_url, sid, query=numbered(1, 0))
        assert (await edge.wait_for("resumed"))["after"] == 0
        r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "hi"})
        speech_id = r.json()["speech_id"]
        await edge.send({"type": "playback.started", "speech_id": speech_id})
        await edge.wait_text(speech_id, 12)
        kept = [f for f in edge.frames if f.get("n") is not None]
        consumed = kept[-1]["n"]
        assert [f["n"] for f in kept] == list(range(1, consumed + 1))
        assert "speech.end" not in {f["type"] for f in kept}  # mid-speech
        await edge.send({"type": "playback.progress", "speech_id": speech_id, "played_chars": len("word0")})
        await edge.send({"type": "ping"})
        await edge.wait_for("pong")
        await edge.close()  # the network drops; the edge has consumed the frames up to `consumed`

        async def generated() -> bool:
            r = await client.get(f"/v1/sessions/{sid}/speeches/{speech_id}")
            return bool(r.json()["text"] == WORDS)

        await until(generated)  # the rest was produced while the edge was away
        again = await Edge.connect(server.ws_url, sid, query=numbered(2, consumed))
        assert (await again.wait_for("resumed"))["after"] == consumed
        await again.wait_for("speech.end", lambda f: f["speech_id"] == speech_id)
        rest = "".join(f["delta"] for f in again.frames if f["type"] == "speech.text")
        heard = "".join(f["delta"] for f in kept if f["type"] == "speech.text")
        assert heard + rest == WORDS  # the rest, nothing twice
        assert all(f["n"] > consumed for f in again.frames if f["type"] != "resumed")
        assert not any(f["type"] == "speech.start" for f in again.frames)  # the same speech goes on
        await again.send({"type": "playback.finished", "speech_id": speech_id})
        done = await events.wait_for("speech.done", lambda d: d["speech_id"] == speech_id, timeout=WAIT_S)
        assert done["data"]["interrupted"] is False
        assert [m["text"] for m in await assistant_messages(client, sid)] == [WORDS]
        await again.close()
        await events.close()


async def test_an_unanswered_transcript_is_sent_again_on_the_resumed_connection_and_taken_once(
    server: Server,
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": "Noted."}])
        edge = await Edge.connect(server.ws_url, sid, query=numbered(1, 0))
        await edge.wait_for("resumed")
        await edge.send({"type": "user.transcript", "text": "book a table", "id": "t-1"})
        await edge.close()  # gone before any answer: taken or not, the edge cannot tell
        again = await Edge.connect(server.ws_url, sid, query=numbered(2, 0))
        answer = await again.wait_for("resumed")
        assert answer["after"] == 0  # nothing was consumed: what was sent since comes again
        await again.send({"type": "user.transcript", "text": "book a table", "id": "t-1"})
        taken = await again.wait_for("transcript.taken", lambda f: f["id"] == "t-1")
        start = await again.wait_for("speech.start")
        await again.wait_for("speech.end", lambda f: f["speech_id"] == start["speech_id"])
        await again.send({"type": "playback.finished", "speech_id": start["speech_id"]})
        items = (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
        users = [i for i in items if i["type"] == "message" and i["role"] == "user"]
        assert [(u["id"], u["text"]) for u in users] == [(taken["item_id"], "book a table")]
        answers = [f for f in again.of_type("transcript.taken") if f["id"] == "t-1"]
        assert {f["item_id"] for f in answers} == {taken["item_id"]}
        await again.close()


async def test_played_ms_alone_is_heard_text_at_a_speaking_rate(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": WORDS}])
        events = await EventStream.open(server, sid, types="speech.*")
        edge = await Edge.connect(server.ws_url, sid)
        r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "hi"})
        speech_id = r.json()["speech_id"]
        await edge.wait_for("speech.end", lambda f: f["speech_id"] == speech_id)
        await edge.send({"type": "playback.started", "speech_id": speech_id})
        # 1 s at 15 characters a second: "word0 word1 wor", back to the last whole word
        await edge.send({"type": "playback.progress", "speech_id": speech_id, "played_ms": 1000})
        await edge.send({"type": "user.speech_started"})
        interrupted = await events.wait_for("speech.interrupted", lambda d: d["speech_id"] == speech_id, timeout=WAIT_S)
        assert interrupted["data"]["played_text"] == "word0 word1"
        assert interrupted["data"]["audio_played_ms"] == 1000
        read = (await client.get(f"/v1/sessions/{sid}/speeches/{speech_id}")).json()
        assert (read["played_text"], read["audio_played_ms"]) == ("word0 word1", 1000)
        assert edge.of_type("error") == []
        await edge.close()
        await events.close()


async def test_a_resume_the_node_cannot_serve_is_refused_and_the_edge_starts_fresh(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": "Fresh start."}])
        edge = await Edge.connect(server.ws_url, sid, query=numbered(1, 7))  # as after a move to this node
        refused = await edge.wait_for("resume.refused")
        assert refused["after"] == 7
        r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "hi"})
        start = await edge.wait_for("speech.start", lambda f: f["speech_id"] == r.json()["speech_id"])
        assert start["n"] == 1  # a new stream, numbered from 1
        await edge.close()


async def test_a_resume_while_the_old_connection_still_looks_open_takes_over_and_closes_it(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": WORDS}])
        old = await Edge.connect(server.ws_url, sid, query={"edge_id": "half-open", "connection": 1, "resume": 0})
        r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "hi"})
        speech_id = r.json()["speech_id"]
        await old.wait_for("speech.end", lambda f: f["speech_id"] == speech_id)
        consumed = max(f["n"] for f in old.frames if f.get("n") is not None)
        # the edge saw its connection die, the server not yet: the edge connects again and resumes
        new = await Edge.connect(
            server.ws_url, sid, query={"edge_id": "half-open", "connection": 2, "resume": consumed}
        )
        assert (await new.wait_for("resumed"))["after"] == consumed
        assert await old.wait_closed() == (4409, "this edge resumed on a newer connection")
        await new.send({"type": "playback.finished", "speech_id": speech_id})
        await until(lambda: _done(client, sid, speech_id))  # played to its end through the new connection
        assert [m["text"] for m in await assistant_messages(client, sid)] == [WORDS]
        await new.close()


async def _done(client: httpx.AsyncClient, sid: str, speech_id: str) -> bool:
    r = await client.get(f"/v1/sessions/{sid}/speeches/{speech_id}")
    return bool(r.json()["state"] == "done" and not r.json()["interrupted"])
