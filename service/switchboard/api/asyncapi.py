"""The AsyncAPI 3.0 document of the WebSocket event streams, generated from the event registry, and its route.

One message per event type and stream: the frame envelope (``{seq, session_id, type, at, data}``, plus ``cursor``
on the multi-session stream) with the payload model's JSON schema as ``data``. Regenerate the committed copy with
``switchboard asyncapi`` (``make openapi``); a test fails when it drifts.
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter
from pydantic.json_schema import models_json_schema

from .. import __version__
from ..runtime.event_types import EVENT_PAYLOADS, EventPayload
from .media.asyncapi import CHANNEL as MEDIA_CHANNEL
from .media.asyncapi import media_channel, media_messages, media_operations, media_schemas
from .streams.events import CLOSE_CODES, CLOSE_NOT_FOUND
from .streams.session_stream import TERMINAL_EVENTS

ASYNCAPI_VERSION = "3.0.0"
WS_BINDING_VERSION = "0.1.0"
SCHEMAS = "#/components/schemas/"

router = APIRouter()

DESCRIPTION = """Events of live agent sessions over WebSocket: every state change of a session (speech, tools,
agent state, chat items) as a frame `{seq, session_id, type, at, data}`. Each session's `seq` increases by one per
event with no gaps; an event is sent only once what it reports is durable, so a client that resumes from the last
`seq` (or `cursor`) it saw receives every later event exactly once, in order, across reconnects and restarts.

