"""Credentials and headers: a session token cannot renew itself, API keys are refused in URLs (however the parameter
name is spelled) and never logged from one, a credential the server cannot compare is a 401 and not a crash,
stream positions are range-checked, every response carries the security headers, and the docs and metrics are
public or private as configured."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from switchboard.api.app import create_app
from switchboard.control.logs import redact
from switchboard.control.settings import ALL_SCOPES, ApiKey, Settings
from switchboard.integrations.signing import sign
from switchboard.integrations.webhooks import verify_signature
from switchboard.runtime.agent import AgentRegistry

from .conftest import Api, make_settings
from .test_browser_guard import ws_result
from .test_observability import AsgiWebSocket

ADMIN = "admin-key-0123456789abcdef"
READER = "reader-key-0123456789abcdef"
METRICS = "metrics-key-0123456789abcdef"
KEYS = [
    ApiKey(key=ADMIN, scopes=list(ALL_SCOPES)),
    ApiKey(key=READER, scopes=["sessions:read", "events:read"]),
    ApiKey(key=METRICS, scopes=["metrics:read"]),
]


def bearer(credential: str) -> dict[str, str]:
    return {"authorization": f"Bearer {credential}"}


@pytest.fixture
async def secured(tmp_path: Path, registry: AgentRegistry) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    app = create_app(make_settings(tmp_path, api_keys=KEYS), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            r = await client.post("/v1/sessions", json={"agent": "tester"}, headers=bearer(ADMIN))
            assert r.status_code == 201, r.text
            yield app, client, r.json()["id"]


# -- session tokens ------------------------------------------------------------------------------------------------


async def test_a_session_token_cannot_mint_tokens(secured: tuple[Any, httpx.AsyncClient, str]):
    """A 10-second token used to mint a 7-day one (minting needs sessions:read, which tokens carry), forever."""
    _, client, sid = secured
    r = await client.post(f"/v1/sessions/{sid}/tokens", json={"ttl_s": 10}, headers=bearer(READER))
    assert r.status_code == 201
    short = r.json()["token"]
    r = await client.post(f"/v1/sessions/{sid}/tokens", json={"ttl_s": 7 * 24 * 3600}, headers=bearer(short))
    assert r.status_code == 403 and r.json()["code"] == "forbidden", r.text
    assert "token" not in r.json()
    assert (await client.get(f"/v1/sessions/{sid}", headers=bearer(short))).status_code == 200  # still reads


# -- credentials in URLs -------------------------------------------------------------------------------------------


async def test_api_keys_are_refused_in_urls(secured: tuple[Any, httpx.AsyncClient, str]):
    app, client, sid = secured
    for query in (f"token={READER}", f"tok%65n={READER}", f"%74oken={ADMIN}"):
        for path in ("/v1/events", f"/v1/sessions/{sid}/events"):
            assert await ws_result(app, path, {}, query) == (4401, "key_in_url"), (query, path)
    token = (await client.post(f"/v1/sessions/{sid}/tokens", headers=bearer(READER))).json()["token"]
    assert await ws_result(app, f"/v1/sessions/{sid}/events", {}, f"tok%65n={token}") == "open"
    assert await ws_result(app, "/v1/events", bearer(READER)) == "open"  # the header is the place for a key


def test_access_log_lines_hide_tokens_however_the_name_is_spelled():
    for line in (
        f'127.0.0.1:5 - "WebSocket /v1/events?tok%65n={ADMIN}" [accepted]',
        f'"GET /v1/events?session_ids=a&%74%6F%6B%65%6E={ADMIN}&x=1 HTTP/1.1" 403',
        f"/v1/events?access%5Ftoken={ADMIN}",
        f"/v1/events?TOKEN={ADMIN}",
    ):
        clean = redact(line)
        assert ADMIN not in clean and "[redacted]" in clean, clean
    assert redact("/v1/events?cursor=5&types=tool.*") == "/v1/events?cursor=5&types=tool.*"


# -- credentials the server cannot compare -------------------------------------------------------------------------


async def test_a_non_ascii_credential_is_401_not_a_crash(secured: tuple[Any, httpx.AsyncClient, str]):
    app, client, sid = secured
    for credential in ("sbt_eyJ9.sïg", "kéy-0123456789abcdef", "sbt_é.é"):
        r = await client.get(f"/v1/sessions/{sid}", headers={"authorization": f"Bearer {credential}".encode()})
        assert r.status_code == 401, (credential, r.status_code, r.text)
        assert r.json()["code"] in ("invalid_token", "invalid_key")
        header = [(b"authorization", f"Bearer {credential}".encode())]
        ws = AsgiWebSocket(app, f"/v1/sessions/{sid}/events", headers=header)
        code, _ = await ws.closed()  # a close frame, not a dropped connection
        assert code == 4401, credential


def test_verify_signature_is_false_for_a_non_ascii_or_unencodable_value():
    secret, now = "whsec-0123456789", time.time()
    body = b'{"x": 1}'
    good = sign(secret, int(now), body)
    assert verify_signature(secret, int(now), body, good, now=now)
    assert not verify_signature(secret, int(now), body, good[:-1] + "é", now=now)
    wrong = good[:-1] + ("1" if good.endswith("0") else "0")  # one hex digit off (it may already end in "0")
    assert not verify_signature(secret, int(now), body, f"v1=ünïcode,{wrong}", now=now)
    assert verify_signature(secret, int(now), body, f"v1=ünïcode,{good}", now=now)  # rotation: any one may match
    assert not verify_signature(secret, int(now), '{"x": "\ud800"}', good, now=now)
    assert not verify_signature(secret, "\ud800", body, good, now=now)


async def test_stream_positions_beyond_64_bits_are_4400(secured: tuple[Any, httpx.AsyncClient, str]):
    app, _, sid = secured
    for path, name in ((f"/v1/sessions/{sid}/events", "since"), ("/v1/events", "cursor")):
        for value in (2**63, 2**64 + 5, 10**30):
            code, reason = await AsgiWebSocket(app, path, f"{name}={value}", headers=_auth(ADMIN)).closed()
            assert code == 4400 and name in reason, (path, value, code, reason)
        edge = AsgiWebSocket(app, path, f"{name}={2**63 - 1}", headers=_auth(ADMIN))
        await asyncio.sleep(0.2)
        assert edge.accepted and edge.close is None  # the largest position is valid: an open, silent stream
        await edge.disconnect()


def _auth(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


# -- headers -------------------------------------------------------------------------------------------------------


async def test_security_headers_on_every_response(api: Api):
    paths = {"/console/": "console", "/v1/sessions": "api", "/healthz": "api", "/nope": "api", "/docs": "docs"}
    for path, kind in paths.items():
        r = await api.client.get(path)
        assert r.headers["x-content-type-options"] == "nosniff", path
        assert r.headers["referrer-policy"] == "no-referrer", path
        assert r.headers["x-frame-options"] == "DENY", path
        csp = r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp, path
        if kind == "console":
            assert "default-src 'self'" in csp and "'unsafe-inline'" not in csp
        if kind == "api":
            assert "default-src 'none'" in csp
    big = await api.client.post("/v1/sessions", content=b"x" * 10**6, headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.headers["x-content-type-options"] == "nosniff"


async def test_security_headers_on_an_unexpected_error(api: Api, monkeypatch: pytest.MonkeyPatch):
    """An unhandled exception is answered by the framework's outermost layer, outside every middleware: that 500
    used to go out without nosniff, framing or CSP headers."""

    async def broken(**_: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(api.app.state.services.host, "list_sessions", broken)
    transport = httpx.ASGITransport(app=api.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.get("/v1/sessions")
    assert r.status_code == 500 and r.json()["code"] == "internal_error"
    assert "a bug" not in r.text
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"


# -- docs and metrics ----------------------------------------------------------------------------------------------


async def test_the_docs_page_loads_nothing_from_another_origin(api: Api):
    """FastAPI's /docs loaded Swagger UI from a CDN without an integrity check, on the console's origin (whose tabs
    hold an API key), under a policy that only refused framing."""
    page = await api.client.get("/docs")
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src" not in csp  # scripts: this origin only, none inline
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(source.startswith("/docs/") for source in sources), sources
    assert "<script>" not in page.text
    for source in sources:
        r = await api.client.get(source)
        assert r.status_code == 200 and r.content, source
        assert r.headers["content-security-policy"] == csp
    assert (await api.client.get("/redoc")).headers["location"] == "/docs"


@pytest.mark.parametrize(("public_docs", "public_metrics"), [(True, False), (False, True)])
async def test_docs_and_metrics_public_or_private_as_configured(
    tmp_path: Path, registry: AgentRegistry, public_docs: bool, public_metrics: bool
):
    settings = make_settings(tmp_path, api_keys=KEYS, public_docs=public_docs, public_metrics=public_metrics)
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            for path in ("/docs", "/redoc", "/openapi.json", "/asyncapi.json"):
                r = await client.get(path)
                ok = 308 if path == "/redoc" else 200  # to /docs
                assert r.status_code == (ok if public_docs else 401), path
                assert (await client.get(path, headers=bearer(METRICS))).status_code == ok  # any key
            r = await client.get("/metrics")
            assert r.status_code == (200 if public_metrics else 401)
            r = await client.get("/metrics", headers=bearer(READER))
            assert r.status_code == (200 if public_metrics else 403)
            r = await client.get("/metrics", headers=bearer(METRICS))
            assert r.status_code == 200 and "switchboard_sessions_live" in r.text


def test_a_short_token_secret_is_refused():
    with pytest.raises(ValidationError, match="token_secret"):
        Settings(token_secret="too-short-0123456789")
    assert len(Settings().token_secret) >= 32
