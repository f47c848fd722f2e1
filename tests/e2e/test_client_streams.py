"""The Python client's event streams against a real server: every event once and in order across a server restart
and a forced slow-consumer close (4008), for one session (by seq) and for many (by cursor)."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from switchboard.client import AsyncClient, AsyncEventStream, Event, Resume
from tests.waiting import WAIT_S

from .server import Server

pytestmark = pytest.mark.e2e


def scripted(*turns: dict[str, Any]) -> dict[str, Any]:
    return {"provider": "scripted", "turns": list(turns)}


def progress_turn(steps: int, step_s: float) -> dict[str, Any]:
    return {"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": steps, "step_s": step_s}}]}


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


class Reader:
    """Reads a stream in a task into ``events``; ``gate`` cleared makes it stop reading (a slow consumer)."""

    def __init__(self, stream: AsyncEventStream, until: Callable[[list[Event]], bool] = lambda _: False) -> None:
        self.stream = stream
        self.events: list[Event] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self._until = until
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async with self.stream:
            async for event in self.stream:
                self.events.append(event)
                if self._until(self.events):
                    return
                await self.gate.wait()

    async def seen(self, predicate: Callable[[Event], bool], timeout: float = WAIT_S) -> Event:
        async with asyncio.timeout(timeout):
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                if self.task.done():
                    self.task.result()
                    raise AssertionError(f"the stream ended first: {[e.type for e in self.events]}")
                await asyncio.sleep(0.01)

    async def finished(self, timeout: float = WAIT_S) -> list[Event]:
        async with asyncio.timeout(timeout):
            await self.task
        return self.events


def step(n: int, of: int) -> Callable[[Event], bool]:
    return lambda e: e.type == "tool.progress" and e.data["message"] == f"step {n}/{of}"


async def test_a_session_stream_resumes_across_a_server_restart(tmp_path: Path):
    server = Server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        async with AsyncClient(server.url) as sb:
            sid = (await sb.create_session("tester", llm=scripted(progress_turn(200, 0.02)))).id
            resumes: list[Resume] = []
            reader = Reader(sb.events(sid, on_resume=resumes.append))
            await sb.input(sid, "count")
            await reader.seen(step(10, 200))
            before_kill = reader.events[-1].seq if reader.events else 0
            await asyncio.to_thread(server.kill)  # a crash: the tool is cut off, the stream drops
            await asyncio.to_thread(server.start)
            await reader.seen(lambda e: e.type == "session.recovered")
            await reader.seen(lambda e: e.type == "tool.ended" and e.data["status"] == "interrupted")
            await sb.say(sid, "Back again.")
            await reader.seen(lambda e: e.type == "speech.done")
            await sb.close_session(sid)
            got = await reader.finished()
            reference = [e async for e in sb.events(sid)]
        assert [e.seq for e in got] == list(range(1, len(got) + 1))
        assert got == reference
        assert got[-1].type == "session.closed"
        # the hook heard of every reconnect, each from the last seq yielded
        assert resumes and all(r.reason == "connection_lost" for r in resumes)
        assert resumes[0].position >= before_kill and resumes[0].code == 1006
    finally:
        await asyncio.to_thread(server.stop)


async def test_a_slow_consumer_is_closed_with_4008_and_the_stream_goes_on_without_loss(tmp_path: Path):
    server = Server(
        tmp_path,
        SWITCHBOARD_WS_BUFFER="10",
        SWITCHBOARD_MAX_TEXT_CHARS="400000",
        SWITCHBOARD_MAX_BODY_BYTES="600000",
    )
    await asyncio.to_thread(server.start)
    try:
        async with AsyncClient(server.url) as sb:
            sid = (await sb.create_session("tester", llm=scripted(progress_turn(40, 0.02), {"text": "Done."}))).id
            resumes: list[Resume] = []
            reader = Reader(sb.events(sid, on_resume=resumes.append))
            await reader.seen(lambda e: e.type == "session.started")
            reader.gate.clear()  # stop reading: the socket buffers and then the server's buffer fill up
            await sb.input(sid, "count")
            interim = 0
            dropped = "switchboard_ws_slow_consumers_dropped_total"
            async with asyncio.timeout(60):
                while not metric(await sb.metrics(), dropped):
                    assert interim < 200, "the slow consumer was never dropped"
                    await sb.input(sid, secrets.token_urlsafe(300_000), final=False)  # ~400 KB that does not compress
                    interim += 1
            reader.gate.set()  # read again: the rest of that connection, then a resume from where it stopped
            await reader.seen(lambda e: e.type == "tool.ended", timeout=30)
            await sb.close_session(sid)
            got = await reader.finished()
            reference = [e async for e in sb.events(sid)]
            assert metric(await sb.metrics(), dropped) == 1
        assert [e.seq for e in got] == list(range(1, len(got) + 1))
        assert got == reference
        assert len([e for e in got if e.type == "user.input" and not e.data["final"]]) == interim
        assert [e.data["message"] for e in got if e.type == "tool.progress"] == [f"step {i}/40" for i in range(1, 41)]
        assert [(r.reason, r.code, r.delay_s) for r in resumes] == [("too_slow", 4008, 0.0)]
        assert "resume with since=" in resumes[0].detail
    finally:
        await asyncio.to_thread(server.stop)


async def test_the_multi_session_stream_resumes_by_cursor_across_a_restart(tmp_path: Path):
    server = Server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        async with AsyncClient(server.url) as sb:
            a = (await sb.create_session("tester", llm=scripted(progress_turn(100, 0.02)))).id
            b = (await sb.create_session("tester", llm=scripted(progress_turn(100, 0.02)))).id
            await sb.create_session("tester")  # not watched

            def both_closed(events: list[Event]) -> bool:
                return {e.session_id for e in events if e.type == "session.closed"} == {a, b}

            reader = Reader(sb.all_events(session_ids=[a, b]), until=both_closed)
            await sb.input(a, "count")
            await sb.input(b, "count")
            await reader.seen(lambda e: e.session_id == b and step(5, 100)(e))
            await asyncio.to_thread(server.kill)
            await asyncio.to_thread(server.start)
            for sid in (a, b):
                await reader.seen(lambda e, sid=sid: e.session_id == sid and e.type == "session.recovered")
                await sb.close_session(sid)
            got = await reader.finished()
            reference: list[Event] = []
            async with sb.all_events(cursor=0, session_ids=[a, b]) as replay:
                async for event in replay:
                    reference.append(event)
                    if both_closed(reference):
                        break
        cursors = [e.cursor for e in got]
        assert all(isinstance(c, int) for c in cursors) and cursors == sorted(set(cursors))  # type: ignore[type-var]
        assert got == reference
        for sid in (a, b):
            seqs = [e.seq for e in got if e.session_id == sid]
            assert seqs == list(range(1, len(seqs) + 1))
    finally:
        await asyncio.to_thread(server.stop)
