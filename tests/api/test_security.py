"""Security, table-driven: EVERY route of the app (HTTP and WebSocket, found by walking the app, cross-checked with
the OpenAPI document) is called with no credential, with a key holding each single scope, with a key holding none,
and with a session token: 401 without a valid credential, 403 with one that lacks the route's scope, and never 401 or
403 with the right one. The scope each route needs is written once, in ``ROUTE_SCOPES``: a route missing from it
fails the test, so a new route cannot ship unguarded by accident.

Also: tampered, forged and expired session tokens on HTTP routes (test_auth_ws.py covers the WebSockets), and
webhook secrets that never reach a log line, even at DEBUG with the HTTP client's own loggers on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.routing import Mount, Route, WebSocketRoute

from switchboard.api.app import create_app
from switchboard.api.auth import TOKEN_SCOPES, issue_token
from switchboard.control.settings import ALL_SCOPES, ApiKey, Settings
from switchboard.runtime.agent import AgentRegistry
from tests.waiting import WAIT_S
from tests.webhook_backend import FakeBackend

from .conftest import make_settings
from .test_observability import AsgiWebSocket
from .test_sessions_api import until

PUBLIC = None
ANY_CREDENTIAL = "any credential"  # the MCP endpoint: each of its tools then needs its REST operation's scope
# (method, path) -> the scope it needs; PUBLIC for probes and the API's own documentation (with the default
# SWITCHBOARD_PUBLIC_DOCS=true; test_hardening.py covers both settings). "WS" for WebSockets.
# a tuple: every one of those scopes at once
ROUTE_SCOPES: dict[tuple[str, str], str | tuple[str, ...] | None] = {
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/metrics"): "metrics:read",
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/asyncapi.json"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/redoc"): PUBLIC,
    ("POST", "/v1/sessions"): "sessions:write",
    ("GET", "/v1/sessions"): "sessions:read",
    ("GET", "/v1/sessions/{sid}"): "sessions:read",
    ("GET", "/v1/cluster/nodes"): "sessions:read",
    ("DELETE", "/v1/sessions/{sid}"): "sessions:write",
    ("GET", "/v1/sessions/{sid}/chat"): "sessions:read",
    ("GET", "/v1/sessions/{sid}/export"): "sessions:read",
    ("POST", "/v1/sessions/{sid}/input"): "sessions:control",
    ("POST", "/v1/sessions/{sid}/say"): "sessions:control",
    ("POST", "/v1/sessions/{sid}/interrupt"): "sessions:control",
    ("POST", "/v1/sessions/{sid}/takeover"): "sessions:control",
    ("POST", "/v1/sessions/{sid}/takeover/say"): "sessions:control",
    ("DELETE", "/v1/sessions/{sid}/takeover"): "sessions:control",
    ("POST", "/v1/sessions/{sid}/coach"): "sessions:control",
    ("GET", "/v1/sessions/{sid}/scheduled"): "sessions:read",
    ("GET", "/v1/sessions/{sid}/scheduled/{scheduled_id}"): "sessions:read",
    ("DELETE", "/v1/sessions/{sid}/scheduled/{scheduled_id}"): "sessions:control",
    ("GET", "/v1/sessions/{sid}/speeches/{speech_id}"): "sessions:read",
    ("POST", "/v1/sessions/{sid}/tokens"): "sessions:read",
    ("GET", "/v1/sessions/{sid}/tool-calls"): "sessions:read",
    ("GET", "/v1/sessions/{sid}/tool-calls/{call_id}"): "sessions:read",
    ("POST", "/v1/sessions/{sid}/tool-calls/{call_id}/cancel"): "tools:cancel",
    ("POST", "/v1/sessions/{sid}/tool-calls/{call_id}/progress"): "tools:report",
    ("POST", "/v1/sessions/{sid}/tool-calls/{call_id}/result"): "tools:report",
    ("GET", "/v1/tool-calls"): "sessions:read",
    ("GET", "/v1/agents"): "sessions:read",
    ("GET", "/v1/agents/{name}"): "sessions:read",
    ("GET", "/v1/alerts"): "sessions:read",
    ("WS", "/v1/sessions/{sid}/events"): "events:read",
    ("WS", "/v1/events"): "events:read",
    ("WS", "/v1/sessions/{sid}/media"): "media:connect",
    ("GET", "/v1/sessions/{sid}/ag-ui"): "events:read",
    ("POST", "/mcp"): ANY_CREDENTIAL,
    ("POST", "/v1/sessions/{sid}/ag-ui"): ("sessions:control", "events:read"),
    ("POST", "/v1/agents/{agent}/ag-ui"): ("sessions:write", "sessions:control", "events:read"),
}
# routes a session token may not call even on its own session, whatever its scopes: it cannot renew itself
KEYS_ONLY = {("POST", "/v1/sessions/{sid}/tokens")}
# static files, public: the operator console (a pure client of the API above) and the docs page's Swagger UI and script
STATIC_MOUNTS = {"/console", "/docs/assets", "/docs/page"}

SID, OTHER = "sec-s", "sec-other"
BODIES = {  # a valid body where one is needed, so that the right scope is seen getting through
    "/v1/sessions": {"agent": "tester"},
    "/v1/sessions/{sid}/input": {"text": "hello"},
    "/v1/sessions/{sid}/say": {"text": "hello"},
    "/v1/sessions/{sid}/coach": {"note": "be brief"},
    "/v1/sessions/{sid}/tool-calls/{call_id}/progress": {"message": "half way", "progress": 0.5},
    "/v1/sessions/{sid}/tool-calls/{call_id}/result": {"output": "done"},
}
KEYS = {scope: f"key-{scope.replace(':', '-')}-0123456789" for scope in ALL_SCOPES}
# a key for each route that needs several scopes, holding exactly those
COMBOS = {
    needed: f"key-combo-{i}-0123456789"
    for i, needed in enumerate(v for v in ROUTE_SCOPES.values() if isinstance(v, tuple))
}
NO_SCOPE = "key-without-any-scope-0123456789"


def walk(routes: list[Any]) -> Iterator[Any]:
    """Every route, through included routers (which FastAPI may keep nested rather than flattened)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from walk(inner.routes)
        else:
            yield route


