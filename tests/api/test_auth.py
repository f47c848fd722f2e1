"""API keys with scopes, per-session tokens, and the loopback-only rule when auth is off."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from switchboard.api.app import create_app
from switchboard.control.settings import ALL_SCOPES, ApiKey, Settings
from switchboard.runtime.agent import AgentRegistry

from .conftest import make_settings

ADMIN = "admin-key-0123456789abcdef"
READER = "reader-key-0123456789abcdef"
CONTROL = "control-key-0123456789abcdef"


@pytest.fixture
async def client(tmp_path: Any, registry: AgentRegistry) -> AsyncIterator[httpx.AsyncClient]:
    keys = [
        ApiKey(key=ADMIN, scopes=list(ALL_SCOPES)),
        ApiKey(key=READER, scopes=["sessions:read", "events:read"]),
        ApiKey(key=CONTROL, scopes=["sessions:control"]),
    ]
    app = create_app(make_settings(tmp_path, api_keys=keys), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_missing_invalid_and_insufficient_credentials(client: httpx.AsyncClient):
    r = await client.get("/v1/sessions")
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    assert r.headers["www-authenticate"] == "Bearer"
    r = await client.get("/v1/sessions", headers=auth("wrong-key-0123456789"))
    assert r.status_code == 401 and r.json()["code"] == "invalid_key"
    r = await client.post("/v1/sessions", json={"agent": "tester"}, headers=auth(READER))
    assert r.status_code == 403 and r.json()["code"] == "forbidden"
    r = await client.post("/v1/sessions", json={"agent": "tester", "id": "a1"}, headers=auth(ADMIN))
    assert r.status_code == 201
    assert (await client.get("/v1/sessions/a1", headers=auth(READER))).status_code == 200
    assert (await client.post("/v1/sessions/a1/input", json={"text": "x"}, headers=auth(READER))).status_code == 403
    assert (await client.post("/v1/sessions/a1/input", json={"text": "x"}, headers=auth(CONTROL))).status_code == 202
    assert (await client.get("/v1/sessions/a1", headers=auth(CONTROL))).status_code == 403
    assert (await client.get("/healthz")).status_code == 200  # probes stay open


async def test_session_tokens_read_one_session_only(client: httpx.AsyncClient):
    for sid in ("t1", "t2"):
        await client.post("/v1/sessions", json={"agent": "tester", "id": sid}, headers=auth(ADMIN))
    r = await client.post("/v1/sessions/t1/tokens", json={"ttl_s": 60}, headers=auth(READER))
    assert r.status_code == 201
    token = r.json()["token"]
    assert (await client.get("/v1/sessions/t1", headers=auth(token))).status_code == 200
    assert (await client.get("/v1/sessions/t2", headers=auth(token))).status_code == 403
    assert (await client.post("/v1/sessions/t1/input", json={"text": "x"}, headers=auth(token))).status_code == 403
    tampered = token[:-3] + ("AAA" if not token.endswith("AAA") else "BBB")
    bad = await client.get("/v1/sessions/t1", headers=auth(tampered))
    assert bad.status_code == 401 and bad.json()["code"] == "invalid_token"


async def test_expired_session_token(tmp_path: Any, registry: AgentRegistry):
    from switchboard.api.auth import issue_token

    settings = make_settings(tmp_path, api_keys=[ApiKey(key=ADMIN, scopes=list(ALL_SCOPES))])
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            await c.post("/v1/sessions", json={"agent": "tester", "id": "e1"}, headers=auth(ADMIN))
            token, _ = issue_token(settings, "e1", ttl_s=-5)
            r = await c.get("/v1/sessions/e1", headers=auth(token))
            assert r.status_code == 401 and r.json()["code"] == "token_expired"


def test_no_keys_means_loopback_only():
    s = Settings(api_keys=[])
    s.check_bind("127.0.0.1")
    s.check_bind("::1")
    s.check_bind("localhost")
    for host in ("0.0.0.0", "10.0.0.5", "::"):
        with pytest.raises(ValueError, match="refusing to bind"):
            s.check_bind(host)
    Settings(api_keys=[ApiKey(key=ADMIN, scopes=["sessions:read"])]).check_bind("0.0.0.0")


def test_api_keys_from_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SWITCHBOARD_API_KEYS", f'[{{"key": "{ADMIN}", "scopes": ["sessions:read"]}}]')
    s = Settings()
    assert s.auth_enabled and s.api_keys[0].scopes == ["sessions:read"]


async def test_a_token_never_holds_a_scope_its_minter_lacks(tmp_path: Any, registry: AgentRegistry):
    """A key that may only read sessions minted tokens holding ``events:read`` too (the key itself is refused on the
    streams): its default token now holds what the key holds, and asking for more is refused."""
    only_sessions = "only-sessions-0123456789abcdef"
    app = create_app(
        make_settings(
            tmp_path,
            api_keys=[ApiKey(key=ADMIN, scopes=list(ALL_SCOPES)), ApiKey(key=only_sessions, scopes=["sessions:read"])],
        ),
        registry=registry,
    )
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            created = await c.post("/v1/sessions", json={"agent": "tester", "id": "m1"}, headers=auth(ADMIN))
            assert created.status_code == 201
            r = await c.post("/v1/sessions/m1/tokens", json={}, headers=auth(only_sessions))
            assert r.status_code == 201 and r.json()["scopes"] == ["sessions:read"]
            token = r.json()["token"]
            assert (await c.get("/v1/sessions/m1", headers=auth(token))).status_code == 200
            asked = {"scopes": ["sessions:read", "events:read"]}
            r = await c.post("/v1/sessions/m1/tokens", json=asked, headers=auth(only_sessions))
            assert r.status_code == 403 and "events:read" in r.json()["detail"]


def test_a_token_spends_its_minters_budget():
    from switchboard.api.auth import authenticate, issue_token, key_subject

    settings = Settings(api_keys=[ApiKey(key=READER, scopes=["sessions:read", "events:read"])])
    minter = authenticate(settings, READER)
    assert minter.budget == key_subject(READER) and not minter.operator
    tokens = [issue_token(settings, sid, 60, minter=minter.budget)[0] for sid in ("s1", "s2")]
    principals = [authenticate(settings, token) for token in tokens]
    assert {p.identity for p in principals} == {"token:s1", "token:s2"}  # told apart where records are kept
    assert {p.budget for p in principals} == {minter.budget}  # charged to the one key that made them


async def test_the_openapi_document_says_where_a_session_token_is_accepted(client: httpx.AsyncClient):
    """Every operation of one session without other parameters: a token of that session is let in exactly where
    the document lists `sessionToken`, and refused (403) where it lists API keys only."""
    await client.post("/v1/sessions", json={"agent": "tester", "id": "d1"}, headers=auth(ADMIN))
    minted = await client.post("/v1/sessions/d1/tokens", json={}, headers=auth(ADMIN))
    token = minted.json()["token"]
    spec = (await client.get("/openapi.json")).json()
    tried = []
    for path, methods in spec["paths"].items():
        if path.count("{") != 1 or "{sid}" not in path or path.endswith("/ag-ui"):  # the stream is test_agui's
            continue
        for method, op in methods.items():
            body = {"agent": "tester"} if method == "post" else None
            r = await client.request(method, path.replace("{sid}", "d1"), json=body, headers=auth(token))
            documented = any("sessionToken" in requirement for requirement in op["security"])
            assert (r.status_code != 403) == documented, (method, path, r.status_code, r.text)
            tried.append(op["operationId"])
    assert {"getSession", "getChat", "closeSession", "createSessionToken", "injectInput"} <= set(tried)
