"""A failure that nobody waits for any more (its caller was cut off, a close stopped the loop that would have looked,
the call ended without the tool's body) is still retrieved and logged: asyncio never reports a lost task."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import message
from switchboard.runtime.memory import MemoryStore
from switchboard.runtime.ports import Commit
from switchboard.runtime.reply import ReplyJob
from switchboard.runtime.scheduler import SpeechScheduler
from switchboard.runtime.speech import SpeechHandle
from tests.lost_tasks import lost_tasks
from tests.waiting import WAIT_S

from .harness import Harness


class Plain(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")


class Refusing(MemoryStore):
    """Rejects for good every write ``refuse`` picks, once ``gate`` is open."""

    def __init__(self, refuse: Callable[[Commit], bool]) -> None:
        super().__init__()
        self.refuse = refuse
        self.gate = asyncio.Event()
        self.gate.set()

    async def write(self, session_id: str, commit: Commit) -> None:
        if self.refuse(commit):
            await self.gate.wait()
            raise ValueError("rejected by the store")
        await super().write(session_id, commit)


def refused_by(h: Harness, refuse: Callable[[Commit], bool]) -> Refusing:
    store = Refusing(refuse)
    h.store = store
    h.session.writes.store = store
    return store


def errors(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and text in r.getMessage()]


async def test_a_state_write_the_store_rejects_with_nobody_waiting_is_logged_not_lost(caplog):
    # the model's position is written in the background as a reply starts: nothing awaits that write
    async with Harness(Plain(), [{"text": "hello there"}]) as h:
        refused_by(h, lambda commit: commit.session is not None and commit.session.state == "active")
        await h.session.input("hi")
        await h.wait_for("speech.done")
        await h.session.writes.settled()
    assert errors(caplog, "commit failed for good")
    assert lost_tasks() == []


async def test_a_rejected_write_whose_caller_was_cut_off_is_logged_not_lost(caplog):
    async with Harness(Plain()) as h:
        store = refused_by(h, lambda commit: bool(commit.items))
        store.gate.clear()
        caller = asyncio.create_task(h.session.commit(Commit(items=[message("user", "hi")])))
        await asyncio.sleep(0.01)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        store.gate.set()  # the write, in a task of its own, fails now: its caller is gone
        await asyncio.sleep(0.01)
    assert errors(caplog, "commit failed for good")
    assert lost_tasks() == []


async def test_a_speech_that_failed_is_reported_when_a_close_stops_the_loop_while_it_ends(caplog):
    ending = asyncio.Event()

    async def play(job: ReplyJob) -> None:
        raise RuntimeError("the reply broke")

    async def finish(speech: SpeechHandle) -> None:
        ending.set()
        await asyncio.Event().wait()  # the end is still being written (again) when the close comes

    scheduler = SpeechScheduler("s1", play=play, finish=finish, after_speech=lambda: None)
    scheduler.start()
    scheduler.push(ReplyJob(speech=SpeechHandle(source="say"), kind="say"))
    await asyncio.wait_for(ending.wait(), WAIT_S)
    await scheduler.stop()
    assert errors(caplog, "failed")[0].exc_info[1].args == ("the reply broke",)
    assert lost_tasks() == []


class Stubborn(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.release = asyncio.Event()

    @function_tool
    async def cleanup_fails(self, ctx: RunContext) -> str:
        """Raises while it is being stopped."""
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None
        return "never"

    @function_tool
    async def deaf_then_fails(self, ctx: RunContext) -> str:
        """Ignores every request to stop until released, then fails."""
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue
        raise RuntimeError("failed after all")


async def test_a_tool_that_raises_as_a_close_stops_it_is_logged_not_lost(caplog):
    turns = [{"text": "", "tool_calls": [{"name": "cleanup_fails", "id": "c1"}]}]
    async with Harness(Stubborn(), turns, close_timeout_s=0.1) as h:
        await h.session.input("go")
        await h.wait_for("tool.started")
    assert h.store.tool_calls[h.sid]["c1"].status == "interrupted"
    assert [r for r in caplog.records if "cleanup failed" in r.getMessage()]
    assert lost_tasks() == []


async def test_an_abandoned_tool_that_fails_later_is_logged_not_lost(caplog):
    agent = Stubborn()
    turns = [{"text": "", "tool_calls": [{"name": "deaf_then_fails", "id": "d1"}]}]
    async with Harness(agent, turns, close_timeout_s=0.1) as h:
        await h.session.input("go")
        await h.wait_for("tool.started")
    assert h.store.tool_calls[h.sid]["d1"].status == "interrupted"
    agent.release.set()
    await asyncio.sleep(0.01)
    assert [r for r in caplog.records if "failed after all" in r.getMessage()]
    assert lost_tasks() == []
