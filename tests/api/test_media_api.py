"""The media edge route in-process: an edge that stops reading is closed (4008) and its speech ends interrupted, a
frame over the size limit is closed (1009), and the session stays usable after each."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from switchboard.api.app import create_app
from switchboard.api.media import codes as media_codes
from switchboard.api.media import routes as media_routes
from switchboard.runtime.agent import AgentRegistry

from .conftest import Api, make_settings
from .test_observability import AsgiWebSocket, sample, scrape, until


async def frames(ws: AsgiWebSocket, n: int) -> bool:
    return len(ws.frames) >= n


WORDS = " ".join(f"w{i}" for i in range(300))


async def create(api: Api, turns: list[dict[str, Any]]) -> str:
    session = await api.create(llm={"provider": "scripted", "turns": turns})
    return str(session["id"])


def send(ws: AsgiWebSocket, frame: dict[str, Any] | str) -> None:
    ws.inbox.put_nowait({"type": "websocket.receive", "text": frame if isinstance(frame, str) else json.dumps(frame)})


async def speech(api: Api, sid: str, speech_id: str) -> dict[str, Any]:
    return dict((await api.client.get(f"/v1/sessions/{sid}/speeches/{speech_id}")).json())


async def test_an_edge_that_stops_reading_is_closed_and_its_speech_ends_interrupted(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(media_routes, "OUTBOX_FRAMES", 50)
    sid = await create(api, [{"text": WORDS}, {"text": "Fine."}])
    ws = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media")
    send(ws, {"type": "ping"})
    await until(lambda: frames(ws, 1))
    assert sample(await scrape(api), "switchboard_media_edges") == 1
    ws.stall()  # reads nothing more: 300 words of speech.text pile up
    r = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "talk"})
    speech_id = r.json()["speech_id"]
    assert (await ws.closed())[0] == 4008
    assert sample(await scrape(api), "switchboard_media_edges") == 0
    done = await until(lambda: _done(api, sid, speech_id))
    assert done["interrupted"] is True and done["played_text"] == ""
    # the session goes on without an edge
    r = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "still there?"})
    second = r.json()["speech_id"]
    done = await until(lambda: _done(api, sid, second))
    assert done["interrupted"] is False and done["played_text"] == "Fine."


async def _done(api: Api, sid: str, speech_id: str) -> dict[str, Any] | None:
    found = await speech(api, sid, speech_id)
    return found if found["state"] == "done" else None


@contextlib.asynccontextmanager
async def edge_with_text_limit(
    tmp_path: Any, registry: AgentRegistry, max_text_chars: int
) -> AsyncIterator[tuple[Api, str, AsgiWebSocket]]:
    """A service whose text limit is ``max_text_chars``, a session of it, and that session's media edge."""
    app = create_app(make_settings(tmp_path, max_text_chars=max_text_chars), registry=registry)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            api = Api(client, app)
            sid = await create(api, [])
            yield api, sid, AsgiWebSocket(app, f"/v1/sessions/{sid}/media")


async def test_a_frame_over_the_size_limit_closes_the_edge(tmp_path: Any, registry: AgentRegistry) -> None:
    async with edge_with_text_limit(tmp_path, registry, 100) as (api, sid, ws):
        send(ws, {"type": "user.transcript", "text": "x" * 101})
        send(ws, {"type": "ping"})
        await until(lambda: frames(ws, 2))
        assert ws.frames[0]["code"] == "text_too_long" and ws.frames[1] == {"type": "pong"}
        send(ws, {"type": "user.transcript", "text": "x" * 2000})
        code, reason = await ws.closed()
        assert code == 1009 and "at most 1624 characters" in reason
        r = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "hello"})
        assert r.status_code == 202


async def test_a_transcript_at_the_text_limit_is_taken_however_its_frame_escapes_it(
    tmp_path: Any, registry: AgentRegistry
) -> None:
    """The text limit is on the text: an edge whose encoder escapes every non-ASCII character (``\\u00e9``, six
    characters for one) sends a frame six times as long, and it is still taken (it was closed 1009)."""
    async with edge_with_text_limit(tmp_path, registry, 300) as (api, sid, ws):
        text = "\u00e9" * 300  # 300 characters, each escaped in the frame
        frame = json.dumps({"type": "user.transcript", "text": text}, ensure_ascii=True)
        assert len(frame) > 300 + media_routes.FRAME_OVERHEAD_CHARS
        send(ws, frame)
        send(ws, {"type": "ping"})
        await until(lambda: _user_text(api, sid, text))
        await until(lambda: frames(ws, 1))
        assert not any(sent.get("type") == "error" for sent in ws.frames)
        await ws.disconnect()


