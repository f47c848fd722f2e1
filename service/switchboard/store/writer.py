"""GroupCommitWriter: one task per store that writes queued operations in batches, one transaction per batch.

Operations are written in the order they were queued. A batch that fails because the database is unreachable is
retried whole, with backoff, until it lands (nothing is dropped or reordered; later operations wait behind it).
A batch that fails for any other reason is retried one operation at a time, so a bad operation fails alone.

With a ``Fence`` (a node that owns its sessions), each batch first checks, in its own transaction, each operation's
fencing token: it lands only while its session's row names this node at the epoch the operation was made under
(``Op.epoch``). A refused operation fails with ``SessionFenced`` and writes nothing; the others are written as usual.
The token is the operation's own, never the epoch the node holds when the batch finally runs: a batch retried while
the node lost a session and took it back must not land what the old incarnation made.
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
from .faults import connection_lost
from .ownership import Fence, Owners, read_owners, refusal
from .records import SessionExists, SessionFenced, StoreClosed, StoreError
from .writes import DurableCallback, Op, apply_batch

logger = logging.getLogger("switchboard.store")

RETRY_MIN_S = 0.05
RETRY_MAX_S = 2.0
_SQLITE_SCHEMA_ERRORS = ("no such table", "no such column", "has no column named")
# PostgreSQL errors that say the database could not do it now, not that the statement is bad: a statement cancelled
# by ``statement_timeout`` (a lock held too long), a lock not granted in time, the server shutting down or out of
# connections, a conflict with a transaction that ran at the same time.
_TRANSIENT_SQLSTATES = frozenset({"57014", "55P03", "57P01", "57P02", "57P03", "53300", "40001", "40P01"})


# What a failing database surfaces as (wrapped by SQLAlchemy, raw at connect time, or a call past its bound: asyncpg's
# ``TimeoutError`` is an ``OSError``; the pool's, a SQLAlchemy ``TimeoutError``); ``is_transient`` tells which.
# A connection that uvloop closed under asyncpg while one was being opened can still surface raw as a ``RuntimeError``
# (``faults``): only that one is transient.
DATABASE_ERRORS: tuple[type[Exception], ...] = (sa_exc.DBAPIError, OSError, sa_exc.TimeoutError, RuntimeError)


def _sqlstate(err: sa_exc.DBAPIError) -> str | None:
    cause: BaseException | None = err.orig
    while cause is not None:  # asyncpg's error sits under SQLAlchemy's adapter of it
        code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
        if isinstance(code, str):
            return code
        cause = cause.__cause__
    return None


def is_transient(err: BaseException) -> bool:
    """True when ``err`` says the database is unavailable (retry), not that the operation is bad (give up)."""
    if connection_lost(err):  # in whatever form the driver reported it (``faults``)
        return True
    if isinstance(err, sa_exc.DBAPIError):
        if err.connection_invalidated or _sqlstate(err) in _TRANSIENT_SQLSTATES:
            return True
        if isinstance(err, sa_exc.OperationalError) and any(s in str(err.orig) for s in _SQLITE_SCHEMA_ERRORS):
            return False  # SQLite reports a missing table (database not migrated) as "operational"
        return isinstance(err, sa_exc.OperationalError | sa_exc.InterfaceError)
    # Connect-time failures may surface unwrapped (refused, reset), and so does a call past its bound (the driver's
    # TimeoutError; the pool's, when no connection came back in time).
    return isinstance(err, OSError | ConnectionError | TimeoutError | sa_exc.TimeoutError)


def _sessions(ops: Iterable[Op]) -> str:
    sids = sorted({op.session_id for op in ops})
    return ", ".join(sids[:10]) + (f" (+{len(sids) - 10} more)" if len(sids) > 10 else "")


# (the chat position counters written, the operations refused (by the fencing check: ``SessionFenced``; a create of an
# id that is taken: ``SessionExists``), the owners the fencing check found)
_Committed = tuple[dict[str, int], dict[Op, StoreError], Owners]


def write_fenced(
    conn: Connection, batch: Sequence[Op], next_pos: dict[str, int], node_id: str | None, ordered: bool = False
) -> _Committed:
    """In the batch's transaction: the fencing check of node ``node_id`` (None: none), with the session rows locked,
    then the writes it lets land (``ordered``: events take their ids in commit order, see
    ``writes.EVENT_ORDER_LOCK_KEY``). Each operation is judged on its own epoch (``ownership.refusal``), so two
    operations of one session made under different epochs may meet different fates in one batch."""
    refused: dict[Op, StoreError] = {}
    if node_id is None:
        return apply_batch(conn, batch, next_pos, ordered=ordered, refused=refused), refused, {}
    owners = read_owners(conn, (op.session_id for op in batch))
    for op in batch:
        err = refusal(node_id, op.session_id, op.epoch, owners)
        if err is not None:  # a create of an id that some node owns: the id is taken
            refused[op] = SessionExists(op.session_id) if op.create is not None else err
    writable = [op for op in batch if op not in refused] if refused else batch
    return apply_batch(conn, writable, next_pos, ordered=ordered, refused=refused), refused, owners


class _SqliteThread:
    """The writer's SQLite connection, on a thread of its own: a whole batch is one call into that thread.

    Everything touching the connection runs on that thread (``sqlite3`` connections belong to the thread that made
    them); it never touches the event loop.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine: Engine = sqlite_writer_engine(engine)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer")
        self._conn: Connection | None = None

    async def write(self, batch: Sequence[Op], next_pos: dict[str, int], node_id: str | None) -> _Committed:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._write, batch, next_pos, node_id)

    def _write(self, batch: Sequence[Op], next_pos: dict[str, int], node_id: str | None) -> _Committed:
        if self._conn is None:
            self._conn = self._engine.connect().execution_options(**{IMMEDIATE: True})
        with self._conn.begin():
            return write_fenced(self._conn, batch, next_pos, node_id)

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
        if op.epoch is None and self.fence is not None:
            op.epoch = self.fence.epochs.get(op.session_id)  # made now, under the claim the node holds now
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
        batch = list(self._refuse_lost(batch))
        if not batch:
            return
        err, refused = await self._commit_until_settled(batch)
        if not batch:  # only creates, failed as the database was unavailable
            return
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
        """Fail at once the operations this node already knows cannot land (``Fence.refused_locally``)."""
        if self.fence is None:
            return batch
        kept = []
        for op in batch:
            err = self.fence.refused_locally(op.session_id, op.epoch)
            if err is None:
                kept.append(op)
            else:
                _failed(op, err)
        return kept

    def _refuse(self, batch: Sequence[Op], refused: dict[Op, StoreError]) -> list[Op]:
        """Fail the operations the batch refused (the fencing check, a create of an id taken); the rest were
        written."""
        if self.fence is not None:
            self.fence.refusals += sum(1 for err in refused.values() if isinstance(err, SessionFenced))
        written = []
        for op in batch:
            found = refused.get(op)
            if found is None:
                written.append(op)
            else:
                _failed(op, found)
        return written

    def _learn_losses(self, held: dict[str, int | None], owners: Owners) -> None:
        """The sessions the batch found no longer this node's at the epoch it held when the batch began are lost (a
        refused write of an older epoch alone says nothing of the claim the node holds now)."""
        assert self.fence is not None
        for sid, epoch in held.items():
            if epoch is None or sid not in owners:
                continue
            err = refusal(self.fence.node_id, sid, epoch, owners)
            if err is not None:
                self.fence.lose(sid, err.detail, epoch=epoch)

    async def _commit_until_settled(self, batch: list[Op]) -> tuple[Exception | None, dict[Op, StoreError]]:
        """Commit ``batch`` in one transaction, retrying while the database is unavailable (the session creates in it
        fail instead, and leave ``batch``: ``_fail_creates``).

        Returns (None, refused) once committed, with the operations the fencing check refused (nothing of theirs was
        written), or the error that shows the batch itself is bad.
        """
        delay = RETRY_MIN_S
        while True:
            try:
                started = time.perf_counter()
                held = self._held(batch)
                counters, refused, owners = await self._commit_once(batch)
                committed_s = time.perf_counter() - started
            except Exception as err:
                await self._drop_connection()  # whatever state it was left in, the next attempt starts afresh
                if not is_transient(err):
                    return err, {}  # rolled back; the counters in memory are still right
                # The outcome is unknown (the commit itself may have landed): start over from what is stored.
                for op in batch:
                    self._next_pos.pop(op.session_id, None)
                if self._fail_creates(batch, err):
                    return None, {}
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
            if self.fence is not None:
                self._learn_losses(held, owners)
            self.unavailable = False
            self.batches += 1
            written = len(batch) - len(refused)
            self.ops_written += written
            if self.on_commit is not None:
                self.on_commit(committed_s, written)
            return None, refused

    @staticmethod
    def _fail_creates(batch: list[Op], err: Exception) -> bool:
        """A session create is not retried: it fails with ``err`` (its caller answers that the database is
        unavailable, and settles later whether its row landed), as it did in a transaction of its own; the rest of
        ``batch`` stays to be retried. Returns True when nothing is left."""
        creates = [op for op in batch if op.create is not None]
        if creates:
            for op in creates:
                _failed(op, err)
            batch[:] = [op for op in batch if op.create is None]
        return not batch

    def _held(self, batch: Sequence[Op]) -> dict[str, int | None]:
        """The epoch this node holds for each session of ``batch`` as an attempt begins (what the attempt may find
        lost), taken on the event loop before the batch goes to the thread that writes it."""
        if self.fence is None:
            return {}
        sids = {op.session_id for op in batch}
        for sid in sids & self.fence.fresh:  # claimed anew: another node may have appended since this one last did
            self._next_pos.pop(sid, None)
            self.fence.fresh.discard(sid)
        return self.fence.claims(sids)

    async def _commit_once(self, batch: Sequence[Op]) -> _Committed:
        node_id = self.fence.node_id if self.fence is not None else None
        if self._sqlite is not None:
            return await self._sqlite.write(batch, self._next_pos, node_id)
        conn = await self._connection()
        async with conn.begin():
            return await conn.run_sync(write_fenced, batch, self._next_pos, node_id, self.ordered_events)

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
            _failed(op, err)


def _failed(op: Op, err: BaseException) -> None:
    """``op`` failed for good with ``err``: nothing of it landed, so neither did the idempotency answers it carried
    (their commands learn it: ``Completion.refused``)."""
    if op.fut.done():
        return
    if op.commit is not None and isinstance(err, Exception):
        for receipt in op.commit.receipts:
            receipt.mark_refused(err)
    op.fut.set_exception(err)
