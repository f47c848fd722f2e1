"""A session's tool calls, and the running calls across sessions, come in pages (SQLite and PostgreSQL).

The attack: ``GET /tool-calls`` answered every call of the session at once (up to 1,000 calls, each with its
arguments, 50 progress entries and a 16,000-character output: ~70 MB), and ``GET /v1/tool-calls`` up to 5,000
running calls with their progress.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import RowMapping, make_url

from switchboard.api.app import create_app
from switchboard.api.sessions import export
from switchboard.runtime import executor as executor_module
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.tools import ToolCallInfo
from switchboard.store import store as store_module
from switchboard.store.rows import tool_call_from_row
from tests.e2e.test_faults import PG_URL, pg_database

from .conftest import Api, make_settings
from .test_sessions_api import assert_problem, until

CALLS = 250
MANY_PER_TURN = {"max_tool_calls_per_turn": CALLS}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def any_api(request: pytest.FixtureRequest, tmp_path: Any, registry: AgentRegistry) -> AsyncIterator[Api]:
    """The API on a SQLite file, or on a PostgreSQL database of its own."""
    if request.param == "sqlite":
        async with _api(make_settings(tmp_path, **MANY_PER_TURN), registry) as api:
            yield api
        return
    async with pg_database() as name:
        url = make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
        async with _api(make_settings(tmp_path, database_url=url, **MANY_PER_TURN), registry) as api:
            yield api


class _api:
    def __init__(self, settings: Any, registry: AgentRegistry) -> None:
        self.app = create_app(settings, registry=registry)
        self._lifespan = self.app.router.lifespan_context(self.app)
        self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test")

    async def __aenter__(self) -> Api:
        await self._lifespan.__aenter__()
        await self._client.__aenter__()
        return Api(self._client, self.app)

    async def __aexit__(self, *exc: Any) -> None:
        await self._client.__aexit__(*exc)
        await self._lifespan.__aexit__(*exc)


def _mark(i: int) -> float | str:
    """The ``seconds`` argument of the ``i``-th call: a number (it completes) or a word (it fails)."""
    return f"bad {i}" if i % 2 else i / 1e6


async def _many_calls(api: Api, count: int = CALLS) -> str:
    """A session whose one turn made ``count`` calls, in order: even ones complete, odd ones fail."""
    calls = [{"name": "slow", "arguments": {"seconds": _mark(i)}} for i in range(count)]
    s = await api.create(llm={"provider": "scripted", "turns": [{"text": "On it.", "tool_calls": calls}]})
    sid = str(s["id"])
    assert (await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})).status_code == 202

    async def all_ended() -> bool:
        calls = await _every_page(api, sid, limit=1000)
        return len(calls) == count and all(c["status"] != "running" for c in calls)

    await until(all_ended)
    return sid


def _marks(calls: list[dict[str, Any]]) -> list[float | str]:
    return [c["arguments"]["seconds"] for c in calls]


async def _every_page(api: Api, sid: str, **params: Any) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        r = await api.client.get(f"/v1/sessions/{sid}/tool-calls", params=query)
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["items"]) <= params.get("limit", 200)
        assert page["next_cursor"] == (page["items"][-1]["call_id"] if page["next_cursor"] else None)
        seen.extend(page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            return seen


async def _assert_pages(api: Api, sid: str) -> None:
    first = (await api.client.get(f"/v1/sessions/{sid}/tool-calls")).json()
    assert len(first["items"]) == 200 and first["next_cursor"] == first["items"][-1]["call_id"]  # the default page
    every = await _every_page(api, sid, limit=30)
    assert _marks(every) == [_mark(i) for i in range(CALLS)]  # each once, in order
    assert first["items"] == every[:200]
    failed = await _every_page(api, sid, status="failed", limit=20)  # the filter applies before paging
    assert failed == [c for c in every if c["status"] == "failed"]
    assert _marks(failed) == [_mark(i) for i in range(1, CALLS, 2)]
    # a cursor is the call it names, whatever its status: a completed call continues a list of failed ones
    query = {"status": "failed", "cursor": every[10]["call_id"], "limit": 1}
    assert (await api.client.get(f"/v1/sessions/{sid}/tool-calls", params=query)).json()["items"] == [every[11]]
    assert (await api.client.get(f"/v1/sessions/{sid}/tool-calls", params={"limit": 5000})).status_code == 422
    for bad in ("nope", every[0]["call_id"] + "x"):
        r = await api.client.get(f"/v1/sessions/{sid}/tool-calls", params={"cursor": bad})
        assert_problem(r, 422, "invalid_cursor")


async def test_a_sessions_tool_calls_come_in_pages_live_and_ended(any_api: Api) -> None:
    sid = await _many_calls(any_api)
    await _assert_pages(any_api, sid)  # from memory
    assert (await any_api.client.delete(f"/v1/sessions/{sid}")).status_code == 204
    await _assert_pages(any_api, sid)  # from the store


async def test_a_live_session_that_forgot_old_calls_pages_through_the_store_too(
    any_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(executor_module, "KEEP_ENDED_CALLS", 40)
    sid = await _many_calls(any_api)
    live = any_api.app.state.services.host.sessions[sid]
    assert not live.remembers_every_tool_call
    await _assert_pages(any_api, sid)


async def test_a_page_of_an_ended_sessions_tool_calls_reads_that_page_only(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ended session's calls are read from the store: each page used to read and parse every call."""
    sid = await _many_calls(api, 60)
    assert (await api.client.delete(f"/v1/sessions/{sid}")).status_code == 204
    parsed: list[str] = []

    def counted(row: RowMapping) -> ToolCallInfo:
        parsed.append(row["call_id"])
        return tool_call_from_row(row)

    every = await _every_page(api, sid, limit=1000)
    monkeypatch.setattr(store_module, "tool_call_from_row", counted)
    first = (await api.client.get(f"/v1/sessions/{sid}/tool-calls", params={"limit": 1})).json()
    assert first["items"] == every[:1] and first["next_cursor"] == every[0]["call_id"]
    assert len(parsed) <= 2, parsed  # the page, and the row that says more follow
    parsed.clear()
    query = {"cursor": every[40]["call_id"], "limit": 5}
    assert (await api.client.get(f"/v1/sessions/{sid}/tool-calls", params=query)).json()["items"] == every[41:46]
    assert len(parsed) <= 6, parsed


