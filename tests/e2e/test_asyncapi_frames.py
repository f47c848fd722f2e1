"""Every frame a real server sends on both event streams, through a full scenario (tools with progress, a say, an
interrupt, a model failure, a restart with a tool running, an interim transcript, a handoff, a close, a session that
fails recovery), matches the committed AsyncAPI document, checked with a JSON Schema validator."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from switchboard.runtime.event_types import EVENT_TYPES
from tests.waiting import WAIT_S

from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SPEC = Path(__file__).resolve().parents[2] / "openapi" / "asyncapi.json"
DOC_URI = "urn:switchboard:asyncapi"
LONG = " ".join(f"w{i}" for i in range(200))
TURNS = [
    # "go": a background tool with progress and a quick one, then the tool reply, then the deferred reply
    {
        "text": "On it.",
        "tool_calls": [
            {"name": "progress", "arguments": {"steps": 3, "step_s": 0.05}},
            {"name": "book", "arguments": {"what": "table 7"}},
        ],
    },
    {"text": "Booked; the rest runs in the background."},
    {"text": "All done: {{tool_output:progress}}"},
    {"text": LONG},  # "talk": interrupted
    {"error": "model overloaded"},  # "fail": generation.failed
    # "search": a cancellable tool still running when the server is killed
    {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "flights", "seconds": 60}}]},
    {"text": "It runs in the background."},
    # "transfer me", after the restart, first as an interim transcript (a speculative generation)
    {"text": "Transferring you.", "tool_calls": [{"name": "transfer", "arguments": {}}]},
]


class FrameChecker:
    """Validates frames against the messages of one channel of the AsyncAPI document, found by their ``type``."""

    def __init__(self, spec: dict[str, Any]) -> None:
        registry = Registry().with_resource(DOC_URI, Resource.from_contents(spec, default_specification=DRAFT7))
        self.validators: dict[str, dict[str, Draft7Validator]] = {}
        self.failures: list[tuple[str, dict[str, Any], str]] = []
        for channel_id, channel in spec["channels"].items():
            table = self.validators[channel_id] = {}
            for ref in channel["messages"].values():
                pointer = ref["$ref"]  # #/components/messages/<Name>
                name = spec["components"]["messages"][pointer.rsplit("/", 1)[1]]["name"]
                table[name] = Draft7Validator({"$ref": f"{DOC_URI}{pointer}/payload"}, registry=registry)

    def errors(self, channel_id: str, frame: Any) -> list[str]:
        validator = self.validators[channel_id].get(frame.get("type") if isinstance(frame, dict) else None)
        if validator is None:
            return [f"no message of type {frame.get('type')!r} on {channel_id}"]
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(frame)]

    def check(self, channel_id: str, frame: dict[str, Any]) -> None:
        for error in self.errors(channel_id, frame):
            self.failures.append((channel_id, frame, error))


class Stream:
    """One WebSocket connection to an event stream, keeping every frame it receives (raw JSON, unchanged)."""

    def __init__(self, ws: Any, channel_id: str) -> None:
        self.ws = ws
        self.channel_id = channel_id
        self.frames: list[dict[str, Any]] = []
        self.close_code: int | None = None
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, server: Server, path: str, channel_id: str) -> Stream:
        return cls(await websockets.connect(server.ws_url + path), channel_id)

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                self.frames.append(json.loads(raw))
        except websockets.ConnectionClosed:
            pass
        finally:
            self.close_code = self.ws.close_code

    def events(self) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] != "pong"]

    async def wait_for(
        self, type: str, pred: Callable[[dict[str, Any]], bool] = lambda d: True, timeout: float = WAIT_S
    ) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                for f in self.frames:
                    if f["type"] == type and pred(f.get("data", {})):
                        return f
                if self._task.done():
                    raise AssertionError(f"stream closed ({self.close_code}) before {type}: {self.types()}")
                await asyncio.sleep(0.005)

    def types(self) -> list[str]:
        return [f["type"] for f in self.frames]

    async def ping(self) -> None:
        await self.ws.send(json.dumps({"type": "ping"}))
        await self.wait_for("pong")

    async def ended(self, timeout: float = WAIT_S) -> int | None:
        async with asyncio.timeout(timeout):
            await self._task
        return self.close_code

    async def close(self) -> None:
        await self.ws.close()
        await self._task


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = await client.post(path, json=body or {})
    assert r.status_code in (200, 201, 202), r.text
    return dict(r.json())


async def _before_restart(server: Server, streams: list[Stream]) -> tuple[str, str]:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        llm = {"provider": "scripted", "turns": TURNS, "fallback": {"text": "OK."}}
        sid = (await _post(client, "/v1/sessions", {"agent": "tester", "llm": llm, "preemptive_generation": True}))[
            "id"
        ]
        retired = (await _post(client, "/v1/sessions", {"agent": "retired"}))["id"]
        session = await Stream.open(server, f"/v1/sessions/{sid}/events?since=0", "sessionEvents")
        everything = await Stream.open(server, "/v1/events?cursor=0", "allEvents")
        streams += [session, everything]
        await session.ping()
        await everything.ping()

        await _post(client, f"/v1/sessions/{sid}/input", {"text": "go"})
        await session.wait_for("tool.ended", lambda d: d["name"] == "progress")
        deferred = await session.wait_for("speech.created", lambda d: d["source"] == "deferred_reply")
        await session.wait_for("speech.done", lambda d: d["speech_id"] == deferred["data"]["speech_id"])

        said = await _post(client, f"/v1/sessions/{sid}/say", {"text": "One moment please."})
        await session.wait_for("speech.done", lambda d: d["speech_id"] == said["speech_id"])

        talk = await _post(client, f"/v1/sessions/{sid}/input", {"text": "talk"})
        await session.wait_for("speech.started", lambda d: d["speech_id"] == talk["speech_id"])
        assert (await _post(client, f"/v1/sessions/{sid}/interrupt"))["interrupted"] is True
        await session.wait_for("speech.done", lambda d: d["speech_id"] == talk["speech_id"] and d["interrupted"])

        await _post(client, f"/v1/sessions/{sid}/input", {"text": "fail"})
        await session.wait_for("generation.failed")

        search = await _post(client, f"/v1/sessions/{sid}/input", {"text": "search"})
        await session.wait_for("tool.progress", lambda d: d["message"] == "searching flights")
        await session.wait_for("speech.done", lambda d: d["speech_id"] == search["speech_id"])
        await everything.wait_for("speech.done", lambda d: d["speech_id"] == search["speech_id"])

        await _operators(server, client, streams, everything)

        # a tool that ignores its cancellation: listed `cancelling` until it settles (never, here: the crash ends it)
        deaf = {"provider": "scripted", "turns": [{"text": "Working.", "tool_calls": [{"name": "deaf"}]}]}
        stub = (await _post(client, "/v1/sessions", {"agent": "stubborn", "llm": deaf}))["id"]
        stubborn = await Stream.open(server, f"/v1/sessions/{stub}/events?since=0", "sessionEvents")
        streams.append(stubborn)
        await _post(client, f"/v1/sessions/{stub}/input", {"text": "work"})
        started = await stubborn.wait_for("tool.started")
        await _post(client, f"/v1/sessions/{stub}/tool-calls/{started['data']['call_id']}/cancel")
        await stubborn.wait_for("tool.cancelling")
        await everything.wait_for("tool.cancelling")
    return sid, retired


async def _operators(server: Server, client: httpx.AsyncClient, streams: list[Stream], everything: Stream) -> None:
    """An operator's commands on a session of their own: a coaching note cancelled and one used, an input scheduled
    for when the agent is idle, a takeover with the operator's words and the hand-back."""
    sid = (await _post(client, "/v1/sessions", {"agent": "tester", "llm": {"provider": "scripted", "turns": []}}))["id"]
    ops = await Stream.open(server, f"/v1/sessions/{sid}/events?since=0", "sessionEvents")
    streams.append(ops)
    note = await _post(client, f"/v1/sessions/{sid}/coach", {"note": "Be brief."})
    await ops.wait_for("session.coached", lambda d: d["id"] == note["id"])
    r = await client.delete(f"/v1/sessions/{sid}/scheduled/{note['id']}")
    assert r.status_code == 200, r.text
    await ops.wait_for("scheduled.cancelled", lambda d: d["id"] == note["id"])
    await _post(client, f"/v1/sessions/{sid}/coach", {"note": "Say hello."})
    later = await _post(client, f"/v1/sessions/{sid}/input", {"text": "later", "when": {"at": "idle"}})
    scheduled_id = later["scheduled"]["id"]
    await ops.wait_for("scheduled.created", lambda d: d["id"] == scheduled_id)
    applied = await ops.wait_for("scheduled.applied", lambda d: d["id"] == scheduled_id)
    await ops.wait_for("speech.done", lambda d: d["speech_id"] == applied["data"]["speech_id"])

    await _post(client, f"/v1/sessions/{sid}/takeover", {})
    await ops.wait_for("session.taken_over")
    await _post(client, f"/v1/sessions/{sid}/takeover/say", {"text": "Hi, an operator here."})
    await ops.wait_for("operator.spoke")
    r = await client.delete(f"/v1/sessions/{sid}/takeover")
    assert r.status_code == 200, r.text
    await ops.wait_for("session.handed_back")
    await everything.wait_for("session.handed_back")


