"""Engine construction: SQLite pragmas and transaction control, PostgreSQL schema selection, tolerant JSON."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from ..runtime.aio import run_to_end
from .faults import watch_connections
from .text import decode_json_text, encode_json_text

SQLITE_BUSY_TIMEOUT_MS = 5000
# PostgreSQL: a hang is an outage. Each statement is bounded on the server (``statement_timeout``: a lock held forever)
# and, COMMAND_TIMEOUT_MARGIN_S later, on the client (asyncpg's ``command_timeout``: a server or a network that stopped
# answering); opening a connection is bounded by CONNECT_TIMEOUT_S, waiting for a pooled one by the statement bound.
DATABASE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_MARGIN_S = 1.0

# Execution option that makes a SQLite transaction take the write lock at BEGIN (the group-commit writer uses it,
# so a read-then-write batch never fails halfway with SQLITE_BUSY_SNAPSHOT).
IMMEDIATE = "switchboard_sqlite_immediate"
# Where a SQLite engine keeps its busy timeout, for the writer's own engine on the same file (``sqlite_writer_engine``).
_BUSY_TIMEOUT = "switchboard_sqlite_busy_timeout_ms"
# Where an engine keeps the arguments ``make_engine`` built it with, for an engine of its own on the same database
# (``sibling_engine``).
_MADE_WITH = "switchboard_engine_args"


P = ParamSpec("P")
T = TypeVar("T")


def whole(transaction: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A store method whose transaction a cancelled caller does not cut in half: it runs to its commit or rollback,
    and the caller, once it has, sees its CancelledError.

    Cut off mid-statement, SQLAlchemy throws the connection away without rolling back; on SQLite a statement with
    rows still to read (a SELECT, a RETURNING) is then held by the traceback of the cancellation, and the connection,
    closed but with a statement left, keeps its transaction and the write lock for as long as that traceback lives
    (a cancelled task keeps it): every other writer waits out its busy timeout and fails.
    """

    @functools.wraps(transaction)
    async def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return await run_to_end(transaction(*args, **kwargs))

    return run


class CorruptJSON:
    """What a JSON column holds when its stored text does not parse (only possible on SQLite)."""

    __slots__ = ("error", "raw")

    def __init__(self, raw: str, error: str) -> None:
        self.raw = raw
        self.error = error

    def __repr__(self) -> str:
        return f"CorruptJSON({self.raw[:40]!r}, {self.error!r})"


def _loads(raw: str | bytes) -> Any:
    try:
        return json.loads(decode_json_text(raw if isinstance(raw, str) else raw.decode()))
    except ValueError as err:  # a corrupt row must not make the whole read fail; callers report it
        return CorruptJSON(raw if isinstance(raw, str) else raw.decode("utf-8", "replace"), str(err))


