"""Faults from a seeded schedule, in two lanes that run side by side: the nodes' lane (SIGKILL then restart, SIGSTOP
past the lease then SIGCONT, SIGTERM drain then restart, a rolling restart of all three, a restart with the wall
clock skewed under libfaketime) and the backing services' lane (Redis frozen then thawed or restarted, Redis's
connections hung through its proxy, PostgreSQL's connections hung for 1-3 s then reset, or reset and refused).

The schedule is a function of the seed alone: the same seed injects the same faults on the same nodes in the same
order; only their timing follows the machine."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

from .cluster import ChaosCluster, Node
from .history import History, now

NODE_FAULTS = ("kill", "pause", "drain", "skew", "rolling")
INFRA_FAULTS = ("redis_freeze", "redis_hang", "pg_stall", "pg_reset")
NODE_FAULT_S = 18.0  # about how long one node fault takes on a loaded machine (to size the schedule)
INFRA_FAULT_S = 8.0
SKEW_S = 1.6
FAILOVER_WATCH_S = 120.0


@dataclass
class Fault:
    kind: str
    node: int = 0  # which node a drain or a skew hits (a kill or a pause hits the busiest node)
    hold_s: float = 0.0  # how long the fault holds (a pause, a hang, a freeze)
    gap_s: float = 0.0  # the quiet time after it
    variant: str = ""  # kill: "" ; redis_freeze: "thaw" | "restart"; redis_hang: "release" | "reset"; skew: "+"/"-"


@dataclass
class FaultPlan:
    node_lane: list[Fault] = field(default_factory=list)
    infra_lane: list[Fault] = field(default_factory=list)

    @classmethod
    def seeded(cls, seed: int, duration_s: float, lease_s: float) -> FaultPlan:
        """Every kind at least once, then more drawn at random until the duration is filled."""
        rng = random.Random(f"faults-{seed}")
        plan = cls()
        node_kinds = list(NODE_FAULTS)
        rng.shuffle(node_kinds)
        while len(node_kinds) * NODE_FAULT_S < duration_s:
            node_kinds.append(rng.choice(NODE_FAULTS))
        for kind in node_kinds:
            hold = lease_s + rng.uniform(1.0, 2.5) if kind == "pause" else rng.uniform(0.5, 2.0)
            variant = rng.choice("+-") if kind == "skew" else ""
            plan.node_lane.append(Fault(kind, rng.randrange(3), hold, rng.uniform(2.0, 6.0), variant))
        infra_kinds = list(INFRA_FAULTS) * 2
        rng.shuffle(infra_kinds)
        while len(infra_kinds) * INFRA_FAULT_S < duration_s:
            infra_kinds.append(rng.choice(INFRA_FAULTS))
        for kind in infra_kinds:
            variant = {"redis_freeze": rng.choice(("thaw", "restart")), "redis_hang": rng.choice(("release", "reset"))}
            hold = rng.uniform(1.0, 3.0) if kind.startswith("pg") else rng.uniform(2.0, 4.0)
            plan.infra_lane.append(Fault(kind, 0, hold, rng.uniform(3.0, 8.0), variant.get(kind, "")))
        return plan


class Injector:
    def __init__(self, cluster: ChaosCluster, history: History, plan: FaultPlan) -> None:
        self.cluster = cluster
        self.history = history
        self.plan = plan
        self._watchers: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        await asyncio.gather(self._lane(self.plan.node_lane), self._lane(self.plan.infra_lane))

    async def wait_watchers(self) -> None:
        await asyncio.gather(*self._watchers, return_exceptions=True)

    async def _lane(self, faults: list[Fault]) -> None:
        for fault in faults:
            await asyncio.sleep(fault.gap_s)
            record = self.history.add("fault", fault=fault.kind, t0=now(), variant=fault.variant)
            try:
                await getattr(self, f"_{fault.kind}")(fault, record)
            except Exception as err:  # a node that did not come back is for the settle step to retry and report
                record["error"] = repr(err)[:500]
            record["t1"] = now()

    # -- the nodes ----------------------------------------------------------------------------------------------

    def _node(self, fault: Fault, record: dict[str, Any]) -> Node:
        node = self.cluster.nodes[fault.node]
        record["target"] = node.id
        return node

    async def _busiest(self, record: dict[str, Any]) -> Node:
        """A crash or a freeze hits the node that owns the most sessions, so that failover has work to measure."""
        node = await self.cluster.busiest()
        record["target"] = node.id
        return node

    async def _kill(self, fault: Fault, record: dict[str, Any]) -> None:
        node = await self._busiest(record)
        await self._watch_failover(node, "kill", lambda: self.cluster.kill(node))
        await asyncio.sleep(fault.hold_s)
        await self.cluster.start_node(node)

    async def _pause(self, fault: Fault, record: dict[str, Any]) -> None:
        node = await self._busiest(record)
        await self._watch_failover(node, "pause", lambda: self.cluster.pause(node))
        await asyncio.sleep(fault.hold_s)  # past its lease
        self.cluster.resume(node)

    async def _drain(self, fault: Fault, record: dict[str, Any], skew_s: float = 0.0) -> None:
        node = self._node(fault, record)
        drain = self.history.add("drain", node=node.id, t0=now())
        await self.cluster.drain(node)
        drain["t1"] = now()
        await self.cluster.start_node(node, skew_s)

    async def _skew(self, fault: Fault, record: dict[str, Any]) -> None:
        skew = SKEW_S if fault.variant == "+" else -SKEW_S
        record["skew_s"] = skew
        await self._drain(fault, record, skew)

    async def _rolling(self, fault: Fault, record: dict[str, Any]) -> None:
        record["target"] = "all"
        for node in self.cluster.nodes:
            drain = self.history.add("drain", node=node.id, t0=now())
            await self.cluster.drain(node)
            drain["t1"] = now()
            await self.cluster.start_node(node, node.skew_s)

    async def _watch_failover(self, node: Node, kind: str, act: Any) -> None:
        """Note the sessions ``node`` owns, act, then time how long until another node owns each one."""
        conn = await self.cluster.connect()
        try:
            rows = await conn.fetch(
                "SELECT id FROM sessions WHERE owner_node = $1 AND state NOT IN ('closed', 'failed')", node.id
            )
        finally:
            await conn.close()
        started = time.monotonic()
        act()
        sids = [r["id"] for r in rows]
        if sids:
            self._watchers.append(asyncio.create_task(self._failover(node.id, kind, sids, started)))

    async def _failover(self, node_id: str, kind: str, sids: list[str], started: float) -> None:
        waiting = set(sids)
        conn = await self.cluster.connect()
        try:
            while waiting and time.monotonic() - started < FAILOVER_WATCH_S:
                rows = await conn.fetch("SELECT id, owner_node FROM sessions WHERE id = ANY($1::text[])", list(waiting))
                for row in rows:
                    if row["owner_node"] is not None and row["owner_node"] != node_id:
                        self.history.add(
                            "failover", node=node_id, fault=kind, sid=row["id"], seconds=time.monotonic() - started
                        )
                        waiting.discard(row["id"])
                await asyncio.sleep(0.1)
        finally:
            await conn.close()
        for sid in waiting:
            self.history.add("failover", node=node_id, fault=kind, sid=sid, seconds=None)

    # -- Redis and PostgreSQL -----------------------------------------------------------------------------------

    async def _redis_freeze(self, fault: Fault, record: dict[str, Any]) -> None:
        self.cluster.redis_freeze()
        await asyncio.sleep(fault.hold_s)
        if fault.variant == "restart":
            await self.cluster.redis_restart()
        else:
            self.cluster.redis_thaw()

    async def _redis_hang(self, fault: Fault, record: dict[str, Any]) -> None:
        proxy = self.cluster.redis_proxy
        proxy.stall()
        try:
            await asyncio.sleep(fault.hold_s)
            if fault.variant == "reset":
                proxy.reset()
        finally:
            proxy.release()

    async def _pg_stall(self, fault: Fault, record: dict[str, Any]) -> None:
        proxy = self.cluster.pg_proxy
        proxy.stall()
        try:
            await asyncio.sleep(fault.hold_s)
            proxy.reset()
        finally:
            proxy.release()

    async def _pg_reset(self, fault: Fault, record: dict[str, Any]) -> None:
        proxy = self.cluster.pg_proxy
        proxy.refuse(True)
        try:
            proxy.reset()
            await asyncio.sleep(min(fault.hold_s, 1.0))
        finally:
            proxy.refuse(False)


async def restore(cluster: ChaosCluster) -> None:
    """Undo whatever a fault left: every node running, Redis up, the proxies passing traffic."""
    for proxy in (cluster.pg_proxy, cluster.redis_proxy):
        proxy.release()
        proxy.refuse(False)
    cluster.redis_thaw()
    if cluster.redis.proc is None or cluster.redis.proc.poll() is not None:
        await cluster.redis_restart()
    for node in cluster.nodes:
        if node.paused:
            cluster.resume(node)
        if not node.running:
            with contextlib.suppress(RuntimeError):
                await cluster.start_node(node, node.skew_s)