async def _after_restart(server: Server, sid: str, retired: str, since: int, cursor: int, streams: list[Stream]):
    session = await Stream.open(server, f"/v1/sessions/{sid}/events?since={since}", "sessionEvents")
    everything = await Stream.open(server, f"/v1/events?cursor={cursor}", "allEvents")
    failed = await Stream.open(server, f"/v1/sessions/{retired}/events?since=0", "sessionEvents")
    streams += [session, everything, failed]
    await failed.wait_for("session.failed")
    assert await failed.ended() == 1000  # nothing follows a terminal event

    recovered = await session.wait_for("session.recovered")
    assert len(recovered["data"]["interrupted_calls"]) == 1
    await session.wait_for("tool.ended", lambda d: d["name"] == "search" and d["status"] == "interrupted")
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        await _post(client, f"/v1/sessions/{sid}/input", {"text": "transfer me", "final": False})
        await session.wait_for("generation.speculative", lambda d: d["state"] == "started")
        await _post(client, f"/v1/sessions/{sid}/input", {"text": "transfer me"})
        await session.wait_for("agent.handoff", lambda d: d["to_agent"] == "other")
        await session.wait_for("tool.ended", lambda d: d["name"] == "transfer")
        r = await client.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 204, r.text
    assert await session.ended() == 1000
    await everything.wait_for("session.closed", lambda d: True)
    await everything.ping()
    await everything.close()


