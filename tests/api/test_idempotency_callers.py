"""Idempotency records belong to their caller and hold no secret; commands are rate limited per API key."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from switchboard.api.app import create_app
from switchboard.control.settings import ApiKey
from switchboard.runtime.agent import AgentRegistry

from .conftest import make_settings

ADMIN = "admin-key-0123456789abcdef"
VIEWER = "viewer-key-0123456789abcdef"  # mints tokens for a dashboard
OTHER = "other-admin-0123456789abcdef"
KEYS = [
    ApiKey(key=ADMIN, name="ops", scopes=["sessions:read", "sessions:write", "sessions:control"]),
    ApiKey(key=VIEWER, scopes=["sessions:read"]),
    ApiKey(key=OTHER, name="ops", scopes=["sessions:read", "sessions:write", "sessions:control"]),  # same name
]


def bearer(key: str, **more: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **more}


async def _served(tmp_path: Path, registry: AgentRegistry, **settings: Any) -> AsyncIterator[tuple[Any, Any, str]]:
    app = create_app(make_settings(tmp_path, api_keys=KEYS, **settings), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            r = await client.post("/v1/sessions", json={"agent": "tester"}, headers=bearer(ADMIN))
            assert r.status_code == 201, r.text
            yield app, client, r.json()["id"]


@pytest.fixture
async def served(tmp_path: Path, registry: AgentRegistry) -> AsyncIterator[tuple[Any, Any, str]]:
    async for found in _served(tmp_path, registry):
        yield found


async def _records(app: Any) -> list[dict[str, Any]]:
    store = app.state.services.store
    async with store.engine.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT * FROM idempotency_keys"))).mappings().all()
    return [dict(row) for row in rows]


async def test_another_caller_reusing_a_key_never_gets_the_first_callers_answer(served: Any):
    """An admin reusing a dashboard key's Idempotency-Key got that holder's stored token back."""
    _, client, sid = served
    url = f"/v1/sessions/{sid}/tokens"
    mine = await client.post(url, json={"ttl_s": 600}, headers=bearer(VIEWER, **{"Idempotency-Key": "k1"}))
    assert mine.status_code == 201
    again = await client.post(url, json={"ttl_s": 600}, headers=bearer(VIEWER, **{"Idempotency-Key": "k1"}))
    assert again.headers.get("Idempotent-Replayed") == "true" and again.json() == mine.json()

    theirs = await client.post(url, json={"ttl_s": 600}, headers=bearer(ADMIN, **{"Idempotency-Key": "k1"}))
    assert theirs.status_code == 201 and "Idempotent-Replayed" not in theirs.headers
    assert theirs.json()["token"] != mine.json()["token"]
    # a different body under the other caller's key is no conflict either: it is not their key
    other = await client.post(url, json={"ttl_s": 60}, headers=bearer(OTHER, **{"Idempotency-Key": "k1"}))
    assert other.status_code == 201 and other.json()["token"] not in (mine.json()["token"], theirs.json()["token"])

    # commands too: two keys that share a name are still two callers
    say = f"/v1/sessions/{sid}/say"
    first = await client.post(say, json={"text": "Hi."}, headers=bearer(ADMIN, **{"Idempotency-Key": "s1"}))
    second = await client.post(say, json={"text": "Hi."}, headers=bearer(OTHER, **{"Idempotency-Key": "s1"}))
    assert first.status_code == second.status_code == 202
    assert "Idempotent-Replayed" not in second.headers and first.json() != second.json()


async def test_a_recorded_token_answer_holds_no_usable_token(served: Any):
    """Stored answers held issued tokens in plain text (anyone reading the database could use them)."""
    app, client, sid = served
    url = f"/v1/sessions/{sid}/tokens"
    minted = await client.post(url, json={"ttl_s": 600}, headers=bearer(VIEWER, **{"Idempotency-Key": "t1"}))
    token = minted.json()["token"]
    signature = token.rpartition(".")[2]
    records = await _records(app)
    assert len(records) == 1
    stored = json.dumps(records[0], default=str)
    assert token not in stored and signature not in stored
    assert VIEWER not in stored  # the caller is kept as a digest of its key, never the key

    # the replay is the very same token, and it works
    replay = await client.post(url, json={"ttl_s": 600}, headers=bearer(VIEWER, **{"Idempotency-Key": "t1"}))
    assert replay.headers.get("Idempotent-Replayed") == "true" and replay.json()["token"] == token
    assert (await client.get(f"/v1/sessions/{sid}", headers=bearer(token))).status_code == 200


async def test_a_sealed_record_that_does_not_check_replays_nothing(served: Any):
    """A record written under another secret (or by anyone with write access to the database) never becomes a
    token: its seal must check under this server's secret."""
    app, client, sid = served
    url = f"/v1/sessions/{sid}/tokens"
    await client.post(url, json={}, headers=bearer(VIEWER, **{"Idempotency-Key": "t2"}))
    store = app.state.services.store
    record = (await _records(app))[0]
    body = record["response_body"]
    body = json.loads(body) if isinstance(body, str) else body
    payload = body["sealed_token"].partition(".")[0]
    forged = {**body, "sealed_token": f"{payload}.{'A' * 43}"}
    async with store.engine.begin() as conn:
        await conn.execute(sa.text("UPDATE idempotency_keys SET response_body = :b"), {"b": json.dumps(forged)})
    r = await client.post(url, json={}, headers=bearer(VIEWER, **{"Idempotency-Key": "t2"}))
    assert r.status_code == 409 and r.json()["code"] == "idempotency_key_reused"
    assert "token" not in r.json() or r.json().get("token") is None


