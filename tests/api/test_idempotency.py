"""Idempotency-Key on operator commands (I7): replays, reuse with another body, and concurrent retries."""

from __future__ import annotations

import asyncio
from typing import Any

from switchboard.api.idempotency import KeyLocks
from tests.agents_fixture import AGENTS as TEST_AGENTS
from tests.waiting import WAIT_S

from .conftest import Api
from .test_sessions_api import assert_problem

BURST = {"text": "burst"}


def live_session(api: Api, sid: str) -> Any:
    return api.app.state.services.host.live(sid)


async def user_texts(api: Api, sid: str, text: str) -> list[str]:
    items = (await api.client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
    return [i["text"] for i in items if i.get("role") == "user" and i.get("text") == text]


async def test_a_retry_arriving_while_another_waits_does_not_run_the_command_beside_it(api: Api, monkeypatch):
    """A's attempt fails without a record (503); B waits on the key meanwhile, then runs the command; C arrives while
    B runs. C must wait for B and get B's outcome, not run the command a second time beside it."""
    sid = (await api.create())["id"]
    session = live_session(api, sid)
    real_input = session.input
    running = 0
    most_running = 0
    calls = 0
    a_entered, release_a = asyncio.Event(), asyncio.Event()
    b_entered, release_b = asyncio.Event(), asyncio.Event()

    async def command(*args: Any, **kwargs: Any) -> Any:
        nonlocal running, most_running, calls
        calls += 1
        first = calls == 1
        running += 1
        most_running = max(most_running, running)
        try:
            if first:
                a_entered.set()
                await release_a.wait()
                raise TimeoutError  # the first attempt fails before anything is durable: 503, nothing recorded
            b_entered.set()
            await release_b.wait()
            return await real_input(*args, **kwargs)
        finally:
            running -= 1

    monkeypatch.setattr(session, "input", command)
    headers = {"Idempotency-Key": "k-race"}

    def post() -> Any:
        return asyncio.create_task(api.client.post(f"/v1/sessions/{sid}/input", json=BURST, headers=headers))

    a = post()
    await asyncio.wait_for(a_entered.wait(), WAIT_S)
    b = post()
    await asyncio.sleep(0.2)  # B is now waiting for A's key
    release_a.set()
    assert_problem(await a, 503, "unavailable")
    await asyncio.wait_for(b_entered.wait(), WAIT_S)
    c = post()
    await asyncio.sleep(0.2)  # C arrives while B runs the command
    release_b.set()
    rb, rc = await b, await c
    assert rb.status_code == rc.status_code == 202, (rb.text, rc.text)
    assert rc.json() == rb.json() and rc.headers.get("idempotent-replayed") == "true"
    assert most_running == 1 and calls == 2
    assert await user_texts(api, sid, "burst") == ["burst"]


async def test_a_problem_answer_is_not_recorded_so_a_retry_runs_the_command_again(api: Api, registry):
    headers = {"Idempotency-Key": "k-late"}
    body = {"id": "late", "agent": "latecomer"}
    assert_problem(await api.client.post("/v1/sessions", json=body, headers=headers), 422, "unknown_agent")
    registry.register("latecomer", TEST_AGENTS["tester"])  # the agent exists now
    first = await api.client.post("/v1/sessions", json=body, headers=headers)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers, first.text
    again = await api.client.post("/v1/sessions", json=body, headers=headers)
    assert again.status_code == 201 and again.headers.get("idempotent-replayed") == "true"
    assert again.json() == first.json()


async def test_creating_an_existing_session_again_replays_its_200(api: Api):
    await api.create(id="twice")
    headers = {"Idempotency-Key": "k-twice"}
    body = {"id": "twice", "agent": "tester"}
    first = await api.client.post("/v1/sessions", json=body, headers=headers)
    again = await api.client.post("/v1/sessions", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.headers.get("idempotent-replayed") == "true" and again.json() == first.json()


async def test_a_command_replays_its_answer_after_the_session_closed(api: Api):
    """The first attempt's outcome is the answer to its retries, whatever happened to the session since (I7)."""
    sid = (await api.create())["id"]
    headers = {"Idempotency-Key": "k-before-close"}
    first = await api.client.post(f"/v1/sessions/{sid}/say", json={"text": "bye"}, headers=headers)
    assert first.status_code == 202
    assert (await api.client.delete(f"/v1/sessions/{sid}")).status_code == 204
    again = await api.client.post(f"/v1/sessions/{sid}/say", json={"text": "bye"}, headers=headers)
    assert again.status_code == 202 and again.headers.get("idempotent-replayed") == "true"
    assert again.json() == first.json()
    fresh = await api.client.post(f"/v1/sessions/{sid}/say", json={"text": "bye"}, headers={"Idempotency-Key": "k-new"})
    assert_problem(fresh, 409, "session_not_active")


async def test_a_missing_optional_body_counts_as_its_defaults(api: Api):
    sid = (await api.create())["id"]
    headers = {"Idempotency-Key": "k-interrupt"}
    first = await api.client.post(f"/v1/sessions/{sid}/interrupt", headers=headers)
    again = await api.client.post(f"/v1/sessions/{sid}/interrupt", json={"force": False}, headers=headers)
    assert first.status_code == again.status_code == 200 and again.headers.get("idempotent-replayed") == "true"
    other = await api.client.post(f"/v1/sessions/{sid}/interrupt", json={"force": True}, headers=headers)
    assert_problem(other, 409, "idempotency_key_reused")


async def test_an_invalid_key_is_a_400(api: Api):
    sid = (await api.create())["id"]
    for key in ("", "k" * 201):
        r = await api.client.post(f"/v1/sessions/{sid}/say", json={"text": "x"}, headers={"Idempotency-Key": key})
        assert_problem(r, 400, "invalid_idempotency_key")


async def test_key_locks_are_dropped_once_nobody_holds_or_waits_for_them():
    locks = KeyLocks()
    order: list[str] = []

    async def use(name: str, hold_s: float) -> None:
        async with locks.hold("k", "POST /x"):
            order.append(f"{name}+")
            await asyncio.sleep(hold_s)
            order.append(f"{name}-")

    a = asyncio.create_task(use("a", 0.05))
    await asyncio.sleep(0.01)
    b = asyncio.create_task(use("b", 0.05))
    await a  # released while b waits: c, arriving now, must queue behind b, not beside it
    c = asyncio.create_task(use("c", 0))
    await asyncio.gather(b, c)
    assert order == ["a+", "a-", "b+", "b-", "c+", "c-"]
    assert len(locks) == 0
