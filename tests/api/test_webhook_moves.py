"""A webhook call whose session moves while its backend works, through the API: a report that reaches a copy of the
session another node has just taken over (this node has not learnt it yet) is not applied and answers 503
``session_moved``, with its idempotency key left free; the backend's retry under the same key reaches the owner that
resumed the call and is applied there. Here the other owner is this node started again on the same database (the
single-node restart resumes calls the same way a failover does)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from switchboard.api.app import create_app
from switchboard.control.settings import Settings
from switchboard.integrations.webhooks import WebhookTool
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.status import SessionStatus
from tests.agents_fixture import AGENTS as TEST_AGENTS
from tests.waiting import WAIT_S, until
from tests.webhook_backend import FakeBackend

from .conftest import make_settings
from .test_sessions_api import assert_problem
from .test_webhook_tools import SECRET, SECRET_ENV, Hooks, agents_file, call_turn

KEY = {"Idempotency-Key": "report-1"}


@pytest.fixture
async def backend() -> AsyncIterator[FakeBackend]:
    async with FakeBackend(SECRET) as b:
        yield b


@pytest.fixture
def settings(tmp_path: Path, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    path = agents_file(tmp_path, backend)
    agents = yaml.safe_load(path.read_text())
    for tool in agents[0]["tools"]:
        if tool["name"] == "lookup":
            tool["timeout_s"] = 4 * WAIT_S  # the call outlives two starts of the service on a loaded machine
    path.write_text(yaml.safe_dump(agents))
    return make_settings(tmp_path, agents_file=path)


@asynccontextmanager
async def serving(settings: Settings, backend: FakeBackend) -> AsyncIterator[Hooks]:
    """One process of the service, started on the database (it recovers what is live there), then stopped."""
    app = create_app(settings, registry=AgentRegistry(TEST_AGENTS))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            hooks = Hooks(client, backend)
            hooks.app = app  # type: ignore[attr-defined]
            yield hooks


def sql(settings: Settings, statement: str, *args: Any) -> list[tuple[Any, ...]]:
    path = settings.database_url.split("///", 1)[1]
    with sqlite3.connect(path, timeout=WAIT_S) as conn:
        return conn.execute(statement, args).fetchall()


def take_over(settings: Settings, sid: str) -> None:
    """Another node adopts the session (its epoch moves on); this node has not heard of it yet."""
    sql(settings, "UPDATE sessions SET owner_node = 'node-b', owner_epoch = owner_epoch + 1 WHERE id = ?", sid)


def stored_call(settings: Settings, call_id: str) -> tuple[str, str | None]:
    ((status, output),) = sql(settings, "SELECT status, output FROM tool_calls WHERE call_id = ?", call_id)
    return status, output


async def running_lookup(hooks: Hooks, backend: FakeBackend) -> tuple[str, str]:
    backend.answers["lookup"] = [(202, None)]
    turns = [call_turn("lookup", "Checking."), {"text": "Still checking."}, {"text": "Found: {{tool_output:lookup}}"}]
    sid = await hooks.session(*turns)
    call_id = str((await backend.next("call"))["call_id"])
    await hooks.call(sid, "lookup", "running")
    return sid, call_id


async def test_a_result_that_reaches_a_stale_copy_is_not_applied_and_its_retry_reaches_the_new_owner(
    settings: Settings, backend: FakeBackend
) -> None:
    async with serving(settings, backend) as hooks:
        sid, call_id = await running_lookup(hooks, backend)
        token = hooks.token(sid, call_id)
        take_over(settings, sid)
        r = await hooks.result(sid, call_id, "shipped on Monday", headers=KEY)
        # the call took the result, but its end was refused by the fence: nothing landed, the backend retries
        assert_problem(r, 503, "session_moved")
        assert r.headers["retry-after"] == "1"
        assert stored_call(settings, call_id) == ("running", None)
        assert sql(settings, "SELECT state FROM idempotency_keys WHERE key = ?", KEY["Idempotency-Key"]) == []
        # this node let go of the session: a retry here is sent on (here: the owner is not live, retry later)
        again = await hooks.result(sid, call_id, "shipped on Monday", headers=KEY)
        assert again.status_code == 503 and again.json()["code"] in ("session_moved", "session_moving"), again.text

    async with serving(settings, backend) as owner:  # the session's next owner: it resumes the call
        query = "SELECT data FROM events WHERE session_id = ? AND type = 'session.recovered'"
        recovered = await until(lambda: sql(settings, query, sid))
        assert json.loads(recovered[-1][0])["resumed_calls"] == [call_id]
        r = await owner.client.post(
            f"/v1/sessions/{sid}/tool-calls/{call_id}/result",
            json={"output": "shipped on Monday"},
            headers={"X-Switchboard-Report-Token": str(token), **KEY},
        )
        assert r.status_code == 200 and r.json() == {"call_id": call_id, "status": "completed"}, r.text
        assert "idempotent-replayed" not in r.headers  # applied now, not the stale copy's answer replayed
        assert stored_call(settings, call_id) == ("completed", "shipped on Monday")
        await owner.said(sid, "Found: shipped on Monday")
        assert len(backend.calls) == 1  # the backend was never asked twice


async def test_a_report_while_the_new_owner_recovers_or_starts_the_resumed_call_answers_retry(
    settings: Settings, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving(settings, backend) as hooks:
        sid, call_id = await running_lookup(hooks, backend)

    # the resumed call's body waits before it takes reports (as while recovery is still starting it)
    gate = asyncio.Event()
    invoke = WebhookTool.invoke

    async def held(self: WebhookTool, ctx: Any, arguments: dict[str, Any]) -> Any:
        if ctx.resumed:
            await gate.wait()
        return await invoke(self, ctx, arguments)

    monkeypatch.setattr(WebhookTool, "invoke", held)
    async with serving(settings, backend) as owner:
        session = owner.app.state.services.host.sessions[sid]  # type: ignore[attr-defined]
        session.state = SessionStatus.INITIALIZING  # as during its recovery, before it starts
        try:
            assert_problem(await owner.result(sid, call_id, "shipped", headers=KEY), 503, "session_recovering")
        finally:
            session.state = SessionStatus.ACTIVE
        r = await owner.result(sid, call_id, "shipped", headers=KEY)  # recovered, the call not waiting yet
        assert_problem(r, 503, "session_recovering")
        assert r.headers["retry-after"] == "1"
        gate.set()
        r = await until(lambda: _applied(owner, sid, call_id))
        assert r.json()["status"] == "completed"
        assert stored_call(settings, call_id) == ("completed", "shipped")
        assert len(backend.calls) == 1


async def _applied(hooks: Hooks, sid: str, call_id: str) -> httpx.Response | None:
    r = await hooks.result(sid, call_id, "shipped", headers=KEY)
    return r if r.status_code != 503 else None
