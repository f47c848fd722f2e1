"""The committed OpenAPI document matches the app (regenerate with `switchboard openapi`)."""

from __future__ import annotations

import json
from pathlib import Path

from switchboard.cli.main import openapi_spec

SPEC = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"


def test_committed_spec_matches_the_app():
    committed = json.loads(SPEC.read_text())
    assert committed == openapi_spec(), "openapi/openapi.json is stale: run `make openapi`"


def test_operation_ids_are_stable_and_documented():
    spec = openapi_spec()
    ids = []
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            assert op.get("operationId"), f"{method} {path} has no operationId"
            assert op.get("description") or op.get("summary"), f"{method} {path} is undocumented"
            ids.append(op["operationId"])
    assert len(ids) == len(set(ids))
    assert "interrupt" in ids and "cancelToolCall" in ids and "injectInput" in ids


def test_every_operation_says_which_credentials_it_needs():
    spec = openapi_spec()
    schemes = spec["components"]["securitySchemes"]
    assert schemes["apiKey"] == schemes["apiKey"] | {"type": "http", "scheme": "bearer"}
    assert schemes["reportToken"]["name"] == "X-Switchboard-Report-Token"
    ops = {op["operationId"]: op for methods in spec["paths"].values() for op in methods.values()}
    for op_id, op in ops.items():
        assert {scheme for requirement in op["security"] for scheme in requirement} <= set(schemes), op_id
        assert "**Credentials:**" in op["description"], op_id
    assert ops["healthz"]["security"] == ops["readyz"]["security"] == []
    assert ops["metrics"]["security"] == [{"apiKey": ["metrics:read"]}]
    assert ops["createSession"]["security"] == [{"apiKey": ["sessions:write"]}]
    assert ops["getChat"]["security"] == [{"apiKey": ["sessions:read"]}, {"sessionToken": ["sessions:read"]}]
    assert ops["createSessionToken"]["security"] == [{"apiKey": ["sessions:read"]}]
    assert ops["reportToolResult"]["security"] == [{"apiKey": ["tools:report"], "reportToken": []}]
    assert {"sessionTokenQuery": ["events:read"]} in ops["streamSessionAgui"]["security"]
    assert all(any(int(code) // 100 == 4 for code in op["responses"]) for op in ops.values())


def test_chat_items_are_told_apart_by_their_type():
    schemas = openapi_spec()["components"]["schemas"]
    for name in ("ChatMessage", "FunctionCall", "FunctionCallOutput", "AgentHandoff"):
        assert "type" in schemas[name]["required"], name


def test_the_document_names_its_servers_and_license():
    spec = openapi_spec()
    assert spec["servers"][0]["url"] == "/"
    assert spec["info"]["license"]["identifier"] == "Apache-2.0"
