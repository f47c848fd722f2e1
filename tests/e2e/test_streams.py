"""WebSocket event streams over the wire: replay + live without gap or duplicate (I6), type filters, ping/pong,
close codes, slow consumers (4008 and a lossless resume), and the multi-session stream resumable by cursor."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from switchboard.client import AsyncClient
from tests.waiting import WAIT_S

from .server import EventStream, Server

pytestmark = pytest.mark.e2e

Frame = dict[str, Any]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module (each test uses sessions of its own): a server start is the slow part."""
    srv = Server(tmp_path_factory.mktemp("streams")).start()
    try:
        yield srv
    finally:
        srv.stop()


async def create(client: httpx.AsyncClient, turns: list[dict[str, Any]], **kw: Any) -> str:
    r = await client.post(
        "/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}, **kw}
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def progress_turn(steps: int, step_s: float, text: str = "Counting.") -> dict[str, Any]:
    return {"text": text, "tool_calls": [{"name": "progress", "arguments": {"steps": steps, "step_s": step_s}}]}


async def connect(url: str, **kw: Any) -> EventStream:
    return EventStream(await websockets.connect(url, **kw))


async def wait_closed(stream: EventStream, timeout: float = WAIT_S) -> tuple[int, str]:
    """The close code and reason, once the server has closed the stream."""
    try:
        async with asyncio.timeout(timeout):
            await asyncio.shield(stream._task)
    except TimeoutError:
        await stream.close()
        raise AssertionError(f"the server left the stream open; got {stream.types()}") from None
    assert stream.closed is not None
    return stream.closed


async def rejected(url: str) -> tuple[int, str]:
    """Connect and expect the server to close at once, before sending any frame."""
    async with asyncio.timeout(WAIT_S):
        async with websockets.connect(url) as ws:
            with pytest.raises(websockets.ConnectionClosed):
                frame = await ws.recv()
                raise AssertionError(f"got a frame instead of a close: {frame}")
            assert ws.close_code is not None
            return ws.close_code, ws.close_reason or ""


def seqs(frames: list[Frame]) -> list[int]:
    return [f["seq"] for f in frames]


def assert_gap_free(frames: list[Frame], start: int = 1) -> None:
    got = seqs(frames)
    assert got == list(range(start, start + len(got))), got


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def flood_until_dropped(client: httpx.AsyncClient, sid: str, timeout_s: float = 120) -> int:
    """Send big interim transcripts to ``sid`` until the server has dropped a slow subscriber; how many were sent."""
    interim = 0
    async with asyncio.timeout(timeout_s):
        while not metric((await client.get("/metrics")).text, "switchboard_ws_slow_consumers_dropped_total"):
            assert interim < 400, "the slow subscriber was never dropped"
            text = secrets.token_urlsafe(36_000)  # ~48 KB that does not compress
            r = await client.post(f"/v1/sessions/{sid}/input", json={"text": text, "final": False})
            assert r.status_code == 202, r.text
            interim += 1
    return interim


# -- one session's stream ------------------------------------------------------------------------------------------


async def test_replay_then_live_has_no_gap_or_duplicate_at_the_seam(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [progress_turn(60, 0.01)])
        full = await EventStream.open(server, sid)
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})
        late: list[tuple[int, EventStream]] = []
        for step in (5, 15, 30):  # join at several points while progress events keep being produced
            mark = await full.wait_for("tool.progress", lambda d, s=step: d["message"] == f"step {s}/60")
            late.append((mark["seq"], await EventStream.open(server, sid, since=mark["seq"])))
        ended = await full.wait_for("tool.ended")
        for _, stream in late:
            await stream.wait_for("tool.ended")
        await full.close()
        assert_gap_free(full.frames)
        by_seq = {f["seq"]: f for f in full.frames}
        for since, stream in late:
            await stream.close()
            assert stream.frames, since
            assert_gap_free(stream.frames, start=since + 1)  # nothing at or before `since`, nothing skipped
            # the same events, byte for byte (`full` was closed first: a late stream may have a few frames more)
            shared = [f for f in stream.frames if f["seq"] in by_seq]
            assert shared == [by_seq[f["seq"]] for f in shared]
            assert shared[-1]["seq"] >= ended["seq"]
        steps = [f["data"]["message"] for f in full.frames if f["type"] == "tool.progress"]
        assert steps == [f"step {i}/60" for i in range(1, 61)]


