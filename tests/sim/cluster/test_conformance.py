"""The simulated database answers as the real store does: one sequence of ownership, fencing and idempotency
operations of two nodes, run against ``SimDatabase`` and against the real ``Store`` on SQLite, gives the same answers.

The cluster simulation trusts its model of the database; this is what keeps the model from drifting away from the
store it stands for (a new rule in the store's SQL that the model lacks makes this test fail).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from switchboard.runtime.chat import message
from switchboard.runtime.ports import Commit, Completion
from switchboard.store import Store
from switchboard.store.ownership import Fence, NodeMode, NodeRecord, NodeState
from switchboard.store.records import Holder, SessionRecord, now_utc

from .database import SimDatabase
from .store import SimStore

LEASE_S = 30.0
A, B = Holder("a", "inc-a"), Holder("b", "inc-b")


def node(node_id: str, incarnation: str) -> NodeRecord:
    now = now_utc()
    return NodeRecord(
        id=node_id,
        url=f"http://{node_id}",
        state=NodeState.LIVE,
        mode=NodeMode.CLUSTER,
        hostname=f"host-{node_id}",
        pid=1,
        started_at=now,
        heartbeat_at=now,
        lease_until=now + timedelta(seconds=LEASE_S),
        incarnation=incarnation,
    )


def receipt(key: str, holder: Holder) -> Completion:
    return Completion(
        key=key, scope="POST /x", holder_node=holder.node, holder_incarnation=holder.incarnation, status_code=202
    )


async def outcome(aw: Awaitable[Any]) -> Any:
    """An answer, or the name of the error raised instead."""
    try:
        return await aw
    except Exception as err:
        return type(err).__name__


def claim_view(claim: Any) -> Any:
    if isinstance(claim, str):
        return claim
    found = claim.record
    record = None if found is None else (found.state.value, found.request_hash, found.status_code, found.holder_node)
    return (claim.held, record, claim.taken_from)


async def sequence(a: Any, b: Any, items: Callable[[], Awaitable[list[str]]]) -> list[Any]:
    """The operations, on two nodes' stores (``a``, ``b``: fenced as nodes ``a`` and ``b``); the answers in order."""
    answers: list[Any] = []
    answers.append(await a.nodes.register(node("a", A.incarnation), conflicts=lambda n: False))
    answers.append(await b.nodes.register(node("b", B.incarnation), conflicts=lambda n: False))
    await a.create_session(SessionRecord(id="s1", agent="demo", state="active", owner_node="a", owner_epoch=1))
    a.fence.claim("s1", 1)
    answers.append(claim_view(await a.idempotency.reserve("k1", "POST /x", "h1", A)))
    answers.append(claim_view(await b.idempotency.reserve("k1", "POST /x", "h1", B)))
    answers.append(claim_view(await b.idempotency.reserve("k1", "POST /x", "h2", B)))
    effect = Commit(items=[message("user", "one")], receipts=[receipt("k1", A)])
    answers.append(await outcome(a.chat_store(1).commit("s1", effect)))
    answers.append(effect.receipts[0].landed)
    answers.append(claim_view(await b.idempotency.reserve("k1", "POST /x", "h1", B)))
    # a completion its holder no longer holds refuses the whole commit
    refused = Commit(items=[message("user", "refused")], receipts=[receipt("k1", B)])
    answers.append(await outcome(a.chat_store(1).commit("s1", refused)))
    # a drain hands s1 over; b claims it at the next epoch
    answers.append(await a.nodes.unowned(["s1"]))
    answers.append(await a.nodes.release("a", {"s1": 1}))
    answers.append(await a.nodes.unowned(["s1"]))
    answers.append(await b.nodes.claim_orphans("b", share=True))
    b.fence.claim("s1", 2)
    a.fence.epochs["s1"] = 1  # a late write of a's old incarnation, which a's own fence does not refuse
    answers.append(await outcome(a.chat_store(1).commit("s1", Commit(items=[message("user", "stale")]))))
    answers.append(await outcome(b.chat_store(2).commit("s1", Commit(items=[message("user", "two")]))))
    answers.append(await outcome(b.chat_store(1).commit("s1", Commit(items=[message("user", "b at 1")]))))
    answers.append(await a.nodes.owned_by("a"))
    answers.append(await b.nodes.owned_by("b"))
    answers.append(await a.nodes.live_url("b"))
    # a stops: its reservations are a dead holder's, taken over by the next request with the key
    answers.append(claim_view(await a.idempotency.reserve("k2", "POST /x", "h1", A)))
    answers.append(claim_view(await b.idempotency.reserve("k2", "POST /x", "h1", B)))
    answers.append(await a.nodes.renew("a", LEASE_S))
    await a.nodes.set_state("a", NodeState.STOPPED)
    answers.append(await a.nodes.renew("a", LEASE_S))
    answers.append(await a.nodes.live_url("a"))
    answers.append(claim_view(await b.idempotency.reserve("k2", "POST /x", "h1", B)))
    answers.append(await a.idempotency.complete(receipt("k2", A)))
    answers.append(await a.idempotency.release("k2", "POST /x", A))
    answers.append(await b.idempotency.complete(receipt("k2", B)))
    answers.append(await b.idempotency.release("k2", "POST /x", B))
    answers.append([(n.id, n.state.value, n.sessions) for n in await b.nodes.list_nodes()])
    answers.append(await items())
    return answers


async def real_answers(path: Path) -> list[Any]:
    url = f"sqlite+aiosqlite:///{path}"
    a, b = Store.from_url(url), Store.from_url(url)
    await a.migrate()
    a.use_fence(Fence("a"))
    b.use_fence(Fence("b"))
    await a.start()
    await b.start()

    async def items() -> list[str]:
        return [getattr(it, "text", "") for it in await a.chat_items("s1")]

    try:
        return await sequence(a, b, items)
    finally:
        await a.aclose()
        await b.aclose()


async def simulated_answers() -> list[Any]:
    db = SimDatabase(asyncio.get_running_loop().time)
    a, b = SimStore(db, "a", "a#1"), SimStore(db, "b", "b#1")
    a.use_fence(Fence("a"))
    b.use_fence(Fence("b"))
    a.start()
    b.start()

    async def items() -> list[str]:
        return [getattr(it, "text", "") for it in db.session_rows("s1").chat()]

    try:
        return await sequence(a, b, items)
    finally:
        await a.writer.aclose()
        await b.writer.aclose()


@pytest.mark.timeout(60)
async def test_the_simulated_database_answers_as_the_store_on_sqlite(tmp_path: Path) -> None:
    real = await real_answers(tmp_path / "switchboard.db")
    simulated = await simulated_answers()
    assert simulated == real
