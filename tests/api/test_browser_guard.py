"""Web pages cannot reach a service running with auth off (the ``make run`` default): a foreign ``Host`` (DNS
rebinding) or ``Origin`` is refused on HTTP (403) and WebSocket (1008), a command's body must be JSON (415: a page's
cross-origin form or text POST needs no preflight), and "" / 0.0.0.0 / :: are not loopback addresses to bind.
With auth on, any Host is served, and WebSocket origins are checked when ``SWITCHBOARD_ALLOWED_ORIGINS`` is set."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchboard.api.app import create_app
from switchboard.control.settings import ALL_SCOPES, ApiKey, Settings
from switchboard.runtime.agent import AgentRegistry

from .conftest import Api, make_settings
from .test_observability import AsgiWebSocket
from .test_sessions_api import until

ADMIN = "admin-key-0123456789abcdef"
EVIL = "http://evil.example"


async def ws_result(app: Any, path: str, headers: dict[str, str], query: str = "") -> tuple[int, str] | str:
    """ "open" when the stream sent its first frame, else its close code and reason."""
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    ws = AsgiWebSocket(app, path, query, headers=raw)

    async def settled() -> bool:
        return bool(ws.frames) or ws.task.done()

    await until(settled)
    if ws.frames:
        await ws.disconnect()
        return "open"
    return await ws.closed()


@pytest.fixture
async def app_and_client(tmp_path: Path, registry: AgentRegistry) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    app = create_app(make_settings(tmp_path, allowed_hosts=[]), registry=registry)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as client:
            yield app, client


async def test_foreign_host_is_refused_with_auth_off(app_and_client: tuple[Any, httpx.AsyncClient]):
    """DNS rebinding: a page at rebind.evil.example whose name now resolves to 127.0.0.1 talks to the service with
    its own name in Host (and, being same-origin to itself, sends no Origin on a GET)."""
    app, client = app_and_client
    r = await client.get("/v1/sessions", headers={"host": "rebind.evil.example:8080"})
    assert r.status_code == 403 and r.json()["code"] == "host_not_allowed", r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    r = await client.post("/v1/sessions", json={"agent": "tester"}, headers={"host": "rebind.evil.example"})
    assert r.status_code == 403
    assert (await client.get("/v1/sessions")).json()["items"] == []  # and nothing was created
    for host in ("127.0.0.1:8080", "localhost", "LOCALHOST:1", "127.4.5.6", "[::1]:8080", "localhost."):
        r = await client.get("/v1/sessions", headers={"host": host})
        assert r.status_code == 200, (host, r.text)
    for host in ("0.0.0.0:8080", "[::]", "10.0.0.1", "localhost.evil.example", "127.0.0.1.nip.io"):
        r = await client.get("/healthz", headers={"host": host})
        assert r.status_code == 403, host
    result = await ws_result(app, "/v1/events", {"host": "rebind.evil.example"})
    assert result == (1008, "host_not_allowed")


async def test_foreign_origin_is_refused_with_auth_off(app_and_client: tuple[Any, httpx.AsyncClient]):
    app, client = app_and_client
    sid = (await client.post("/v1/sessions", json={"agent": "tester"})).json()["id"]
    # a cross-origin page streaming every session's transcript
    assert await ws_result(app, "/v1/events", {"host": "127.0.0.1:8080", "origin": EVIL}) == (
        1008,
        "origin_not_allowed",
    )
    session_ws = f"/v1/sessions/{sid}/events"
    assert (await ws_result(app, session_ws, {"host": "localhost:8080", "origin": "null"}))[0] == 1008
    # a cross-origin POST (JSON would need a preflight the service never answers; this one does not)
    r = await client.post(f"/v1/sessions/{sid}/interrupt", json={}, headers={"origin": EVIL})
    assert r.status_code == 403 and r.json()["code"] == "origin_not_allowed"
    # loopback pages (the console, a local dashboard on another port) and clients that send no Origin are served
    for origin in ("http://127.0.0.1:8080", "http://localhost:3000", "https://[::1]", None):
        headers = {"host": "127.0.0.1:8080", **({"origin": origin} if origin else {})}
        assert await ws_result(app, "/v1/events", headers) == "open", origin
        r = await client.post(f"/v1/sessions/{sid}/say", json={"text": "hi"}, headers=headers)
        assert r.status_code == 202, (origin, r.text)


async def test_command_bodies_must_be_json(app_and_client: tuple[Any, httpx.AsyncClient]):
    """A form-encoded POST /interrupt from any page (a "simple" request: no preflight) used to succeed."""
    _, client = app_and_client
    sid = (await client.post("/v1/sessions", json={"agent": "tester"})).json()["id"]
    for content_type in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x", None):
        headers = {"content-type": content_type} if content_type else {}
        for path, body in (
            (f"/v1/sessions/{sid}/interrupt", b"force=true"),
            (f"/v1/sessions/{sid}/say", b'{"text":"x"}'),
        ):
            r = await client.post(path, content=body, headers=headers)
            assert r.status_code == 415 and r.json()["code"] == "unsupported_media_type", (content_type, path, r.text)
    ok = {"content-type": "application/json; charset=utf-8"}
    assert (await client.post(f"/v1/sessions/{sid}/say", content=b'{"text":"x"}', headers=ok)).status_code == 202
    # no body at all stays fine (interrupt's body is optional; DELETE has none)
    assert (await client.post(f"/v1/sessions/{sid}/interrupt")).status_code in (200, 409)
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204


async def test_with_auth_on_any_host_and_checked_websocket_origins(tmp_path: Path, registry: AgentRegistry):
    ops = "https://ops.example.com"
    keys = [ApiKey(key=ADMIN, scopes=list(ALL_SCOPES))]
    for allowed in ([], [ops]):
        settings = make_settings(tmp_path, api_keys=keys, allowed_hosts=[], allowed_origins=allowed)
        app = create_app(settings, registry=registry)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            auth = {"authorization": f"Bearer {ADMIN}"}
            async with httpx.AsyncClient(transport=transport, base_url="http://switchboard.internal") as client:
                assert (await client.get("/v1/sessions", headers=auth)).status_code == 200  # behind a proxy
                r = await client.post("/v1/sessions", json={"agent": "tester"}, headers=auth)
                assert r.status_code == 201  # its events are the first frame of an open stream
                r = await client.get("/v1/sessions", headers={**auth, "origin": EVIL})
                assert r.status_code == 200  # a page holds no key: HTTP origins do not matter with auth on
            base = {**auth, "host": "switchboard.internal"}
            own = {**base, "origin": "https://switchboard.internal"}
            assert await ws_result(app, "/v1/events", own) == "open"
            assert await ws_result(app, "/v1/events", {**base, "origin": ops}) == "open"
            evil = await ws_result(app, "/v1/events", {**base, "origin": EVIL})
            assert evil == ("open" if not allowed else (1008, "origin_not_allowed"))


def test_all_interfaces_are_not_loopback():
    for host in ("", "0.0.0.0", "::", "10.1.2.3", "example.com"):
        with pytest.raises(ValueError, match="refusing to bind"):
            Settings(host=host).check_bind()
        with pytest.raises(ValueError, match="refusing to bind"):
            Settings().check_bind(host)
    for host in ("127.0.0.1", "127.9.9.9", "localhost", "::1"):
        Settings(host=host).check_bind()
    Settings(host="", api_keys=[ApiKey(key=ADMIN, scopes=["sessions:read"])]).check_bind()  # auth on: anywhere


def test_allowed_hosts_and_origins_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SWITCHBOARD_ALLOWED_HOSTS", "Switchboard.LAN., ops.internal")
    monkeypatch.setenv("SWITCHBOARD_ALLOWED_ORIGINS", '["https://Ops.example.com/"]')
    settings = Settings()
    assert settings.allowed_hosts == ["switchboard.lan", "ops.internal"]
    assert settings.allowed_origins == ["https://ops.example.com"]


async def test_an_allowed_host_is_served_with_auth_off(api: Api):
    """tests/api/conftest.py allows the in-process client's host name, "test"."""
    assert (await api.client.get("/v1/sessions")).status_code == 200
    r = await api.client.get("/v1/sessions", headers={"host": "tester"})
    assert r.status_code == 403
