"""Switchboard events as AG-UI events (the ``ag-ui-protocol`` package's models), for AG-UI front-ends.

One ``AguiTranslator`` per stream turns each session event into one or more AG-UI events, in order. Its state is
the run it has open: the tool calls and the speeches started in it. A run is a turn: it opens with the first event
after a quiet point, or with a final user input (which finishes the run still open, the turn it cuts short), and
finishes at the next quiet point: the agent back to `listening`, none of the run's tool calls running and none of its
speeches (a deferred reply to a background result included: ``tool.ended`` names the one it makes owed) still to
play. An operator's interrupt of one of its speeches finishes it at once, with the ``cancelled`` outcome.
``docs/ag-ui.md`` has the whole mapping.

The last AG-UI event a session event yields completes it: a stream marks that one with the event's ``seq`` (the SSE
``id``), so resuming from an id never splits a session event. The chat items of a progress update
(``<call_id>/update/<n>``, the model's copy of it) yield none: the update's ``ACTIVITY_SNAPSHOT`` carries it, and a
dashboard of a long tool would otherwise get three frames per update.

>>> translator = AguiTranslator("s1")
>>> [e.type.value for e in translator.translate(event)]
['RUN_STARTED', 'STATE_SNAPSHOT']
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ag_ui.core import (
    ActivitySnapshotEvent,
    BaseEvent,
    CustomEvent,
    RunErrorEvent,
    RunFinishedCancelledOutcome,
    RunFinishedEvent,
    RunStartedEvent,
    StateDeltaEvent,
    StateSnapshotEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
)

from ...runtime.chat import UPDATE_MARK
from ...runtime.events import Event

PROTOCOL_VERSION = "1.0"
CUSTOM_PREFIX = "switchboard."  # CUSTOM event names: `switchboard.<event type>`
PROGRESS_ACTIVITY = "switchboard.tool_progress"
BUSY_AGENT_STATES = frozenset({"thinking", "speaking"})
# an operator's coaching note is for the agent, never for the user: an AG-UI client (the user's own UI) is not sent it
OPERATORS_ONLY = frozenset({"session.coached"})
SETTLING_EVENTS = frozenset({"agent.state", "tool.ended", "speech.done"})  # the events that can make a run quiet

Handler = Callable[["AguiTranslator", Event, int], list[BaseEvent]]
StateKey = tuple[Any, ...]
SHARED_TRANSLATIONS = 4096  # recent (event, stream state) translations kept for the other streams of a session


def _custom(event: Event, ts: int) -> list[BaseEvent]:
    return [CustomEvent(name=CUSTOM_PREFIX + event.type, value=event.data, timestamp=ts)]


def _state(ts: int, **changes: Any) -> StateDeltaEvent:
    # `add` sets a member of the root object whether or not it exists, so each delta applies to any state a client
    # holds: also after a resume that did not replay the snapshot it started from
    ops = [{"op": "add", "path": f"/{key}", "value": value} for key, value in changes.items()]
    return StateDeltaEvent(delta=ops, timestamp=ts)


class AguiTranslator:
    """Turns one session's events, in ``seq`` order, into AG-UI events (see the module docstring)."""

    __slots__ = ("_key", "agent_state", "calls", "cut", "pending", "run_id", "running", "spoken", "thread_id")

    def __init__(self, session_id: str) -> None:
        self.thread_id = session_id
        self.run_id: str | None = None
        self.calls: set[str] = set()  # tool calls started in the open run
        self.running: set[str] = set()  # ... and not ended yet (or started in a run cut short)
        self.spoken: set[str] = set()  # speeches of the open run (created in it, or owed by the end of a call)
        self.pending: set[str] = set()  # ... not done yet
        self.cut = False  # a speech of the open run was interrupted
        self.agent_state: str | None = None
        self._key: StateKey | None = None  # ``state_key()`` until ``translate`` changes the state

    def state_key(self) -> StateKey:
        """Everything ``translate`` depends on besides the event (streams in the same state share a translation)."""
        if self._key is None:  # asked for every event of every stream: built once per change of state
            sets = (frozenset(s) for s in (self.calls, self.running, self.spoken, self.pending))
            self._key = (self.run_id, *sets, self.cut, self.agent_state)
        return self._key

    def restore(self, state: StateKey) -> None:
        if state == self.state_key():
            return
        self.run_id, calls, running, spoken, pending, self.cut, self.agent_state = state
        self.calls, self.running, self.spoken, self.pending = set(calls), set(running), set(spoken), set(pending)
        self._key = state

    def translate(self, event: Event) -> list[BaseEvent]:
        """The AG-UI events for ``event``, framed in a run (none for a progress update's chat items)."""
        if _update_item(event) or event.type in OPERATORS_ONLY:
            return []
        self._key = None
        ts = int(event.at.timestamp() * 1000)
        out: list[BaseEvent] = []
        if self.run_id is not None and _new_turn(event):  # the turn it cuts short ends here
            out.append(self._finish(ts, cancelled=self.cut))
        if self.run_id is None:
            out.append(self._open(self._next_run_id(event), ts))
        out.extend(_HANDLERS.get(event.type, _generic)(self, event, ts))
        if self.run_id is not None:
            if _operator_interrupt(event) and event.data.get("speech_id") in self.spoken:
                out.append(self._finish(ts, cancelled=True))
            elif event.type in SETTLING_EVENTS and self._quiet():
                out.append(self._finish(ts))
        return out

    def _next_run_id(self, event: Event) -> str:
        return f"{self.thread_id}.{event.seq}"

    def _open(self, run_id: str, ts: int) -> RunStartedEvent:
        self.run_id = run_id
        return RunStartedEvent(thread_id=self.thread_id, run_id=run_id, protocol_version=PROTOCOL_VERSION, timestamp=ts)

    def _quiet(self) -> bool:
        return self.agent_state not in BUSY_AGENT_STATES and not self.running and not self.pending

    def _finish(self, ts: int, *, cancelled: bool = False) -> RunFinishedEvent:
        outcome = RunFinishedCancelledOutcome() if cancelled else None
        finished = RunFinishedEvent(thread_id=self.thread_id, run_id=self.run_id or "", outcome=outcome, timestamp=ts)
        self._close_run()
        return finished

    def _close_run(self) -> None:
        # calls still running (a run cut short) stay: the run their results land in waits for them, and for the
        # reply to them
        self.run_id = None
        self.cut = False
        for ids in (self.calls, self.spoken, self.pending):
            ids.clear()

    # -- one handler per event type -----------------------------------------------------------------------------

    def _session_started(self, event: Event, ts: int) -> list[BaseEvent]:
        snapshot = {"agent": event.data.get("agent"), "agent_state": None, "status": "active"}
        return [StateSnapshotEvent(snapshot=snapshot, timestamp=ts)]

    def _session_recovered(self, event: Event, ts: int) -> list[BaseEvent]:
        return [_state(ts, agent=event.data.get("agent"), status="active"), *_custom(event, ts)]

    def _session_closed(self, event: Event, ts: int) -> list[BaseEvent]:
        self.running.clear()
        return [_state(ts, status="closed"), self._finish(ts)]

    def _session_failed(self, event: Event, ts: int) -> list[BaseEvent]:
        error = RunErrorEvent(message=str(event.data.get("reason", "")), code="session_failed", timestamp=ts)
        self.running.clear()
        self._close_run()
        return [_state(ts, status="failed"), *_custom(event, ts), error]

    def _agent_state(self, event: Event, ts: int) -> list[BaseEvent]:
        self.agent_state = str(event.data.get("state"))
        return [_state(ts, agent_state=self.agent_state)]

    def _agent_handoff(self, event: Event, ts: int) -> list[BaseEvent]:
        return [_state(ts, agent=event.data.get("to_agent")), *_custom(event, ts)]

    def _chat_item(self, event: Event, ts: int) -> list[BaseEvent]:
        item = event.data.get("item") or {}
        if item.get("type") != "message":
            return _custom(event, ts)  # tool items: the tool.* events carry them
        message_id, text = str(item["id"]), str(item.get("text", ""))
        out: list[BaseEvent] = [TextMessageStartEvent(message_id=message_id, role=item.get("role"), timestamp=ts)]
        if text:
            out.append(TextMessageContentEvent(message_id=message_id, delta=text, timestamp=ts))
        # an interrupted message holds what was heard; the mark says so (speech.interrupted follows as CUSTOM)
        metadata = {"interrupted": True} if item.get("interrupted") else None
        out.append(TextMessageEndEvent(message_id=message_id, metadata=metadata, timestamp=ts))
        return out

    def _tool_started(self, event: Event, ts: int) -> list[BaseEvent]:
        call_id = str(event.data["call_id"])
        if call_id in self.calls:  # run again after a restart within the same run: AG-UI allows one start per id
            self.running.add(call_id)
            return _custom(event, ts)
        self.calls.add(call_id)
        self.running.add(call_id)
        arguments = json.dumps(event.data.get("arguments") or {}, ensure_ascii=False)
        return [
            ToolCallStartEvent(tool_call_id=call_id, tool_call_name=str(event.data["name"]), timestamp=ts),
            ToolCallArgsEvent(tool_call_id=call_id, delta=arguments, timestamp=ts),
            ToolCallEndEvent(tool_call_id=call_id, timestamp=ts),
        ]

    def _tool_progress(self, event: Event, ts: int) -> list[BaseEvent]:
        call_id = str(event.data["call_id"])
        content = {"call_id": call_id, "message": event.data.get("message"), "progress": event.data.get("progress")}
        return [
            ActivitySnapshotEvent(
                message_id=f"{call_id}.progress", activity_type=PROGRESS_ACTIVITY, content=content, timestamp=ts
            )
        ]

    def _speech_created(self, event: Event, ts: int) -> list[BaseEvent]:
        self._owes(str(event.data["speech_id"]))
        return _custom(event, ts)

    def _speech_interrupted(self, event: Event, ts: int) -> list[BaseEvent]:
        self.cut = self.cut or event.data.get("speech_id") in self.spoken
        return _custom(event, ts)

    def _speech_done(self, event: Event, ts: int) -> list[BaseEvent]:
        self.pending.discard(str(event.data["speech_id"]))
        return _custom(event, ts)

    def _owes(self, speech_id: str) -> None:
        if speech_id not in self.spoken:  # a speech reported created after it was owed is still the same one
            self.spoken.add(speech_id)
            self.pending.add(speech_id)

    def _tool_ended(self, event: Event, ts: int) -> list[BaseEvent]:
        call_id = str(event.data["call_id"])
        self.running.discard(call_id)
        reply = event.data.get("reply_speech_id")
        if reply is not None:  # the reply to its result belongs to the run its result lands in
            self._owes(str(reply))
        if call_id not in self.calls:
            # started before this stream's first event (it resumed): AG-UI ties a result to a call of the same run
            return _custom(event, ts)
        metadata = {"status": event.data.get("status"), "is_error": bool(event.data.get("is_error"))}
        return [
            ToolCallResultEvent(
                message_id=f"{call_id}.result",
                tool_call_id=call_id,
                content=str(event.data.get("output", "")),
                metadata=metadata,
                timestamp=ts,
            )
        ]


