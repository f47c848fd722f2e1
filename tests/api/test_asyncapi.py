"""The committed AsyncAPI document matches the event registry (regenerate with `make openapi`), is served, and is a
well-formed AsyncAPI 3.0 document whose schemas are valid JSON Schema and whose references all resolve."""

from __future__ import annotations

import ast
import inspect
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft7Validator

from switchboard.api.streams import events as event_routes
from switchboard.cli.main import asyncapi_spec, main
from switchboard.runtime.event_types import EVENT_PAYLOADS, EVENT_TYPES

from .conftest import Api

with warnings.catch_warnings():  # the object model's field names shadow BaseModel attributes; harmless here
    warnings.simplefilter("ignore", UserWarning)
    from asyncapi3.models.asyncapi import AsyncAPI3

SPEC = Path(__file__).resolve().parents[2] / "openapi" / "asyncapi.json"
CHANNELS = {"sessionEvents": "/v1/sessions/{sid}/events", "allEvents": "/v1/events"}


def test_committed_document_matches_the_registry():
    committed = json.loads(SPEC.read_text())
    assert committed == asyncapi_spec(), "openapi/asyncapi.json is stale: run `make openapi`"


def test_the_command_writes_the_committed_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "asyncapi.json"
    assert main(["asyncapi", "--output", str(out)]) == 0
    assert out.read_text() == SPEC.read_text()  # byte for byte: `make openapi` leaves no diff


async def test_document_is_served(api: Api):
    r = await api.client.get("/asyncapi.json")
    assert r.status_code == 200
    assert r.json() == json.loads(SPEC.read_text())
    assert "/asyncapi.json" not in api.app.openapi()["paths"]  # like /openapi.json: not an API operation


def test_document_is_well_formed_asyncapi_3():
    spec = asyncapi_spec()
    assert spec["asyncapi"] == "3.0.0"
    AsyncAPI3.model_validate(spec)  # the AsyncAPI 3.0 object model: fields, types, key patterns, bindings


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


def _resolve(spec: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = spec
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"unresolved reference {ref}"
        node = node[part]
    return node


def test_every_reference_resolves_and_every_schema_is_valid_json_schema():
    spec = asyncapi_spec()
    refs = _refs(spec)
    assert len(refs) > 100
    for ref in refs:
        _resolve(spec, ref)
    schemas = list(spec["components"]["schemas"].values())
    schemas += [message["payload"] for message in spec["components"]["messages"].values()]
    schemas += [binding for ch in spec["channels"].values() for binding in ch["bindings"]["ws"].values()
                if isinstance(binding, dict)]  # fmt: skip
    for schema in schemas:
        Draft7Validator.check_schema(schema)  # the AsyncAPI schema object is a superset of draft 07


@pytest.mark.parametrize(("channel_id", "cursor"), [("sessionEvents", False), ("allEvents", True)])
def test_every_event_type_is_a_message_of_both_streams(channel_id: str, cursor: bool):
    spec = asyncapi_spec()
    channel = spec["channels"][channel_id]
    assert channel["address"] == CHANNELS[channel_id]
    by_type = {}
    for ref in channel["messages"].values():
        message = _resolve(spec, ref["$ref"])
        by_type[message["name"]] = message
    assert set(by_type) == {*EVENT_TYPES, "ping", "pong"}
    for model in EVENT_PAYLOADS:
        payload = by_type[model.type]["payload"]
        assert payload["properties"]["type"]["const"] == model.type
        assert ("cursor" in payload["required"]) is cursor
        data = _resolve(spec, payload["properties"]["data"]["$ref"])
        assert set(data["properties"]) == set(model.model_fields)
        assert data["additionalProperties"] is False
    operation = spec["operations"]["send" + channel_id[0].upper() + channel_id[1:]]
    assert operation["action"] == "send" and operation["channel"] == {"$ref": f"#/channels/{channel_id}"}
    sent = {_resolve(spec, _resolve(spec, m["$ref"])["$ref"])["name"] for m in operation["messages"]}
    assert sent == {*EVENT_TYPES, "pong"}


def test_query_parameters_are_those_the_routes_read():
    spec = asyncapi_spec()
    session_query = spec["channels"]["sessionEvents"]["bindings"]["ws"]["query"]["properties"]
    all_query = spec["channels"]["allEvents"]["bindings"]["ws"]["query"]["properties"]
    assert set(session_query) == _query_params_read(event_routes.session_events) | {"token"}
    assert set(all_query) == _query_params_read(event_routes.all_events) | {"token"}
    assert spec["channels"]["sessionEvents"]["parameters"] == {"sid": {"description": "The session id."}}


def _query_params_read(route: Any) -> set[str]:
    """The names a route reads with ``ws.query_params.get(NAME)`` or ``_int_param(ws, NAME)``."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(route).lstrip())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[-1], ast.Constant):
            func = node.func
            reads_query = isinstance(func, ast.Attribute) and func.attr == "get" and "query_params" in ast.unparse(func)
            if reads_query or (isinstance(func, ast.Name) and func.id == "_int_param"):
                names.add(node.args[-1].value)
    return names


def _close_codes_used() -> set[int]:
    """Every close code ``api.streams.events`` passes to ``_Closed(code, ...)`` or ``_close(ws, code, ...)``."""
    codes: set[int] = set()
    for node in ast.walk(ast.parse(inspect.getsource(event_routes))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        if node.func.id in ("_Closed", "_close"):
            arg = node.args[0 if node.func.id == "_Closed" else 1]
            candidates = [arg.body, arg.orelse] if isinstance(arg, ast.IfExp) else [arg]
            for candidate in candidates:
                if isinstance(candidate, ast.Constant):
                    codes.add(candidate.value)
                elif isinstance(candidate, ast.Name):
                    codes.add(getattr(event_routes, candidate.id))
    return codes


def test_close_codes_document_every_code_the_streams_use():
    used = _close_codes_used()
    assert {1000, 1003, 1011, 4008, 4400, 4401, 4403, 4404} <= used  # the walk sees the routes' closes
    spec = asyncapi_spec()
    session_codes = {c["code"] for c in spec["channels"]["sessionEvents"]["x-close-codes"]}
    all_codes = {c["code"] for c in spec["channels"]["allEvents"]["x-close-codes"]}
    assert used <= session_codes
    assert used - {event_routes.CLOSE_NOT_FOUND} <= all_codes
    assert event_routes.CLOSE_NOT_FOUND not in all_codes  # the multi-session stream names no session
    assert all(c["meaning"] for c in spec["channels"]["sessionEvents"]["x-close-codes"])
    for channel in spec["channels"].values():
        for code in channel["x-close-codes"]:
            assert f"| {code['code']} |" in channel["description"]
