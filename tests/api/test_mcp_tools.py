"""Each MCP tool is the REST operation it says it is: the request it makes is that operation's (method, path, query
parameters, body fields) in the OpenAPI document, and the scope it states is the one the operation requires."""

from __future__ import annotations

import re
from typing import Any

import pytest

from switchboard.api.app import create_app
from switchboard.api.mcp.tools import TOOLS, McpTool
from switchboard.runtime.agent import AgentRegistry

from .conftest import make_settings

SAMPLE = {"session_id": "s1", "call_id": "c1", "text": "hello", "idempotency_key": "k1"}


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    app = create_app(make_settings(tmp_path_factory.mktemp("mcp")), registry=AgentRegistry())
    return app.openapi()


def _operation(spec: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    for template, operations in spec["paths"].items():
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path) and method.lower() in operations:
            return dict(operations[method.lower()])
    raise AssertionError(f"no operation {method} {path}")


def _schema(spec: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """A body's schema, its `$ref` (and the `anyOf` of an optional body) followed."""
    if "anyOf" in ref:
        ref = next(s for s in ref["anyOf"] if "$ref" in s)
    return dict(spec["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]])


@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: tool.name)
def test_the_tool_makes_its_rest_operations_request(spec: dict[str, Any], tool: McpTool) -> None:
    fields = tool.args.model_fields
    call = tool.request(tool.args.model_validate({k: v for k, v in SAMPLE.items() if k in fields}))
    operation = _operation(spec, call.method, call.path)
    assert operation["operationId"] == tool.operation
    assert {"apiKey": [tool.scope]} in operation["security"]  # (or a session token's, for its own session)
    query = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
    assert set(call.params) <= query, set(call.params) - query
    if call.body is not None:
        properties = _schema(spec, operation["requestBody"]["content"]["application/json"]["schema"])["properties"]
        assert set(call.body) <= set(properties), set(call.body) - set(properties)
    assert ("idempotency_key" in fields) == (call.method == "POST")  # every command takes one, as REST does
