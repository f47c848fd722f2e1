"""What needs an operator: each live session's reasons for attention, from its durable events and its live state.

A reason is kept from the event that raised it until the event that resolves it:

- ``generation_failed``: the model failed; cleared once a later generation of the session completes.
- ``tool_failed``: a tool call ended ``failed``; cleared once the same tool later completes.
- ``session_failed``: the session could not be recovered (it stays until the process restarts; at most
  ``KEEP_FAILED`` are remembered).

and the others are read from the live session when asked:

- ``tool_long_running``: a call has been running longer than ``long_tool_s``.
- ``speech_stalled``: a generation has produced nothing to play for ``stall_s``.
- ``silence_after_input``: a reply to input was queued, and no speech has started since, for ``silence_s``.
- ``operator_quiet``: an operator holds the session (a takeover) and has given no sign (a say, a heartbeat) for
  ``operator_quiet_s``: the user may be talking to nobody.
- ``store_failing``: the database is unreachable and the session has writes waiting, or a write failed for good
  since the last chat item it wrote.

The tracker sees the events of the sessions this process hosts; it is fed from the same place as the event hub. A
session adopted from another node (a failover, a drain) is fed its latest durable events of these kinds first, and
the sessions that failed are read from the database: nothing here is known only to the node where it happened.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from ..runtime.chat import utcnow
from ..runtime.events import Event
from ..runtime.session import AgentSession
from ..runtime.speech import SpeechState
from ..runtime.tools import ToolStatus

KEEP_FAILED = 1000
DETAIL_MAX_CHARS = 200


class AttentionCode(StrEnum):
    GENERATION_FAILED = "generation_failed"
    TOOL_FAILED = "tool_failed"
    TOOL_LONG_RUNNING = "tool_long_running"
    STORE_FAILING = "store_failing"
    SPEECH_STALLED = "speech_stalled"
    SILENCE_AFTER_INPUT = "silence_after_input"
    SESSION_FAILED = "session_failed"
    OPERATOR_QUIET = "operator_quiet"


class AttentionReason(BaseModel):
    """One reason a session needs an operator, since when."""

    code: AttentionCode
    message: str
    since: datetime


def _short(value: object) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= DETAIL_MAX_CHARS else text[: DETAIL_MAX_CHARS - 1] + "…"


@dataclass
class _Watch:
    """What the events of one session say about it."""

    last_activity: datetime
    generation_failed: AttentionReason | None = None
    failed_tools: dict[str, AttentionReason] = field(default_factory=dict)  # tool name -> its latest failure
    generated: set[str] = field(default_factory=set)  # speeches with a generation step
    failed_speeches: set[str] = field(default_factory=set)
    waiting_since: datetime | None = None  # final user input not yet answered by a speech starting
    generating_since: dict[str, datetime] = field(default_factory=dict)  # speech -> its step's generation start
    failed: AttentionReason | None = None
    first_audio_s: float | None = None  # the latest reply's time from its first generation to its first audio
    reply_started: dict[str, datetime] = field(default_factory=dict)  # speech -> its first generation's start
    write_failures_seen: int = 0  # the session's write failures when something of it was last written


@dataclass(frozen=True)
class Thresholds:
    long_tool_s: float = 60.0
    stall_s: float = 10.0
    silence_s: float = 8.0
    operator_quiet_s: float = 60.0


class AttentionTracker:
    """Reasons for attention per session, from the durable events of the sessions this process runs."""

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.thresholds = thresholds or Thresholds()
        self._watch: dict[str, _Watch] = {}
        self._failed: OrderedDict[str, _Watch] = OrderedDict()

    # -- events -----------------------------------------------------------------------------------------------

    def observe(self, event: Event, live: AgentSession | None = None) -> None:
        w = self._watch.get(event.session_id)
        if w is None:
            w = self._watch[event.session_id] = _Watch(last_activity=event.at)
        w.last_activity = max(w.last_activity, event.at)
        handler = _HANDLERS.get(event.type)
        if handler is not None:
            handler(w, event.data, event.at)
        if event.type == "chat.item" and live is not None:
            w.write_failures_seen = live.write_failures  # written since: the store works again
        if event.type in ("session.closed", "session.failed"):
            self._watch.pop(event.session_id, None)
            if w.failed is not None:
                self._failed[event.session_id] = w
                while len(self._failed) > KEEP_FAILED:
                    self._failed.popitem(last=False)

    # -- reading ----------------------------------------------------------------------------------------------

    def last_activity(self, session_id: str) -> datetime | None:
        w = self._watch.get(session_id) or self._failed.get(session_id)
        return w.last_activity if w is not None else None

    def first_audio_s(self, session_id: str) -> float | None:
        """The latest reply's time to first audio: from its first model request to its first word playing."""
        w = self._watch.get(session_id)
        return w.first_audio_s if w is not None else None

    def failed_sessions(self) -> list[str]:
        """The failed sessions remembered, most recent first."""
        return list(reversed(self._failed))

    def reasons(
        self, session_id: str, live: AgentSession | None, *, store_unavailable: bool = False
    ) -> list[AttentionReason]:
        """Every reason ``session_id`` needs attention now, oldest first."""
        failed = self._failed.get(session_id)
        if failed is not None and failed.failed is not None:
            return [failed.failed]
        w = self._watch.get(session_id)
        if w is None or live is None:
            return []
        now = utcnow()
        found: list[AttentionReason] = []
        if w.generation_failed is not None:
            found.append(w.generation_failed)
        found.extend(w.failed_tools.values())
        found.extend(self._live_reasons(w, live, now, store_unavailable))
        return sorted(found, key=lambda r: r.since)

    def _live_reasons(
        self, w: _Watch, live: AgentSession, now: datetime, store_unavailable: bool
    ) -> list[AttentionReason]:
        t = self.thresholds
        found = [
            _reason(
                AttentionCode.TOOL_LONG_RUNNING,
                f"{call.name} {call.status.value} for {_secs(now, call.started_at)} s",
                call.started_at,
            )
            for call in live.tool_calls(ToolStatus.RUNNING)
            if now - call.started_at >= timedelta(seconds=t.long_tool_s)
        ]
        speech = live.current_speech
        started = w.generating_since.get(speech.id) if speech is not None else None
        stalled = speech is not None and speech.state == SpeechState.GENERATING
        if started is not None and stalled and now - started >= timedelta(seconds=t.stall_s):
            message = f"no answer from the model for {_secs(now, started)} s"
            found.append(_reason(AttentionCode.SPEECH_STALLED, message, started))
        waiting = w.waiting_since
        if waiting is not None and now - waiting >= timedelta(seconds=t.silence_s):
            message = f"the user has heard nothing for {_secs(now, waiting)} s"
            found.append(_reason(AttentionCode.SILENCE_AFTER_INPUT, message, waiting))
        found.extend(self._operator_reasons(live, now))
        failures = live.write_failures - w.write_failures_seen
        if failures > 0 or (store_unavailable and live.pending_writes):
            what = f"{failures} write(s) failed" if failures > 0 else "the database is unreachable"
            found.append(_reason(AttentionCode.STORE_FAILING, f"{what}; changes may not be saved", w.last_activity))
        return found

    def _operator_reasons(self, live: AgentSession, now: datetime) -> list[AttentionReason]:
        quiet_s = live.seat.quiet_for_s(now)
        if quiet_s is None or quiet_s < self.thresholds.operator_quiet_s:
            return []
        message = f"held by operator {live.seat.operator}, who has said nothing for {int(quiet_s)} s"
        return [_reason(AttentionCode.OPERATOR_QUIET, message, live.seat.last_seen)]