class RunTranslator(AguiTranslator):
    """The AG-UI events of one run a client started with its input (``POST .../ag-ui``): nothing before the input's
    ``user.input`` (the previous turn's end, cut short by it), which opens the run under the client's ``run_id``,
    then the run as ``AguiTranslator`` makes it, up to its ``RUN_FINISHED`` (or ``RUN_ERROR``): ``over`` then. The
    input's own chat item makes nothing: the client holds that message already, under its own id."""

    __slots__ = ("client_run_id", "item_id", "opened", "over")

    def __init__(self, session_id: str, run_id: str, item_id: str) -> None:
        super().__init__(session_id)
        self.client_run_id = run_id
        self.item_id = item_id
        self.opened = False
        self.over = False

    def translate(self, event: Event) -> list[BaseEvent]:
        if self.over:
            return []
        if not self.opened:
            if event.type == "agent.state":
                self.agent_state = str(event.data.get("state"))
            if not (event.type == "user.input" and event.data.get("item_id") == self.item_id):
                return []
            self.opened = True
            return [self._open(self.client_run_id, int(event.at.timestamp() * 1000))]
        return self._translate_open(event)

    def restarted(self, ts: int) -> RunStartedEvent:
        """``RUN_STARTED`` again, for a client continuing the run on a new connection. The results of the calls it
        got before come as ``CUSTOM switchboard.tool.ended`` (as on a resumed watch stream)."""
        self.calls.clear()
        return RunStartedEvent(
            thread_id=self.thread_id, run_id=self.client_run_id, protocol_version=PROTOCOL_VERSION, timestamp=ts
        )

    def _translate_open(self, event: Event) -> list[BaseEvent]:
        if event.type == "chat.item" and (event.data.get("item") or {}).get("id") == self.item_id:
            return []
        out = super().translate(event)
        for i, made in enumerate(out):
            if isinstance(made, RunFinishedEvent | RunErrorEvent):  # the run ends: what follows is the next one's
                self.over = True
                return out[: i + 1]
        return out