async def test_type_filters_with_globs_live_and_replayed(server: Server):
    turns = [progress_turn(3, 0.01, "Starting."), {"text": "In the background."}, {"text": "Done."}]
    pattern = "tool.*,speech.done"

    def wanted(f: Frame) -> bool:
        return f["type"].startswith("tool.") or f["type"] == "speech.done"

    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, turns)
        full = await EventStream.open(server, sid)
        filtered = await EventStream.open(server, sid, types=pattern)
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
        await full.wait_for("chat.item", lambda d: d["item"].get("text") == "Done.")
        created = {f["data"]["speech_id"] for f in full.frames if f["type"] == "speech.created"}
        for speech_id in created:  # every speech has ended
            await full.wait_for("speech.done", lambda d, s=speech_id: d["speech_id"] == s)
        assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
        # both streams end with the session, the filtered one too although session.closed is filtered out
        assert await wait_closed(full) == (1000, "session closed")
        assert await wait_closed(filtered) == (1000, "session closed")
        assert full.frames[-1]["type"] == "session.closed"
        expected = [f for f in full.frames if wanted(f)]
        assert {f["type"] for f in expected} == {"tool.started", "tool.progress", "tool.ended", "speech.done"}
        assert filtered.frames == expected
        # replayed from the store with the same filter: the same frames, then the stream ends
        replayed = await EventStream.open(server, sid, types=pattern)
        assert await wait_closed(replayed) == (1000, "session closed")
        assert replayed.frames == expected
        only_progress = await EventStream.open(server, sid, types="tool.progress")
        assert await wait_closed(only_progress) == (1000, "session closed")
        assert only_progress.frames == [f for f in full.frames if f["type"] == "tool.progress"]


async def test_ping_pong_and_bad_messages(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [])
    async with asyncio.timeout(WAIT_S):
        async with websockets.connect(f"{server.ws_url}/v1/sessions/{sid}/events") as ws:
            events: list[Frame] = []

            async def ping() -> None:
                """Send a ping; a pong comes back (event frames may come first, each with its seq)."""
                await ws.send(json.dumps({"type": "ping"}))
                while (frame := json.loads(await ws.recv())) != {"type": "pong"}:
                    assert "seq" in frame and frame.get("type") != "pong", frame
                    events.append(frame)

            await ping()
            await ping()
            await ping()
            assert_gap_free(events)  # pongs are not events and take no seq
            await ws.send("not json")
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await ws.recv()
            assert ws.close_code == 4400


async def test_unknown_session_and_bad_parameters_are_closed(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [])
    assert await rejected(f"{server.ws_url}/v1/sessions/nope/events") == (4404, "session_not_found")
    assert (await rejected(f"{server.ws_url}/v1/sessions/nope/events?since=3"))[0] == 4404
    for bad in ("abc", "-1", "1.5", ""):
        code, reason = await rejected(f"{server.ws_url}/v1/sessions/{sid}/events?since={bad}")
        assert code == 4400 and "since" in reason, (bad, code, reason)
    code, reason = await rejected(f"{server.ws_url}/v1/events?cursor=x")
    assert code == 4400 and "cursor" in reason


async def test_session_stream_closes_with_1000_after_session_closed(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": "Hello there."}])
        live = await EventStream.open(server, sid)
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "hi"})
        await live.wait_for("speech.done")
        assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
        assert await wait_closed(live) == (1000, "session closed")
        assert live.frames[-1]["type"] == "session.closed"
        assert_gap_free(live.frames)
        last = live.frames[-1]["seq"]
        # a closed session's log is still readable: replayed, then closed
        for since in (0, last - 2, last):
            replay = await EventStream.open(server, sid, since=since)
            assert await wait_closed(replay) == (1000, "session closed")
            assert replay.frames == live.frames[since:]


async def test_slow_consumer_is_closed_with_4008_and_resumes_without_loss(tmp_path):
    # A small per-subscriber buffer; big interim transcripts fill the socket buffers quickly so that a client that
    # stops reading blocks the server's sends while the tool keeps producing progress events.
    server = Server(tmp_path, SWITCHBOARD_WS_BUFFER="10", SWITCHBOARD_MAX_TEXT_CHARS="60000").start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
            sid = await create(client, [progress_turn(80, 0.01), {"text": "Running."}])
            sock = socket.socket()
            # a small window, so that the server blocks sooner; not below twice the loopback's segment size (64 KB):
            # with a 4 KB buffer the client, reading again, got one 48 KB frame every 5 s on a loaded machine (its
            # window opening unannounced, the sender finding out only when it probed the window again)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 131072)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
            url = f"{server.ws_url}/v1/sessions/{sid}/events?since=0"
            # max_queue=1: the client stops reading from the socket as soon as a frame is waiting; no compression,
            # so that the bytes on the wire are the bytes of the events
            slow = await websockets.connect(url, sock=sock, max_queue=1, compression=None)
            await client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})
            interim = await flood_until_dropped(client, sid)
            # a slow client is slow for a while longer: past an ordinary close's wait (2 s), it still gets its 4008
            await asyncio.sleep(3)
            # the client reads again: everything sent before the close, then the close with the seq to resume from
            frames: list[Frame] = []
            async with asyncio.timeout(WAIT_S):  # a few MB, on a loaded machine
                try:
                    async for raw in slow:
                        frames.append(json.loads(raw))
                except websockets.ConnectionClosed:
                    pass
            assert slow.close_code == 4008, (slow.close_code, slow.close_reason)
            match = re.fullmatch(r"too slow; resume with since=(\d+)", slow.close_reason or "")
            assert match, slow.close_reason
            resume_from = int(match.group(1))
            assert_gap_free(frames)
            # exactly what was delivered, nothing more (on a loaded machine the server may have fallen behind before
            # its first send: then nothing was delivered, and the close names the position the client asked for)
            assert resume_from == (frames[-1]["seq"] if frames else 0), (resume_from, len(frames))

            # the rest, read as a client does: resuming where each 4008 says (a reader at full speed may fall behind
            # a 10-event buffer too while the machine is loaded; it resumes again and nothing is lost)
            rest: list[Frame] = []
            inputs = len([f for f in frames if f["type"] == "user.input"])
            ended = any(f["type"] == "tool.ended" for f in frames)  # the tool may have ended before the close
            async with AsyncClient(server.url) as sb, sb.events(sid, since=resume_from) as stream:
                async with asyncio.timeout(WAIT_S):
                    async for event in stream:
                        rest.append({"seq": event.seq, "type": event.type, "data": event.data})
                        inputs += event.type == "user.input"
                        ended = ended or event.type == "tool.ended"
                        if ended and inputs == interim + 1:
                            break
            union = frames + rest
            assert_gap_free(union)
            steps = [f["data"]["message"] for f in union if f["type"] == "tool.progress"]
            assert steps == [f"step {i}/80" for i in range(1, 81)]
            assert len([f for f in union if f["type"] == "user.input" and not f["data"]["final"]]) == interim
            # this client, and the resuming one each time it fell behind
            assert metric((await client.get("/metrics")).text, "switchboard_ws_slow_consumers_dropped_total") >= 1
            async with asyncio.timeout(WAIT_S):  # the server notices the last disconnect
                while metric((await client.get("/metrics")).text, "switchboard_ws_connections"):
                    await asyncio.sleep(0.02)
    finally:
        server.stop()


