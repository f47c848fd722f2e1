"""A real crash: a child process running a session is SIGKILLed mid-tool; the session is then recovered.

What must hold afterwards: the completed call/output pair survived exactly once (I1), the call in flight ended
``interrupted`` with one is_error output (I5), the context is valid (I2), the event log continues gap-free from the
last durable ``seq`` (I6), and the next reply's model request sees the completed result while the scripted model
goes on with its next unused turn.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from switchboard.runtime.chat import ChatMessage, FunctionCall, FunctionCallOutput, validate
from switchboard.runtime.events import Event
from switchboard.runtime.llm.scripted import ScriptedLLM
from switchboard.runtime.recovery import RESTART_OUTPUT
from switchboard.runtime.speech import SpeechState
from switchboard.runtime.tools import ToolStatus
from tests.waiting import WAIT_S

from .conftest import Db, wait_for
from .crash_child import EVENTS_LOST, MARKER, build_host

CHILD = Path(__file__).with_name("crash_child.py")
SID = "crashed"
CHILD_TIMEOUT_S = 3 * WAIT_S  # a hang detector: a child starting on a loaded machine took over 30 s


async def run_child_until_marker(db: Db, marker: str = MARKER, *mode: str) -> None:
    """Start the child, wait for its marker (the long tool is running), then SIGKILL it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHILD),
        db.url,
        db.schema or "",
        SID,
        *mode,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    output: list[str] = []
    try:
        async with asyncio.timeout(CHILD_TIMEOUT_S):
            while marker not in output:
                line = await proc.stdout.readline()
                if not line:
                    raise AssertionError("the child exited before the long tool started:\n" + "\n".join(output))
                output.append(line.decode().strip())
    finally:
        if proc.returncode is None:
            proc.kill()  # SIGKILL: no cleanup, no flush; whatever was not committed is gone
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL


def count(items: list[object], kind: type, name: str) -> int:
    return sum(1 for it in items if isinstance(it, kind) and getattr(it, "name", None) == name)


async def test_sigkill_mid_tool_then_recover(db: Db) -> None:
    await run_child_until_marker(db)

    store = db.store()
    await store.migrate()
    await store.start()
    # what the crash left behind
    before_items = await store.chat_items(SID)
    before_events = await store.events(SID, limit=10_000)
    last_seq = await store.last_seq(SID)
    calls = {c.name: c for c in await store.tool_calls(SID)}
    assert {n: c.status for n, c in calls.items()} == {"book": ToolStatus.COMPLETED, "slow": ToolStatus.RUNNING}
    unfinished = [sp.id for sp in await store.speeches(SID) if sp.state != SpeechState.DONE]
    assert unfinished, "the reply waiting for the long tool was still in progress"
    assert [e.seq for e in before_events] == list(range(1, last_seq + 1))

    durable: list[Event] = []
    host = build_host(store, on_event=durable.append)
    await host.recover_all()
    try:
        assert host.recovered == [SID] and host.failed == []
        session = host.sessions[SID]

        items = await store.chat_items(SID)
        assert validate(items) == [], validate(items)
        assert all(it in items for it in before_items), "something committed before the crash was lost"
        # the completed pair, exactly once (I1)
        assert count(items, FunctionCall, "book") == 1
        assert [it.output for it in items if isinstance(it, FunctionCallOutput) and it.name == "book"] == [
            "booked room 12"
        ]
        # the call in flight ended interrupted, with one is_error output (I5)
        slow = calls["slow"]
        ended = await store.tool_call(SID, slow.call_id)
        assert ended is not None and ended.status == ToolStatus.INTERRUPTED and ended.is_error
        assert ended.output == RESTART_OUTPUT and "interrupted by a service restart" in RESTART_OUTPUT
        slow_outputs = [it for it in items if isinstance(it, FunctionCallOutput) and it.call_id == slow.call_id]
        assert [(o.output, o.is_error) for o in slow_outputs] == [(RESTART_OUTPUT, True)]
        assert count(items, FunctionCall, "slow") == 1

        # seq continues: no gap, no reuse. The first new events report what was durable without its event (the kill
        # can land between a commit and its events, as it does on a loaded machine), then session.recovered
        events = await store.events(SID, limit=10_000)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[: len(before_events)] == before_events
        new = events[len(before_events) :]
        at = next(i for i, e in enumerate(new) if e.type == "session.recovered")
        reported = new[:at]
        kinds = ("user.input", "chat.item", "tool.ended", "speech.created", "speech.done")
        assert all(e.type in kinds for e in reported), reported
        items_reported = [e.data["item"]["id"] for e in before_events + reported if e.type == "chat.item"]
        assert len(items_reported) == len(set(items_reported)), "an item reported twice"
        first = new[at]
        assert first.seq == last_seq + 1 + len(reported)
        assert first.data["interrupted_calls"] == [slow.call_id]
        # the reply that was waiting for the long tool is owed: played again, generated anew from the chat as it is
        assert first.data["interrupted_speeches"] == [] and first.data["resumed_speeches"] == unfinished

        # the model sees the completed result, and the script goes on with its third turn
        llm = session.llm
        assert isinstance(llm, ScriptedLLM)
        expected = "Before the crash you had booked room 12"
        await wait_for(
            lambda: any(
                e.type == "chat.item"
                and e.data["item"].get("role") == "assistant"
                and e.data["item"]["text"] == expected
                for e in durable
            )
        )
        request = llm.requests[-1]
        assert validate(request.items) == []
        seen = {(it.name, it.output) for it in request.items if isinstance(it, FunctionCallOutput)}
        assert seen == {("book", "booked room 12"), ("slow", RESTART_OUTPUT)}
        assert llm.position == 3
        items = await store.chat_items(SID)
        assert count(items, FunctionCall, "book") == 1, "the model was made to call the completed tool again"
        assert [it.text for it in items if isinstance(it, ChatMessage) and it.role == "assistant"][-1] == expected
        async with asyncio.timeout(WAIT_S):  # its end is written once it has played
            while any(sp.state != SpeechState.DONE for sp in await store.speeches(SID)):
                await asyncio.sleep(0.02)
        assert not any(sp.interrupted for sp in await store.speeches(SID))
    finally:
        await host.aclose()
    events = await store.events(SID, limit=10_000)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))


