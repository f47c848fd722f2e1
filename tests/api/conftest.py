from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from switchboard.api.app import create_app
from switchboard.control.settings import Settings
from switchboard.integrations.demo import AGENTS as DEMO_AGENTS
from switchboard.runtime.agent import AgentRegistry
from tests.agents_fixture import AGENTS as TEST_AGENTS
from tests.waiting import WAIT_S


def make_settings(tmp_path: Any, **kw: Any) -> Settings:
    kw.setdefault("database_url", f"sqlite+aiosqlite:///{tmp_path}/api.db")
    kw.setdefault("words_per_second", 100.0)
    # a backstop for a request that hangs, not a claim of speed (the tests of the deadline set their own)
    kw.setdefault("request_timeout_s", WAIT_S)
    kw.setdefault("allowed_hosts", ["test"])  # the in-process client's host name (http://test)
    kw.setdefault("scripted_model", "allow")  # the tests script their sessions' models, with auth on too
    return Settings(**kw)


@pytest.fixture
def registry() -> AgentRegistry:
    return AgentRegistry({**DEMO_AGENTS, **TEST_AGENTS})


class Api:
    def __init__(self, client: httpx.AsyncClient, app: Any) -> None:
        self.client = client
        self.app = app

    async def create(self, **body: Any) -> dict[str, Any]:
        body.setdefault("agent", "tester")
        r = await self.client.post("/v1/sessions", json=body)
        assert r.status_code == 201, r.text
        return r.json()


@pytest.fixture
async def api(tmp_path: Any, registry: AgentRegistry) -> AsyncIterator[Api]:
    app = create_app(make_settings(tmp_path), registry=registry)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield Api(client, app)
