"""Each operation of the HTTP API as a :class:`Call`: its route, body and answer (one place for both clients)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from ._http import Call
from .models import (
    AgentInfo,
    AgentList,
    Alert,
    AlertList,
    Chat,
    CoachAccepted,
    HandBack,
    Health,
    InputAccepted,
    InterruptResult,
    SayAccepted,
    ScheduledCommand,
    ScheduledList,
    Session,
    SessionExport,
    SessionList,
    SessionToken,
    Speech,
    Takeover,
    ToolCall,
    ToolCallList,
    ToolReport,
    ToolStatus,
)

M = TypeVar("M", bound=BaseModel)
REPORT_TOKEN_HEADER = "X-Switchboard-Report-Token"  # the webhook delivery's report_token goes here
MISSING_NODES_HEADER = "Switchboard-Missing-Nodes"  # cluster mode: the nodes left out of an attention list
Role = Literal["user", "system", "developer"]
#: When a command applies: ``None`` or ``"now"`` (now), ``"idle"``, ``"after_speech"`` (or ``"after-speech"``),
#: ``"after_tool:CALL_ID"`` (or ``"after-tool:CALL_ID"``), or the request's own ``{"at": ..., "call_id"?: ...}``.
When = str | Mapping[str, Any] | None


def when_body(when: When) -> dict[str, Any] | None:
    """The ``when`` of a command's body (None: now, and the body carries none)."""
    if when is None or when == "now":
        return None
    if isinstance(when, Mapping):
        return dict(when)
    point, _, call_id = when.replace("-", "_").partition(":")
    if point == "after_tool":
        if not call_id:
            raise ValueError("after_tool needs the call's id: after_tool:CALL_ID")
        return {"at": "after_tool", "call_id": when.partition(":")[2]}
    if point not in ("idle", "after_speech") or call_id:
        raise ValueError(f"not a point of the conversation: {when!r} (idle, after_speech, after_tool:CALL_ID)")
    return {"at": point}


def _with_when(body: dict[str, Any], when: When) -> dict[str, Any]:
    point = when_body(when)
    return {**body, "when": point} if point is not None else body


TOOL_CALL_PAGE_MAX = 1000  # the largest page of tool calls the service answers


def _seg(value: str) -> str:
    """A path segment: ids are quoted so that no id can reach another route."""
    return quote(value, safe="")


def _session(sid: str, *rest: str) -> str:
    return "/".join(["/v1/sessions", _seg(sid), *(_seg(r) for r in rest)])


def _model(model: type[M]) -> Callable[[httpx.Response], M]:
    return lambda r: model.model_validate_json(r.content)


def _nothing(_: httpx.Response) -> None:
    return None


def _tool_calls(r: httpx.Response) -> ToolCallList:
    return ToolCallList.model_validate_json(r.content)


def _chat(r: httpx.Response) -> Chat:
    return Chat.model_validate_json(r.content)


def _text(r: httpx.Response) -> str:
    return r.text


def create_session(
    agent: str,
    *,
    id: str | None,
    llm: Mapping[str, Any] | None,
    playout: Mapping[str, Any] | None,
    preemptive_generation: bool | None,
    allow_interruptions: bool | None,
    max_tool_steps: int | None,
    metadata: Mapping[str, Any] | None,
    idempotency_key: str | None,
) -> Call[Session]:
    body: dict[str, Any] = {"agent": agent}
    options = {
        "id": id,
        "llm": dict(llm) if llm is not None else None,
        "playout": dict(playout) if playout is not None else None,
        "preemptive_generation": preemptive_generation,
        "allow_interruptions": allow_interruptions,
        "max_tool_steps": max_tool_steps,
        "metadata": dict(metadata) if metadata is not None else None,
    }
    body.update({k: v for k, v in options.items() if v is not None})
    return Call("POST", "/v1/sessions", _model(Session), json=body, command=True, idempotency_key=idempotency_key)