async def test_sigkill_between_a_commit_and_its_events_then_recovery_emits_them(db: Db) -> None:
    """The call's end and its output were committed, the process died before ``tool.ended`` and ``chat.item`` were
    written: recovery emits them, so nothing durable is left without its event (and the log stays gap-free)."""
    await run_child_until_marker(db, EVENTS_LOST, "lose-events")

    store = db.store()
    await store.migrate()
    await store.start()
    before = await store.events(SID, limit=10_000)
    (book,) = [c for c in await store.tool_calls(SID) if c.name == "book"]
    assert book.status == ToolStatus.COMPLETED
    assert not [e for e in before if e.type == "tool.ended"], "the crash came after the tool.ended was written"
    unreported = {it.id for it in await store.chat_items(SID)} - {
        e.data["item"]["id"] for e in before if e.type == "chat.item"
    }
    assert unreported, "the crash came after every chat.item was written"

    host = build_host(store)
    await host.recover_all()
    try:
        assert host.recovered == [SID]
    finally:
        await host.aclose()
    events = await store.events(SID, limit=10_000)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[: len(before)] == before
    items = await store.chat_items(SID)
    item_events = [e.data["item"]["id"] for e in events if e.type == "chat.item"]
    assert sorted(item_events) == sorted(it.id for it in items), "an item has no chat.item, or two"
    ended = [e.data for e in events if e.type == "tool.ended"]
    calls = await store.tool_calls(SID)
    assert sorted(d["call_id"] for d in ended) == sorted(c.call_id for c in calls if c.ended)
    (book_ended,) = [d for d in ended if d["call_id"] == book.call_id]
    assert (book_ended["status"], book_ended["output"]) == ("completed", "booked room 12")
    done = {e.data["speech_id"] for e in events if e.type == "speech.done"}
    assert {sp.id for sp in await store.speeches(SID) if sp.state == SpeechState.DONE} == done
    # the recovered events come before session.recovered: they report what happened before the crash
    recovered_at = next(i for i, e in enumerate(events) if e.type == "session.recovered")
    assert book.call_id in [d["call_id"] for d in (e.data for e in events[:recovered_at] if e.type == "tool.ended")]
