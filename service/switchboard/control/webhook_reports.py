"""A webhook backend's reports, applied where their call runs: the effect of the report routes (and of the cluster
simulation's nodes, which apply reports as the routes do).

A report is handed to the call waiting for it on this node (``WebhookBroker``); a result is answered once the call's
end, which carries it, is durable. Where the session runs can change under a report: another node may have taken the
session over an instant before this one learns it (its lease renewal or a fenced write tells it). This node's copy is
then stale, and the call's end is refused by the fence (``SessionFenced``): nothing of the report landed, so it is
answered as not applied (503 ``session_moved``), and the backend's retry reaches the new owner, where the call was
resumed (``on_restart="resume"``) and waits for it. A report no call here takes is answered from what this node
and the store know (``refusal``): never "stop" (409) for a call that goes on, here in a moment or elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..integrations.webhooks import (
    BackendResult,
    CallAlreadyEnded,
    NotAwaitingReport,
    PendingCall,
    WebhookBroker,
    WebhookTool,
)
from ..runtime.ports import Receipt
from ..runtime.session import AgentSession
from ..runtime.status import SessionStatus
from ..runtime.tools import ToolCallInfo
from ..store import SessionFenced
from .cluster.routing import Retry, Unavailable, locate
from .host import SessionHost

ALREADY_ENDED = "already_ended"
NOT_AWAITING = "not_awaiting_report"
NO_SESSION = "session_not_found"
NO_CALL = "tool_call_not_found"


async def apply_result(
    broker: WebhookBroker,
    session_id: str,
    call_id: str,
    result: BackendResult,
    receipt: Receipt[ToolCallInfo] | None = None,
) -> None:
    """Hand ``result`` to the call waiting for it on this node, and return once the call's end, carrying it (and
    completing ``receipt``), is durable.

    Raises ``CallAlreadyEnded`` or ``NotAwaitingReport`` when no call here takes it (``refusal`` says why), and
    ``SessionFenced`` when the call took it but its end was refused because the session moved meanwhile: nothing of
    the report landed, and it is to be sent again (to the new owner)."""
    pending = broker.result(session_id, call_id, result, receipt)
    await end_landed(pending)


async def end_landed(pending: PendingCall) -> None:
    """Wait for the end of ``pending``'s call, in the incarnation of the session it runs in; raise ``SessionFenced``
    when that end was refused because the session was taken over meanwhile (this copy was stale)."""
    session = pending.session
    if not isinstance(session, AgentSession):  # a call outside of any session: nothing to wait for
        return
    await session.wait_tool_call(pending.call_id)
    error = session.tool_call_end_error(pending.call_id)
    if isinstance(error, SessionFenced):
        raise error


@dataclass(frozen=True, slots=True)
class Refused:
    """Why no call on this node took the rightful backend's report: ``code`` is ``already_ended`` (with the call),
    ``not_awaiting_report``, ``session_not_found``, ``tool_call_not_found``, or a ``Retry`` code (503: the call goes
    on, but not here, or not yet: its session is being recovered here, is moving, or runs elsewhere)."""

    code: str
    info: ToolCallInfo | None = None

    @property
    def retry(self) -> bool:
        return self.code in RETRY_CODES


RETRY_CODES = frozenset(r.value for r in Retry)


async def refusal(host: SessionHost, sid: str, call_id: str, err: CallAlreadyEnded | NotAwaitingReport) -> Refused:
    """Why the report was refused, from the session live here and the store. A call that ended is ``already_ended``;
    one that still runs is never told to stop unless it is not a webhook call at all: it is waiting for the report
    elsewhere (the session moved: retry there) or in a moment here (a resumed call whose body is starting)."""
    live = host.live(sid)
    known = live.tool_call(call_id) if live is not None else None
    if known is not None and (known.ended or isinstance(err, CallAlreadyEnded)):
        return Refused(ALREADY_ENDED, known)  # ended here, or it has its result (or a cancel) already
    if live is not None and live.state == SessionStatus.INITIALIZING:
        return Refused(Retry.RECOVERING.value)
    view = await host.find(sid)
    if view is None:
        return Refused(NO_SESSION)
    info = known or await view.tool_call(call_id)
    if info is None:
        return Refused(NO_CALL)
    if info.ended:
        return Refused(ALREADY_ENDED, info)
    if live is None:  # running, and not here: the session moved (or is moving) to another node
        where = await locate(host, sid, view.record)
        return Refused(where.retry.value if isinstance(where, Unavailable) else Retry.MOVED.value)
    if live.state == SessionStatus.SUSPENDED:  # being handed over: its next owner resumes the call
        return Refused(Retry.MOVING.value)
    if known is None or isinstance(live.agent.tools.get(info.name), WebhookTool | None):
        # running here (or about to be, once recovery resumes it), and not waiting for reports yet: its body starts
        return Refused(Retry.RECOVERING.value)
    return Refused(NOT_AWAITING, info)


__all__ = [
    "ALREADY_ENDED",
    "NOT_AWAITING",
    "NO_CALL",
    "NO_SESSION",
    "RETRY_CODES",
    "Refused",
    "apply_result",
    "end_landed",
    "refusal",
]
