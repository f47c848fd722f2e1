"""Reads have a budget per caller: a bucket of their own (apart from commands), spent by an API key and by every
session token it minted together."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from switchboard.api.app import create_app
from switchboard.runtime.agent import AgentRegistry

from .conftest import make_settings
from .test_idempotency_callers import ADMIN, VIEWER, _served, bearer


async def test_a_keys_tokens_share_its_read_budget_and_another_key_has_its_own(tmp_path: Path, registry: AgentRegistry):
    """A read-only token could read (and export) without end: reads were counted nowhere."""
    async for app, client, sid in _served(tmp_path, registry, read_rate_per_s=2.0, read_burst=4):
        now = [time.monotonic()]

        def clock(now: list[float] = now) -> float:  # a virtual clock: no sleeping
            return now[0]

        app.state.services.reads._clock = clock
        minted = [await client.post(f"/v1/sessions/{sid}/tokens", json={}, headers=bearer(VIEWER)) for _ in range(2)]
        one, two = (r.json()["token"] for r in minted)
        url = f"/v1/sessions/{sid}"
        answers = [await client.get(url + path, headers=bearer(t)) for t, path in [(one, ""), (two, "/chat")]]
        answers += [await client.get(url, headers=bearer(VIEWER)), await client.get(url, headers=bearer(two))]
        assert [a.status_code for a in answers] == [200] * 4  # the key's burst, spent by the key and its tokens
        for credential in (one, two, VIEWER):
            limited = await client.get(url + "/export", headers=bearer(credential))
            assert limited.status_code == 429, limited.text
            assert limited.headers["content-type"].startswith("application/problem+json")
            assert limited.json()["code"] == "rate_limited" and limited.headers["Retry-After"] == "1"
            assert "reads" in limited.json()["detail"]
        # another key reads on; the key's commands are another door; what is not the API is not counted
        assert (await client.get(url, headers=bearer(ADMIN))).status_code == 200
        assert (await client.post(f"/v1/sessions/{sid}/tokens", json={}, headers=bearer(VIEWER))).status_code == 201
        assert (await client.get("/healthz", headers=bearer(VIEWER))).status_code == 200
        # refused reads spend nothing: the bucket refills at its rate
        now[0] += 0.5
        assert (await client.get(url, headers=bearer(one))).status_code == 200
        assert (await client.get(url, headers=bearer(VIEWER))).status_code == 429


async def test_with_auth_off_reads_are_not_limited(tmp_path: Path, registry: AgentRegistry):
    app = create_app(make_settings(tmp_path, read_rate_per_s=1.0, read_burst=1), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            sid = (await client.post("/v1/sessions", json={"agent": "tester"})).json()["id"]
            for _ in range(5):
                assert (await client.get(f"/v1/sessions/{sid}")).status_code == 200