def _dumps(value: Any) -> str:
    # NUL and lone surrogates are encoded inside the JSON text: neither database can store them as they are.
    return encode_json_text(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def make_engine(
    url: str,
    *,
    schema: str | None = None,
    busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS,
    application_name: str | None = None,
    idle_in_transaction_ms: int | None = None,
    timeout_s: float | None = DATABASE_TIMEOUT_S,
) -> AsyncEngine:
    """An async engine for ``sqlite+aiosqlite:///path`` or ``postgresql+asyncpg://...``.

    SQLite: WAL, ``synchronous=NORMAL``, ``busy_timeout``, foreign keys on; transactions are begun explicitly
    (so DDL is transactional and the writer can ``BEGIN IMMEDIATE``); the file's directory is created.
    PostgreSQL: ``schema`` becomes the ``search_path`` (tests use one schema each); connections are pre-pinged; every
    call is bounded in time (``timeout_s``: see ``_pg_timeouts``; None: unbounded, for migrations only).
    """
    made_with = {
        "schema": schema,
        "busy_timeout_ms": busy_timeout_ms,
        "application_name": application_name,
        "idle_in_transaction_ms": idle_in_transaction_ms,
        "timeout_s": timeout_s,
    }
    u = make_url(url)
    backend = u.get_backend_name()
    # Plain URLs get the async drivers this store is built on.
    if u.drivername in ("sqlite", "postgresql", "postgres"):
        backend = "sqlite" if u.drivername == "sqlite" else "postgresql"
        u = u.set(drivername="sqlite+aiosqlite" if backend == "sqlite" else "postgresql+asyncpg")
    if backend == "sqlite":
        database = u.database or ""
        if database in ("", ":memory:") or "memory" in database.split("?")[0].split(":"):
            # The writer holds a connection of its own while readers use others: an in-memory database would be
            # a different (empty) database on each connection.
            raise ValueError("in-memory SQLite is not supported; use a file, e.g. sqlite+aiosqlite:///./var/test.db")
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(u, json_serializer=_dumps, json_deserializer=_loads)
        _configure_sqlite(engine.sync_engine, busy_timeout_ms=busy_timeout_ms)
        engine.sync_engine.update_execution_options(**{_BUSY_TIMEOUT: busy_timeout_ms, _MADE_WITH: made_with})
        return engine
    if backend == "postgresql":
        server_settings: dict[str, str] = {}
        if schema:
            server_settings["search_path"] = schema
        if application_name:
            server_settings["application_name"] = application_name
        if idle_in_transaction_ms:
            # a process frozen inside a transaction (SIGSTOP, a paused VM) would hold its row locks, and so keep the
            # other nodes from taking its sessions over, until it runs again: the server ends such a transaction
            server_settings["idle_in_transaction_session_timeout"] = str(int(idle_in_transaction_ms))
        connect_args: dict[str, Any] = {}
        pool_args: dict[str, Any] = {}
        if timeout_s is not None:
            connect_args, pool_args = _pg_timeouts(timeout_s, server_settings)
        if server_settings:
            connect_args["server_settings"] = server_settings
        engine = create_async_engine(
            u,
            json_serializer=_dumps,
            json_deserializer=_loads,
            pool_pre_ping=True,
            connect_args=connect_args,
            **pool_args,
        )
        watch_connections(engine)  # a connection lost in any form is thrown away, not handed out again
        engine.sync_engine.update_execution_options(**{_MADE_WITH: made_with})
        return engine
    raise ValueError(f"unsupported database URL {u.render_as_string(hide_password=True)!r}: use SQLite or PostgreSQL")


def _pg_timeouts(timeout_s: float, server_settings: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """asyncpg's connect arguments and the pool's for a bound of ``timeout_s`` on every call (``server_settings``
    gains the server's own bound).

    The server cancels a statement that runs (or waits for a lock) ``timeout_s``: the connection stays usable. The
    client gives up ``COMMAND_TIMEOUT_MARGIN_S`` later, when the server itself does not answer (stalled, or the
    network dropping everything): asyncpg raises ``TimeoutError``, and the connection is thrown away."""
    server_settings["statement_timeout"] = str(max(1, int(timeout_s * 1000)))
    connect_args = {
        "timeout": min(CONNECT_TIMEOUT_S, timeout_s),
        "command_timeout": timeout_s + COMMAND_TIMEOUT_MARGIN_S,
    }
    return connect_args, {"pool_timeout": timeout_s}


def sibling_engine(engine: AsyncEngine, **overrides: Any) -> AsyncEngine:
    """A new engine on the database of ``engine`` (built by ``make_engine``), configured the same way (but for
    ``overrides`` of ``make_engine``'s arguments), with a pool of its own: for a thread that runs its own event loop
    (an async driver's connections belong to one loop), or for calls bounded otherwise (a lease renewal, migrations)."""
    made_with = engine.sync_engine.get_execution_options().get(_MADE_WITH, {})
    return make_engine(engine.url.render_as_string(hide_password=False), **{**made_with, **overrides})


def sqlite_writer_engine(engine: AsyncEngine) -> Engine:
    """A synchronous engine (the standard ``sqlite3`` driver) on the database of ``engine``, configured the same way.

    The group-commit writer runs each batch on it in a thread of its own, in one call: through the async driver every
    statement is several hops between the event loop and the driver's thread (cursor, execute, fetch, close), and on
    a busy machine each hop waits to be scheduled, so a batch of ten statements took tens of milliseconds.
    """
    busy_timeout_ms = engine.sync_engine.get_execution_options().get(_BUSY_TIMEOUT, SQLITE_BUSY_TIMEOUT_MS)
    sync = create_engine(engine.url.set(drivername="sqlite+pysqlite"), json_serializer=_dumps, json_deserializer=_loads)
    _configure_sqlite(sync, busy_timeout_ms=busy_timeout_ms)
    return sync


def _configure_sqlite(engine: Engine, *, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: ConnectionPoolEntry) -> None:
        # Let SQLAlchemy, not the driver, decide when transactions begin (see _on_begin).
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get(IMMEDIATE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
