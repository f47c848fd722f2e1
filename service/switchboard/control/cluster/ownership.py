"""NodeLease: this process as a node of its database: its registration, its lease, its claims on sessions.

Single-node mode (the default): a second instance on the same database does not start while the first one holds its
lease; it waits ``takeover_wait_s`` for it to stop, then refuses with a message naming it. A previous instance on
this host whose process is gone (a crash, a container restart) holds nothing. Cluster mode: nodes share the
database, and each one takes over the sessions of nodes whose lease passed.

Either way every write carries the ownership epoch it was made under and the store checks it in the write's own
transaction (``store.ownership``), so a process that lost a session (paused past its lease, partitioned, replaced)
never writes for it again, even once it took it back.

Leases are set and judged on the database's clock (``Nodes``): a node whose own clock runs ahead or behind buries no
live node and keeps its own lease. The node's own durations (how long since its last renewal was sent) are measured on
its monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from ...runtime.aio import cancel_and_wait
from ...store import DATABASE_ERRORS, Fence, NodeMode, NodeRecord, Nodes, NodeState, Store, sibling_engine
from ...store.records import now_utc
from ..database_wait import DatabaseWait
from ..settings import Settings

logger = logging.getLogger("switchboard.control.cluster.ownership")

# A node stops acting on its sessions once this fraction of its lease has passed without a renewal (measured from when
# it sent the renewal, on its monotonic clock): the others take them over only after the whole lease, counted on the
# database's clock from when the renewal ran there, later still, so the two never act on a session at once (clocks
# running at the same rate).
STOP_FRACTION = 0.75
RENEWALS_PER_LEASE = 4
# The lease is renewed from a thread of its own while the event loop stamps a heartbeat every HEARTBEAT_S; the thread
# stops renewing once the loop has not stamped for this fraction of the lease: a process whose loop is stuck loses
# its lease about this much later than a dead one, and a loop that stalls for less never loses it.
LOOP_STALL_FRACTION = 0.5
HEARTBEAT_S = 0.1
REGISTER_POLL_S = 0.25
# Adoption wakes this long after the first lease of another node passes (on the database's clock, where it is judged)
EXPIRY_MARGIN_S = 0.02
ADOPT_MIN_WAIT_S = 0.05
CLOSE_TIMEOUT_S = 2.0


class AnotherInstanceRunning(RuntimeError):
    """A single-node instance would share its database with a live one: it does not start."""


class NodeDeposed(RuntimeError):
    """This node no longer serves sessions: another instance took them over."""


class NodeDraining(RuntimeError):
    """This node is stopping: it takes no new session (another node does)."""


def _process_gone(node: NodeRecord, hostname: str) -> bool:
    """A node registered by a process of this host that no longer runs (or that this process replaced: a container
    restarted with the same pid)."""
    if node.hostname != hostname:
        return False
    if node.pid == os.getpid():
        return True
    try:
        os.kill(node.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class NodeLease:
    def __init__(self, store: Store, settings: Settings, *, on_lost: Callable[[str, str], None] | None = None) -> None:
        self.store = store
        self.settings = settings
        self.mode = NodeMode.CLUSTER if settings.cluster_mode else NodeMode.SINGLE
        self.node_id = settings.node_id or f"node-{uuid.uuid4().hex[:12]}"
        # this process, as the holder of what it reserves (idempotency keys): a restart under the same id is not it
        self.incarnation = uuid.uuid4().hex
        self.url = settings.advertise_url or f"http://{settings.host}:{settings.port}"
        self.lease_s = settings.effective_lease_s
        self.hostname = socket.gethostname()
        self.fence = Fence(self.node_id, on_fenced=on_lost)
        self.deposed: str | None = None  # why this node stopped serving its sessions, while it does not
        self.draining = False  # stopping: takes no new session and hands its own over (``SessionHost.drain``)
        self.renew_latency_s: float | None = None
        self.on_renewed: Callable[[float], None] | None = None  # each renewal's latency (the metrics)
        self.renewals_failed = 0
        self.renewals_skipped = 0  # the event loop had not stamped its heartbeat for ``stall_s``
        self.stall_s = self.lease_s * LOOP_STALL_FRACTION
        # Shared with the renewal thread (each written on one side only, and read whole on the other):
        self.loop_stamp = time.monotonic()  # the event loop's heartbeat (monotonic)
        self._renewed_at = 0.0  # monotonic time the last successful renewal was sent
        # let go of its sessions (a late renewal, a burial): the database still names it their owner until it rejoins
        self._rejoin = False
        # a claim failed after it may have committed (its answer lost with the connection): the database may name this
        # node the owner of sessions it does not run, and no other node takes them (it holds its lease): settled by
        # the next ``claim_orphans``
        self._claims_unsettled = False
        self._loop_stalled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._renewer: _Renewer | None = None

    # -- registration -----------------------------------------------------------------------------------------

    def _record(self) -> NodeRecord:
        now = now_utc()
        return NodeRecord(
            id=self.node_id,
            url=self.url,
            state=NodeState.DRAINING if self.draining else NodeState.LIVE,  # rejoining while it drains
            mode=self.mode,
            hostname=self.hostname,
            pid=os.getpid(),
            started_at=now,
            heartbeat_at=now,
            lease_until=now + timedelta(seconds=self.lease_s),
            incarnation=self.incarnation,
        )

    def _conflicts(self, node: NodeRecord) -> bool:
        return self.mode == NodeMode.SINGLE or node.mode == NodeMode.SINGLE

    async def _register_once(self, nodes: Nodes) -> list[NodeRecord]:
        live = await nodes.list_nodes(states=[NodeState.LIVE, NodeState.DRAINING])
        gone = [node.id for node in live if node.id != self.node_id and _process_gone(node, self.hostname)]
        return await nodes.register(self._record(), gone=gone, conflicts=self._conflicts)

    async def start(self, wait: DatabaseWait | None = None) -> None:
        """Register this node (waiting up to ``takeover_wait_s`` for a conflicting live instance to stop, and for up to
        ``database_wait_s`` while the database is unavailable: ``wait``), fence the store's writes with its claims and
        start renewing the lease. Raises ``AnotherInstanceRunning`` or ``DatabaseUnavailable``."""
        wait = wait or DatabaseWait(self.settings.database_wait_s)
        deadline = time.monotonic() + self.settings.takeover_wait_s
        waited = False
        while blocking := await self._try_register(wait):
            if time.monotonic() >= deadline:
                raise AnotherInstanceRunning(self._refusal(blocking))
            if not waited:
                logger.warning("%s; waiting up to %.0fs for it to stop", self._refusal(blocking), self._wait_s)
                waited = True
            await asyncio.sleep(REGISTER_POLL_S)
        self.store.use_fence(self.fence)
        logger.info(
            "node %s registered (%s mode, lease %.1fs, %s)", self.node_id, self.mode.value, self.lease_s, self.url
        )
        self._loop = asyncio.get_running_loop()
        self.loop_stamp = time.monotonic()
        self._task = asyncio.create_task(self._watch_forever(), name=f"lease:{self.node_id}")
        self._renewer = _Renewer(self)
        self._renewer.start()

    async def _try_register(self, wait: DatabaseWait) -> list[NodeRecord]:
        """``_register_once``, retried while the database is unavailable or locked (a SQLite database stays locked
        while a frozen instance holds its write lock), as ``wait`` allows."""
        sent = time.monotonic()

        async def register() -> list[NodeRecord]:
            nonlocal sent
            sent = time.monotonic()
            return await self._register_once(self.store.nodes)

        blocking = await wait.retry(f"node {self.node_id}: registering", register)
        if not blocking:
            self._renewed(sent)
        return blocking

    @property
    def _wait_s(self) -> float:
        return self.settings.takeover_wait_s

    def _refusal(self, blocking: list[NodeRecord]) -> str:
        other = blocking[0]
        left = max(0.0, other.lease_left_s or 0.0)
        hint = (
            "stop it first, or run every instance in cluster mode (SWITCHBOARD_REDIS_URL with PostgreSQL)"
            if self.mode == NodeMode.SINGLE
            else "a single-node instance does not share its database: stop it first"
        )
        return (
            f"another switchboard instance is running on this database: {other.describe()}, lease valid for "
            f"{left:.1f}s more; {hint}"
        )

    async def aclose(self) -> None:
        """Stop renewing and mark this node stopped (its sessions are then free for the next instance at once)."""
        if self._renewer is not None:
            await self._renewer.aclose()
            self._renewer = None
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
            if self.deposed is None:
                try:
                    async with asyncio.timeout(CLOSE_TIMEOUT_S):
                        await self.store.nodes.set_state(self.node_id, NodeState.STOPPED)
                except Exception as err:  # the lease runs out on its own
                    logger.warning("node %s: could not record the stop (%r)", self.node_id, err)

    async def start_draining(self) -> None:
        """Take no new session from now on: the others stop placing sessions here and adopt none from here until
        this node hands them over (it keeps its lease meanwhile)."""
        self.draining = True
        await self.store.nodes.set_state(self.node_id, NodeState.DRAINING)

    # -- claims ---------------------------------------------------------------------------------------------

    def check_serving(self) -> None:
        if self.deposed is not None:
            raise NodeDeposed(f"this node ({self.node_id}) no longer serves sessions: {self.deposed}")
        if self.draining:
            raise NodeDraining(f"this node ({self.node_id}) is stopping and takes no new session; retry")
        if self._rejoin:  # a session created now would be let go of at once: its lease is late
            raise NodeDraining(f"this node ({self.node_id}) is rejoining after a late lease renewal; retry")

    def claim_new(self, sid: str) -> int:
        """The epoch a session this node creates starts at (its row is inserted naming this node)."""
        self.fence.claim(sid, 1)
        return 1

    async def claim_orphans(self) -> dict[str, int]:
        """Take over the live sessions no live node owns (at start: every live session; in a cluster: those of
        nodes that died). In a cluster each node takes its share, so the survivors split a dead node's sessions."""
        if self.deposed is not None or self.draining or self._rejoin:  # rejoining lets go of what it would claim
            return {}
        share = self.mode == NodeMode.CLUSTER
        claimed = await self._settle_claims() if self._claims_unsettled else {}
        try:
            claimed |= await self.store.nodes.claim_orphans(self.node_id, share=share)
        except BaseException:
            self._claims_unsettled = True
            raise
        if claimed and self._claimed_too_late():
            return {}
        for sid, epoch in claimed.items():
            self.fence.claim(sid, epoch)
        return claimed

    def _claimed_too_late(self) -> bool:
        """A claim's answer came back after this node let go of its sessions, or once it must stop acting on them
        (``STOP_FRACTION`` of its lease passed without a renewal): the database may already let another node take
        what it claimed. It acts on none of it, and rejoins, which releases what the database names it the owner of."""
        if self.deposed is not None:
            return True
        if self.mode != NodeMode.CLUSTER:
            return False
        if not self._rejoin and time.monotonic() - self._renewed_at < self.lease_s * STOP_FRACTION:
            return False
        if not self._rejoin:
            logger.warning("node %s: a claim came back after its lease was due; rejoining", self.node_id)
        self._rejoin = True
        return True

    async def _settle_claims(self) -> dict[str, int]:
        """The sessions an earlier claim took whose answer was lost: those the database names this node the owner of,
        at an epoch it holds none for. (A session created here, at epoch 1, is the host's to settle.)"""
        owned = await self.store.nodes.owned_by(self.node_id)
        self._claims_unsettled = False
        return {sid: epoch for sid, epoch in owned.items() if epoch > 1 and not self.fence.owns(sid)}

    async def next_adoption_in(self, interval_s: float) -> float:
        """How long to wait before the next look for orphaned sessions: ``interval_s``, or less when the lease of
        another live node passes sooner (a node that died is then taken over as soon as its lease has passed)."""
        try:
            left = await self.store.nodes.next_expiry_in(self.node_id)
        except DATABASE_ERRORS as err:
            logger.warning("node %s: cannot read the other nodes' leases (%r)", self.node_id, err)
            return interval_s
        if left is None:
            return interval_s
        return min(interval_s, max(ADOPT_MIN_WAIT_S, left + EXPIRY_MARGIN_S))

    # -- the lease ------------------------------------------------------------------------------------------

    async def _watch_forever(self) -> None:
        """The event loop's side of the lease: stop acting on the sessions once ``STOP_FRACTION`` of the lease passed
        without a renewal (checked before anything else this loop does after a stall), and stamp the heartbeat that
        lets the renewal thread renew."""
        beat_s = min(HEARTBEAT_S, self.lease_s / 20)
        while True:
            self._check_renewed()
            self.loop_stamp = time.monotonic()
            await asyncio.sleep(beat_s)

    def _check_renewed(self) -> None:
        """Past ``STOP_FRACTION`` of the lease without a renewal, a cluster node lets go of its sessions (the others
        may take them over once the lease passes) and rejoins as a fresh member once it can."""
        if self.mode != NodeMode.CLUSTER or not self.fence.epochs:
            return
        late_s = time.monotonic() - self._renewed_at
        if late_s < self.lease_s * STOP_FRACTION:
            return
        self._rejoin = True
        held = self.lose_all(f"node {self.node_id} could not renew its lease for {late_s:.1f}s")
        logger.error("node %s: lease not renewed in time; let go of %d session(s)", self.node_id, len(held))

    async def renew_once(self, nodes: Nodes) -> None:
        """One renewal, on the renewal thread (``nodes`` on its own engine), if the event loop stamped its heartbeat
        within ``stall_s``: a node whose loop is stuck lets its lease pass, so the others take its sessions over."""
        if self.deposed is not None:
            return
        sent = time.monotonic()
        stalled_s = sent - self.loop_stamp
        if stalled_s > self.stall_s:
            self.renewals_skipped += 1
            if not self._loop_stalled:
                logger.warning("node %s: event loop stalled for %.1fs; not renewing the lease", self.node_id, stalled_s)
            self._loop_stalled = True
            return
        if self._loop_stalled:
            logger.warning("node %s: event loop running again; renewing the lease", self.node_id)
            self._loop_stalled = False
        stop_at = self._renewed_at + self.lease_s * STOP_FRACTION
        try:
            async with asyncio.timeout(max(stop_at - sent, self.lease_s / RENEWALS_PER_LEASE)):
                ok = await (self._rejoin_once(nodes) if self._rejoin else nodes.renew(self.node_id, self.lease_s))
        except Exception as err:
            self.renewals_failed += 1
            logger.warning("node %s: lease renewal failed (%r)", self.node_id, err)
            return
        if ok:
            self._renewed(sent)
        elif self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the node is gone anyway
                self._loop.call_soon_threadsafe(self._buried)

    def _renewed(self, sent: float) -> None:
        self._renewed_at = sent
        self.renew_latency_s = time.monotonic() - sent
        if self.on_renewed is not None:
            self.on_renewed(self.renew_latency_s)

    async def _rejoin_once(self, nodes: Nodes) -> bool:
        """After letting go of its sessions, the node registers again as a fresh member instead of renewing: the
        database stops naming it the owner of the sessions it dropped, so the live nodes (this one too) take them
        over. A plain renewal would keep them owned by a live node that no longer runs them."""
        if await self._register_once(nodes):
            return False  # cannot happen in a cluster (nodes do not conflict); treated as being buried
        self._rejoin = False
        logger.warning("node %s rejoined after letting go of its sessions", self.node_id)
        return True

    def _buried(self) -> None:
        """Another node took this node's sessions over (its lease had passed): on the event loop."""
        why = f"another node took over the sessions of node {self.node_id} (its lease had passed)"
        self.lose_all(why)
        if self.mode == NodeMode.SINGLE:
            if self.deposed is None:
                logger.error("node %s: %s; this instance no longer serves sessions", self.node_id, why)
            self.deposed = why
            return
        # a cluster node carries on as a fresh member: it owns nothing now, and takes its share again once it rejoined
        if not self._rejoin:
            logger.warning("node %s lost its lease; rejoining", self.node_id)
        self._rejoin = True

    def lose_all(self, why: str) -> list[str]:
        return self.fence.lose_all(why)


