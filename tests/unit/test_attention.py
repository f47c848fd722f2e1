"""The attention tracker on a real session (in-memory ports): a store that refuses writes makes the session need an
operator until something of it is written again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from switchboard.control.attention import AttentionCode, AttentionTracker
from switchboard.runtime.events import Event
from switchboard.runtime.speech import SpeechState
from tests.waiting import WAIT_S

from .harness import Harness
from .test_session_failure_paths import harness


def watched(h: Harness) -> AttentionTracker:
    """A tracker given each event as it is published (durable: the memory log is), as the host does."""
    tracker = AttentionTracker()
    publish = h.events.publish

    def observe(event: Event) -> Awaitable[None]:
        tracker.observe(event, h.session)
        return publish(event)

    h.events.publish = observe  # type: ignore[method-assign]
    return tracker


async def test_a_refused_write_needs_attention_until_the_session_writes_again() -> None:
    async with harness() as h:
        tracker = watched(h)
        first = await h.session.say("one two three")
        await asyncio.wait_for(first.wait_done(), WAIT_S)
        await h.idle()
        assert tracker.reasons(h.sid, h.session) == []
        h.store.reject_speech_end = 1
        refused = await h.session.say("four five")
        await asyncio.wait_for(refused.wait_done(), WAIT_S)
        await h.idle()
        [reason] = tracker.reasons(h.sid, h.session)
        assert reason.code == AttentionCode.STORE_FAILING and "1 write(s) failed" in reason.message
        again = await h.session.say("six seven")
        await asyncio.wait_for(again.wait_done(), WAIT_S)
        await h.idle()
        assert tracker.reasons(h.sid, h.session) == []
        assert again.state == SpeechState.DONE


async def test_an_unreachable_database_with_writes_waiting_needs_attention() -> None:
    async with harness() as h:
        tracker = watched(h)
        h.store.hold_items = True
        speech = await h.session.say("held words")
        await asyncio.wait_for(h.store.holding.wait(), WAIT_S)
        assert tracker.reasons(h.sid, h.session, store_unavailable=False) == []
        [reason] = tracker.reasons(h.sid, h.session, store_unavailable=True)
        assert reason.code == AttentionCode.STORE_FAILING and "unreachable" in reason.message
        h.store.release.set()
        await asyncio.wait_for(speech.wait_done(), WAIT_S)
        await h.idle()
        assert tracker.reasons(h.sid, h.session, store_unavailable=True) == []
