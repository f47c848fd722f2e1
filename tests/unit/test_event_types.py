"""The event catalogue: typed payloads, one registry, and an event log that accepts nothing else."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
from pydantic import ValidationError

from switchboard.runtime import event_types as ev
from switchboard.runtime.chat import ChatMessage, FunctionCall
from switchboard.runtime.event_types import EVENT_PAYLOADS, EVENT_TYPES, EventPayload, UnknownEventType
from switchboard.runtime.events import EventLog
from switchboard.runtime.memory import MemoryEventLog
from switchboard.runtime.tools import ToolStatus

DOCUMENTED = {  # the event types the design names, with the keys its consumers read
    "session.started": {"agent"},
    "session.recovered": {"agent", "interrupted_calls", "retried_calls", "interrupted_speeches"},
    "session.closed": set(),
    "session.failed": {"reason", "interrupted_calls"},
    "agent.state": {"state"},
    "agent.handoff": {"from_agent", "to_agent"},
    "user.input": {"item_id", "text", "final", "role"},
    "speech.created": {"speech_id", "source"},
    "generation.started": {"speech_id", "step", "preemptive"},
    "generation.speculative": {"state", "user_text"},
    "generation.failed": {"speech_id", "step", "error"},
    "speech.started": {"speech_id"},
    "speech.interrupted": {"speech_id", "played_text"},
    "speech.done": {"speech_id", "interrupted"},
    "chat.item": {"item"},
    "tool.started": {"call_id", "name", "arguments", "cancellable", "speech_id"},
    "tool.progress": {"call_id", "message", "progress"},
    "tool.cancelling": {"call_id", "reason"},
    "tool.ended": {"call_id", "name", "status", "output", "is_error"},
    "operator.action": {"action", "actor"},
    "session.taken_over": {"operator", "since"},
    "session.handed_back": {"operator", "since", "until"},
    "operator.spoke": {"operator", "speech_id", "item_id", "text"},
    "scheduled.created": {"id", "kind", "at"},
    "scheduled.applied": {"id", "kind"},
    "scheduled.cancelled": {"id", "kind", "reason"},
    "session.coached": {"id", "note"},
}


def test_registry_holds_one_frozen_strict_model_per_event_type():
    assert set(EVENT_TYPES) == set(DOCUMENTED)
    for type_, model in EVENT_TYPES.items():
        assert model.type == type_
        assert model.model_config.get("frozen") is True and model.model_config.get("extra") == "forbid"
        assert {n for n, f in model.model_fields.items() if f.is_required()} == DOCUMENTED[type_], type_
    assert len(set(EVENT_PAYLOADS)) == len(EVENT_PAYLOADS)


@pytest.mark.parametrize(
    "build",
    [
        lambda: ev.ToolProgress(call_id="c1", message="half", progress="half"),  # wrong type
        lambda: ev.ToolProgress(call_id="c1", message="half"),  # a missing key
        lambda: ev.ToolProgress(call_id="c1", message="half", progress=0.5, percent=50),  # an unknown key
        lambda: ev.AgentStateChanged(state="dreaming"),  # not one of the states
        lambda: ev.ToolEnded(call_id="c1", name="t", status="finished", output="", is_error=False),
        lambda: ev.GenerationStarted(speech_id="sp", step=-1, preemptive=False),
    ],
)
def test_a_payload_that_does_not_validate_raises(build):
    with pytest.raises(ValidationError):
        build()


def test_payloads_are_immutable():
    payload = ev.SpeechStarted(speech_id="sp1")
    with pytest.raises(ValidationError):
        payload.speech_id = "sp2"  # type: ignore[misc]


async def test_emitting_an_unregistered_payload_fails_and_consumes_no_seq():
    class Sneaky(EventPayload):
        type: ClassVar[Literal["speech.started"]] = "speech.started"  # a registered type, but not its model
        speech_id: str

    class Unknown(EventPayload):
        type: ClassVar[Literal["speech.whispered"]] = "speech.whispered"

    sink = MemoryEventLog()
    log = EventLog("s1", sink)
    for payload in (Sneaky(speech_id="sp1"), Unknown()):
        with pytest.raises(UnknownEventType):
            log.emit(payload)
    await log.emit(ev.SpeechStarted(speech_id="sp1"))
    assert [(e.seq, e.type, e.data) for e in sink.events["s1"]] == [(1, "speech.started", {"speech_id": "sp1"})]
    assert log.last_seq == 1


async def test_the_frame_keeps_its_wire_shape():
    sink = MemoryEventLog()
    log = EventLog("s1", sink, last_seq=41)
    item = FunctionCall(id="item_1", call_id="call_1", name="book", arguments={"what": "table 7"})
    log.emit(ev.ChatItemAdded(item=item))
    log.emit(ev.ToolEnded(call_id="call_1", name="book", status=ToolStatus.COMPLETED, output="ok", is_error=False))
    log.emit(ev.UserInput(item_id=None, text="hel", final=False, role="user"))
    chat_item, ended, interim = sink.events["s1"]
    assert (chat_item.seq, chat_item.type) == (42, "chat.item")
    assert chat_item.data == {"item": item.model_dump(mode="json")}  # the item whole, JSON-ready, as before
    assert ended.data == {"call_id": "call_1", "name": "book", "status": "completed", "output": "ok", "is_error": False}
    assert type(ended.data["status"]) is str
    assert interim.data == {"item_id": None, "text": "hel", "final": False, "role": "user"}  # null is kept
    assert set(chat_item.model_dump(mode="json")) == {"seq", "session_id", "type", "at", "data"}


def test_an_optional_key_appears_only_when_set():
    plain = ev.SessionFailed(reason="boom", interrupted_calls=["c1"])
    assert plain.data() == {"reason": "boom", "interrupted_calls": ["c1"]}
    named = ev.SessionFailed(reason="unknown agent 'x'", interrupted_calls=[], agent="x")
    assert named.data() == {"reason": "unknown agent 'x'", "interrupted_calls": [], "agent": "x"}


def test_a_chat_item_payload_keeps_every_field_of_its_item():
    item = ChatMessage(id="item_1", role="assistant", text="Hi", interrupted=True)
    data = ev.ChatItemAdded(item=item).data()["item"]
    assert data == {
        "id": "item_1",
        "created_at": item.created_at.isoformat().replace("+00:00", "Z"),
        "type": "message",
        "role": "assistant",
        "text": "Hi",
        "interrupted": True,
    }
