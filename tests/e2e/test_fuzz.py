"""Schema fuzzing: schemathesis generates requests from the committed ``openapi/openapi.json`` (valid and invalid
ones) and sends them to a real server on loopback. Every response must be documented: no 5xx, a status code the spec
lists for the operation, its content type, a body that matches its schema.

Bounded for CI: ``FUZZ_EXAMPLES`` generated examples per operation (plus schemathesis' explicit and coverage cases),
derandomized (a fixed seed) when ``CI=true``. Locally, raise the budget with ``SWITCHBOARD_FUZZ_EXAMPLES=500``; runs
outside CI are randomized, so each one explores a little more.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.retryable import retried_sync

from .server import ROOT, Server

pytestmark = pytest.mark.e2e

CI = os.environ.get("CI") == "true"
FUZZ_EXAMPLES = int(os.environ.get("SWITCHBOARD_FUZZ_EXAMPLES", "15"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
LIVE, CLOSED = "fz-live", "fz-closed"  # sessions that exist, so that generated requests reach more than 404s

schema = schemathesis.openapi.from_path(ROOT / "openapi" / "openapi.json")
sent: Counter[str] = Counter()  # requests per operation, reported at the end of the module
statuses: Counter[int] = Counter()


@schema.hook
def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any]) -> Any:
    """Half of the generated session ids are replaced by sessions that exist (live, closed)."""
    if not path_parameters or "sid" not in path_parameters:
        return st.just(path_parameters)
    return st.sampled_from([None, LIVE, CLOSED]).map(
        lambda sid: path_parameters if sid is None else {**path_parameters, "sid": sid}
    )


@schema.hook
def flatmap_body(context: Any, body: Any) -> Any:
    """Some generated sessions name an agent that exists (and no model config), so that creation succeeds too."""
    operation = getattr(context, "operation", None)
    if getattr(operation, "path", None) != "/v1/sessions" or not isinstance(body, dict) or "agent" not in body:
        return st.just(body)
    plain = {k: v for k, v in body.items() if k not in ("llm", "id")}
    return st.sampled_from([body, {**body, "agent": "tester"}, {**plain, "agent": "tester"}])


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("fuzz"), SWITCHBOARD_REQUEST_TIMEOUT_S="5").start()
    turns = [
        {"text": "Working.", "tool_calls": [{"name": "search", "arguments": {"query": "fuzz", "seconds": 600}}]},
    ]
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as client:
            # the server's 5 s deadline can pass on a loaded machine: setup retries as a client does (a create
            # under the same id and options, the input under its key, are applied once)
            for sid in (LIVE, CLOSED):
                body = {"id": sid, "agent": "tester", "llm": {"provider": "scripted", "turns": turns}}
                assert retried_sync(lambda body=body: client.post("/v1/sessions", json=body)).status_code in (200, 201)
            key = {"Idempotency-Key": "fuzz-setup-input"}
            go = retried_sync(lambda: client.post(f"/v1/sessions/{LIVE}/input", json={"text": "go"}, headers=key))
            assert go.status_code == 202
            assert retried_sync(lambda: client.delete(f"/v1/sessions/{CLOSED}")).status_code == 204
        yield srv
    finally:
        srv.stop()
        if sent:
            total = sum(sent.values())
            by_status = ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))
            print(f"\nfuzz: {total} requests over {len(sent)} operations ({by_status})")
            print(json.dumps(dict(sorted(sent.items())), indent=1))
        logs = srv.logs()
        assert "Traceback" not in logs, logs[-3000:]


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=CI,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_responses_match_the_spec(case: schemathesis.Case, fuzz_server: Server, http: requests.Session) -> None:
    response = case.call_and_validate(base_url=fuzz_server.url, session=http, checks=CHECKS, timeout=15)
    sent[f"{case.method} {case.path}"] += 1
    statuses[response.status_code] += 1


def test_the_spec_documents_problem_answers() -> None:
    """Every /v1 operation documents its problem answers as application/problem+json with the Problem schema."""
    spec = json.loads((Path(ROOT) / "openapi" / "openapi.json").read_text())
    for path, methods in spec["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, op in methods.items():
            problems = {code: r for code, r in op["responses"].items() if int(code) >= 400}
            assert {"401", "403", "422", "503"} <= set(problems), (method, path, sorted(problems))
            if "{sid}" in path:
                assert "404" in problems, (method, path)
            if method == "post":
                assert {"400", "408", "409", "413"} <= set(problems), (method, path, sorted(problems))
            for code, response in problems.items():
                assert list(response["content"]) == ["application/problem+json"], (method, path, code)
                assert response["content"]["application/problem+json"]["schema"] == {
                    "$ref": "#/components/schemas/Problem"
                }
