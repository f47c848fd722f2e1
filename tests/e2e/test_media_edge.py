"""The media edge over the wire: a real server and a real WebSocket client acting as the edge. Heard text is the last
progress the edge reported before a barge-in, a disconnect mid-speech ends the speech interrupted there and the
session goes on with the simulated clock, a second edge replaces the first, and bad frames never kill a session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.waiting import WAIT_S

from .edge_client import Edge
from .server import ROOT, EventStream, Server

pytestmark = pytest.mark.e2e

WORDS = " ".join(f"word{i}" for i in range(40))
KEY = "media-test-key-0123456789"
READ_KEY = "media-read-key-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("media")).start()
    try:
        yield srv
    finally:
        srv.stop()


async def create(client: httpx.AsyncClient, turns: list[dict[str, Any]], **kw: Any) -> str:
    body = {"agent": "tester", "llm": {"provider": "scripted", "turns": turns}, **kw}
    r = await client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def assistant_messages(client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    items = (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
    return [i for i in items if i["type"] == "message" and i["role"] == "assistant"]


async def speaking(client: httpx.AsyncClient, edge: Edge, sid: str, text: str = "hi") -> str:
    """Send input; the edge receives the reply's speech and reports that its audio started. Returns its id."""
    r = await client.post(f"/v1/sessions/{sid}/input", json={"text": text})
    assert r.status_code == 202, r.text
    speech_id = str(r.json()["speech_id"])
    start = await edge.wait_for("speech.start", lambda f: f["speech_id"] == speech_id)
    assert start["allow_interruptions"] is True
    await edge.send({"type": "playback.started", "speech_id": speech_id})
    return speech_id