def _update_item(event: Event) -> bool:
    """``event`` adds a chat item of a progress update's pair (its ``tool.progress`` follows)."""
    if event.type != "chat.item":
        return False
    item = event.data.get("item") or {}
    return UPDATE_MARK in str(item.get("call_id") or "")


def _new_turn(event: Event) -> bool:
    """``event`` is a final user input: it starts a turn."""
    return event.type == "user.input" and bool(event.data.get("final"))


def _operator_interrupt(event: Event) -> bool:
    """``event`` logs an operator's interrupt that stopped a speech."""
    return event.type == "operator.action" and event.data.get("action") == "interrupt"


def _generic(translator: AguiTranslator, event: Event, ts: int) -> list[BaseEvent]:
    return _custom(event, ts)


_HANDLERS: dict[str, Handler] = {
    "session.started": AguiTranslator._session_started,
    "session.recovered": AguiTranslator._session_recovered,
    "session.closed": AguiTranslator._session_closed,
    "session.failed": AguiTranslator._session_failed,
    "agent.state": AguiTranslator._agent_state,
    "agent.handoff": AguiTranslator._agent_handoff,
    "chat.item": AguiTranslator._chat_item,
    "tool.started": AguiTranslator._tool_started,
    "tool.progress": AguiTranslator._tool_progress,
    "tool.ended": AguiTranslator._tool_ended,
    "speech.created": AguiTranslator._speech_created,
    "speech.interrupted": AguiTranslator._speech_interrupted,
    "speech.done": AguiTranslator._speech_done,
}


