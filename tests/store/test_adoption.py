"""An adoption round (a cluster node taking over the sessions of a dead node) against a real PostgreSQL: a session
whose recovery fails, or that the node loses halfway, does not stop the others; a failed one is tried again on the
next round."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from switchboard.control.cluster.drain import drain
from switchboard.control.cluster.ownership import NodeLease
from switchboard.control.host import SessionHost
from switchboard.control.hub import EventHub
from switchboard.runtime.agent import AgentRegistry
from switchboard.store import SessionData, SessionRecord
from tests.waiting import WAIT_S

from .conftest import ON_POSTGRESQL, Db
from .test_lease import cluster_settings
from .test_recovery import Worker

pytestmark = [pytest.mark.timeout(60), ON_POSTGRESQL]

SIDS = ["s1", "s2", "s3"]
LLM = {"provider": "scripted", "turns": [], "fallback": {"text": "fine"}}

# Refuses the writes of the sessions named in ``fault`` that are not a takeover (those keep the epoch): a write error
# the database itself raises, for one session of a batch
FAULT_SQL = [
    "CREATE TABLE fault (sid text PRIMARY KEY)",
    """CREATE FUNCTION refuse_write() RETURNS trigger AS $$
    BEGIN
        IF NEW.owner_epoch = OLD.owner_epoch AND EXISTS (SELECT 1 FROM fault WHERE sid = NEW.id) THEN
            RAISE EXCEPTION 'write refused for session %', NEW.id;
        END IF;
        RETURN NEW;
    END $$ LANGUAGE plpgsql""",
    "CREATE TRIGGER refuse_write BEFORE UPDATE ON sessions FOR EACH ROW EXECUTE FUNCTION refuse_write()",
]


@pytest.fixture
async def host(db: Db) -> AsyncIterator[SessionHost]:
    """Node ``a``, alive, with three sessions of a node that died (``gone``) to adopt."""
    store = db.store()
    await store.migrate()
    settings = cluster_settings(db, "a", lease_s=10.0)
    lease = NodeLease(store, settings)
    await lease.start()
    await store.start()
    for sid in SIDS:
        config = {"agent": "worker", "llm": LLM}
        await store.create_session(
            SessionRecord(id=sid, agent="worker", state="active", config=config, owner_node="gone", owner_epoch=1)
        )
    host = SessionHost(
        store=store, registry=AgentRegistry({"worker": Worker}), hub=EventHub(), settings=settings, lease=lease
    )
    try:
        yield host
    finally:
        await host.aclose()
        await lease.aclose()


async def recovered_events(db: Db, host: SessionHost) -> dict[str, int]:
    """How many ``session.recovered`` events each session has, once every event emitted so far is durable."""
    for session in list(host.sessions.values()):
        await session.events.flushed()
    rows = await db.sql("SELECT session_id, count(*) FROM events WHERE type = 'session.recovered' GROUP BY session_id")
    return {sid: int(n) for sid, n in rows}


async def owner(db: Db, sid: str) -> tuple[str, int]:
    ((who, epoch),) = await db.sql("SELECT owner_node, owner_epoch FROM sessions WHERE id = $1", sid)
    return who, int(epoch)


def while_loading(host: SessionHost, monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], Awaitable[None]]) -> None:
    """Run ``meanwhile`` once the round has claimed its sessions and read them, before it recovers any."""
    load = host.store.load_sessions_bulk

    async def load_then(ids: Any, **kw: Any) -> dict[str, SessionData]:
        found = await load(ids, **kw)
        await meanwhile()
        return found

    monkeypatch.setattr(host.store, "load_sessions_bulk", load_then)


async def test_a_session_whose_recovery_fails_is_retried_on_the_next_round_and_the_others_recover(
    db: Db, host: SessionHost, caplog: pytest.LogCaptureFixture
) -> None:
    for statement in FAULT_SQL:
        await db.sql(statement)
    await db.sql("INSERT INTO fault VALUES ('s2')")
    with caplog.at_level(logging.ERROR, logger="switchboard.control.host"):
        await host.recover_all()
    assert sorted(host.sessions) == ["s1", "s3"]
    assert await recovered_events(db, host) == {"s1": 1, "s3": 1}
    assert any("session s2: recovery failed" in r.getMessage() for r in caplog.records)
    assert await owner(db, "s2") == ("a", 2) and host.lease is not None and host.lease.fence.owns("s2")
    # the write error is gone: the next round recovers s2, and only s2
    await db.sql("DELETE FROM fault")
    await host.recover_all()
    assert sorted(host.sessions) == SIDS
    assert await recovered_events(db, host) == {"s1": 1, "s2": 1, "s3": 1}
    await host.sessions["s2"].input("hello")
    assert host.failed == []


async def test_a_session_taken_over_during_the_round_does_not_stop_the_others(
    db: Db, host: SessionHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def b_takes_s2() -> None:
        await db.sql("UPDATE sessions SET owner_node = 'b', owner_epoch = owner_epoch + 1 WHERE id = 's2'")

    while_loading(host, monkeypatch, b_takes_s2)
    await host.recover_all()
    assert sorted(host.sessions) == ["s1", "s3"]
    assert await recovered_events(db, host) == {"s1": 1, "s3": 1}
    assert await owner(db, "s2") == ("b", 3)  # nothing of this node's landed for it, and it is not tried again
    assert "s2" in host.fenced
    await host.recover_all(claim=False)
    assert sorted(host.sessions) == ["s1", "s3"]


async def test_losing_the_lease_during_the_round_ends_it_without_error(
    db: Db, host: SessionHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = host.lease
    assert lease is not None

    async def lease_lost() -> None:  # what the node does when its renewals came too late
        lease.lose_all("renewals came too late")

    while_loading(host, monkeypatch, lease_lost)
    await host.recover_all()
    assert host.sessions == {} and await recovered_events(db, host) == {}
    await host.recover_all(claim=False)  # nothing is tried again: the sessions are the cluster's now
    assert host.sessions == {}


async def test_a_drain_during_a_round_hands_over_what_the_round_recovers(
    db: Db, host: SessionHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM arrives while an adoption round is under way: the drain must hand over the sessions the round is still
    # recovering too, or they run on here, unreleased, as ghosts of a node that is leaving (found by the cluster
    # simulation: a rolling restart during an adoption round)
    lease = host.lease
    assert lease is not None
    draining: list[asyncio.Task[list[str]]] = []

    async def sigterm() -> None:
        await lease.start_draining()
        draining.append(asyncio.create_task(host.hand_off_all()))
        await asyncio.sleep(0.05)  # the drain runs while the round is between its reads and its recoveries

    while_loading(host, monkeypatch, sigterm)
    await host.recover_all()
    handed = await draining[0]
    assert sorted(handed) == SIDS
    assert host.sessions == {}
    for sid in SIDS:
        assert (await owner(db, sid))[0] is None


async def test_the_last_live_node_drains_without_waiting_for_adopters(db: Db, host: SessionHost) -> None:
    # SIGTERM to the only live node of a cluster: nobody can adopt its sessions, so waiting DRAIN_TIMEOUT_S for it only
    # delays the stop (past a supervisor's patience, which then kills it). The sessions are let go, durable, and the
    # next node to start adopts them
    await host.recover_all()
    assert sorted(host.sessions) == SIDS
    # a drain that waited for adopters would run out its own timeout, twice the ceiling
    waiting = await asyncio.wait_for(drain(host, wake=None, timeout_s=2 * WAIT_S), WAIT_S)
    assert sorted(waiting) == SIDS
    for sid in SIDS:
        assert (await owner(db, sid))[0] is None


async def test_a_drain_waits_while_another_node_is_live_to_adopt(db: Db, host: SessionHost) -> None:
    other = NodeLease(db.store(), cluster_settings(db, "b", lease_s=10.0))  # live, but it never adopts
    # another machine's node: on this host, in this process, it would take ``a`` for a process that is gone, and bury
    # it (a buried node claims nothing)
    other.hostname = "elsewhere"
    await other.store.start()
    await other.start()
    try:
        await host.recover_all()
        ran = sorted(host.sessions)
        assert len(ran) == 2  # its share: 3 orphans between 2 live nodes
        loop = asyncio.get_running_loop()
        began = loop.time()
        waiting = await drain(host, wake=None, timeout_s=2.0)
        assert loop.time() - began >= 1.9  # it waited for b to adopt, up to its timeout
        assert sorted(waiting) == ran
    finally:
        await other.aclose()
        await other.store.aclose()


async def test_a_drain_whose_first_write_meets_a_reset_connection_still_hands_everything_over(
    db: Db, host: SessionHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a chaos run: SIGTERM during a database reset; recording the drain failed once, the drain was given up ("stopping
    # anyway") and nothing was handed over: its sessions, and the input accepted meanwhile, waited out the lease
    await host.recover_all()
    assert sorted(host.sessions) == SIDS
    set_state = host.store.nodes.set_state
    tries: list[object] = []

    async def reset_twice(node_id: str, state: Any) -> None:
        tries.append(state)
        if len(tries) <= 2:
            raise ConnectionResetError(104, "Connection reset by peer")
        await set_state(node_id, state)

    monkeypatch.setattr(host.store.nodes, "set_state", reset_twice)
    # a drain that waited for adopters would run out its own timeout, twice the ceiling
    waiting = await asyncio.wait_for(drain(host, wake=None, timeout_s=2 * WAIT_S), WAIT_S)
    assert len(tries) == 3
    assert sorted(waiting) == SIDS and host.sessions == {}  # handed over (no other node is live to adopt them)
    for sid in SIDS:
        assert (await owner(db, sid))[0] is None
