"""GroupCommitWriter: one task per store that writes queued operations in batches, one transaction per batch.

Operations are written in the order they were queued. A batch that fails because the database is unreachable is
retried whole, with backoff, until it lands (nothing is dropped or reordered; later operations wait behind it).
A batch that fails for any other reason is retried one operation at a time, so a bad operation fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable, Sequence

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..runtime.aio import cancel_and_wait
from ..runtime.events import Event
from ..runtime.status import ENDED_STATUSES
from .engine import IMMEDIATE
from .records import StoreClosed
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


class GroupCommitWriter:
    def __init__(self, engine: AsyncEngine, *, batch_max: int = 256) -> None:
        if batch_max < 1:
            raise ValueError("batch_max must be at least 1")
        self.engine = engine
        self.batch_max = batch_max
        self._queue: deque[Op] = deque()
        self._wake_ev = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._conn: AsyncConnection | None = None
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
        err = await self._commit_until_settled(batch)
        if err is None:
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

    async def _commit_until_settled(self, batch: Sequence[Op]) -> Exception | None:
        """Commit ``batch`` in one transaction, retrying while the database is unavailable.

        Returns None once committed, or the error that shows the batch itself is bad.
        """
        delay = RETRY_MIN_S
        while True:
            try:
                conn = await self._connection()
                async with conn.begin():
                    counters = await apply_batch(conn, batch, self._next_pos)
            except Exception as err:
                await self._drop_connection()  # whatever state it was left in, the next attempt starts afresh
                if not is_transient(err):
                    return err  # rolled back; the counters in memory are still right
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
            self.ops_written += len(batch)
            return None

    async def _connection(self) -> AsyncConnection:
        if self._conn is None:
            conn = await self.engine.connect()
            if conn.dialect.name == "sqlite":
                conn = await conn.execution_options(**{IMMEDIATE: True})
            self._conn = conn
        return self._conn

    async def _drop_connection(self) -> None:
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
            elif op.commit is not None and op.commit.session is not None and op.commit.session.state in ENDED_STATUSES:
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
