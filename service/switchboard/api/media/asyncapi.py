"""The media edge's part of the AsyncAPI document: its channel, one message per frame type (generated from the frame
models in ``runtime/media_frames.py``), its operations and close codes."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from ...runtime.media_frames import EDGE_FRAMES, SERVER_FRAMES, _Frame
from .codes import CLOSE_CODES

SCHEMAS = "#/components/schemas/"
CHANNEL = "sessionMedia"
WS_BINDING_VERSION = "0.1.0"

DESCRIPTION = """The session's media edge (docs/media-edge.md): an outside edge (a browser, a phone gateway, a LiveKit
room agent) plays the session's speeches and reports what it played; its barge-ins and transcripts drive the session.
One edge per session: a second connection replaces the first (closed with 4409). JSON text frames, each
`{"type": ..., ...}`.

Server -> edge: `speech.start`, `speech.text` (streamed as the model produces it), `speech.end`, `speech.stop` (on an
interruption: stop now; the server does not wait for an answer), `error` (a refused frame; the connection and the
session go on), `pong`, `transcript.taken` (a final transcript with an `id` is durable: taken once, whatever node or
connection it is sent again on).

Edge -> server: `playback.started`, `playback.progress`, `playback.finished`, `user.speech_started` (barge-in),
`user.transcript`, `ping`.

The transcripts of one credential (an API key, the session tokens it minted included) share one budget across all its
edges and sessions (`SWITCHBOARD_MEDIA_TRANSCRIPT_CHARS_PER_S`): over it an interim transcript is coalesced (not
stored; the next one supersedes it), a final one refused with an `error` `rate_limited` naming `retry_after_s`: keep
it and send it again then.

When the session is interrupted, the heard text is the last `playback.progress` received before the interruption and
every wait is released at once; a later report changes nothing committed. When the edge leaves mid-speech, that speech
ends interrupted at its last reported position and the session goes on with its configured playout (the simulated
clock) until an edge connects again.

In cluster mode any node takes the connection: one that does not run the session relays it to the node that does,
frames and closes unchanged; when that node cannot be reached or goes away, the edge is closed with 4410 and connects
again (to any node)."""


def _message_name(model: type[_Frame]) -> str:
    return "Media" + model.__name__.removesuffix("Frame")


def _frame_type(model: type[_Frame]) -> str:
    return str(model.model_fields["type"].default)


def media_schemas() -> dict[str, Any]:
    """The JSON schema of every frame, keyed by model name. The server's frames list every field as required (it
    always sends all of them) and no other."""
    models = [*SERVER_FRAMES, *EDGE_FRAMES]
    _, top = models_json_schema([(model, "validation") for model in models], ref_template=SCHEMAS + "{model}")
    schemas: dict[str, Any] = top["$defs"]
    for model in SERVER_FRAMES:
        schema = schemas[model.__name__]
        schema["required"] = list(schema["properties"])
        schema["additionalProperties"] = False  # what the server sends is exactly this (an edge may send more)
    for model in EDGE_FRAMES:
        schema = schemas[model.__name__]
        schema["required"] = sorted({*schema.get("required", []), "type"}, key=list(schema["properties"]).index)
    return schemas


def media_messages() -> dict[str, Any]:
    return {
        _message_name(model): {
            "name": _frame_type(model),
            "title": _frame_type(model),
            "summary": (model.__doc__ or "").strip().split("\n\n", 1)[0].replace("\n", " "),
            "description": (model.__doc__ or "").strip(),
            "contentType": "application/json",
            "payload": {"$ref": SCHEMAS + model.__name__},
        }
        for model in (*SERVER_FRAMES, *EDGE_FRAMES)
    }


def media_channel(auth_headers: dict[str, Any], token_query: dict[str, Any]) -> dict[str, Any]:
    codes = [{"code": code, "meaning": meaning} for code, meaning in CLOSE_CODES.items()]
    rows = "\n".join(f"| {c['code']} | {c['meaning']} |" for c in codes)
    return {
        "address": "/v1/sessions/{sid}/media",
        "title": "/v1/sessions/{sid}/media",
        "description": f"{DESCRIPTION}\n\nClose codes (also in `x-close-codes`):\n\n| code | meaning |\n|---|---|\n"
        f"{rows}",
        "parameters": {"sid": {"description": "The session id."}},
        "messages": {
            _message_name(model): {"$ref": f"#/components/messages/{_message_name(model)}"}
            for model in (*SERVER_FRAMES, *EDGE_FRAMES)
        },
        "bindings": {
            "ws": {
                "method": "GET",
                "query": {
                    "type": "object",
                    "properties": {
                        "token": token_query,
                        "edge_id": {
                            "type": "string",
                            "pattern": "^[A-Za-z0-9._~-]{1,64}$",
                            "description": "An id the edge chose for its run, sent with `connection` on each of its "
                            "connections.",
                        },
                        "connection": {
                            "type": "string",
                            "pattern": "^[1-9][0-9]{0,15}$",
                            "description": "This connection's number among the edge's own, counting up from 1: one "
                            "not newer than the last taken from the same `edge_id` is refused (4409) rather than "
                            "replacing it.",
                        },
                    },
                },
                "headers": auth_headers,
                "bindingVersion": WS_BINDING_VERSION,
            }
        },
        "x-close-codes": codes,
    }


def media_operations() -> dict[str, Any]:
    channel = {"$ref": f"#/channels/{CHANNEL}"}
    security = [{"$ref": "#/components/securitySchemes/bearer"}, {"$ref": "#/components/securitySchemes/token"}]

    def refs(models: tuple[type[_Frame], ...]) -> list[dict[str, str]]:
        return [{"$ref": f"#/channels/{CHANNEL}/messages/{_message_name(model)}"} for model in models]

    return {
        "sendSessionMedia": {
            "action": "send",
            "channel": channel,
            "summary": "Speeches for the edge to play (needs `media:connect`).",
            "security": security,
            "messages": refs(SERVER_FRAMES),
        },
        "receiveSessionMedia": {
            "action": "receive",
            "channel": channel,
            "summary": "The edge's playback reports, barge-ins and transcripts.",
            "messages": refs(EDGE_FRAMES),
        },
    }
