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