def _secs(now: datetime, since: datetime) -> int:
    return int((now - since).total_seconds())


def _reason(code: AttentionCode, message: str, since: datetime) -> AttentionReason:
    return AttentionReason(code=code, message=_short(message), since=since)


# -- what each event does to a session's watch -------------------------------------------------------------------


def _generation_started(w: _Watch, d: dict[str, Any], at: datetime) -> None:
    speech_id = str(d.get("speech_id"))
    w.generated.add(speech_id)
    w.generating_since[speech_id] = at
    if d.get("step") == 0:
        w.reply_started[speech_id] = at


def _generation_failed(w: _Watch, d: dict[str, Any], at: datetime) -> None:
    speech_id = str(d.get("speech_id"))
    w.failed_speeches.add(speech_id)
    w.generating_since.pop(speech_id, None)
    w.generation_failed = _reason(AttentionCode.GENERATION_FAILED, f"the model failed: {d.get('error')}", at)


def _speech_started(w: _Watch, d: dict[str, Any], at: datetime) -> None:
    speech_id = str(d.get("speech_id"))
    w.waiting_since = None
    w.generating_since.pop(speech_id, None)
    began = w.reply_started.pop(speech_id, None)
    if began is not None:
        w.first_audio_s = (at - began).total_seconds()


def _speech_done(w: _Watch, d: dict[str, Any], at: datetime) -> None:
    speech_id = str(d.get("speech_id"))
    w.generating_since.pop(speech_id, None)
    if speech_id in w.generated and speech_id not in w.failed_speeches:
        w.generation_failed = None  # the model answered again
    w.generated.discard(speech_id)
    w.failed_speeches.discard(speech_id)
    w.reply_started.pop(speech_id, None)


def _speech_created(w: _Watch, d: dict[str, Any], at: datetime) -> None:
    # a reply to input: the user waits from now until some speech starts (a reply that says nothing leaves them
    # waiting)
    if d.get("source") == "reply" and w.waiting_since is None:
        w.waiting_since = at


def _tool_ended(w: _Watch, d: dict[str, Any], at: datetime) -> None:
    name = str(d.get("name"))
    if d.get("status") == ToolStatus.FAILED:
        w.failed_tools[name] = _reason(AttentionCode.TOOL_FAILED, f"{name} failed: {d.get('output')}", at)
    elif d.get("status") == ToolStatus.COMPLETED:
        w.failed_tools.pop(name, None)


def _session_failed(w: _Watch, d: dict[str, Any], at: datetime) -> None:
    w.failed = _reason(AttentionCode.SESSION_FAILED, f"the session failed: {d.get('reason')}", at)


_HANDLERS = {
    "generation.started": _generation_started,
    "generation.failed": _generation_failed,
    "speech.started": _speech_started,
    "speech.done": _speech_done,
    "speech.created": _speech_created,
    "tool.ended": _tool_ended,
    "session.failed": _session_failed,
}

#: The kinds of event the tracker learns from: what a node reads of a session's durable log when it adopts it
ATTENTION_EVENTS: tuple[str, ...] = (*_HANDLERS, "session.closed")