async def _user_text(api: Api, sid: str, text: str) -> bool:
    chat = (await api.client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
    return any(item.get("role") == "user" and item.get("text") == text for item in chat)


async def test_barge_in_latency_is_measured_from_the_frame_read_to_the_stop_written(api: Api) -> None:
    sid = await create(api, [{"text": WORDS}])
    ws = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media")
    send(ws, {"type": "user.speech_started"})  # nothing to interrupt yet: not measured
    send(ws, {"type": "ping"})
    await until(lambda: frames(ws, 1))
    await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "talk"})
    await until(lambda: _sent(ws, "speech.end"))
    send(ws, {"type": "user.speech_started"})
    await until(lambda: _sent(ws, "speech.stop"))
    m = await scrape(api)
    assert sample(m, "switchboard_media_barge_in_seconds_count") == 1
    await ws.disconnect()


async def _sent(ws: AsgiWebSocket, kind: str) -> bool:
    return any(f["type"] == kind for f in ws.frames)


async def test_a_transcript_that_reaches_a_session_being_moved_is_not_lost(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session is handed over (a drain): a final transcript that arrives once it takes nothing more is refused
    with a 4410 that says so, and the edge sends it again where the session runs next; the edge is never told that
    the session ended (it would stop for good while the session lives on)."""
    monkeypatch.setattr(media_routes, "WATCH_INTERVAL_S", 60.0)  # the connection does not notice the move itself
    sid = await create(api, [{"text": "Fine."}])
    ws = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media")
    send(ws, {"type": "ping"})
    await until(lambda: frames(ws, 1))
    host = api.app.state.services.host
    await host.sessions[sid].suspend()  # handed over: its last writes are settled
    send(ws, {"type": "user.transcript", "text": "are you there?", "final": True})
    code, reason = await ws.closed()
    assert (code, reason) == (4410, media_codes.TRANSCRIPT_NOT_TAKEN)


def _of(ws: AsgiWebSocket, kind: str) -> list[dict[str, Any]]:
    """The frames of ``kind``, without their position in the stream (``n``: each connection counts its own)."""
    return [{k: v for k, v in f.items() if k != "n"} for f in ws.frames if f["type"] == kind]


async def _pong(ws: AsgiWebSocket) -> bool:
    return bool(_of(ws, "pong"))


async def _user_messages(api: Api, sid: str, text: str) -> list[dict[str, Any]]:
    chat = (await api.client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
    return [item for item in chat if item.get("role") == "user" and item.get("text") == text]


async def test_a_final_transcript_sent_again_with_its_id_is_taken_once_and_answered_each_time(api: Api) -> None:
    """An edge whose connection dropped cannot tell whether the final transcript it had just sent was taken (the node
    died with it in its buffer, or after committing it). With an ``id`` it sends it again on its next connection: the
    session takes it at most once, and each copy is answered ``transcript.taken`` with the same item (before, a
    transcript had no id and no answer: sent again it was applied twice, not sent again it could be lost)."""
    sid = await create(api, [{"text": "Booked."}, {"text": "Anything else?"}])
    said = {"type": "user.transcript", "text": "book a table", "final": True, "id": "tr-1"}
    first = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media")
    send(first, said)
    send(first, {"type": "ping"})  # read after the transcript is applied: its pong comes after the answer
    await until(lambda: _pong(first))
    taken = _of(first, "transcript.taken")
    assert len(taken) == 1 and taken[0]["id"] == "tr-1"
    [item] = await _user_messages(api, sid, "book a table")
    assert taken[0]["item_id"] == item["id"]
    await first.disconnect()

    again = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media")  # the answer was lost with the connection
    send(again, said)
    send(again, {"type": "ping"})
    await until(lambda: _pong(again))
    assert _of(again, "transcript.taken") == taken  # answered again, not applied again
    assert len(await _user_messages(api, sid, "book a table")) == 1
    await again.disconnect()


async def test_a_transcript_id_is_refused_for_another_text_and_a_refusal_names_the_id(
    tmp_path: Any, registry: AgentRegistry
) -> None:
    async with edge_with_text_limit(tmp_path, registry, 100) as (api, sid, ws):
        send(ws, {"type": "user.transcript", "text": "first", "id": "tr-1"})
        send(ws, {"type": "user.transcript", "text": "second", "id": "tr-1"})
        send(ws, {"type": "user.transcript", "text": "x" * 101, "id": "tr-2"})
        send(ws, {"type": "ping"})
        await until(lambda: _pong(ws))
        errors = _of(ws, "error")
        assert [(e["code"], e["frame_type"], e["id"]) for e in errors] == [
            ("transcript_id_reused", "user.transcript", "tr-1"),
            ("text_too_long", "user.transcript", "tr-2"),
        ]
        assert [f["id"] for f in _of(ws, "transcript.taken")] == ["tr-1"]
        assert await _user_messages(api, sid, "first") and not await _user_messages(api, sid, "second")
        await ws.disconnect()


async def test_a_connection_cancelled_as_its_watch_closes_it_loses_no_task(api: Api) -> None:
    """The edge is replaced (its watch ends the connection with 4409) and, before the connection hears of it, the
    server cancels it (a shutdown): how the watch ended is still read (it was a task exception nobody retrieved)."""
    sid = await create(api, [])
    ws = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media")
    send(ws, {"type": "ping"})
    await until(lambda: _pong(ws))
    session = api.app.state.services.host.sessions[sid]
    session.playout.edge.close()  # replaced: the watch wakes up and ends the connection
    await asyncio.sleep(0)  # the watch has ended; the connection has not run yet
    ws.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ws.task


async def _connected(api: Api, sid: str, query: str) -> AsgiWebSocket:
    """An edge connection, once the session plays through it (its ping answered)."""
    ws = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media", query=query)
    send(ws, {"type": "ping"})
    await until(lambda: _pong(ws))
    return ws


async def test_a_late_connection_of_an_edge_is_refused_and_its_newer_one_goes_on(api: Api) -> None:
    """An edge gave up on a connection (its node was paused, say) and connected again; the attempt it gave up on is
    delivered afterwards. Before, it replaced the edge's live connection (4409, on which an edge stops for good): the
    session was left without the edge that was talking to its user. Numbered, it is refused, the live one goes on."""
    sid = await create(api, [])
    playout = api.app.state.services.host.sessions[sid].playout
    live = await _connected(api, sid, "edge_id=e1&connection=2")
    late = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media", query="edge_id=e1&connection=1")
    assert await late.closed() == (4409, "this edge connected again since")
    again = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media", query="edge_id=e1&connection=2")  # delivered twice
    assert (await again.closed())[0] == 4409
    assert live.close is None and playout.edge is not None and not playout.edge.gone
    send(live, {"type": "user.transcript", "text": "still here", "id": "tr-1"})
    await until(lambda: _user_messages(api, sid, "still here"))

    newer = await _connected(api, sid, "edge_id=e1&connection=3")  # the edge's next connection replaces its last
    assert (await live.closed())[0] == 4409
    await newer.disconnect()
    # the edge is away (reconnecting): its stale attempt still does not take the session's playout
    stale = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media", query="edge_id=e1&connection=2")
    assert (await stale.closed())[0] == 4409 and playout.edge is None
    # another edge (another run, or another device) replaces it, as does an edge that does not number its connections
    other = await _connected(api, sid, "edge_id=e2&connection=1")
    plain = await _connected(api, sid, "")
    assert (await other.closed())[0] == 4409
    await plain.disconnect()


@pytest.mark.parametrize(
    "query",
    [
        "edge_id=e1",
        "connection=1",
        "edge_id=e1&connection=0",
        "edge_id=e1&connection=-1",
        "edge_id=e1&connection=01",
        "edge_id=e1&connection=1.5",
        "edge_id=e1&connection=12345678901234567",
        "edge_id=e1&connection=%D9%A3",  # an Arabic-Indic three: a digit to Python, not a number here
        "edge_id=&connection=1",
        f"edge_id={'e' * 65}&connection=1",
        "edge_id=a%20b&connection=1",
        "edge_id=e1&edge_id=e2&connection=1",
    ],
)
async def test_edge_connection_parameters_are_checked(api: Api, query: str) -> None:
    sid = await create(api, [])
    ws = AsgiWebSocket(api.app, f"/v1/sessions/{sid}/media", query=query)
    code, reason = await ws.closed()
    assert code == 4400 and ("edge_id" in reason or "connection" in reason), (query, code, reason)
    assert api.app.state.services.host.sessions[sid].playout.edge is None