async def test_a_session_with_few_calls_is_one_page_as_before(api: Api) -> None:
    s = await api.create(llm={"provider": "scripted", "turns": []})
    body = (await api.client.get(f"/v1/sessions/{s['id']}/tool-calls")).json()
    assert body == {"items": [], "next_cursor": None}
    sid = await _many_calls(api, 4)
    body = (await api.client.get(f"/v1/sessions/{sid}/tool-calls")).json()
    assert _marks(body["items"]) == [_mark(i) for i in range(4)] and body["next_cursor"] is None


async def test_running_calls_across_sessions_come_in_pages(any_api: Api) -> None:
    sids = []
    for n in range(3):
        search = [{"name": "search", "arguments": {"query": f"q{n}.{k}", "seconds": 60}} for k in range(2)]
        s = await any_api.create(llm={"provider": "scripted", "turns": [{"text": "Searching.", "tool_calls": search}]})
        assert (await any_api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": "go"})).status_code == 202
        sids.append(s["id"])

    async def running() -> list[dict[str, Any]]:
        """Every call running and settled: moved to the background by its first update, which comes a moment after
        the call is listed (a snapshot taken before that would differ from every later page)."""
        calls = (await any_api.client.get("/v1/tool-calls", params={"limit": 1000})).json()["items"]
        return calls if len(calls) == 6 and all(c["background"] and c["progress"] for c in calls) else []

    every = await until(running)
    assert [c["started_at"] for c in every] == sorted(c["started_at"] for c in every)  # oldest first
    first = (await any_api.client.get("/v1/tool-calls", params={"limit": 4})).json()
    assert first["items"] == every[:4] and first["next_cursor"]
    ended = first["items"][-1]  # the cursor stays valid when the call it ends on ends meanwhile
    r = await any_api.client.post(f"/v1/sessions/{ended['session_id']}/tool-calls/{ended['call_id']}/cancel")
    assert r.status_code == 200, r.text
    rest = (await any_api.client.get("/v1/tool-calls", params={"limit": 4, "cursor": first["next_cursor"]})).json()
    assert rest == {"items": every[4:], "next_cursor": None}
    assert (await any_api.client.get("/v1/tool-calls", params={"limit": 5000})).status_code == 422
    assert_problem(await any_api.client.get("/v1/tool-calls", params={"cursor": "nope"}), 422, "invalid_cursor")
    for sid in sids:
        assert (await any_api.client.delete(f"/v1/sessions/{sid}")).status_code == 204


async def test_export_of_an_ended_session_reads_its_tool_calls_a_page_at_a_time(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export read every call of an ended session at once."""
    monkeypatch.setattr(export, "EXPORT_TOOL_CALLS_PAGE", 7, raising=False)
    sid = await _many_calls(api, 30)
    every = await _every_page(api, sid, limit=1000)
    assert (await api.client.delete(f"/v1/sessions/{sid}")).status_code == 204
    reads: list[int] = []  # tool-call rows of each query
    fetch = store_module.Store._fetch

    async def counted(self: store_module.Store, stmt: Any) -> Sequence[RowMapping]:
        rows = await fetch(self, stmt)
        if rows and "arguments" in rows[0]:
            reads.append(len(rows))
        return rows

    monkeypatch.setattr(store_module.Store, "_fetch", counted)
    doc = json.loads((await api.client.get(f"/v1/sessions/{sid}/export")).content)
    assert doc["tool_calls"] == every
    assert reads and max(reads) <= 8, reads
