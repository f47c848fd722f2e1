"""The AG-UI stream of a real server, checked by the AG-UI conformance validator (``ag-ui-validate``) over a full
scenario (tools, background progress, an interrupt, a handoff, the close), and resumed without gap or duplicate."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import websockets
from ag_ui_validate.pytest_plugin import assert_valid_agui, validate_agui_endpoint

from tests.waiting import WAIT_S

from .server import EventStream, Server
from .test_streams import flood_until_dropped, metric

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("agui")).start()
    try:
        yield srv
    finally:
        srv.stop()


LONG = " ".join(f"w{i}" for i in range(200))
TURNS = [
    {
        "text": LONG,
        "tool_calls": [
            {"name": "book", "arguments": {"what": "table 7"}},
            {"name": "progress", "arguments": {"steps": 3, "step_s": 0.05}},
        ],
    },
    # the deferred reply to the background tool's result hands off to the other agent
    {"text": "One moment.", "tool_calls": [{"name": "transfer", "arguments": {}}]},
]


@dataclass
class SseCapture:
    """What one SSE connection received: (id or None, AG-UI event) per frame."""

    frames: list[tuple[int | None, dict[str, Any]]] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)

    def events(self) -> list[dict[str, Any]]:
        return [e for _, e in self.frames]

    def ids(self) -> list[int]:
        return [i for i, _ in self.frames if i is not None]


async def read_sse(
    client: httpx.AsyncClient,
    url: str,
    capture: SseCapture,
    *,
    stop_after_id: int | None = None,
    method: str = "GET",
    **kw: Any,
) -> int:
    """Read an SSE stream into ``capture`` until it ends (or after the frame with ``stop_after_id`` or a later one);
    its status."""
    async with client.stream(method, url, **kw) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code
        assert resp.headers["content-type"].startswith("text/event-stream")
        event_id: int | None = None
        data: list[str] = []
        async for line in resp.aiter_lines():
            if line.startswith(":"):
                capture.comments.append(line)
            elif line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and data:
                capture.frames.append((event_id, json.loads("\n".join(data))))
                if stop_after_id is not None and event_id is not None and event_id >= stop_after_id:
                    return 200
                event_id, data = None, []
    return 200


async def run_scenario(client: httpx.AsyncClient, sid: str, events: EventStream) -> None:
    await client.post(f"/v1/sessions/{sid}/input", json={"text": "book table 7"})
    await events.wait_for("tool.ended", lambda d: d["name"] == "book")
    await asyncio.sleep(0.05)
    r = await client.post(f"/v1/sessions/{sid}/interrupt")
    assert r.json()["interrupted"] is True
    await events.wait_for("agent.handoff")
    await events.wait_for("speech.done", lambda d: not d["interrupted"])
    await client.post(f"/v1/sessions/{sid}/input", json={"text": "thanks"})
    await events.wait_for("agent.state", lambda d: d["state"] == "listening")
    await asyncio.sleep(0.2)
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
    await events.wait_for("session.closed")


async def new_session(client: httpx.AsyncClient) -> str:
    r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": TURNS}})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def carried(frames: list[dict[str, Any]]) -> list[int]:
    """The seqs of the session events that make AG-UI events: all but a progress update's chat items (the update's
    ``tool.progress`` carries it)."""
    return [
        f["seq"]
        for f in frames
        if not (f["type"] == "chat.item" and "/update/" in str(f["data"]["item"].get("call_id", "")))
    ]


def of_type(events: list[dict[str, Any]], t: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == t]


def split_runs(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``events`` as runs, each from its RUN_STARTED to its RUN_FINISHED or RUN_ERROR."""
    runs: list[list[dict[str, Any]]] = []
    for e in events:
        if e["type"] == "RUN_STARTED":
            runs.append([])
        runs[-1].append(e)
    return runs