Clients may send `{"type": "ping"}` at any time; the server answers `{"type": "pong"}`."""

_TYPES_QUERY = {
    "type": "string",
    "description": "Comma-separated glob patterns of event types to receive, e.g. `tool.*,speech.*` (default: all).",
    "examples": ["tool.*,speech.*"],
}
_TOKEN_QUERY = {
    "type": "string",
    "description": "An API key or a session token, for clients that cannot send an `Authorization: Bearer` header. "
    "Not needed when authentication is off.",
}

_SESSION_QUERY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "since": {
            "type": "integer",
            "minimum": 0,
            "default": 0,
            "description": "Replay the stored events with `seq` greater than this, then stream live ones.",
        },
        "types": _TYPES_QUERY,
        "format": {
            "enum": ["switchboard", "ag-ui"],
            "default": "switchboard",
            "description": "`ag-ui`: each frame is an AG-UI event (the `ag-ui-protocol` models; docs/ag-ui.md), not a "
            'Switchboard event; the last frame made from a session event carries `rawEvent: {"seq": N}`, the `since` '
            "to resume from. Cannot be combined with `types`.",
        },
        "token": _TOKEN_QUERY,
    },
}
_ALL_QUERY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "cursor": {
            "oneOf": [{"type": "integer", "minimum": 0}, {"const": "now"}],
            "default": 0,
            "description": "Replay the stored events after this position in the global log (each frame carries its "
            "`cursor`), then stream live ones. `now` starts at the live tail without replaying history.",
        },
        "session_ids": {
            "type": "string",
            "description": "Comma-separated session ids to follow (default: every session).",
        },
        "types": _TYPES_QUERY,
        "token": _TOKEN_QUERY,
    },
}
_AUTH_HEADERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "Authorization": {"type": "string", "description": "`Bearer <API key or session token>`."},
    },
}


def _payload_schemas() -> dict[str, Any]:
    """The JSON schema of every payload model (and of what they nest), keyed by model name."""
    _, top = models_json_schema(
        [(model, "serialization") for model in EVENT_PAYLOADS], ref_template=SCHEMAS + "{model}"
    )
    schemas: dict[str, Any] = top["$defs"]
    payload_names = {model.__name__ for model in EVENT_PAYLOADS}
    for name, schema in schemas.items():
        if name not in payload_names and "properties" in schema:
            # nested models (chat items) are always dumped whole: a field with a default is present all the same
            schema["required"] = list(schema["properties"])
    converted: dict[str, Any] = _asyncapi_discriminators(schemas)
    return converted


def _asyncapi_discriminators(node: Any) -> Any:
    """AsyncAPI's ``discriminator`` is the property name (OpenAPI's is an object with a mapping)."""
    if isinstance(node, dict):
        return {
            key: value["propertyName"]
            if key == "discriminator" and isinstance(value, dict)
            else _asyncapi_discriminators(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_asyncapi_discriminators(value) for value in node]
    return node


def _frame(model: type[EventPayload], *, cursor: bool) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    if cursor:
        properties["cursor"] = {
            "type": "integer",
            "minimum": 1,
            "description": "Position in the global log (commit order, across every node of a cluster): resume this "
            "stream with `cursor=<it>` on any node.",
        }
    properties |= {
        "seq": {"type": "integer", "minimum": 1, "description": "Position in the session's log, gap-free."},
        "session_id": {"type": "string"},
        "type": {"type": "string", "const": model.type},
        "at": {"type": "string", "format": "date-time", "description": "When the event was logged (UTC)."},
        "data": {"$ref": SCHEMAS + model.__name__},
    }
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _summary(model: type[EventPayload]) -> str:
    return (model.__doc__ or model.type).strip().split("\n\n", 1)[0].replace("\n", " ")


def _messages() -> dict[str, Any]:
    messages: dict[str, Any] = {}
    for model in EVENT_PAYLOADS:
        for suffix, cursor in (("", False), ("WithCursor", True)):
            messages[model.__name__ + suffix] = {
                "name": model.type,
                "title": model.type,
                "summary": _summary(model),
                "contentType": "application/json",
                "payload": _frame(model, cursor=cursor),
            }
    for kind, summary in (("ping", "Keep-alive from the client."), ("pong", "The server's answer to a ping.")):
        messages[kind.capitalize()] = {
            "name": kind,
            "title": kind,
            "summary": summary,
            "contentType": "application/json",
            "payload": {
                "type": "object",
                "properties": {"type": {"type": "string", "const": kind}},
                "required": ["type"],
            },
        }
    return messages


def _close_codes(*, session_stream: bool) -> list[dict[str, Any]]:
    return [
        {"code": code, "meaning": meaning}
        for code, meaning in CLOSE_CODES.items()
        if session_stream or code != CLOSE_NOT_FOUND
    ]


def _close_table(codes: list[dict[str, Any]]) -> str:
    rows = "\n".join(f"| {c['code']} | {c['meaning']} |" for c in codes)
    return f"Close codes (also in `x-close-codes`):\n\n| code | meaning |\n|---|---|\n{rows}"


def _channel(
    address: str, description: str, query: dict[str, Any], *, cursor: bool, parameters: dict[str, Any] | None = None
) -> dict[str, Any]:
    suffix = "WithCursor" if cursor else ""
    messages: dict[str, Any] = {
        model.__name__: {"$ref": f"#/components/messages/{model.__name__}{suffix}"} for model in EVENT_PAYLOADS
    }
    messages |= {kind: {"$ref": f"#/components/messages/{kind}"} for kind in ("Ping", "Pong")}
    codes = _close_codes(session_stream=not cursor)
    channel: dict[str, Any] = {
        "address": address,
        "title": address,
        "description": f"{description}\n\n{_close_table(codes)}",
        "messages": messages,
        "bindings": {
            "ws": {"method": "GET", "query": query, "headers": _AUTH_HEADERS, "bindingVersion": WS_BINDING_VERSION}
        },
        "x-close-codes": codes,
    }
    if parameters:
        channel["parameters"] = parameters
    return channel


def _operations(channel_id: str, summary: str) -> dict[str, Any]:
    channel = {"$ref": f"#/channels/{channel_id}"}
    security = [{"$ref": "#/components/securitySchemes/bearer"}, {"$ref": "#/components/securitySchemes/token"}]
    sent = [model.__name__ for model in EVENT_PAYLOADS] + ["Pong"]
    name = channel_id[0].upper() + channel_id[1:]
    return {
        f"send{name}": {
            "action": "send",
            "channel": channel,
            "summary": summary,
            "security": security,
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{message}"} for message in sent],
        },
        f"receive{name}Ping": {
            "action": "receive",
            "channel": channel,
            "summary": "Client keep-alive; answered with a pong.",
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/Ping"}],
        },
    }


@functools.cache
def asyncapi_spec() -> dict[str, Any]:
    """The AsyncAPI document (built once: it depends only on the code)."""
    terminal = " and ".join(f"`{t}`" for t in TERMINAL_EVENTS)
    session_channel = _channel(
        "/v1/sessions/{sid}/events",
        "One session's events: those stored after `since` are replayed, then live ones follow, without gap or "
        f"duplicate. The stream ends (close 1000) after {terminal}, which are sent even when `types` filters them "
        "out.",
        _SESSION_QUERY,
        cursor=False,
        parameters={"sid": {"description": "The session id."}},
    )
    all_channel = _channel(
        "/v1/events",
        "Events of many sessions (all, or those in `session_ids`), each frame with the `cursor` to resume from. "
        "A session token cannot open this stream.",
        _ALL_QUERY,
        cursor=True,
    )
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "Switchboard event streams and media edge",
            "version": __version__,
            "description": DESCRIPTION,
        },
        "defaultContentType": "application/json",
        "channels": {
            "sessionEvents": session_channel,
            "allEvents": all_channel,
            MEDIA_CHANNEL: media_channel(_AUTH_HEADERS, _TOKEN_QUERY),
        },
        "operations": {
            **_operations("sessionEvents", "Stream one session's events."),
            **_operations("allEvents", "Stream the events of many sessions."),
            **media_operations(),
        },
        "components": {
            "schemas": _payload_schemas() | media_schemas(),
            "messages": _messages() | media_messages(),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "`Authorization: Bearer <API key or session token>` (needs `events:read`; the "
                    "media edge needs `media:connect`).",
                },
                "token": {
                    "type": "httpApiKey",
                    "name": "token",
                    "in": "query",
                    "description": "The same credential as a `token` query parameter.",
                },
            },
        },
    }


@router.get("/asyncapi.json", include_in_schema=False)
async def asyncapi_document() -> dict[str, Any]:
    return asyncapi_spec()