def list_sessions(
    state: str | None, cursor: str | None, limit: int | None, *, agent: str | None = None, attention: bool = False
) -> Call[SessionList]:
    given = {
        "state": state,
        "cursor": cursor,
        "limit": limit,
        "agent": agent,
        "attention": "true" if attention else None,
    }
    return Call("GET", "/v1/sessions", _session_list, params=_present(given))


def _present(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


def _session_list(r: httpx.Response) -> SessionList:
    page = SessionList.model_validate_json(r.content)
    missing = [node.strip() for node in r.headers.get(MISSING_NODES_HEADER, "").split(",") if node.strip()]
    return page.model_copy(update={"missing_nodes": missing}) if missing else page


def _agents(r: httpx.Response) -> list[AgentInfo]:
    return AgentList.model_validate_json(r.content).items


def list_agents() -> Call[list[AgentInfo]]:
    return Call("GET", "/v1/agents", _agents)


def list_alerts(
    *, include_cleared: bool = False, session_id: str | None = None, limit: int | None = None
) -> Call[list[Alert]]:
    params: dict[str, str | int] = {"state": "all" if include_cleared else "open"}
    if session_id is not None:
        params["session_id"] = session_id
    if limit is not None:
        params["limit"] = limit
    return Call("GET", "/v1/alerts", lambda r: AlertList.model_validate_json(r.content).items, params=params)


def get_agent(name: str) -> Call[AgentInfo]:
    return Call("GET", "/v1/agents/" + _seg(name), _model(AgentInfo))


def get_session(sid: str) -> Call[Session]:
    return Call("GET", _session(sid), _model(Session))


def close_session(sid: str) -> Call[None]:
    return Call("DELETE", _session(sid), _nothing)


def get_chat(sid: str, cursor: str | None) -> Call[Chat]:
    """One page of the chat; ``next_cursor`` names where the next starts."""
    return Call("GET", _session(sid, "chat"), _chat, params={"cursor": cursor} if cursor else {})


def input(
    sid: str,
    text: str,
    *,
    final: bool,
    interrupt: bool,
    force: bool,
    reply: bool,
    role: Role,
    idempotency_key: str | None,
    when: When = None,
) -> Call[InputAccepted]:
    body = {"text": text, "final": final, "interrupt": interrupt, "force": force, "reply": reply, "role": role}
    body = _with_when(body, when)
    return Call(
        "POST", _session(sid, "input"), _model(InputAccepted), json=body, command=True, idempotency_key=idempotency_key
    )


def say(
    sid: str, text: str, *, allow_interruptions: bool, add_to_chat: bool, idempotency_key: str | None, when: When = None
) -> Call[SayAccepted]:
    body = _with_when({"text": text, "allow_interruptions": allow_interruptions, "add_to_chat": add_to_chat}, when)
    return Call(
        "POST", _session(sid, "say"), _model(SayAccepted), json=body, command=True, idempotency_key=idempotency_key
    )


def interrupt(sid: str, *, force: bool, idempotency_key: str | None, when: When = None) -> Call[InterruptResult]:
    return Call(
        "POST",
        _session(sid, "interrupt"),
        _model(InterruptResult),
        json=_with_when({"force": force}, when),
        command=True,
        idempotency_key=idempotency_key,
    )


def take_over(sid: str, *, force: bool, idempotency_key: str | None) -> Call[Takeover]:
    return Call(
        "POST",
        _session(sid, "takeover"),
        _model(Takeover),
        json={"force": force},
        command=True,
        idempotency_key=idempotency_key,
    )


def coach(sid: str, note: str, *, idempotency_key: str | None) -> Call[CoachAccepted]:
    return Call(
        "POST",
        _session(sid, "coach"),
        _model(CoachAccepted),
        json={"note": note},
        command=True,
        idempotency_key=idempotency_key,
    )


def takeover_say(sid: str, text: str, *, idempotency_key: str | None) -> Call[SayAccepted]:
    return Call(
        "POST",
        _session(sid, "takeover", "say"),
        _model(SayAccepted),
        json={"text": text},
        command=True,
        idempotency_key=idempotency_key,
    )


def hand_back(sid: str, *, force: bool) -> Call[HandBack]:
    return Call("DELETE", _session(sid, "takeover"), _model(HandBack), params={"force": "true"} if force else None)


def list_scheduled(sid: str, *, pending_only: bool) -> Call[ScheduledList]:
    params = {"pending_only": "true"} if pending_only else {}
    return Call("GET", _session(sid, "scheduled"), _model(ScheduledList), params=params)


def get_scheduled(sid: str, scheduled_id: str) -> Call[ScheduledCommand]:
    return Call("GET", _session(sid, "scheduled", scheduled_id), _model(ScheduledCommand))


def cancel_scheduled(sid: str, scheduled_id: str) -> Call[ScheduledCommand]:
    return Call("DELETE", _session(sid, "scheduled", scheduled_id), _model(ScheduledCommand))


def export_session(sid: str) -> Call[SessionExport]:
    return Call("GET", _session(sid, "export"), _model(SessionExport))


def get_speech(sid: str, speech_id: str) -> Call[Speech]:
    return Call("GET", _session(sid, "speeches", speech_id), _model(Speech))


def list_tool_calls(
    sid: str, status: ToolStatus | str | None, cursor: str | None, limit: int | None
) -> Call[ToolCallList]:
    """One page of the session's tool calls; ``next_cursor`` names where the next starts."""
    params = {"status": None if status is None else str(status), "cursor": cursor, "limit": limit}
    return Call("GET", _session(sid, "tool-calls"), _tool_calls, params=_present(params))


def get_tool_call(sid: str, call_id: str) -> Call[ToolCall]:
    return Call("GET", _session(sid, "tool-calls", call_id), _model(ToolCall))


def cancel_tool_call(sid: str, call_id: str, *, force: bool, idempotency_key: str | None) -> Call[ToolCall]:
    path = _session(sid, "tool-calls", call_id, "cancel")
    body = {"force": True} if force else None
    return Call("POST", path, _model(ToolCall), json=body, command=True, idempotency_key=idempotency_key)


def list_running_tool_calls(cursor: str | None, limit: int | None) -> Call[ToolCallList]:
    """One page of the running calls across sessions; ``next_cursor`` names where the next starts."""
    params = _present({"status": "running", "cursor": cursor, "limit": limit})
    return Call("GET", "/v1/tool-calls", _tool_calls, params=params)


def create_token(
    sid: str, *, ttl_s: int | None, idempotency_key: str | None, scopes: list[str] | None = None
) -> Call[SessionToken]:
    body: dict[str, object] = {"ttl_s": ttl_s} if ttl_s is not None else {}
    if scopes:
        body["scopes"] = list(scopes)
    return Call(
        "POST", _session(sid, "tokens"), _model(SessionToken), json=body, command=True, idempotency_key=idempotency_key
    )


def _report(sid: str, call_id: str, what: str, body: dict[str, Any], token: str, key: str | None) -> Call[ToolReport]:
    path = _session(sid, "tool-calls", call_id, what)
    headers = {REPORT_TOKEN_HEADER: token}
    return Call("POST", path, _model(ToolReport), json=body, command=True, idempotency_key=key, headers=headers)


def report_tool_progress(
    sid: str, call_id: str, message: str, *, report_token: str, progress: float | None, idempotency_key: str | None
) -> Call[ToolReport]:
    body = {"message": message, "progress": progress}
    return _report(sid, call_id, "progress", body, report_token, idempotency_key)


def report_tool_result(
    sid: str, call_id: str, output: str, *, report_token: str, is_error: bool, idempotency_key: str | None
) -> Call[ToolReport]:
    body = {"output": output, "is_error": is_error}
    return _report(sid, call_id, "result", body, report_token, idempotency_key)


def health() -> Call[Health]:
    return Call("GET", "/healthz", _model(Health))


def ready() -> Call[Health]:
    # a 503 here is an answer (the database is unreachable), not a failure to retry
    return Call("GET", "/readyz", _model(Health), success=(503,))


def metrics() -> Call[str]:
    return Call("GET", "/metrics", _text)


def types_param(types: Sequence[str] | None) -> str | None:
    return ",".join(types) if types else None