async def test_full_scenario_passes_the_validator_live_and_maps_every_event(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        sid = await new_session(client)
        url = f"{server.url}/v1/sessions/{sid}/ag-ui"
        events = await EventStream.open(server, sid)
        # the validator's own transport (SSE framing, content type, a terminal event at the end) on a live stream
        report_task = asyncio.create_task(validate_agui_endpoint(url, method="GET", timeout_ms=20_000))
        capture = SseCapture()
        read_task = asyncio.create_task(read_sse(client, url, capture))
        await asyncio.sleep(0.2)
        await run_scenario(client, sid, events)
        report = await asyncio.wait_for(report_task, WAIT_S)
        assert await asyncio.wait_for(read_task, WAIT_S) == 200
        await events.close()

    problems = [d for d in report.diagnostics if d.severity in ("error", "warning")]
    assert report.summary.errors == 0 and report.summary.warnings == 0, problems
    assert report.event_count == len(capture.frames)
    assert_valid_agui(capture.events(), max_warnings=0)
    # every session event is delivered, once, in order: its id is on the last AG-UI event made from it
    assert [f["seq"] for f in events.frames] == list(range(1, len(events.frames) + 1))
    assert capture.ids() == carried(events.frames)
    ag = capture.events()
    starts = {e["toolCallName"]: e["toolCallId"] for e in of_type(ag, "TOOL_CALL_START")}
    assert set(starts) == {"book", "progress", "transfer"}
    assert json.loads(next(e["delta"] for e in of_type(ag, "TOOL_CALL_ARGS") if e["toolCallId"] == starts["book"])) == {
        "what": "table 7"
    }
    results = {e["toolCallId"]: e["content"] for e in of_type(ag, "TOOL_CALL_RESULT")}
    assert results[starts["book"]] == "booked table 7"
    # the operator's interrupt finishes the turn it cut short, cancelled; the background call's result lands in the
    # next run (as CUSTOM: its call started in the cancelled one), and so does the reply to it (the transfer)
    runs = split_runs(ag)
    cut = next(
        i for i, run in enumerate(runs) if starts["book"] in [e["toolCallId"] for e in of_type(run, "TOOL_CALL_START")]
    )
    assert runs[cut][-1]["outcome"] == {"type": "cancelled"}
    late = next(
        i
        for i, run in enumerate(runs)
        for e in of_type(run, "CUSTOM")
        if e["name"] == "switchboard.tool.ended" and e["value"]["call_id"] == starts["progress"]
    )
    assert late == cut + 1 and starts["transfer"] in [e["toolCallId"] for e in of_type(runs[late], "TOOL_CALL_START")]
    assert "outcome" not in runs[late][-1]
    progress = [e["content"]["message"] for e in of_type(ag, "ACTIVITY_SNAPSHOT")]
    assert progress == ["step 1/3", "step 2/3", "step 3/3"]
    # the interrupted message holds what was heard, and says it was interrupted
    interrupted = next(e for e in of_type(ag, "TEXT_MESSAGE_END") if e.get("metadata", {}).get("interrupted"))
    heard = "".join(
        e["delta"] for e in of_type(ag, "TEXT_MESSAGE_CONTENT") if e["messageId"] == interrupted["messageId"]
    )
    marked = next(e for e in of_type(ag, "CUSTOM") if e["name"] == "switchboard.speech.interrupted")
    assert heard == marked["value"]["played_text"] and LONG.startswith(heard) and heard != LONG
    roles = [e.get("role") for e in of_type(ag, "TEXT_MESSAGE_START")]
    assert roles.count("user") == 2 and "assistant" in roles
    # the session's state: a snapshot at the start, deltas after (the handoff names the new agent)
    assert ag[1]["type"] == "STATE_SNAPSHOT" and ag[1]["snapshot"]["agent"] == "tester"
    deltas = [op for e in of_type(ag, "STATE_DELTA") for op in e["delta"]]
    assert {"op": "add", "path": "/agent", "value": "other"} in deltas
    assert deltas[-1] == {"op": "add", "path": "/status", "value": "closed"}
    # turns are runs, each finished; the stream ends with the last
    runs = of_type(ag, "RUN_STARTED")
    assert len(runs) == len(of_type(ag, "RUN_FINISHED")) >= 3
    assert ag[-1]["type"] == "RUN_FINISHED" and all(r["threadId"] == sid for r in runs)


async def test_resume_with_last_event_id_is_gap_free_across_live_and_replay(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        sid = await new_session(client)
        url = f"/v1/sessions/{sid}/ag-ui"
        events = await EventStream.open(server, sid)
        first = SseCapture()
        # drop the first connection mid-scenario, after the 12th session event (a tool call is running)
        read_task = asyncio.create_task(read_sse(client, url, first, stop_after_id=12))
        await asyncio.sleep(0.2)
        scenario = asyncio.create_task(run_scenario(client, sid, events))
        await asyncio.wait_for(read_task, WAIT_S)
        second = SseCapture()
        # an EventSource resumes with Last-Event-ID: replayed from the store, then live, with nothing missed
        assert await read_sse(client, url, second, headers={"Last-Event-ID": str(first.ids()[-1])}) == 200
        await asyncio.wait_for(scenario, WAIT_S)
        # after the end, `since` does the same from the store alone
        third = SseCapture()
        assert await read_sse(client, f"{url}?since=30", third) == 200
        await events.close()

    every = carried(events.frames)
    assert first.ids() == [s for s in every if s <= first.ids()[-1]] and first.ids()[-1] >= 12
    assert first.ids() + second.ids() == every
    assert third.ids() == [s for s in every if s > 30]
    # each resumed stream is a valid AG-UI stream of its own (a result whose call started before it is CUSTOM)
    assert_valid_agui(second.events(), max_warnings=0)
    assert_valid_agui(third.events(), max_warnings=0)


async def test_websocket_format_ag_ui_is_valid_and_names_the_seq_to_resume_from(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        sid = await new_session(client)
        events = await EventStream.open(server, sid)
        ws = await websockets.connect(f"{server.ws_url}/v1/sessions/{sid}/events?format=ag-ui")
        frames: list[dict[str, Any]] = []

        async def read() -> None:
            async for raw in ws:
                frames.append(json.loads(raw))

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.2)
        await run_scenario(client, sid, events)
        await asyncio.wait_for(reader, WAIT_S)
        assert ws.close_code == 1000
        await events.close()
        bad = await websockets.connect(f"{server.ws_url}/v1/sessions/{sid}/events?format=ag-ui&types=tool.*")
        with pytest.raises(websockets.ConnectionClosed):
            await bad.recv()
        assert bad.close_code == 4400

    assert_valid_agui(frames, max_warnings=0)
    seqs = [f["rawEvent"]["seq"] for f in frames if "rawEvent" in f]
    assert seqs == carried(events.frames)


async def test_sse_refusals_are_problems(server: Server):
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        r = await client.get("/v1/sessions/nope/ag-ui")
        assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
        sid = await new_session(client)
        r = await client.get(f"/v1/sessions/{sid}/ag-ui", headers={"Last-Event-ID": "x"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_last_event_id"
        r = await client.get(f"/v1/sessions/{sid}/ag-ui?since=-1")
        assert r.status_code == 422


async def test_a_slow_sse_reader_is_dropped_and_resumes_without_loss(tmp_path):
    # A small per-subscriber buffer and big interim transcripts: a reader that stops reading blocks the server's
    # sends while the session keeps producing events. Its stream ends (with a comment) instead of holding them all.
    srv = Server(tmp_path, SWITCHBOARD_WS_BUFFER="10", SWITCHBOARD_MAX_TEXT_CHARS="60000").start()
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
            sid = await new_session(client)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server blocks sooner
            sock.connect(("127.0.0.1", srv.port))
            sock.sendall(f"GET /v1/sessions/{sid}/ag-ui HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode())
            sock.setblocking(False)  # and nothing is read from it for now
            await flood_until_dropped(client, sid)
            raw = await asyncio.wait_for(read_all(sock), WAIT_S)  # it reads again: what was sent, then the end
            ids = [int(m) for m in re.findall(rb"^id: (\d+)$", raw, re.MULTILINE)]
            assert ids and ids == list(range(ids[0], ids[0] + len(ids))) and ids[0] <= 2  # gap-free, from the start
            assert raw.endswith(b"0\r\n\r\n"), raw[-200:]  # the response ended (chunked)
            rest = SseCapture()
            await client.post(f"/v1/sessions/{sid}/input", json={"text": "book table 7"})
            await asyncio.sleep(0.5)
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
            url = f"/v1/sessions/{sid}/ag-ui"
            assert await read_sse(client, url, rest, headers={"Last-Event-ID": str(ids[-1])}) == 200
            log = await EventStream.open(srv, sid, since=0)
            await log.wait_for("session.closed")
            await log.close()
            # nothing lost, nothing twice
            assert ids + rest.ids() == [seq for seq in carried(log.frames) if seq >= ids[0]]
            assert metric((await client.get("/metrics")).text, "switchboard_ws_slow_consumers_dropped_total") == 1
    finally:
        srv.stop()


async def read_all(sock: socket.socket) -> bytes:
    chunks = []
    with sock:
        while chunk := await asyncio.get_running_loop().sock_recv(sock, 2**16):
            chunks.append(chunk)
    return b"".join(chunks)