# -- the multi-session stream --------------------------------------------------------------------------------------


async def test_multi_session_stream_filters_by_session_and_type(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        a, b, c = [await create(client, [progress_turn(4, 0.01)]) for _ in range(3)]
        url = f"{server.ws_url}/v1/events?session_ids={a},{b}&types=tool.*,speech.done"
        stream = await connect(url)
        for sid in (a, b, c):
            await client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
        async with asyncio.timeout(WAIT_S):
            while {f["session_id"] for f in stream.frames if f["type"] == "tool.ended"} != {a, b}:
                await asyncio.sleep(0.01)
        await stream.close()
        # the stored log, read by cursor from the start, is the reference
        reference = await connect(f"{server.ws_url}/v1/events?session_ids={a},{b},{c}")
        async with asyncio.timeout(WAIT_S):
            while len({f["session_id"] for f in reference.frames if f["type"] == "tool.ended"}) < 3:
                await asyncio.sleep(0.01)
        await reference.close()

    frames = stream.frames
    assert {f["session_id"] for f in frames} == {a, b}
    assert all(f["type"].startswith("tool.") or f["type"] == "speech.done" for f in frames)
    cursors = [f["cursor"] for f in frames]
    assert all(isinstance(x, int) for x in cursors) and cursors == sorted(set(cursors))
    for sid in (a, b):
        mine = [f for f in frames if f["session_id"] == sid]
        steps = [f["data"]["message"] for f in mine if f["type"] == "tool.progress"]
        assert steps == [f"step {i}/4" for i in range(1, 5)]
        assert seqs(mine) == sorted(seqs(mine))
    by_cursor = {f["cursor"]: f for f in reference.frames}
    for f in frames:  # the same cursor names the same event
        assert by_cursor[f["cursor"]] == f
    upto = max(cursors)
    expected = [
        f
        for f in reference.frames
        if f["cursor"] <= upto
        and f["session_id"] in (a, b)
        and (f["type"].startswith("tool.") or f["type"] == "speech.done")
    ]
    assert frames == expected


async def test_multi_session_resume_by_cursor_delivers_everything_once_in_order(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        a = await create(client, [progress_turn(40, 0.01)])
        b = await create(client, [progress_turn(40, 0.01)])
        url = f"{server.ws_url}/v1/events?session_ids={a},{b}"
        first = await connect(url)
        await client.post(f"/v1/sessions/{a}/input", json={"text": "go"})
        await client.post(f"/v1/sessions/{b}/input", json={"text": "go"})
        await first.wait_for("tool.progress", lambda d: d["message"] == "step 10/40")
        await first.close()
        cursor = first.frames[-1]["cursor"]
        await asyncio.sleep(0.1)  # events go on while nobody listens
        second = await connect(f"{url}&cursor={cursor}")
        async with asyncio.timeout(WAIT_S):
            while len([f for f in second.frames if f["type"] == "tool.ended"]) < 2:
                await asyncio.sleep(0.01)
        await second.close()

    assert second.frames[0]["cursor"] > cursor
    union = first.frames + second.frames
    cursors = [f["cursor"] for f in union]
    assert cursors == sorted(set(cursors)), "a cursor was delivered twice or out of order"
    for sid in (a, b):
        mine = [f for f in union if f["session_id"] == sid]
        assert_gap_free(mine)  # per session: every event, once, in seq order
        steps = [f["data"]["message"] for f in mine if f["type"] == "tool.progress"]
        assert steps == [f"step {i}/40" for i in range(1, 41)]
