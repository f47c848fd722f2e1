"""Conversions between runtime types and table rows. Reading never raises: a bad row becomes a ``ReadError``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from ..runtime.chat import ChatItem, chat_item_adapter
from ..runtime.events import Event
from ..runtime.pending import PendingCommand
from ..runtime.ports import reported_subject
from ..runtime.speech import SpeechInfo
from ..runtime.tools import ToolCallInfo
from .engine import CorruptJSON
from .records import IdempotencyRecord, SessionRecord

T = TypeVar("T")


class BadRow(Exception):
    """A stored row that does not convert back to its type."""


def _json(value: Any, column: str) -> Any:
    if isinstance(value, CorruptJSON):
        raise BadRow(f"{column} is not valid JSON: {value.error}")
    return value


def _validated(build: Callable[[Any], T], data: Any) -> T:
    try:
        return build(data)
    except (ValidationError, ValueError, TypeError) as err:
        raise BadRow(str(err).replace("\n", " ")) from err


# -- chat items -------------------------------------------------------------------------------------------------


def item_row(session_id: str, pos: int, item: ChatItem) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "pos": pos,
        "item_id": item.id,
        "type": item.type,
        "call_id": getattr(item, "call_id", None),
        "created_at": item.created_at,
        "data": item.model_dump(mode="json"),
    }


def item_from_row(row: Mapping[Any, Any]) -> ChatItem:
    """From a row whose ``data`` was read as JSON text (``ITEM_DATA``). Parsed by ``json`` first: unlike pydantic's
    parser it accepts the ``\\ud800`` escapes a stored lone surrogate decodes to (see ``text``)."""
    try:
        data = json.loads(row["data"])
    except ValueError as err:
        raise BadRow(f"data is not valid JSON: {err}") from err
    return _validated(chat_item_adapter.validate_python, data)


_items_adapter: TypeAdapter[list[ChatItem]] = TypeAdapter(list[ChatItem])


def items_from_texts(texts: Sequence[str]) -> list[ChatItem]:
    """Many items' ``data`` (JSON text) parsed and validated in one call: several times faster than one by one
    (recovery reads every item of every live session). Raises ``BadRow`` if any of them is bad, or holds a lone
    surrogate (pydantic's parser rejects those: ``item_from_row`` reads them)."""
    return _validated(_items_adapter.validate_json, "[" + ",".join(texts) + "]")


# -- tool calls -------------------------------------------------------------------------------------------------


def tool_call_row(session_id: str, info: ToolCallInfo) -> dict[str, Any]:
    dumped = info.model_dump(mode="json", include={"arguments", "progress"})
    return {
        "session_id": session_id,
        "call_id": info.call_id,
        "name": info.name,
        "status": info.status.value,
        "arguments": dumped["arguments"],
        "progress": dumped["progress"],
        "output": info.output,
        "is_error": info.is_error,
        "error": info.error,
        "cancellable": info.cancellable,
        "scope": info.scope,
        "background": info.background,
        "speech_id": info.speech_id,
        "agent": info.agent,
        "speculative": info.speculative,
        "started_at": info.started_at,
        "ended_at": info.ended_at,
    }


TOOL_CALL_FIELDS = (
    "call_id",
    "name",
    "status",
    "arguments",
    "progress",
    "output",
    "is_error",
    "error",
    "cancellable",
    "scope",
    "background",
    "speech_id",
    "agent",
    "speculative",
    "started_at",
    "ended_at",
)


def tool_call_from_row(row: Mapping[Any, Any]) -> ToolCallInfo:
    data = {name: row[name] for name in TOOL_CALL_FIELDS}
    data["arguments"] = _json(data["arguments"], "arguments")
    data["progress"] = _json(data["progress"], "progress")
    return _validated(ToolCallInfo.model_validate, data)


# -- speeches ---------------------------------------------------------------------------------------------------

SPEECH_FIELDS = ("id", "source", "state", "interrupted", "allow_interruptions", "text", "played_text", "created_at")


USAGE_FIELDS = ("prompt_tokens", "completion_tokens")


def speech_row(session_id: str, info: SpeechInfo) -> dict[str, Any]:
    row = {name: getattr(info, name) for name in SPEECH_FIELDS}
    row["state"] = info.state.value
    row["session_id"] = session_id
    row.update({name: getattr(info.usage, name) for name in USAGE_FIELDS})
    return row


def speech_from_row(row: Mapping[Any, Any]) -> SpeechInfo:
    data = {name: row[name] for name in SPEECH_FIELDS}
    data["usage"] = {name: row[name] for name in USAGE_FIELDS}
    return _validated(SpeechInfo.model_validate, data)


# -- pending commands -------------------------------------------------------------------------------------------


def pending_row(session_id: str, command: PendingCommand) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "id": command.id,
        "kind": command.kind,
        "state": command.state,
        "created_at": command.created_at,
        "data": command.model_dump(mode="json"),
    }


def pending_from_row(row: Mapping[Any, Any]) -> PendingCommand:
    return _validated(PendingCommand.model_validate, _json(row["data"], "data"))


# -- events -----------------------------------------------------------------------------------------------------


def event_row(event: Event) -> dict[str, Any]:
    return {
        "session_id": event.session_id,
        "seq": event.seq,
        "type": event.type,
        "at": event.at,
        "data": event.model_dump(mode="json", include={"data"})["data"],
        "subject": reported_subject(event),
    }


def event_from_row(row: Mapping[Any, Any]) -> Event:
    data = {"seq": row["seq"], "session_id": row["session_id"], "type": row["type"], "at": row["at"]}
    data["data"] = _json(row["data"], "data")
    if "id" in row:
        data["cursor"] = row["id"]
    return _validated(Event.model_validate, data)


# -- sessions and idempotency -----------------------------------------------------------------------------------

SESSION_FIELDS = tuple(SessionRecord.model_fields)


def session_row(rec: SessionRecord) -> dict[str, Any]:
    row = rec.model_dump(mode="json", include={"config", "metadata", "llm_state", "takeover"})
    row.update({name: getattr(rec, name) for name in SESSION_FIELDS if name not in row})
    return row


def session_from_row(row: Mapping[Any, Any]) -> SessionRecord:
    data = {name: row[name] for name in SESSION_FIELDS}
    for column in ("config", "metadata", "llm_state", "takeover"):
        data[column] = _json(data[column], column)
    return _validated(SessionRecord.model_validate, data)


IDEMPOTENCY_FIELDS = tuple(IdempotencyRecord.model_fields)


def idempotency_row(rec: IdempotencyRecord) -> dict[str, Any]:
    row = {name: getattr(rec, name) for name in IDEMPOTENCY_FIELDS}
    row["response_body"] = rec.model_dump(mode="json", include={"response_body"})["response_body"]
    row["state"] = rec.state.value
    return row


def idempotency_from_row(row: Mapping[Any, Any]) -> IdempotencyRecord:
    data = {name: row[name] for name in IDEMPOTENCY_FIELDS}
    data["response_body"] = _json(data["response_body"], "response_body")
    return _validated(IdempotencyRecord.model_validate, data)
