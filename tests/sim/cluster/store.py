"""One node's store on the simulated database: the product's ``GroupCommitWriter`` and runtime ports, with the
statements answered by ``SimDatabase`` instead of SQL.

Only ``GroupCommitWriter._commit_once`` (the SQL transaction) is replaced: batching, ordering, retrying while the
database is away, refusing what the fence already knows is lost and learning losses from a batch are the product's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from switchboard.runtime.events import Event
from switchboard.runtime.ports import ChatStore, Completion, EventSink
from switchboard.runtime.status import SessionStatus
from switchboard.runtime.tools import ToolCallInfo
from switchboard.store.ownership import Fence, NodeRecord, NodeState
from switchboard.store.records import Claim, Holder, SessionData, SessionRecord
from switchboard.store.runtime_ports import StoreChatStore, StoreEventSink
from switchboard.store.writer import GroupCommitWriter
from switchboard.store.writes import Op

from .database import SimDatabase


class SimWriter(GroupCommitWriter):
    def __init__(self, db: SimDatabase, node: str, store_id: str, *, receipts_with_effect: bool = True) -> None:
        super().__init__(SimpleNamespace(dialect=SimpleNamespace(name="sim")), batch_max=64)  # type: ignore[arg-type]
        self.db = db
        self.node = node
        self.store_id = store_id
        self.receipts_with_effect = receipts_with_effect
        # the epoch each queued write was made under (what the stale-epoch oracle compares with the row)
        self.made: dict[asyncio.Future[None], int | None] = {}

    def submit(self, op: Op) -> None:
        self.made.setdefault(op.fut, op.epoch)
        op.fut.add_done_callback(self.made.pop)
        if not self.receipts_with_effect and op.commit is not None and op.commit.receipts:
            # before the fix: the effect commits alone, and the route records the answer after it, separately
            op.commit = op.commit.model_copy(update={"receipts": []})
        super().submit(op)

    async def _commit_once(self, batch: Sequence[Op]) -> Any:
        reset_after = await self.db.statement(self.node, self.store_id)
        node_id = self.fence.node_id if self.fence is not None else None
        committed = self.db.write_batch(batch, node_id, self.made)
        if reset_after:
            raise ConnectionResetError("connection reset after the commit (simulated)")
        return committed

    async def _drop_connection(self) -> None:
        return None


class _Tagged:
    """Submits to the writer noting the epoch the write was made under, then hands it over with ``epoch`` (the
    before-mode hands over None: the writer then stamps the epoch the node holds when the write is queued)."""

    def __init__(self, writer: SimWriter, made: int | None) -> None:
        self.writer = writer
        self.made_epoch = made

    def submit(self, op: Op) -> None:
        self.writer.made[op.fut] = self.made_epoch
        self.writer.submit(op)


class SimNodes:
    """``store.ownership.Nodes`` on the simulated database, for the statements of one node."""

    def __init__(self, db: SimDatabase, node: str, store_id: str) -> None:
        self.db = db
        self.node = node
        self.store_id = store_id

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if await self.db.statement(self.node, self.store_id):
            fn(*args)
            raise ConnectionResetError("connection reset after the commit (simulated)")
        return fn(*args)

    async def list_nodes(self, *, states: Sequence[NodeState] | None = None) -> list[NodeRecord]:
        return await self._run(self.db.list_nodes, states, self.node)  # type: ignore[no-any-return]

    async def register(
        self, me: NodeRecord, *, gone: Iterable[str] = (), conflicts: Callable[[NodeRecord], bool]
    ) -> list[NodeRecord]:
        return await self._run(self.db.register, me, gone, conflicts)  # type: ignore[no-any-return]

    async def live_url(self, node_id: str) -> str | None:
        return await self._run(self.db.live_url, node_id, self.node)  # type: ignore[no-any-return]

    async def next_expiry_in(self, node_id: str) -> float | None:
        return await self._run(self.db.next_expiry_in, node_id)  # type: ignore[no-any-return]

    async def renew(self, node_id: str, lease_s: float) -> bool:
        return await self._run(self.db.renew, node_id, lease_s)  # type: ignore[no-any-return]

    async def set_state(self, node_id: str, state: NodeState) -> None:
        await self._run(self.db.set_state, node_id, state)

    async def release(self, node_id: str, claims: dict[str, int]) -> list[str]:
        return await self._run(self.db.release, node_id, claims)  # type: ignore[no-any-return]

    async def owned_by(self, node_id: str) -> dict[str, int]:
        return await self._run(self.db.owned_by, node_id)  # type: ignore[no-any-return]

    async def unowned(self, sids: Sequence[str]) -> list[str]:
        return await self._run(self.db.unowned, sids)  # type: ignore[no-any-return]

    async def claim_orphans(self, node_id: str, *, share: bool = False) -> dict[str, int]:
        return await self._run(self.db.claim_orphans, node_id, share)  # type: ignore[no-any-return]


class SimKeys:
    """``store.idempotency.IdempotencyKeys`` on the simulated database."""

    def __init__(self, db: SimDatabase, node: str, store_id: str) -> None:
        self.db = db
        self.node = node
        self.store_id = store_id

    async def reserve(self, key: str, scope: str, request_hash: str, holder: Holder) -> Claim:
        reset = await self.db.statement(self.node, self.store_id)
        claim = self.db.reserve(key, scope, request_hash, holder, self.node)
        if reset:
            raise ConnectionResetError("connection reset after the commit (simulated)")
        return claim

    async def complete(self, done: Completion) -> bool:
        reset = await self.db.statement(self.node, self.store_id)
        ok = self.db.complete(done)
        if reset:
            raise ConnectionResetError("connection reset after the commit (simulated)")
        return ok

    async def release(self, key: str, scope: str, holder: Holder) -> bool:
        reset = await self.db.statement(self.node, self.store_id)
        ok = self.db.release_key(key, scope, holder)
        if reset:
            raise ConnectionResetError("connection reset after the commit (simulated)")
        return ok


class SimStore:
    """The part of ``store.Store`` a node's ``SessionHost``, ``NodeLease`` and idempotent routes use."""

    def __init__(
        self,
        db: SimDatabase,
        node: str,
        store_id: str,
        *,
        write_time_epochs: bool = True,
        receipts_with_effect: bool = True,
    ) -> None:
        self.db = db
        self.node = node
        self.store_id = store_id
        self.writer = SimWriter(db, node, store_id, receipts_with_effect=receipts_with_effect)
        self.nodes = SimNodes(db, node, store_id)
        self.idempotency = SimKeys(db, node, store_id)
        self.engine = None
        self.write_time_epochs = write_time_epochs

    def start(self) -> None:
        self.writer.start()

    def use_fence(self, fence: Fence) -> None:
        self.writer.fence = fence

    @property
    def fence(self) -> Fence | None:
        return self.writer.fence

    def chat_store(self, epoch: int | None = None) -> ChatStore:
        handed = epoch if self.write_time_epochs else None
        return StoreChatStore(_Tagged(self.writer, epoch), handed)  # type: ignore[arg-type]

    def event_sink(
        self, on_durable: Callable[[list[Event]], None] | None = None, epoch: int | None = None
    ) -> EventSink:
        handed = epoch if self.write_time_epochs else None
        return StoreEventSink(_Tagged(self.writer, epoch), on_durable, handed)  # type: ignore[arg-type]

    async def _read(self) -> None:
        if await self.db.statement(self.node, self.store_id):
            raise ConnectionResetError("connection reset (simulated)")

    async def create_session(
        self, rec: SessionRecord, *, owner_quota: int | None = None, receipt: Completion | None = None
    ) -> None:
        reset = await self.db.statement(self.node, self.store_id)
        self.db.insert_session(rec, receipt)
        if reset:
            raise ConnectionResetError("connection reset after the commit (simulated)")
        if receipt is not None:
            receipt.mark_landed()

    async def get_session(self, sid: str) -> SessionRecord | None:
        await self._read()
        rec = self.db.sessions.get(sid)
        return rec.model_copy() if rec is not None else None

    async def tool_call(self, sid: str, call_id: str) -> ToolCallInfo | None:
        await self._read()
        return self.db.session_rows(sid).tool_calls.get(call_id)

    async def live_sessions(self, ids: Sequence[str] | None = None) -> list[SessionRecord]:
        await self._read()
        return self.db.live_sessions(ids)

    async def load_sessions_bulk(
        self, ids: Sequence[str], *, recent_types: Iterable[str] = (), recent_limit: int = 0
    ) -> dict[str, SessionData]:
        await self._read()
        found = {}
        for sid in ids:
            d = self.db.session_rows(sid)
            log = d.event_log()
            found[sid] = SessionData(
                items=d.chat(),
                tool_calls=list(d.tool_calls.values()),
                speeches=list(d.speeches.values()),
                last_seq=log[-1].seq if log else 0,
                reported=self.db.reported(sid),
            )
        return found

    async def mark_session(self, sid: str, state: SessionStatus, *, epoch: int | None = None) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.writer.submit(Op(sid, fut, mark_state=state, epoch=epoch))
        await asyncio.shield(fut)

    async def failed_sessions(self, *, since: Any, limit: int) -> list[Any]:
        return []
