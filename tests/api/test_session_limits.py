"""Sessions are bounded per caller and in time: one API key cannot fill the server, idle sessions are closed with a
stated reason, and ended sessions are deleted after their retention."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchboard.api.app import create_app
from switchboard.control.settings import ApiKey, Settings
from switchboard.runtime.agent import AgentRegistry

from .conftest import make_settings
from .test_sessions_api import until

WRITER = "writer-key-0123456789abcdef"
NEIGHBOUR = "neighbour-key-0123456789abcdef"
SCOPES = ["sessions:read", "sessions:write", "sessions:control"]
KEYS = [ApiKey(key=WRITER, scopes=SCOPES), ApiKey(key=NEIGHBOUR, scopes=SCOPES)]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
async def served(tmp_path: Path, registry: AgentRegistry, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    settings: Settings = make_settings(tmp_path, **getattr(request, "param", {}))
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield app, client


async def _create(client: httpx.AsyncClient, key: str | None = None, **body: Any) -> httpx.Response:
    return await client.post("/v1/sessions", json={"agent": "tester", **body}, headers=bearer(key) if key else None)


@pytest.mark.parametrize("served", [{"api_keys": KEYS, "max_sessions": 5, "max_sessions_per_key": 2}], indirect=True)
async def test_one_key_cannot_fill_the_server(served: Any):
    """One sessions:write key could take every one of MAX_SESSIONS, for everyone."""
    _, client = served
    mine = [await _create(client, WRITER) for _ in range(2)]
    assert [r.status_code for r in mine] == [201, 201]
    over = await _create(client, WRITER)
    assert over.status_code == 429 and over.json()["code"] == "session_quota_exceeded"
    assert over.headers["Retry-After"] and over.headers["content-type"].startswith("application/problem+json")
    # the neighbour is not affected, and closing one frees a place for its owner
    assert (await _create(client, NEIGHBOUR)).status_code == 201
    sid = mine[0].json()["id"]
    assert (await client.delete(f"/v1/sessions/{sid}", headers=bearer(WRITER))).status_code == 204
    assert (await _create(client, WRITER)).status_code == 201


@pytest.mark.parametrize("served", [{"max_sessions": 3}], indirect=True)
async def test_with_auth_off_the_only_limit_is_the_servers(served: Any):
    _, client = served
    assert [(await _create(client)).status_code for _ in range(4)] == [201, 201, 201, 429]


@pytest.mark.parametrize("served", [{"api_keys": KEYS, "max_sessions": 3, "max_sessions_per_key": 2}], indirect=True)
async def test_creates_at_the_same_moment_count_toward_the_limits_before_they_land(served: Any):
    """Creates run concurrently (their rows share group commits): the ones under way count, so neither a key's quota
    nor the server's limit is passed by creates that all checked before any landed."""
    _, client = served
    mine = await asyncio.gather(*(_create(client, WRITER) for _ in range(5)))
    assert sorted(r.status_code for r in mine) == [201, 201, 429, 429, 429]
    theirs = await asyncio.gather(*(_create(client, NEIGHBOUR) for _ in range(3)))
    assert sorted(r.status_code for r in theirs) == [201, 429, 429]  # the server's 3


async def test_creates_of_one_id_at_the_same_moment_make_one_session(served: Any):
    """The same id created five times at once: one create (201), the others answer that session (200); a different
    body for that id is a conflict (409)."""
    app, client = served
    same = await asyncio.gather(*(_create(client, WRITER, id="once", metadata={"n": 1}) for _ in range(5)))
    assert sorted(r.status_code for r in same) == [200, 200, 200, 200, 201]
    assert {r.json()["id"] for r in same} == {"once"}
    other = await _create(client, WRITER, id="once", metadata={"n": 2})
    assert other.status_code == 409, other.text
    assert app.state.services.host.live("once") is not None


def test_the_default_quota_is_half_the_server():
    assert Settings(max_sessions=1000).session_quota == 500
    assert Settings(max_sessions=1).session_quota == 1
    assert Settings(max_sessions=1000, max_sessions_per_key=10).session_quota == 10


async def _closed_event(app: Any, sid: str) -> dict[str, Any] | None:
    found = await app.state.services.store.events(sid, types=["session.closed"])
    return found[0].data if found else None


@pytest.mark.parametrize("served", [{"idle_timeout_s": 600, "housekeeping_interval_s": 0.05}], indirect=True)
async def test_idle_sessions_are_closed_with_the_reason(served: Any):
    """Idle sessions never expired: each held its memory and a place under MAX_SESSIONS forever."""
    app, client = served
    host = app.state.services.host
    now = [1000.0]
    host.clock = lambda: now[0]  # virtual time for the idle clock; housekeeping itself runs every 50 ms
    idle = (await _create(client)).json()["id"]
    busy = (
        await _create(
            client,
            llm={
                "provider": "scripted",
                "turns": [{"tool_calls": [{"name": "search", "arguments": {"query": "x", "seconds": 30}}]}],
            },
        )
    ).json()["id"]
    await client.post(f"/v1/sessions/{busy}/input", json={"text": "search"})

    async def searching() -> bool:
        calls = (await client.get(f"/v1/sessions/{busy}/tool-calls")).json()["items"]
        return bool(calls) and calls[0]["status"] == "running"

    await until(searching)
    await asyncio.sleep(0.2)
    assert host.live(idle) is not None  # not idle for long enough yet
    now[0] += 601

    async def closed() -> bool:
        return host.live(idle) is None

    await until(closed)
    assert (await client.get(f"/v1/sessions/{idle}")).json()["state"] == "closed"
    assert await _closed_event(app, idle) == {"reason": "idle"}
    assert host.live(busy) is not None  # a tool call is running: not idle, however long
    await client.delete(f"/v1/sessions/{busy}")
    assert await _closed_event(app, busy) == {}  # closed by a caller: no reason given


