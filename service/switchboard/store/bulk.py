"""Recovery's bulk reads: rows read as the driver returns them and built into records without validating them again.

Recovery reads every chat item and tool call of every live session (100,000 items and 20,000 calls for 1,000
sessions of 100 items). Read the ordinary way, each value goes through its column type's processing, then each record
through pydantic's validation: most of recovery's CPU. Here the columns are read raw (no per-value processing), the
chat items of a session are validated by pydantic in one call on their joined JSON text (pydantic-core builds them
faster than Python could), and a tool call is built from its row with the checks its columns need (``trusted``).

What this store wrote reads back here, but for a chat item holding a lone surrogate (pydantic's JSON parser refuses
one, see ``text``). That and whatever else does not (a row edited by hand, a corrupt JSON text, a value out of its
type) makes the fast read give up (``FastReadFailed``): the caller reads those rows the ordinary way, which reads
the first and reports and skips each bad row (``Store.read_errors``), exactly as before.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, get_args

import sqlalchemy as sa
from pydantic import TypeAdapter, ValidationError

from ..runtime.chat import ChatItem
from ..runtime.tools import ProgressUpdate, ToolCallInfo, ToolScope, ToolStatus
from ..runtime.trusted import trusted
from . import models as m
from .text import ESC, decode_json_text, decode_text

# A column read as the driver returns it: no result processing (the JSON columns are read as their text, the same on
# both databases: PostgreSQL's driver would parse JSONB itself).
_RAW = sa.types.NullType()


def _raw(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    return sa.type_coerce(column, _RAW)


def _json_text(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    return sa.type_coerce(sa.cast(column, sa.Text()), _RAW)


class FastReadFailed(Exception):
    """Rows the fast read cannot vouch for: read them the ordinary way (which reports the bad ones)."""


_STATUSES = {status.value: status for status in ToolStatus}
_SCOPES = frozenset(get_args(ToolScope))
_progress_adapter: TypeAdapter[list[ProgressUpdate]] = TypeAdapter(list[ProgressUpdate])
_items_adapter: TypeAdapter[list[ChatItem]] = TypeAdapter(list[ChatItem])

# -- chat items -------------------------------------------------------------------------------------------------

ITEMS = sa.select(_raw(m.chat_items.c.session_id), _json_text(m.chat_items.c.data))


def items_of(session_ids: Sequence[str]) -> sa.Select[Any]:
    """The chat items of ``session_ids``: rows of (session id, data as stored JSON text), by session, in ``pos``
    order (their insertion order)."""
    ci = m.chat_items
    return ITEMS.where(ci.c.session_id.in_(session_ids)).order_by(ci.c.session_id, ci.c.pos)


def items_from_stored(texts: Sequence[str]) -> list[ChatItem]:
    """One session's items from their stored JSON texts (in insertion order), validated in one call."""
    joined = "[" + ",".join(texts) + "]"
    if ESC in joined:  # the store's encoding of NUL and lone surrogates (``text``): rare
        joined = decode_json_text(joined)
    try:
        return _items_adapter.validate_json(joined)
    except (ValidationError, ValueError) as err:  # a lone surrogate (pydantic's parser refuses it), a bad row
        raise FastReadFailed(str(err)) from err


# -- what the event log reports --------------------------------------------------------------------------------


def reported_of(session_ids: Sequence[str], dialect: str) -> sa.Select[Any]:
    """What the event logs of ``session_ids`` report (``Reported``): a row per session and event type, with the
    subjects of those events as one JSON array (text), in place of a row per event (150 per session)."""
    ev = m.events
    subjects = (sa.func.json_agg if dialect == "postgresql" else sa.func.json_group_array)(ev.c.subject)
    return (
        sa.select(_raw(ev.c.session_id), _raw(ev.c.type), _json_text(subjects))
        .where(ev.c.subject.is_not(None), ev.c.session_id.in_(session_ids))
        .group_by(ev.c.session_id, ev.c.type)
    )


def subjects_from_stored(text: Any) -> list[str]:
    """The subjects of a row of ``reported_of`` (decoded: ``text``)."""
    subjects = _json(text)
    if not isinstance(subjects, list) or not all(isinstance(subject, str) for subject in subjects):
        raise FastReadFailed(f"subjects {text!r} are not a list of text")
    return subjects


# -- tool calls -------------------------------------------------------------------------------------------------

