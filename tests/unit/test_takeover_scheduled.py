"""An operator's takeover and the scheduled commands and coaching notes together: while an operator holds the session
the model is asked for nothing, whatever applies meanwhile (a scheduled input is committed, not answered), and a
coaching note left during the hold waits for the first model request after the hand-back."""

from __future__ import annotations

from switchboard import Agent
from switchboard.runtime.chat import ChatMessage

from .harness import Harness


def said(h: Harness) -> list[str]:
    return [it.text for it in h.chat() if isinstance(it, ChatMessage) and it.role == "assistant"]


async def test_a_scheduled_input_applied_during_a_hold_is_answered_only_after_the_hand_back() -> None:
    turns = [{"text": "Answer {{coach}}"}]
    async with Harness(Agent(instructions="test agent"), turns) as h:
        await h.session.take_over("alice")
        cmd = await h.session.scheduled.schedule("input", {"text": "are you there?"}, at="idle")
        applied = await h.wait_for("scheduled.applied", lambda e: e.data["id"] == cmd.id)
        assert applied.data["item_id"] is not None and applied.data.get("speech_id") is None  # committed, no reply
        note = await h.session.coach.coach("apologise for the wait")
        await h.idle()
        assert len(h.llm.requests) == 0 and said(h) == []  # the model was asked for nothing while held

        back = await h.session.hand_back("alice")
        assert back.speech_id is not None  # the scheduled input was unanswered: the agent answers it now
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] == back.speech_id)
        assert said(h) == ["Answer apologise for the wait"]  # the note reached that first request
        assert len(h.llm.requests) == 1
        await h.wait_for("scheduled.applied", lambda e: e.data["id"] == note.id)
        h.check_invariants()
