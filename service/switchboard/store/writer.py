"""GroupCommitWriter: one task per store that writes queued operations in batches, one transaction per batch.

Operations are written in the order they were queued. A batch that fails because the database is unreachable is
retried whole, with backoff, until it lands (nothing is dropped or reordered; later operations wait behind it).
A batch that fails for any other reason is retried one operation at a time, so a bad operation fails alone.

With a ``Fence`` (a node that owns its sessions), each batch first checks, in its own transaction, that this node
still owns every session it writes for: the operations of a session it lost fail with ``SessionFenced`` and write
nothing; the others are written as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..runtime.aio import cancel_and_wait
from ..runtime.events import Event
from ..runtime.status import ENDED_STATUSES
from .engine import IMMEDIATE, sqlite_writer_engine
from .ownership import Fence, check_owners
from .records import SessionFenced, StoreClosed
from .writes import DurableCallback, Op, apply_batch

logger = logging.getLogger("switchboard.store")

RETRY_MIN_S = 0.05
RETRY_MAX_S = 2.0
_SQLITE_SCHEMA_ERRORS = ("no such table", "no such column", "has no column named")


# What a failing database surfaces as (wrapped by SQLAlchemy, or raw at connect time); ``is_transient`` tells which.
DATABASE_ERRORS: tuple[type[Exception], ...] = (sa_exc.DBAPIError, OSError)


def is_transient(err: BaseException) -> bool:
    """True when ``err`` says the database is unavailable (retry), not that the operation is bad (give up)."""
    if isinstance(err, sa_exc.DBAPIError):
        if err.connection_invalidated:
            return True
        if isinstance(err, sa_exc.OperationalError) and any(s in str(err.orig) for s in _SQLITE_SCHEMA_ERRORS):
            return False  # SQLite reports a missing table (database not migrated) as "operational"
        return isinstance(err, sa_exc.OperationalError | sa_exc.InterfaceError)
    # Connect-time failures may surface unwrapped (refused, reset, timed out).
    return isinstance(err, OSError | ConnectionError | TimeoutError)


def _sessions(ops: Iterable[Op]) -> str:
    sids = sorted({op.session_id for op in ops})
    return ", ".join(sids[:10]) + (f" (+{len(sids) - 10} more)" if len(sids) > 10 else "")


# (this node's id, its epoch for each session of a batch): the fencing check's input
_Claims = tuple[str, dict[str, int | None]]
# (the chat position counters written, the sessions the fencing check refused)
_Committed = tuple[dict[str, int], dict[str, SessionFenced]]


def _apply_fenced(
    conn: Connection, batch: Sequence[Op], next_pos: dict[str, int], claims: _Claims | None, ordered: bool = False
) -> _Committed:
    """In the batch's transaction: the fencing check (with the session rows locked), then the writes it allows
    (``ordered``: events take their ids in commit order, see ``writes.EVENT_ORDER_LOCK_KEY``)."""
    if claims is None:
        return apply_batch(conn, batch, next_pos, ordered=ordered), {}
    refused = check_owners(conn, *claims)
    writable = [op for op in batch if op.session_id not in refused] if refused else batch
    return apply_batch(conn, writable, next_pos, ordered=ordered), refused


class _SqliteThread:
    """The writer's SQLite connection, on a thread of its own: a whole batch is one call into that thread.

    Everything touching the connection runs on that thread (``sqlite3`` connections belong to the thread that made
    them); it never touches the event loop.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine: Engine = sqlite_writer_engine(engine)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer")
        self._conn: Connection | None = None

    async def write(self, batch: Sequence[Op], next_pos: dict[str, int], claims: _Claims | None) -> _Committed:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._write, batch, next_pos, claims)

    def _write(self, batch: Sequence[Op], next_pos: dict[str, int], claims: _Claims | None) -> _Committed:
        if self._conn is None:
            self._conn = self._engine.connect().execution_options(**{IMMEDIATE: True})
        with self._conn.begin():
            return _apply_fenced(self._conn, batch, next_pos, claims)

    async def drop_connection(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._drop)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
            with contextlib.suppress(Exception):
                conn.close()

    async def aclose(self) -> None:
        await self.drop_connection()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._engine.dispose)
        self._executor.shutdown(wait=False)