class _Renewer:
    """Renews a lease from a thread of its own, with its own event loop and its own database engine.

    On the node's event loop a renewal waits its turn like everything else, and each of its database round trips
    waits again: a saturated loop (a starved CPU, a flood of requests or streams) renewed late, let go of its
    sessions and moved them for nothing. This thread is not held up by the loop, but it renews only while the loop
    proves it runs (``NodeLease.renew_once``), so a stuck loop still loses the lease, and a frozen process
    (SIGSTOP) freezes this thread with it. Fencing does not depend on any of it: every write checks the epoch."""

    def __init__(self, lease: NodeLease) -> None:
        self.lease = lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"lease:{lease.node_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def aclose(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, self.lease.lease_s + CLOSE_TIMEOUT_S)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            # a renewal that ends after the node must stop acting is useless: no call of this thread waits longer
            engine = sibling_engine(self.lease.store.engine, timeout_s=self.lease.lease_s * STOP_FRACTION)
            nodes = Nodes(engine)
            try:
                while not self._stop.wait(self.lease.lease_s / RENEWALS_PER_LEASE):
                    loop.run_until_complete(self.lease.renew_once(nodes))
            finally:
                loop.run_until_complete(engine.dispose())
        except Exception:  # never silent: without renewals the node lets go of its sessions and they move
            logger.exception("node %s: the lease renewal thread failed", self.lease.node_id)
        finally:
            loop.close()