def app_routes(app: Any) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for route in walk(app.routes):
        if isinstance(route, WebSocketRoute) or type(route).__name__ == "APIWebSocketRoute":
            found.add(("WS", route.path))
        elif isinstance(route, Mount):
            assert route.path in STATIC_MOUNTS, f"unknown mount {route.path}: say what it needs in this test"
        elif isinstance(route, Route):
            found |= {(m, route.path) for m in route.methods or () if m != "HEAD"}
        else:
            raise AssertionError(f"a route of an unknown kind: {route!r}")
    return found


@pytest.fixture
async def secured(tmp_path: Path, registry: AgentRegistry) -> AsyncIterator[Any]:
    keys = [ApiKey(key=key, scopes=[scope]) for scope, key in KEYS.items()] + [ApiKey(key=NO_SCOPE, scopes=[])]
    keys += [ApiKey(key=key, scopes=list(scopes)) for scopes, key in COMBOS.items()]
    keys.append(ApiKey(key="admin-key-0123456789abcdef", scopes=list(ALL_SCOPES)))
    app = create_app(make_settings(tmp_path, api_keys=keys), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            client.headers["authorization"] = "Bearer admin-key-0123456789abcdef"
            for sid in (SID, OTHER):
                r = await client.post("/v1/sessions", json={"id": sid, "agent": "tester"})
                assert r.status_code == 201, r.text
            del client.headers["authorization"]
            yield app, client


def test_every_route_has_its_scope_in_the_table(tmp_path: Path, registry: AgentRegistry):
    app = create_app(make_settings(tmp_path), registry=registry)
    routes = app_routes(app)
    missing = routes - set(ROUTE_SCOPES)
    assert not missing, f"routes without an expected scope in ROUTE_SCOPES: {sorted(missing)}"
    gone = set(ROUTE_SCOPES) - routes
    assert not gone, f"ROUTE_SCOPES names routes that do not exist: {sorted(gone)}"
    # the walk found every operation of the OpenAPI document (and so did not miss a router's prefix)
    spec = app.openapi()
    documented = {(m.upper(), p) for p, methods in spec["paths"].items() for m in methods}
    assert documented <= routes, sorted(documented - routes)
    assert {("WS", "/v1/sessions/{sid}/events"), ("WS", "/v1/events")} <= routes


def _path(path: str, sid: str = SID) -> str:
    return path.format(
        sid=sid, speech_id="sp-1", call_id="call-1", name="tester", agent="tester", scheduled_id="sched-1"
    )


async def _http(client: httpx.AsyncClient, method: str, path: str, credential: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {credential}"} if credential else {}
    if path.endswith("/ag-ui"):  # a stream: it would not end while the session lives (or its run)
        body = _run_input(SID) if method == "POST" else None
        return await _stream_status(client._transport.app, _path(path), headers, body)  # type: ignore[attr-defined]
    body = BODIES.get(path)
    if method == "DELETE":  # with the right scope it would close the session the other cases use
        return await client.request(method, _path(path, "sec-gone"), headers=headers)
    return await client.request(method, _path(path), json=body, headers=headers)


def _run_input(sid: str) -> dict[str, Any]:
    """An AG-UI run's input on the session ``sid``."""
    return {"threadId": sid, "runId": "sec-run", "messages": [{"id": "m1", "role": "user", "content": "hello"}]}


async def _stream_status(
    app: Any, path: str, headers: dict[str, str], payload: dict[str, Any] | None = None
) -> httpx.Response:
    """A GET (or, with ``payload``, a POST) of a streaming route, in-process: a refusal in full; an accepted stream
    only its status (left at once)."""
    started: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = asyncio.get_running_loop().create_future()
    body, finished, leave, first_frame = bytearray(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    request_body = [json.dumps(payload).encode()] if payload is not None else []

    async def receive() -> dict[str, Any]:
        if request_body:
            return {"type": "http.request", "body": request_body.pop(), "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            started.set_result((message["status"], message["headers"]))
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))
            if body:
                first_frame.set()
            if not message.get("more_body"):
                finished.set()

    raw = [(b"host", b"test"), *[(k.encode(), v.encode()) for k, v in headers.items()]]
    if payload is not None:
        raw.append((b"content-type", b"application/json"))
    method = "GET" if payload is None else "POST"
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "headers": raw, "root_path": "",
             "client": ("127.0.0.1", 50000), "server": ("test", 80)}  # fmt: skip
    task = asyncio.create_task(app(scope, receive, send))
    status, response_headers = await asyncio.wait_for(started, WAIT_S)
    # a refusal in full; a stream once its first frame is out (its replay query done: none is cut off midway)
    await asyncio.wait_for((finished if status != 200 else first_frame).wait(), WAIT_S)
    leave.set()
    await asyncio.wait_for(task, WAIT_S)
    return httpx.Response(status, headers=[(k.decode(), v.decode()) for k, v in response_headers], content=bytes(body))


async def _ws(app: Any, path: str, credential: str | None) -> tuple[int, str] | str:
    """The close code and reason, or "open" when the stream was accepted and sent its first frame. A session token
    travels in ``?token=``, an API key in the header (keys are refused in URLs)."""
    in_url = credential is not None and credential.startswith("sbt_")
    query = f"token={credential}" if in_url else ""
    headers = [(b"authorization", f"Bearer {credential}".encode())] if credential and not in_url else None
    ws = AsgiWebSocket(app, _path(path), query, headers=headers)
    if path.endswith("/media"):  # a media edge is sent nothing until it speaks: a ping is answered once let in
        ws.inbox.put_nowait({"type": "websocket.receive", "text": '{"type": "ping"}'})

    async def settled() -> bool:
        return bool(ws.frames) or ws.task.done()

    await until(settled)
    if ws.frames:
        await ws.disconnect()
        return "open"
    return await ws.closed()


def _expect(needed: str | tuple[str, ...] | None, held: set[str] | None, session_ok: bool = True) -> str:
    """What a credential holding ``held`` scopes (None: no credential) gets: "401", "403" or "ok"."""
    if needed is PUBLIC:
        return "ok"
    if held is None:
        return "401"
    if needed == ANY_CREDENTIAL:
        return "ok"
    every = {needed} if isinstance(needed, str) else set(needed)
    return "ok" if every <= held and session_ok else "403"


def _got_http(r: httpx.Response) -> str:
    if r.status_code == 403 and r.json()["code"] == "report_refused":
        return "ok"  # past the scope check: the report then lacks its call's own credential (test_webhook_tools)
    if r.status_code in (401, 403):
        assert r.headers["content-type"].startswith("application/problem+json"), r.headers
        return str(r.status_code)
    return "ok"


def _got_ws(result: tuple[int, str] | str) -> str:
    if result == "open":
        return "ok"
    code = result[0]
    return {4401: "401", 4403: "403"}.get(code, "ok")


async def test_every_route_with_every_scope(secured: Any):
    app, client = secured
    credentials: dict[str, tuple[str | None, set[str] | None]] = {"none": (None, None), "no scope": (NO_SCOPE, set())}
    credentials |= {scope: (key, {scope}) for scope, key in KEYS.items()}
    credentials |= {" + ".join(scopes): (key, set(scopes)) for scopes, key in COMBOS.items()}
    mismatches = []
    checked = 0
    for (method, path), needed in sorted(ROUTE_SCOPES.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for name, (credential, held) in credentials.items():
            want = _expect(needed, held)
            if method == "WS":
                got = _got_ws(await _ws(app, path, credential))
            else:
                got = _got_http(await _http(client, method, path, credential))
            checked += 1
            if got != want:
                mismatches.append(f"{method} {path} with {name}: expected {want}, got {got}")
    assert not mismatches, "\n".join(mismatches)
    assert checked == len(ROUTE_SCOPES) * len(credentials)


async def test_every_route_with_a_session_token(secured: Any):
    """A session token holds sessions:read and events:read, for its own session only."""
    app, client = secured
    admin = {"authorization": "Bearer admin-key-0123456789abcdef"}
    token = (await client.post(f"/v1/sessions/{SID}/tokens", headers=admin)).json()["token"]
    mismatches = []
    for (method, path), needed in ROUTE_SCOPES.items():
        own = "{sid}" in path and (method, path) not in KEYS_ONLY
        want = _expect(needed, set(TOKEN_SCOPES), session_ok=own)
        if method == "WS":
            got = _got_ws(await _ws(app, path, token))
        else:
            got = _got_http(await _http(client, method, path, token))
        if got != want:
            mismatches.append(f"{method} {path}: expected {want}, got {got}")
        if "{sid}" in path and needed is not PUBLIC and method != "WS":  # and never another session's
            headers = {"authorization": f"Bearer {token}"}
            body = _run_input(OTHER) if path.endswith("/ag-ui") else BODIES.get(path)
            r = await client.request(method, _path(path, OTHER), json=body, headers=headers)
            if r.status_code != 403:
                mismatches.append(f"{method} {path} of another session: expected 403, got {r.status_code}")
    assert not mismatches, "\n".join(mismatches)


async def test_tampered_forged_and_expired_tokens_are_401_on_http(secured: Any, tmp_path: Path):
    app, client = secured
    settings: Settings = app.state.services.settings
    token, _ = issue_token(settings, SID, ttl_s=60)
    other, _ = issue_token(settings, OTHER, ttl_s=60)
    payload, _, sig = token.partition(".")
    expired, _ = issue_token(settings, SID, ttl_s=-5)
    forged, _ = issue_token(Settings(token_secret="not-the-server-secret-0123456789", api_keys=[]), SID, ttl_s=60)
    cases = {
        "bad signature": (f"{payload}.{sig[:-2]}{'AA' if not sig.endswith('AA') else 'BB'}", "invalid_token"),
        "another session's payload": (f"{other.partition('.')[0]}.{sig}", "invalid_token"),
        "no signature": (payload, "invalid_token"),
        "empty signature": (f"{payload}.", "invalid_token"),
        "garbage": ("sbt_garbage", "invalid_token"),
        "not base64": ("sbt_%%%.%%%", "invalid_token"),
        "signed by another secret": (forged, "invalid_token"),
        "expired": (expired, "token_expired"),
    }
    for name, (credential, code) in cases.items():
        for path in (f"/v1/sessions/{SID}", f"/v1/sessions/{SID}/chat", f"/v1/sessions/{SID}/tool-calls"):
            r = await client.get(path, headers={"authorization": f"Bearer {credential}"})
            assert r.status_code == 401 and r.json()["code"] == code, (name, path, r.status_code, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
    ok = await client.get(f"/v1/sessions/{SID}", headers={"authorization": f"Bearer {token}"})
    assert ok.status_code == 200  # the untouched token works: the cases above fail for what was done to them


WEBHOOK_SECRET = "whsec-never-log-me-0123456789abcdef"


async def test_webhook_secrets_never_reach_the_logs(
    tmp_path: Path, registry: AgentRegistry, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG)  # everything, the HTTP client's request logging included
    monkeypatch.setenv("SEC_WEBHOOK_SECRET", WEBHOOK_SECRET)
    async with FakeBackend(WEBHOOK_SECRET) as backend:
        obj = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}

        def hook(name: str, timeout_s: float) -> dict[str, Any]:
            return {"kind": "webhook", "name": name, "description": name, "parameters": obj, "timeout_s": timeout_s,
                    "url": backend.url(f"/tools/{name}"), "secret_env": "SEC_WEBHOOK_SECRET"}  # fmt: skip

        agents = tmp_path / "agents.yaml"
        agents.write_text(
            yaml.safe_dump([{"name": "hooks", "instructions": "x", "tools": [hook("ok", WAIT_S), hook("bad", WAIT_S)]}])
        )
        # "bad" fails once (a 500: logged, and retried), then answers; both have all the time they need, so the
        # backend is reached and the failure logged however loaded the machine is (a 0.5 s deadline left it unreached)
        backend.answers["bad"] = [(500, {"detail": "backend exploded"}), (200, {"output": "bad done"})]
        app = create_app(make_settings(tmp_path, agents_file=agents), registry=registry)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                turns = [{"text": "Both.", "tool_calls": [{"name": n, "arguments": {"q": "x"}} for n in ("ok", "bad")]}]
                body = {"agent": "hooks", "llm": {"provider": "scripted", "turns": turns}}
                sid = (await client.post("/v1/sessions", json=body)).json()["id"]
                await client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})

                async def both_ended() -> bool:
                    calls = (await client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
                    return len(calls) == 2 and all(c["status"] != "running" for c in calls)

                await until(both_ended)
                for path in (f"/v1/sessions/{sid}/tool-calls", f"/v1/sessions/{sid}/chat", "/openapi.json"):
                    assert WEBHOOK_SECRET not in (await client.get(path)).text, path
                await client.delete(f"/v1/sessions/{sid}")
        assert backend.calls and backend.bad_signatures == 0  # the secret was used: deliveries were signed with it
    assert any(r.name.startswith("switchboard.integrations.webhooks") for r in caplog.records), (
        "nothing logged: proves nothing"
    )
    for record in caplog.records:
        text = f"{record.getMessage()} {record.__dict__!r}"
        assert WEBHOOK_SECRET not in text, f"{record.name}: {record.getMessage()}"