class GroupCommitWriter:
    def __init__(self, engine: AsyncEngine, *, batch_max: int = 256, fence: Fence | None = None) -> None:
        if batch_max < 1:
            raise ValueError("batch_max must be at least 1")
        self.engine = engine
        self.fence = fence
        self.batch_max = batch_max
        self._queue: deque[Op] = deque()
        self._wake_ev = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._conn: AsyncConnection | None = None
        self._sqlite = _SqliteThread(engine) if engine.dialect.name == "sqlite" else None
        self._closing = False
        self._closed = False
        # Next chat position per session. Only this task appends, so memory is authoritative once loaded.
        self._next_pos: dict[str, int] = {}
        # Counters for metrics and tests.
        self.batches = 0
        self.ops_written = 0
        self.retries = 0
        self.failed_ops = 0
        self.unavailable = False  # the last attempt failed because the database was unreachable
        self.ordered_events = False  # cluster mode: event ids in commit order across the nodes' writers
        #: Told of each committed batch: (seconds from its transaction's start to its commit, operations in it)
        self.on_commit: Callable[[float, int], None] | None = None

    @property
    def pending(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def submit(self, op: Op) -> None:
        if self._closing:
            raise StoreClosed("the store is closed")
        self._queue.append(op)
        self._wake_ev.set()

    def start(self) -> None:
        if self._task is None and not self._closing:
            self._task = asyncio.create_task(self._run(), name="store-writer")

    async def aclose(self, *, timeout_s: float | None = 30.0) -> None:
        """Write everything queued, then stop. After ``timeout_s`` (database still down) the rest fails."""
        if self._closed:
            return
        self._closing = True
        self._wake_ev.set()
        if self._task is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(self._task)
            except TimeoutError:
                logger.error("store: %d write(s) not durable after %.1fs at close; giving up", self.pending, timeout_s)
                await cancel_and_wait(self._task)
        self._fail(list(self._queue), StoreClosed("the store closed before this write was durable"))
        self._queue.clear()
        await self._drop_connection()
        if self._sqlite is not None:
            await self._sqlite.aclose()
        self._closed = True

    # -- the task ---------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake_ev.clear()
                await self._wake_ev.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.batch_max))]
            try:
                await self._write(batch)
            except asyncio.CancelledError:
                self._fail(batch, StoreClosed("the store closed before this write was durable"))
                raise
            except Exception as err:  # a bug here must not stop every later write
                logger.exception("store writer: unexpected error for session(s) %s", _sessions(batch))
                self._fail(batch, err)

    async def _write(self, batch: Sequence[Op]) -> None:
        batch = self._refuse_lost(batch)
        if not batch:
            return
        err, refused = await self._commit_until_settled(batch)
        if err is None:
            if refused:
                batch = self._refuse(batch, refused)
            self._settle(batch)
            return
        if len(batch) == 1:
            op = batch[0]
            logger.error(
                "store: write for session %s failed: %r", op.session_id, err, extra={"session_id": op.session_id}
            )
            self.failed_ops += 1
            self._fail(batch, err)
            return
        logger.warning("store: batch of %d failed (%r); writing its operations one by one", len(batch), err)
        for op in batch:
            await self._write([op])

    def _refuse_lost(self, batch: Sequence[Op]) -> Sequence[Op]:
        """Fail at once the operations of sessions this node already knows it lost."""
        if self.fence is None or not self.fence.lost:
            return batch
        kept = []
        for op in batch:
            err = self.fence.refused_locally(op.session_id)
            if err is None:
                kept.append(op)
            elif not op.fut.done():
                op.fut.set_exception(err)
        return kept

    def _refuse(self, batch: Sequence[Op], refused: dict[str, SessionFenced]) -> list[Op]:
        """Fail the operations the fencing check refused (the sessions are lost from now on); the rest were written."""
        assert self.fence is not None
        self.fence.refusals += len(refused)
        for sid, err in refused.items():
            self.fence.lose(sid, err.detail)
        written = []
        for op in batch:
            found = refused.get(op.session_id)
            if found is None:
                written.append(op)
            elif not op.fut.done():
                op.fut.set_exception(found)
        return written

    async def _commit_until_settled(self, batch: Sequence[Op]) -> tuple[Exception | None, dict[str, SessionFenced]]:
        """Commit ``batch`` in one transaction, retrying while the database is unavailable.

        Returns (None, refused) once committed, with the sessions the fencing check refused (nothing of theirs was
        written), or the error that shows the batch itself is bad.
        """
        delay = RETRY_MIN_S
        while True:
            try:
                started = time.perf_counter()
                counters, refused = await self._commit_once(batch, self._fence_claims(batch))
                committed_s = time.perf_counter() - started
            except Exception as err:
                await self._drop_connection()  # whatever state it was left in, the next attempt starts afresh
                if not is_transient(err):
                    return err, {}  # rolled back; the counters in memory are still right
                # The outcome is unknown (the commit itself may have landed): start over from what is stored.
                for op in batch:
                    self._next_pos.pop(op.session_id, None)
                self.retries += 1
                self.unavailable = True
                first = batch[0].session_id
                logger.error(
                    "store: database unavailable writing %d operation(s) for session(s) %s: %r; retrying in %.2fs",
                    len(batch),
                    _sessions(batch),
                    err,
                    delay,
                    extra={"session_id": first},
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            self._next_pos.update(counters)
            self.unavailable = False
            self.batches += 1
            written = sum(1 for op in batch if op.session_id not in refused) if refused else len(batch)
            self.ops_written += written
            if self.on_commit is not None:
                self.on_commit(committed_s, written)
            return None, refused

    def _fence_claims(self, batch: Sequence[Op]) -> _Claims | None:
        """What the fencing check needs (this node's id and its epoch for each session of ``batch``), taken on the
        event loop before the batch goes to the thread that writes it."""
        if self.fence is None:
            return None
        sids = {op.session_id for op in batch}
        for sid in sids & self.fence.fresh:  # claimed anew: another node may have appended since this one last did
            self._next_pos.pop(sid, None)
            self.fence.fresh.discard(sid)
        return self.fence.node_id, self.fence.claims(sids)

    async def _commit_once(self, batch: Sequence[Op], claims: _Claims | None) -> _Committed:
        if self._sqlite is not None:
            return await self._sqlite.write(batch, self._next_pos, claims)
        conn = await self._connection()
        async with conn.begin():
            return await conn.run_sync(_apply_fenced, batch, self._next_pos, claims, self.ordered_events)

    async def _connection(self) -> AsyncConnection:
        if self._conn is None:  # PostgreSQL (SQLite writes on its own thread)
            self._conn = await self.engine.connect()
        return self._conn

    async def _drop_connection(self) -> None:
        if self._sqlite is not None:
            await self._sqlite.drop_connection()
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.invalidate()
            with contextlib.suppress(Exception):
                await conn.close()

    def _settle(self, batch: Sequence[Op]) -> None:
        durable: dict[DurableCallback, list[Event]] = {}
        for op in batch:
            if op.event is not None and op.on_durable is not None:
                durable.setdefault(op.on_durable, []).append(op.event)
            elif op.commit is not None:
                for receipt in op.commit.receipts:
                    receipt.mark_landed()
                if op.commit.session is not None and op.commit.session.state in ENDED_STATUSES:
                    self._next_pos.pop(op.session_id, None)  # the session is over: forget its counter
        for callback, events in durable.items():
            try:
                callback(events)
            except Exception:
                logger.exception("store: on_durable callback failed")
        for op in batch:
            if not op.fut.done():
                op.fut.set_result(None)

    @staticmethod
    def _fail(ops: Iterable[Op], err: BaseException) -> None:
        for op in ops:
            if not op.fut.done():
                op.fut.set_exception(err)