_TC = m.tool_calls
TOOL_CALLS = sa.select(
    _raw(_TC.c.session_id),
    _raw(_TC.c.call_id),
    _raw(_TC.c.name),
    _raw(_TC.c.status),
    _json_text(_TC.c.arguments),
    _json_text(_TC.c.progress),
    _raw(_TC.c.output),
    _raw(_TC.c.is_error),
    _raw(_TC.c.error),
    _raw(_TC.c.cancellable),
    _raw(_TC.c.scope),
    _raw(_TC.c.background),
    _raw(_TC.c.speech_id),
    _raw(_TC.c.agent),
    _raw(_TC.c.speculative),
    _raw(_TC.c.started_at),
    _raw(_TC.c.ended_at),
)


def tool_calls_of(session_ids: Sequence[str]) -> sa.Select[Any]:
    """The tool calls of ``session_ids``, as ``Store.tool_calls`` orders them: rows for ``tool_calls_from_raw``."""
    return TOOL_CALLS.where(_TC.c.session_id.in_(session_ids)).order_by(_TC.c.started_at, _TC.c.call_id)


def tool_calls_from_raw(rows: Sequence[Sequence[Any]]) -> list[tuple[str, ToolCallInfo]]:
    """(session id, call) from each row of ``tool_calls_of``. Raises ``FastReadFailed`` if it cannot vouch for one."""
    try:
        arguments = _json_values([row[4] for row in rows])  # in one parse: a parse per row costs more than it
        calls = [_tool_call(row, args) for row, args in zip(rows, arguments, strict=True)]
    except FastReadFailed:
        raise
    except (ValueError, TypeError, KeyError) as err:  # ValidationError is a ValueError
        raise FastReadFailed(str(err)) from err
    return calls


def _tool_call(row: Sequence[Any], args: Any) -> tuple[str, ToolCallInfo]:
    (sid, call_id, name, status, _, progress, output, is_error, error, cancellable, scope, background, speech_id,
     agent, speculative, started_at, ended_at) = row  # fmt: skip
    scope = _text(scope)
    if not isinstance(args, dict) or scope not in _SCOPES:
        raise FastReadFailed(f"tool call {call_id!r}: arguments or scope out of their types")
    values = {
        "call_id": _text(call_id),
        "name": _text(name),
        "arguments": args,
        "status": _STATUSES[_text(status)],
        "cancellable": _bool(cancellable),
        "scope": scope,
        "background": _bool(background),
        "progress": _progress(progress),
        "output": _optional_text(output),
        "is_error": _bool(is_error),
        "error": _optional_text(error),
        "speech_id": _optional_text(speech_id),
        "agent": _optional_text(agent),
        "speculative": _bool(speculative),
        "started_at": _timestamp(started_at),
        "ended_at": None if ended_at is None else _timestamp(ended_at),
    }
    return _text(sid), trusted(ToolCallInfo, values)


def _json_values(texts: list[Any]) -> list[Any]:
    """Many JSON column values (stored texts) parsed in one call."""
    if not all(text.__class__ is str for text in texts):
        raise FastReadFailed("a JSON column that is not text")
    values = _json("[" + ",".join(texts) + "]")
    if len(values) != len(texts):  # a text that was not one JSON value
        raise FastReadFailed("a JSON column that is not one value")
    return values  # type: ignore[no-any-return]


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        raise FastReadFailed("a JSON column that is not text")
    return json.loads(text if ESC not in text else decode_json_text(text))


def _progress(text: Any) -> list[ProgressUpdate]:
    if text == "[]":  # most calls report no progress
        return []
    return _progress_adapter.validate_python(_json(text))


def _text(value: Any) -> str:
    if value.__class__ is not str:
        raise FastReadFailed(f"{value!r} is not text")
    return decode_text(value)


def _optional_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _bool(value: Any) -> bool:
    # SQLite keeps a boolean as 0 or 1 (SQLAlchemy checks the same)
    if value is True or value is False:
        return value
    if value == 0 or value == 1:
        return bool(value)
    raise FastReadFailed(f"{value!r} is not a boolean")


def _timestamp(value: Any) -> datetime:
    """As ``models.TZDateTime`` reads it: UTC, timezone-aware. SQLite keeps UTC as text without an offset."""
    if isinstance(value, str):
        parsed = datetime.fromisoformat(value)
        if parsed.tzinfo is not None:
            raise FastReadFailed(f"{value!r}: not as this store writes a timestamp")
        return parsed.replace(tzinfo=UTC)
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    raise FastReadFailed(f"{value!r} is not a timestamp")