class SharedEncodings:
    """Encoded translations shared by the streams of a session: a thousand subscribers in the same state pay for one
    translation and one serialisation of each event, not a thousand."""

    def __init__(self, maxsize: int = SHARED_TRANSLATIONS) -> None:
        self.maxsize = maxsize
        self._done: OrderedDict[tuple[Any, ...], tuple[Any, StateKey]] = OrderedDict()

    def sse(self, translator: AguiTranslator, event: Event) -> str:
        """``encode_sse`` of ``translator.translate(event)``."""
        text: str = self._get("sse", translator, event, lambda events: encode_sse(events, event.seq))
        return text

    def ws(self, translator: AguiTranslator, event: Event) -> list[str]:
        """``encode_ws`` of ``translator.translate(event)``."""
        frames: list[str] = self._get("ws", translator, event, lambda events: encode_ws(events, event.seq))
        return frames

    def _get(self, fmt: str, translator: AguiTranslator, event: Event, encode: Callable[[list[BaseEvent]], Any]) -> Any:
        # `at` and `type` too: session ids can repeat across the apps of one process (tests), events cannot
        key = (fmt, event.session_id, event.seq, event.at, event.type, translator.state_key())
        found = self._done.get(key)
        if found is not None:
            translator.restore(found[1])
            return found[0]
        encoded = encode(translator.translate(event))
        self._done[key] = (encoded, translator.state_key())
        if len(self._done) > self.maxsize:
            self._done.popitem(last=False)
        return encoded


#: One per process: an event's translation depends only on the event and the stream's state.
SHARED = SharedEncodings()


def encode_sse(events: list[BaseEvent], seq: int) -> str:
    """SSE frames for one session event's AG-UI events; the last carries ``id: <seq>``, and each its position in
    ``rawEvent`` (``with_positions``)."""
    if not events:
        return ""
    frames = [f"data: {e.model_dump_json(by_alias=True)}\n\n" for e in with_positions(events, seq)]
    frames[-1] = f"id: {seq}\n{frames[-1]}"
    return "".join(frames)


def with_positions(events: list[BaseEvent], seq: int) -> list[BaseEvent]:
    """``events`` (made from the session event ``seq``), each carrying ``rawEvent: {"seq": <position>}``: where a
    client that got it resumes from (``since`` or ``Last-Event-ID``). The last is the event's ``seq``; the others,
    the seq before it, so that resuming from one of them sends the whole session event again, never half of it. A
    stock client drops the SSE ``id`` but keeps ``rawEvent``."""
    last = len(events) - 1
    return [e.model_copy(update={"raw_event": {"seq": seq if i == last else seq - 1}}) for i, e in enumerate(events)]


def encode_ws(events: list[BaseEvent], seq: int) -> list[str]:
    """WebSocket frames for one session event's AG-UI events; the last carries ``rawEvent: {"seq": <seq>}``, the
    position to resume from (``since``)."""
    if not events:
        return []
    frames = [e.model_dump_json(by_alias=True) for e in events[:-1]]
    last = events[-1].model_copy(update={"raw_event": {"seq": seq}})
    frames.append(last.model_dump_json(by_alias=True))
    return frames