async def test_commands_are_rate_limited_per_key(tmp_path: Path, registry: AgentRegistry):
    """A 60-second read-only token wrote 3,000 idempotency rows in 18 s: nothing bounded a caller's writes."""
    async for app, client, sid in _served(tmp_path, registry, write_rate_per_s=2.0, write_burst=4):
        now = [time.monotonic()]

        def clock(now: list[float] = now) -> float:  # a virtual clock: no sleeping
            return now[0]

        app.state.services.writes._clock = clock
        say = f"/v1/sessions/{sid}/say"
        answers = [await client.post(say, json={"text": "Hi."}, headers=bearer(ADMIN)) for _ in range(3)]
        assert [a.status_code for a in answers] == [202, 202, 202]  # the burst of 4 (the create above was one)
        limited = await client.post(say, json={"text": "Hi."}, headers=bearer(ADMIN))
        assert limited.status_code == 429
        assert limited.headers["content-type"].startswith("application/problem+json")
        assert limited.json()["code"] == "rate_limited" and limited.headers["Retry-After"] == "1"
        # reads are not commands; another key has its own bucket (even under the same name)
        assert (await client.get(f"/v1/sessions/{sid}", headers=bearer(ADMIN))).status_code == 200
        assert (await client.post(say, json={"text": "Hi."}, headers=bearer(OTHER))).status_code == 202
        # refused requests spend nothing: the bucket refills at its rate
        now[0] += 0.5
        assert (await client.post(say, json={"text": "Hi."}, headers=bearer(ADMIN))).status_code == 202
        assert (await client.post(say, json={"text": "Hi."}, headers=bearer(ADMIN))).status_code == 429


async def test_with_auth_off_commands_are_not_rate_limited(tmp_path: Path, registry: AgentRegistry):
    app = create_app(make_settings(tmp_path, write_rate_per_s=1.0, write_burst=1), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            sid = (await client.post("/v1/sessions", json={"agent": "tester"})).json()["id"]
            for _ in range(5):
                assert (await client.post(f"/v1/sessions/{sid}/say", json={"text": "Hi."})).status_code == 202
