"""How a session writes when the store fails, and what a service shutdown (suspend) leaves behind."""

from __future__ import annotations

import asyncio

import pytest

from switchboard import Agent
from switchboard.runtime.chat import ChatMessage, message
from switchboard.runtime.memory import MemoryStore
from switchboard.runtime.ports import Commit
from tests.waiting import WAIT_S

from .harness import Harness

LONG = " ".join(f"word{i}" for i in range(60))


class Plain(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")


class BrokenOnce(MemoryStore):
    """Rejects one write for good (a constraint violation, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.reject_next = 0

    async def write(self, session_id: str, commit: Commit) -> None:
        if self.reject_next:
            self.reject_next -= 1
            raise ValueError("rejected by the store")
        await super().write(session_id, commit)


async def test_an_outage_is_ridden_out_by_the_store_and_writes_land_once_in_order():
    async with Harness(Plain()) as h:
        h.store.fail_next = 3
        first, second = message("user", "first"), message("user", "second")
        writes = [asyncio.create_task(h.session.commit(Commit(items=[it]))) for it in (first, second)]
        await asyncio.wait_for(asyncio.gather(*writes), WAIT_S)
        assert h.store.retries == 3
        written = [it.id for sid, c in h.store.commits if sid == h.sid for it in c.items]
        assert [i for i in written if i in (first.id, second.id)] == [first.id, second.id]


class Unreachable(MemoryStore):
    """Fails every write the way an unreachable database does, and counts the attempts."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0
        self.down = False

    async def write(self, session_id: str, commit: Commit) -> None:
        if self.down:
            self.attempts += 1
            raise ConnectionError("connection refused")
        await super().write(session_id, commit)


async def test_the_session_never_retries_a_failed_commit():
    # only the store knows whether a failed attempt landed: retrying is its job (the ChatStore port), not the caller's
    h = Harness(Plain())
    h.store = Unreachable()
    h.session.writes.store = h.store
    async with h:
        h.store.down = True
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(h.session.commit(Commit(items=[message("user", "lost")])), WAIT_S)
        assert h.store.attempts == 1
        h.store.down = False


async def test_a_permanent_store_error_is_raised_and_does_not_hold_up_later_writes(caplog: pytest.LogCaptureFixture):
    h = Harness(Plain())
    h.store = BrokenOnce()
    h.session.writes.store = h.store
    async with h:
        h.store.reject_next = 1
        with pytest.raises(ValueError, match="rejected"):
            await asyncio.wait_for(h.session.commit(Commit(items=[message("user", "refused")])), WAIT_S)
        later = message("user", "accepted")
        await asyncio.wait_for(h.session.commit(Commit(items=[later])), WAIT_S)
        assert [it.text for it in h.chat() if isinstance(it, ChatMessage)] == ["accepted"]
    assert "commit failed for good" in caplog.text


async def test_suspend_commits_what_was_heard_and_leaves_the_session_live():
    async with Harness(Plain(), [{"text": LONG}]) as h:
        res = await h.session.input("talk")
        await h.wait_for("speech.started")
        await asyncio.sleep(0.06)
        await h.session.suspend()
        heard = [it for it in h.chat() if isinstance(it, ChatMessage) and it.role == "assistant"]
        assert len(heard) == 1 and heard[0].interrupted  # the message was cut short
        assert heard[0].text and LONG.startswith(heard[0].text) and heard[0].text != LONG
        # a move is not an interruption: the speech is owed (not done, not interrupted) for the next owner to play
        stored = h.store.speeches[h.sid][res.speech_id]
        assert stored.state != "done" and not stored.interrupted and stored.played_text == heard[0].text
        assert not h.of_type("speech.interrupted") and not h.of_type("speech.done")
        assert "session.closed" not in h.types()  # a shutdown is not a close: the session is recovered later
        assert h.store.sessions[h.sid].state == "active"
        h.session.state = "closed"  # already stopped; nothing left for the harness to close


class Gated(MemoryStore):
    """Records when each commit reaches the store, and holds the writes that carry a chosen text until released."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[str] = []  # texts, in the order the commits reached the store
        self.hold = ""
        self.release = asyncio.Event()
        self.refuse = ""

    async def commit(self, session_id: str, commit: Commit) -> None:
        self.received += [it.text for it in commit.items if isinstance(it, ChatMessage)]
        await super().commit(session_id, commit)

    async def write(self, session_id: str, commit: Commit) -> None:
        texts = [it.text for it in commit.items if isinstance(it, ChatMessage)]
        if self.hold in texts:
            await self.release.wait()
        if self.refuse in texts:
            raise ValueError("rejected by the store")
        await super().write(session_id, commit)


def two_writes(h: Harness, first: str, second: str) -> tuple[list[str], asyncio.Task[None], asyncio.Task[None]]:
    """Two overlapping commits of one message each; the list records the order their effects are applied in."""
    applied: list[str] = []

    def write(text: str) -> asyncio.Task[None]:
        return asyncio.create_task(
            h.session.commit(Commit(items=[message("user", text)]), then=lambda: applied.append(text))
        )

    return applied, write(first), write(second)


def stored(h: Harness) -> list[str]:
    return [it.text for it in h.store.chat(h.sid) if isinstance(it, ChatMessage)]


async def test_overlapping_commits_reach_the_store_at_once_and_are_applied_in_order():
    # a session pipelines its writes: the second reaches the store while the first is not durable yet (they can share
    # a group commit), and the live session applies them in the order they were made
    h = Harness(Plain())
    h.store = h.session.writes.store = store = Gated()
    async with h:
        store.hold = "first"
        applied, first, second = two_writes(h, "first", "second")
        for _ in range(5):
            await asyncio.sleep(0)
        assert store.received == ["first", "second"]
        assert applied == [] and not first.done() and not second.done()
        store.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
        assert applied == ["first", "second"]
        assert stored(h) == ["first", "second"]


async def test_a_refused_commit_does_not_hold_up_or_reorder_the_next_one(caplog: pytest.LogCaptureFixture):
    h = Harness(Plain())
    h.store = h.session.writes.store = store = Gated()
    async with h:
        store.hold, store.refuse = "refused", "refused"
        applied, refused, later = two_writes(h, "refused", "later")
        await asyncio.sleep(0.01)
        store.release.set()
        with pytest.raises(ValueError, match="rejected"):
            await asyncio.wait_for(refused, WAIT_S)
        await asyncio.wait_for(later, WAIT_S)
        assert applied == ["later"]
        assert stored(h) == ["later"]
    assert "commit failed for good" in caplog.text


async def test_a_caller_cancelled_while_an_earlier_write_is_pending_still_has_its_write_applied():
    h = Harness(Plain())
    h.store = h.session.writes.store = store = Gated()
    async with h:
        store.hold = "first"
        applied, first, second = two_writes(h, "first", "second")
        await asyncio.sleep(0.01)
        second.cancel()  # the caller gives up (a deadline); its write and its effect are one unit all the same
        with pytest.raises(asyncio.CancelledError):
            await second
        store.release.set()
        await asyncio.wait_for(first, WAIT_S)
        for _ in range(20):
            if len(applied) == 2:
                break
            await asyncio.sleep(0.01)
        assert applied == ["first", "second"]
        assert stored(h) == ["first", "second"]


class SlowStart(MemoryStore):
    """Holds the write of the session's state (what ``start`` commits first) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def write(self, session_id: str, commit: Commit) -> None:
        if commit.session is not None and not self.release.is_set():
            await self.release.wait()
        await super().write(session_id, commit)


@pytest.mark.parametrize("stop", ["suspend", "aclose"])
async def test_a_session_stopped_while_its_start_is_written_does_not_start_playing(stop: str):
    # a recovered session fenced (another node took it over) while its start was being written: the suspend (or a
    # close) ran before the scheduler existed; the start must not then start it on a session that is over here, or a
    # ghost of the session keeps running (its speeches, its model calls, its tools) with nothing left to stop it
    h = Harness(Plain(), [{"text": "hello there"}])
    h.store = h.session.writes.store = store = SlowStart()
    starting = asyncio.create_task(h.session.start())
    await asyncio.sleep(0.01)
    stopping = asyncio.create_task(h.session.suspend(tool_grace=False) if stop == "suspend" else h.session.aclose())
    await asyncio.sleep(0.01)
    store.release.set()
    await asyncio.wait_for(asyncio.gather(starting, stopping, return_exceptions=True), WAIT_S)
    task = h.session.speeches.scheduler._task
    assert task is None or task.done()
    assert h.session.state != "active"