async def test_every_frame_of_a_full_scenario_matches_the_asyncapi_document(tmp_path: Path):
    spec = json.loads(SPEC.read_text())
    checker = FrameChecker(spec)
    streams: list[Stream] = []
    agents = "tests.agents_fixture:AGENTS,tests.agents_fixture:RETIRED_AGENTS,tests.agents_fixture:STUBBORN_AGENTS"
    first = Server(tmp_path, SWITCHBOARD_AGENTS=agents)
    first.start()
    try:
        sid, retired = await _before_restart(first, streams)
    finally:
        first.kill()  # a crash, with a tool running: recovery ends it
    for stream in streams:
        await stream.ended()
    before = len(streams)  # after the restart: the session's, all sessions', the retired session's
    since = max(f["seq"] for f in streams[0].events())
    cursor = max(f["cursor"] for f in streams[1].events())

    second = Server(tmp_path, database_url=first.database_url).start()  # the retired agent is not registered
    try:
        await _after_restart(second, sid, retired, since, cursor, streams)
    finally:
        second.stop()

    for stream in streams:
        for frame in stream.frames:
            checker.check(stream.channel_id, frame)
    for channel_id in ("sessionEvents", "allEvents"):
        checker.check(channel_id, {"type": "ping"})  # what the client sent
    assert checker.failures == [], f"{len(checker.failures)} frame(s) do not match the document: {checker.failures}"

    session_types = {f["type"] for s in streams if s.channel_id == "sessionEvents" for f in s.frames}
    all_types = {f["type"] for s in streams if s.channel_id == "allEvents" for f in s.frames}
    assert session_types == all_types == {*EVENT_TYPES, "pong"}, (set(EVENT_TYPES) - session_types, all_types)
    assert sum(len(s.frames) for s in streams) > 100
    # the main session's log, across the restart, is gap-free; the multi-session cursor only moves forward
    # (streams: before the restart the session's, all sessions', the operators' and the stubborn session's; after it
    # the first two again)
    seqs = [f["seq"] for s in (streams[0], streams[before]) for f in s.events()]
    assert seqs == list(range(1, len(seqs) + 1))
    cursors = [f["cursor"] for s in (streams[1], streams[before + 1]) for f in s.events()]
    assert cursors == sorted(set(cursors))

    # the checker really checks: real frames, each broken one way, are all rejected
    progress = next(f for f in streams[0].frames if f["type"] == "tool.progress")
    broken = [copy.deepcopy(progress) for _ in range(5)]
    broken[0]["data"]["percent"] = 50
    broken[1]["data"]["progress"] = "half"
    del broken[2]["data"]["message"]
    broken[3]["type"] = "tool.whispered"
    broken[4]["cursor"] = 7  # a cursor belongs to the multi-session stream only
    assert all(checker.errors("sessionEvents", frame) for frame in broken)
    item = next(f for f in streams[1].frames if f["type"] == "chat.item")
    item = copy.deepcopy(item)
    item["data"]["item"]["type"] = "note"
    assert checker.errors("allEvents", item)
