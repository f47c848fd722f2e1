"""How a tool call's end is written: its pair and its final record in one commit (I1, I5), written again on a
permanent store error (the last attempts with the output replaced by a note), and, should the store refuse even that,
again and again in the background while the session runs, so that the store never keeps `running` a call that ended
here. A base of ``ToolExecutor``, which holds what it uses."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from . import event_types as ev
from .aio import cancel_and_wait, resolve, spawn
from .chat import ChatContext
from .events import EventLog
from .ports import Commit, completions
from .speech import SpeechInfo
from .tool_call import EndRecord, Handoff, Outcome, RunningCall, end_record

logger = logging.getLogger("switchboard.runtime.tools")

# a permanent store error on a call's end: the end is written again after each of these pauses, the last attempts
# with the output replaced by a note (the store never keeps an ended call `running`)
END_RETRY_BACKOFF_S = (0.1, 0.4, 1.6)
END_FULL_ATTEMPTS = 2
STORE_ERROR_OUTPUT = "The tool call ended ({status}), but its output could not be stored."
# an end the store refused every time is written again in the background, after these pauses (doubling up to the
# last), for as long as the session runs here; a close carries it in its own last write (``unwritten_ends``)
END_REPAIR_FIRST_S = 2.0
END_REPAIR_MAX_S = 30.0


class CallEnds:
    """Writing and reporting the ends of a session's tool calls (see the module docstring)."""

    session_id: str
    _chat: ChatContext
    _events: EventLog
    _commit: Callable[[Commit], Awaitable[None]]
    _on_ended: Callable[[RunningCall, bool], None]
    _owed_by_end: Callable[[RunningCall, Outcome], list[SpeechInfo]] | None
    # ends the store refused every time (call id -> what to write, and the agent that made the call), and the tasks
    # writing them again: a call never stays `running` in the store while it ended here (I8)
    _unwritten: dict[str, tuple[EndRecord, str | None]]
    _repairs: set[asyncio.Task[Any]]
    _calls: dict[str, RunningCall]

    def _forget_old_calls(self) -> None:
        raise NotImplementedError

    async def _write_end(
        self, rc: RunningCall, outcome: Outcome, handoff: Handoff | None
    ) -> tuple[EndRecord, Exception | None]:
        """Write the call's end; on a permanent store error write it again a few times, the last attempts with
        the output replaced by a note. Returns what was written (or, if nothing could be, the last attempt) and,
        when nothing could be, the store's error on the last attempt (the store's fencing refusal when the session
        moved to another process meanwhile: then no attempt can land); None once it is durable."""
        owed = tuple(self._owed_by_end(rc, outcome)) if self._owed_by_end is not None else ()
        full = replace(end_record(rc, outcome, handoff), owed=owed)
        note = STORE_ERROR_OUTPUT.format(status=outcome.status.value)
        fallback = replace(end_record(rc, replace(outcome, output=note, is_error=True), handoff), owed=owed)
        attempts = [full] * END_FULL_ATTEMPTS + [fallback] * (len(END_RETRY_BACKOFF_S) + 1 - END_FULL_ATTEMPTS)
        error: Exception | None = None
        for attempt, record in enumerate(attempts):
            if attempt:
                await asyncio.sleep(END_RETRY_BACKOFF_S[attempt - 1])
            # the commands that decided the end are answered by its first attempt only: a call must end even when
            # the store refuses a receipt (its command is then answered on its own)
            receipts = completions(record.info, *rc.end_receipts, *rc.cancel_receipts) if attempt == 0 else []
            try:
                await self._commit(record.commit(receipts))
            except Exception as err:
                error = err
                logger.error(
                    "the end of tool call %s (%s) could not be stored (attempt %d of %d)",
                    rc.call_id,
                    rc.info.name,
                    attempt + 1,
                    len(attempts),
                    extra={"session_id": self.session_id, "call_id": rc.call_id},
                )
                continue
            return record, None
        logger.error(
            "tool call %s (%s) ended %s but its end could not be stored; it ended in memory only",
            rc.call_id,
            rc.info.name,
            outcome.status.value,
            extra={"session_id": self.session_id, "call_id": rc.call_id},
        )
        return attempts[-1], error

    async def _commit_end(self, rc: RunningCall, outcome: Outcome, handoff: Handoff | None) -> None:
        record, error = await self._write_end(rc, outcome, handoff)
        durable = error is None
        rc.end_error = error
        agent = rc.info.agent
        rc.info = record.info
        rc.needs_reply = outcome.needs_reply
        if record.items:  # a dropped speculative call adds nothing: the context its speculation saw is unchanged
            self._chat.append(*record.items)
        if durable:  # an event only reports what is durable (I6)
            self._emit_end(record, agent)
        else:
            self._unwritten[rc.call_id] = (record, agent)
            spawn(self._write_again(rc.call_id), name=f"end-repair:{rc.call_id}", tasks=self._repairs)
        resolve(rc.settled_fut, None)
        resolve(rc.ended_fut, None)
        rc.tool_task = None  # drop the finished body (and any traceback it holds)
        self._forget_old_calls()
        try:
            self._on_ended(rc, durable)
        except Exception:
            logger.exception("on_ended hook failed", extra={"session_id": self.session_id})

    async def _write_again(self, call_id: str) -> None:
        """Write an end the store refused every time, again and again (with growing pauses) while the session runs:
        the call ended here, and the store must not keep it `running`. Its events follow once it is durable."""
        pause = END_REPAIR_FIRST_S
        while call_id in self._unwritten:
            await asyncio.sleep(pause)
            record, agent = self._unwritten[call_id]
            try:
                await self._commit(record.commit())
            except Exception:
                logger.error(
                    "the end of tool call %s still cannot be stored; trying again in %.0fs",
                    call_id,
                    min(pause * 2, END_REPAIR_MAX_S),
                    extra={"session_id": self.session_id, "call_id": call_id},
                )
                pause = min(pause * 2, END_REPAIR_MAX_S)
                continue
            if self._unwritten.pop(call_id, None) is not None:
                self._written(call_id)
                logger.warning(
                    "the end of tool call %s is stored at last", call_id, extra={"session_id": self.session_id}
                )
                self._emit_end(record, agent)

    def unwritten_ends(self) -> list[EndRecord]:
        """Ends the store has refused so far (their repair stopped): a close writes them with its own last write, so
        that a session is never stored closed with a call `running`."""
        return [record for record, _ in self._unwritten.values()]

    def report_written(self, records: list[EndRecord]) -> None:
        """``records`` (from ``unwritten_ends``) are durable now: report them."""
        for record in records:
            found = self._unwritten.pop(record.info.call_id, None)
            if found is not None:
                self._written(record.info.call_id)
                self._emit_end(*found)

    def _written(self, call_id: str) -> None:
        rc = self._calls.get(call_id)
        if rc is not None:
            rc.end_error = None

    async def stop_repairs(self) -> None:
        await cancel_and_wait(*self._repairs)

    def _emit_end(self, record: EndRecord, agent: str | None) -> None:
        for it in record.items:
            self._events.emit(ev.ChatItemAdded(item=it))
        if record.state is not None:
            self._events.emit(ev.AgentHandedOff(from_agent=agent, to_agent=record.state.agent))
        info = record.info
        self._events.emit(
            ev.ToolEnded(
                call_id=info.call_id,
                name=info.name,
                status=info.status,
                output=info.output or "",
                is_error=info.is_error,
                error=info.error,
                **({"reply_speech_id": record.owed[0].id} if record.owed else {}),
                **({"reason": record.dropped} if record.dropped else {}),
            )
        )


__all__ = [
    "END_FULL_ATTEMPTS",
    "END_REPAIR_FIRST_S",
    "END_REPAIR_MAX_S",
    "END_RETRY_BACKOFF_S",
    "STORE_ERROR_OUTPUT",
    "CallEnds",
]