@pytest.mark.parametrize(
    "served", [{"closed_retention_s": 0.05, "housekeeping_interval_s": 0.05, "idle_timeout_s": 0}], indirect=True
)
async def test_ended_sessions_are_deleted_after_their_retention(served: Any):
    """Closed sessions were never purged: the store grew forever with every chat and event."""
    _, client = served
    gone = (await _create(client)).json()["id"]
    kept = (await _create(client)).json()["id"]
    await client.post(f"/v1/sessions/{gone}/say", json={"text": "Bye."})
    assert (await client.delete(f"/v1/sessions/{gone}")).status_code == 204

    async def deleted() -> bool:
        return (await client.get(f"/v1/sessions/{gone}")).status_code == 404

    await until(deleted)
    assert (await client.get(f"/v1/sessions/{kept}")).json()["state"] == "active"


@pytest.mark.parametrize("served", [{"api_keys": KEYS, "max_sessions_per_key": 1}], indirect=True)
async def test_a_create_cut_off_in_its_commit_runs_if_its_row_landed_and_is_forgotten_if_not(
    served: Any, monkeypatch: pytest.MonkeyPatch
):
    """The connection lost while the insert commits: the caller gets a 503, and the row may be there or not. One that
    landed is run by the next recovery round (not left unrun, holding its key's place for nothing); one that did
    not is forgotten, and its id can be created."""
    app, client = served
    host = app.state.services.host
    store = host.store
    insert = store.create_session

    async def lost_after_commit(rec: Any, **kw: Any) -> None:
        await insert(rec, **kw)
        raise OSError("connection reset while committing")

    async def lost_before_commit(rec: Any, **kw: Any) -> None:
        raise OSError("connection reset while committing")

    monkeypatch.setattr(store, "create_session", lost_after_commit)
    r = await _create(client, WRITER, id="landed")
    assert r.status_code == 503 and r.json()["code"] == "database_unavailable", r.text
    monkeypatch.setattr(store, "create_session", lost_before_commit)
    r = await _create(client, NEIGHBOUR, id="not-landed")
    assert r.status_code == 503 and r.json()["code"] == "database_unavailable", r.text
    monkeypatch.setattr(store, "create_session", insert)

    await host.recover_all(claim=False)  # the round each node runs every half lease
    assert host.live("landed") is not None
    found = (await client.get("/v1/sessions/landed", headers=bearer(WRITER))).json()
    assert found["state"] == "active", found
    assert (await _create(client, WRITER)).json()["code"] == "session_quota_exceeded"
    assert host.live("not-landed") is None and not host.lease.fence.owns("not-landed")
    assert (await _create(client, NEIGHBOUR, id="not-landed")).status_code == 201


@pytest.mark.parametrize(
    "served",
    [{"api_keys": KEYS, "closed_retention_s": 2, "housekeeping_interval_s": 0.05, "idle_timeout_s": 0}],
    indirect=True,
)
async def test_a_session_token_never_outlives_its_session(served: Any):
    """A 7-day token for "support-42" read the next session to take that id, once the first had been deleted."""
    _, client = served
    week = 7 * 24 * 3600
    assert (await _create(client, WRITER, id="support-42", metadata={"customer": "alice"})).status_code == 201
    r = await client.post("/v1/sessions/support-42/tokens", json={"ttl_s": week}, headers=bearer(WRITER))
    assert r.status_code == 201, r.text
    token, expires_at = r.json()["token"], datetime.fromisoformat(r.json()["expires_at"])
    assert expires_at <= datetime.now(UTC) + timedelta(seconds=2)  # deleted 2 s after it ends, at the earliest
    assert (await client.get("/v1/sessions/support-42", headers=bearer(token))).status_code == 200
    assert (await client.delete("/v1/sessions/support-42", headers=bearer(WRITER))).status_code == 204
    ended = datetime.now(UTC)
    r = await client.post("/v1/sessions/support-42/tokens", json={"ttl_s": week}, headers=bearer(WRITER))
    assert datetime.fromisoformat(r.json()["expires_at"]) <= ended + timedelta(seconds=2)  # minted once it ended

    async def deleted() -> bool:
        return (await client.get("/v1/sessions/support-42", headers=bearer(WRITER))).status_code == 404

    await until(deleted)
    assert (await _create(client, NEIGHBOUR, id="support-42", metadata={"customer": "bob"})).status_code == 201
    r = await client.get("/v1/sessions/support-42", headers=bearer(token))
    assert r.status_code == 401 and r.json()["code"] == "token_expired", r.text
