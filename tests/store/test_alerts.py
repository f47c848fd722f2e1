"""Alerts on a real store (SQLite and PostgreSQL) sent to a real HTTP receiver that verifies each message with the
``standardwebhooks`` library: one alert per session and reason until it clears, then one "cleared"; routing by reason
and agent; retries under one webhook-id; a dead sink bounded; two nodes never alert twice."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from switchboard.control.alerts import AlertEngine, RetryPolicy
from switchboard.control.attention import AttentionCode, AttentionReason
from switchboard.control.settings import AlertSink
from switchboard.store import NodeMode, NodeRecord, NodeState, SessionRecord, Store
from switchboard.store.alerts import DeliveryState
from tests.alert_receiver import AlertReceiver
from tests.waiting import WAIT_S

from .conftest import Db, wait_for

FAST = RetryPolicy(max_attempts=3, backoff_s=0.01, backoff_max_s=0.05, queue_max=100)


class Reasons:
    """What the attention tracker says of each session (the engine's input), set by the test."""

    def __init__(self) -> None:
        self.now: dict[str, list[AttentionReason]] = {}
        self.failed: list[str] = []

    def reasons(self, sid: str, live: Any, *, store_unavailable: bool = False) -> list[AttentionReason]:
        return list(self.now.get(sid, []))

    def failed_sessions(self) -> list[str]:
        return list(self.failed)


def reason(code: str, message: str = "something is wrong") -> AttentionReason:
    # model_construct: a code this version does not know (a newer node's) is routed like any other
    return AttentionReason.model_construct(code=code, message=message, since=datetime(2026, 1, 1, tzinfo=UTC))


def live(agent: str = "demo") -> Any:
    return SimpleNamespace(agent=SimpleNamespace(name=agent))


def sink(receiver: AlertReceiver, name: str = "ops", **kw: Any) -> AlertSink:
    return AlertSink(name=name, url=receiver.url, secret=receiver.secret, **kw)


async def node(store: Store, node_id: str) -> str:
    """Register ``node_id`` as a live node holding a lease (its owed deliveries are its own)."""
    now = datetime.now(UTC)
    me = NodeRecord(
        id=node_id,
        url="http://127.0.0.1:9",
        state=NodeState.LIVE,
        mode=NodeMode.CLUSTER,
        hostname="test",
        pid=1,
        started_at=now,
        heartbeat_at=now,
        lease_until=now + timedelta(seconds=WAIT_S * 10),
        incarnation=node_id,
    )
    await store.nodes.register(me, conflicts=lambda other: False)
    return node_id


def engine(
    store: Store,
    reasons: Reasons,
    sessions: dict[str, Any],
    sinks: list[AlertSink],
    node: str = "node-a",
    policy: RetryPolicy = FAST,
) -> AlertEngine:
    e = AlertEngine(
        store=store,
        tracker=reasons,  # type: ignore[arg-type]
        sessions=sessions,
        node_id=node,
        sinks=sinks,
        policy=policy,
        interval_s=3600.0,  # rounds are run by the test
    )
    e.dispatcher.start()
    return e


async def settled(store: Store) -> None:
    """Every delivery of every alert final."""
    async with asyncio.timeout(WAIT_S):
        while await store.alerts.outstanding():
            await asyncio.sleep(0.02)


async def test_one_alert_per_session_and_reason_until_it_clears_then_one_cleared(store: Store) -> None:
    reasons, sessions = Reasons(), {"s1": live()}
    async with AlertReceiver() as receiver:
        e = engine(store, reasons, sessions, [sink(receiver)])
        try:
            reasons.now["s1"] = [reason(AttentionCode.TOOL_FAILED)]
            for _ in range(3):
                await e.round()
            opened = await receiver.next()
            assert opened.type == "alert.opened"
            assert opened.data["session_id"] == "s1" and opened.data["reason"] == "tool_failed"
            assert opened.webhook_id == f"{opened.data['alert_id']}-opened"
            reasons.now["s1"] = []
            for _ in range(3):
                await e.round()
            cleared = await receiver.next()
            assert cleared.type == "alert.cleared" and cleared.data["alert_id"] == opened.data["alert_id"]
            await settled(store)
            assert [m.type for m in receiver.messages] == ["alert.opened", "alert.cleared"]
            assert receiver.bad_signatures == 0
            [row] = await store.alerts.listing(include_cleared=True)
            assert row.cleared_at is not None
            assert row.opened_deliveries["ops"].state == DeliveryState.DELIVERED
            assert row.cleared_deliveries is not None and row.cleared_deliveries["ops"].state == DeliveryState.DELIVERED
            # the reason again: a new alert
            reasons.now["s1"] = [reason(AttentionCode.TOOL_FAILED)]
            await e.round()
            again = await receiver.next()
            assert again.type == "alert.opened" and again.data["alert_id"] != opened.data["alert_id"]
        finally:
            await e.aclose()


async def test_sinks_get_the_reasons_and_agents_they_subscribe_to_new_reasons_included(store: Store) -> None:
    await store.create_session(SessionRecord(id="s2", agent="billing", state="active"))
    reasons, sessions = Reasons(), {"s1": live("demo"), "s2": live("billing")}
    async with AlertReceiver() as tools, AlertReceiver() as billing, AlertReceiver() as quiet:
        sinks = [
            sink(tools, "tools", reasons=["tool_failed"]),
            sink(billing, "billing", agents=["billing"]),
            sink(quiet, "quiet", reasons=["operator_quiet"]),
        ]
        e = engine(store, reasons, sessions, sinks)
        try:
            reasons.now["s1"] = [reason("tool_failed"), reason("operator_quiet")]
            reasons.now["s2"] = [reason("generation_failed")]
            await e.round()
            await settled(store)
            assert {(m.data["session_id"], m.data["reason"]) for m in tools.messages} == {("s1", "tool_failed")}
            assert {(m.data["session_id"], m.data["reason"]) for m in billing.messages} == {("s2", "generation_failed")}
            assert {(m.data["session_id"], m.data["reason"]) for m in quiet.messages} == {("s1", "operator_quiet")}
            assert len(await store.alerts.listing()) == 3
        finally:
            await e.aclose()


async def test_a_failing_attempt_is_retried_under_the_same_webhook_id(store: Store) -> None:
    reasons, sessions = Reasons(), {"s1": live()}
    async with AlertReceiver() as receiver:
        receiver.answers = [500, 503, 204]
        e = engine(store, reasons, sessions, [sink(receiver)])
        try:
            reasons.now["s1"] = [reason(AttentionCode.SPEECH_STALLED)]
            await e.round()
            message = await receiver.next()
            assert receiver.attempts == {message.webhook_id: 3}
            await settled(store)
            [row] = await store.alerts.listing()
            assert row.opened_deliveries["ops"].state == DeliveryState.DELIVERED
            assert row.opened_deliveries["ops"].attempts == 3
        finally:
            await e.aclose()


async def test_a_dead_sink_fails_a_delivery_after_its_bounded_attempts(store: Store) -> None:
    reasons, sessions = Reasons(), {"s1": live()}
    async with AlertReceiver() as dead:
        dead.answers = [503]
        e = engine(store, reasons, sessions, [sink(dead, "dead")])
        try:
            reasons.now["s1"] = [reason(AttentionCode.TOOL_FAILED)]
            await e.round()
            await settled(store)
            [row] = await store.alerts.listing()
            delivery = row.opened_deliveries["dead"]
            assert delivery.state == DeliveryState.FAILED and delivery.attempts == FAST.max_attempts
            assert delivery.last_error == "HTTP 503"
            assert sum(dead.attempts.values()) == FAST.max_attempts
        finally:
            await e.aclose()


async def test_a_dead_sink_holds_a_bounded_queue_and_never_holds_up_another(store: Store) -> None:
    ids = [f"d{i}" for i in range(5)]
    for sid in ids:
        await store.create_session(SessionRecord(id=sid, agent="demo", state="active"))
    reasons, sessions = Reasons(), {sid: live() for sid in ids}
    async with AlertReceiver() as dead, AlertReceiver() as fine:
        dead.answers = [503]
        policy = RetryPolicy(max_attempts=5, backoff_s=WAIT_S, backoff_max_s=WAIT_S, queue_max=2)
        e = engine(store, reasons, sessions, [sink(dead, "dead"), sink(fine, "fine")], policy=policy)
        try:
            for sid in ids:
                reasons.now[sid] = [reason(AttentionCode.TOOL_FAILED)]
                await e.round()
                message = await fine.next()  # each one delivered while the dead sink waits to retry
                assert message.data["session_id"] == sid
                assert e.waiting()["dead"] <= 2
            rows = await store.alerts.listing()

            async def dropped() -> int:
                found = await store.alerts.listing()
                return sum(row.opened_deliveries["dead"].state == DeliveryState.DROPPED for row in found)

            async with asyncio.timeout(WAIT_S):
                while await dropped() < 3:  # 5 queued, 2 kept: the oldest waiting made room each time
                    await asyncio.sleep(0.02)
            assert len(rows) == 5 and len(fine.messages) == 5
            assert sum(dead.attempts.values()) == 1  # the first one, waiting for its next attempt
        finally:
            await e.aclose()


async def test_a_session_moved_to_another_node_is_not_alerted_again_and_its_clear_is_sent_once(store: Store) -> None:
    reasons = Reasons()
    await node(store, "node-a")
    await node(store, "node-b")
    async with AlertReceiver() as receiver:
        a = engine(store, reasons, {"s1": live()}, [sink(receiver)], node="node-a")
        b_sessions: dict[str, Any] = {}
        b = engine(store, reasons, b_sessions, [sink(receiver)], node="node-b")
        try:
            reasons.now["s1"] = [reason(AttentionCode.SILENCE_AFTER_INPUT)]
            await a.round()
            await settled(store)
            a.sessions.clear()  # node A lost it, node B adopted it with the same reason
            b_sessions["s1"] = live()
            await a.round()
            await b.round()
            await b.round()
            reasons.now["s1"] = []
            await b.round()
            await a.round()
            await settled(store)
            assert [m.type for m in receiver.messages] == ["alert.opened", "alert.cleared"]
            [row] = await store.alerts.listing(include_cleared=True)
            assert row.opened_node == "node-a" and row.cleared_node == "node-b"
        finally:
            await a.aclose()
            await b.aclose()


async def test_two_nodes_that_both_run_a_session_for_a_moment_open_its_alert_once(store: Store) -> None:
    reasons = Reasons()
    await node(store, "node-a")
    await node(store, "node-b")
    async with AlertReceiver() as receiver:
        a = engine(store, reasons, {"s1": live()}, [sink(receiver)], node="node-a")
        b = engine(store, reasons, {"s1": live()}, [sink(receiver)], node="node-b")
        try:
            reasons.now["s1"] = [reason(AttentionCode.TOOL_FAILED)]
            await asyncio.gather(a.round(), b.round())
            await asyncio.gather(a.round(), b.round())
            await settled(store)
            reasons.now["s1"] = []
            await asyncio.gather(a.round(), b.round())
            await settled(store)
            assert [m.type for m in receiver.messages] == ["alert.opened", "alert.cleared"]
            assert len(await store.alerts.listing(include_cleared=True)) == 1
        finally:
            await a.aclose()
            await b.aclose()


async def test_an_alert_of_a_session_that_ended_is_cleared_by_any_node(db: Db, store: Store) -> None:
    reasons = Reasons()
    await node(store, "node-a")
    await node(store, "node-b")
    async with AlertReceiver() as receiver:
        a = engine(store, reasons, {"s1": live()}, [sink(receiver)], node="node-a")
        b = engine(store, reasons, {}, [sink(receiver)], node="node-b")
        try:
            reasons.now["s1"] = [reason(AttentionCode.TOOL_LONG_RUNNING)]
            await a.round()
            a.sessions.clear()
            await db.sql(db.q("UPDATE sessions SET state = 'closed' WHERE id = ?"), "s1")
            await asyncio.gather(a.round(), b.round())
            await settled(store)
            assert [m.type for m in receiver.messages] == ["alert.opened", "alert.cleared"]
        finally:
            await a.aclose()
            await b.aclose()


async def test_deliveries_owed_by_a_node_gone_are_sent_by_another(store: Store) -> None:
    reasons = Reasons()
    async with AlertReceiver() as receiver:
        receiver.answers = [503]
        slow = RetryPolicy(max_attempts=50, backoff_s=30.0, backoff_max_s=30.0)
        a = engine(store, reasons, {"s1": live()}, [sink(receiver)], node="node-a", policy=slow)
        reasons.now["s1"] = [reason(AttentionCode.GENERATION_FAILED)]
        await a.round()
        await wait_for(lambda: len(receiver.attempts) == 1)
        await a.aclose()  # stops with its delivery owed (no node row: node-a holds no lease)
        receiver.answers = [204]
        b = engine(store, reasons, {}, [sink(receiver)], node="node-b")
        try:
            await b.round()
            message = await receiver.next()
            assert message.type == "alert.opened" and receiver.attempts[message.webhook_id] == 2
            await settled(store)
        finally:
            await b.aclose()