async def test_barge_in_commits_the_last_reported_progress_and_releases_the_tools_wait(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": WORDS, "tool_calls": [{"name": "heard"}]}])
        events = await EventStream.open(server, sid, types="speech.*,tool.*,agent.state")
        edge = await Edge.connect(server.ws_url, sid)
        speech_id = await speaking(client, edge, sid)
        await events.wait_for("speech.started", lambda d: d["speech_id"] == speech_id, timeout=WAIT_S)
        await events.wait_for("agent.state", lambda d: d["state"] == "speaking", timeout=WAIT_S)
        text = await edge.wait_text(speech_id, len(WORDS))
        heard = text.index("word7") + len("word7")
        await edge.send({"type": "playback.progress", "speech_id": speech_id, "played_chars": 12})
        await edge.send({"type": "playback.progress", "speech_id": speech_id, "played_chars": heard})
        await edge.send({"type": "user.speech_started"})
        await edge.wait_for("speech.stop", lambda f: f["speech_id"] == speech_id)
        interrupted = await events.wait_for("speech.interrupted", lambda d: d["speech_id"] == speech_id, timeout=WAIT_S)
        ended = await events.wait_for("tool.ended", timeout=WAIT_S)
        assert ended["data"]["status"] == "interrupted"  # its wait_for_playout was released, not left hanging
        assert interrupted["data"]["played_text"] == text[:heard]
        # late reports change nothing committed
        await edge.send({"type": "playback.progress", "speech_id": speech_id, "played_chars": len(text)})
        await edge.send({"type": "playback.finished", "speech_id": speech_id, "interrupted": False})
        await edge.send({"type": "ping"})
        await edge.wait_for("pong")
        [message] = await assistant_messages(client, sid)
        assert message["text"] == text[:heard] and message["interrupted"] is True
        speech = (await client.get(f"/v1/sessions/{sid}/speeches/{speech_id}")).json()
        assert speech["played_text"] == text[:heard] and speech["interrupted"] is True
        assert edge.of_type("error") == []
        await edge.close()
        await events.close()


async def test_a_speech_played_to_its_end_through_the_edge(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": "Hello there."}])
        events = await EventStream.open(server, sid, types="speech.*")
        edge = await Edge.connect(server.ws_url, sid)
        speech_id = await speaking(client, edge, sid)
        await edge.wait_for("speech.end", lambda f: f["speech_id"] == speech_id)
        text = edge.texts[speech_id]
        assert text == "Hello there."
        await edge.send({"type": "playback.progress", "speech_id": speech_id, "played_chars": 6})
        await edge.send({"type": "playback.finished", "speech_id": speech_id, "interrupted": False})
        done = await events.wait_for("speech.done", lambda d: d["speech_id"] == speech_id, timeout=WAIT_S)
        assert done["data"]["interrupted"] is False
        [message] = await assistant_messages(client, sid)
        assert message["text"] == "Hello there." and message["interrupted"] is False
        await edge.close()
        await events.close()


async def test_disconnect_mid_speech_ends_it_interrupted_and_the_session_goes_on_without_an_edge(
    server: Server,
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": WORDS}, {"text": "Back to text only."}, {"text": "Audio again."}])
        events = await EventStream.open(server, sid, types="speech.*")
        edge = await Edge.connect(server.ws_url, sid)
        speech_id = await speaking(client, edge, sid)
        text = await edge.wait_text(speech_id, 20)
        await edge.send({"type": "playback.progress", "speech_id": speech_id, "played_chars": 11})
        await edge.send({"type": "ping"})
        await edge.wait_for("pong")  # the progress was applied before the edge leaves
        await edge.close()
        interrupted = await events.wait_for("speech.interrupted", lambda d: d["speech_id"] == speech_id, timeout=WAIT_S)
        assert interrupted["data"]["played_text"] == text[:11]
        # text only now: the next reply plays on the simulated clock, to its end
        r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "still there?"})
        second = r.json()["speech_id"]
        done = await events.wait_for("speech.done", lambda d: d["speech_id"] == second, timeout=WAIT_S)
        assert done["data"]["interrupted"] is False
        messages = await assistant_messages(client, sid)
        assert [m["text"] for m in messages] == [text[:11], "Back to text only."]
        # until an edge connects again
        again = await Edge.connect(server.ws_url, sid)
        third = await speaking(client, again, sid, "and now?")
        await again.wait_for("speech.end", lambda f: f["speech_id"] == third)
        assert again.texts[third] == "Audio again."
        await again.send({"type": "playback.finished", "speech_id": third})
        done = await events.wait_for("speech.done", lambda d: d["speech_id"] == third, timeout=WAIT_S)
        assert done["data"]["interrupted"] is False
        await again.close()
        await events.close()


async def test_a_second_edge_replaces_the_first(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": WORDS}, {"text": "Now on the second edge."}])
        events = await EventStream.open(server, sid, types="speech.*")
        first = await Edge.connect(server.ws_url, sid)
        speech_id = await speaking(client, first, sid)
        text = await first.wait_text(speech_id, 20)
        await first.send({"type": "playback.progress", "speech_id": speech_id, "played_chars": 5})
        await first.send({"type": "ping"})
        await first.wait_for("pong")
        second = await Edge.connect(server.ws_url, sid)
        assert (await first.wait_closed())[0] == 4409
        interrupted = await events.wait_for("speech.interrupted", lambda d: d["speech_id"] == speech_id, timeout=WAIT_S)
        assert interrupted["data"]["played_text"] == text[:5]
        next_id = await speaking(client, second, sid, "again")
        await second.wait_for("speech.end", lambda f: f["speech_id"] == next_id)
        await second.send({"type": "playback.finished", "speech_id": next_id, "interrupted": False})
        done = await events.wait_for("speech.done", lambda d: d["speech_id"] == next_id, timeout=WAIT_S)
        assert done["data"]["interrupted"] is False
        assert not any(f["speech_id"] == next_id for f in first.frames if "speech_id" in f)
        await second.close()
        await events.close()


async def test_bad_frames_get_error_frames_and_the_session_lives_on(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": WORDS}])
        edge = await Edge.connect(server.ws_url, sid)
        speech_id = await speaking(client, edge, sid)
        text = await edge.wait_text(speech_id, 30)
        await edge.send({"type": "playback.progress", "speech_id": speech_id, "played_chars": 10})
        bad: list[Any] = [
            "not json",
            {"no": "type"},
            {"type": "launch.rockets"},
            {"type": "playback.progress", "speech_id": speech_id, "played_chars": "ten"},
            {"type": "playback.progress", "speech_id": speech_id, "played_chars": 10_000},
            {"type": "playback.progress", "speech_id": speech_id, "played_chars": 4},
            {"type": "playback.progress", "speech_id": "speech_nope", "played_chars": 1},
            {"type": "user.transcript", "text": ""},
        ]
        for frame in bad:
            await edge.send(frame if isinstance(frame, str) else json.dumps(frame))
        await edge.send({"type": "ping"})
        await edge.wait_for("pong")
        codes = [f["code"] for f in edge.of_type("error")]
        assert codes == [
            "bad_json",
            "unknown_type",
            "unknown_type",
            "bad_frame",
            "played_chars_beyond_text",
            "played_chars_backwards",
            "unknown_speech",
            "bad_frame",
        ]
        # the session and the connection are unharmed: a barge-in still commits the last good progress
        await edge.send({"type": "user.speech_started"})
        await edge.wait_for("speech.stop")
        speech = (await client.get(f"/v1/sessions/{sid}/speeches/{speech_id}")).json()
        assert speech["interrupted"] is True and speech["played_text"] == text[:10]
        await edge.send(b"\x00binary")
        assert (await edge.wait_closed())[0] == 1003


async def test_transcripts_drive_the_session_like_input(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": "You said something."}])
        events = await EventStream.open(server, sid, types="user.input,speech.*")
        edge = await Edge.connect(server.ws_url, sid)
        await edge.send({"type": "user.transcript", "text": "book a", "final": False})
        await edge.send({"type": "user.transcript", "text": "book a table", "final": True})
        interim = await events.wait_for("user.input", lambda d: d["final"] is False, timeout=WAIT_S)
        final = await events.wait_for("user.input", lambda d: d["final"] is True, timeout=WAIT_S)
        assert (interim["data"]["text"], final["data"]["text"]) == ("book a", "book a table")
        start = await edge.wait_for("speech.start")
        await edge.wait_for("speech.end")
        assert edge.texts[start["speech_id"]] == "You said something."
        await edge.close()
        await events.close()


async def test_unknown_sessions_and_ended_sessions_are_refused(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        edge = await Edge.connect(server.ws_url, "sess_missing")
        assert (await edge.wait_closed())[0] == 4404
        sid = await create(client, [])
        edge = await Edge.connect(server.ws_url, sid)
        await edge.send({"type": "ping"})
        await edge.wait_for("pong")
        assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
        assert (await edge.wait_closed())[0] == 1000
        edge = await Edge.connect(server.ws_url, sid)  # ended for good: 1000, not 4410 (which has an edge retry)
        assert await edge.wait_closed() == (1000, "session closed")


async def test_media_connect_scope_from_a_key_or_a_minted_token(tmp_path: Any) -> None:
    keys = [
        {"key": KEY, "scopes": ["sessions:read", "sessions:write", "sessions:control", "media:connect"]},
        {"key": READ_KEY, "scopes": ["sessions:read", "events:read"]},
    ]
    srv = Server(tmp_path, SWITCHBOARD_API_KEYS=json.dumps(keys)).start()
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=srv.url, headers=headers, timeout=WAIT_S) as client:
            sid = await create(client, [])
            edge = await Edge.connect(srv.ws_url, sid)
            assert (await edge.wait_closed())[0] == 4401
            edge = await Edge.connect(srv.ws_url, sid, additional_headers={"Authorization": f"Bearer {READ_KEY}"})
            assert (await edge.wait_closed())[0] == 4403
            plain = (await client.post(f"/v1/sessions/{sid}/tokens", json={})).json()
            assert plain["scopes"] == ["sessions:read"]  # the default scopes the key holds (it cannot read events)
            edge = await Edge.connect(srv.ws_url, sid, token=plain["token"])
            assert (await edge.wait_closed())[0] == 4403
            r = await client.post(f"/v1/sessions/{sid}/tokens", json={"scopes": ["media:connect"]})
            assert r.status_code == 201, r.text
            assert r.json()["scopes"] == ["media:connect"]
            edge = await Edge.connect(srv.ws_url, sid, token=r.json()["token"])
            await edge.send({"type": "ping"})
            await edge.wait_for("pong")
            await edge.close()
            edge = await Edge.connect(srv.ws_url, sid, additional_headers=headers)
            await edge.send({"type": "ping"})
            await edge.wait_for("pong")
            await edge.close()
            # a key cannot mint a token that reaches further than itself
            r = await client.post(
                f"/v1/sessions/{sid}/tokens",
                json={"scopes": ["media:connect"]},
                headers={"Authorization": f"Bearer {READ_KEY}"},
            )
            assert r.status_code == 403 and r.json()["code"] == "forbidden"
    finally:
        srv.stop()


async def test_the_edge_is_closed_when_it_sends_too_many_frames(tmp_path: Any) -> None:
    srv = Server(tmp_path, SWITCHBOARD_MEDIA_MAX_FRAMES_PER_S="5").start()
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=WAIT_S) as client:
            sid = await create(client, [])
            edge = await Edge.connect(srv.ws_url, sid)
            for _ in range(30):
                try:
                    await edge.send({"type": "ping"})
                except Exception:
                    break
            assert (await edge.wait_closed())[0] == 4429
            r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "still alive"})
            assert r.status_code == 202
            await asyncio.sleep(0)
    finally:
        srv.stop()


async def test_every_frame_both_ways_matches_the_asyncapi_document(server: Server) -> None:
    from jsonschema import Draft202012Validator

    spec = json.loads((ROOT / "openapi" / "asyncapi.json").read_text())
    channel = spec["channels"]["sessionMedia"]
    by_type: dict[str, dict[str, Any]] = {}
    for ref in channel["messages"].values():
        message = spec["components"]["messages"][ref["$ref"].rsplit("/", 1)[1]]
        by_type[message["name"]] = spec["components"]["schemas"][message["payload"]["$ref"].rsplit("/", 1)[1]]
    sent: list[dict[str, Any]] = []

    async def send(edge: Edge, frame: dict[str, Any]) -> None:
        sent.append(frame)
        await edge.send(frame)

    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": WORDS}, {"text": "Done."}])
        edge = await Edge.connect(server.ws_url, sid)
        await send(edge, {"type": "user.transcript", "text": "hel", "final": False})
        await send(edge, {"type": "user.transcript", "text": "hello", "final": True})
        start = await edge.wait_for("speech.start")
        speech_id = start["speech_id"]
        await edge.wait_text(speech_id, 10)
        await send(edge, {"type": "playback.started", "speech_id": speech_id})
        await send(edge, {"type": "playback.progress", "speech_id": speech_id, "played_chars": 5})
        await send(edge, {"type": "playback.progress", "speech_id": speech_id, "played_chars": 1})  # an error frame
        await send(edge, {"type": "user.speech_started"})
        await edge.wait_for("speech.stop")
        await send(edge, {"type": "playback.finished", "speech_id": speech_id, "interrupted": True})
        await send(edge, {"type": "user.transcript", "text": "again"})
        second = await edge.wait_for("speech.start", lambda f: f["speech_id"] != speech_id)
        await edge.wait_for("speech.end", lambda f: f["speech_id"] == second["speech_id"])
        await send(edge, {"type": "playback.finished", "speech_id": second["speech_id"]})
        await send(edge, {"type": "ping"})
        await edge.wait_for("pong")
        await edge.close()
    received = edge.frames
    assert {f["type"] for f in received} >= {
        "speech.start",
        "speech.text",
        "speech.end",
        "speech.stop",
        "error",
        "pong",
    }
    for frame in [*received, *sent]:
        schema = by_type[frame["type"]]
        errors = list(Draft202012Validator(schema).iter_errors(frame))
        assert not errors, (frame, [e.message for e in errors])
