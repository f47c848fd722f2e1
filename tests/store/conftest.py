"""Store fixtures: every test runs on a fresh SQLite file and on a fresh PostgreSQL schema.

PostgreSQL comes from ``SWITCHBOARD_TEST_PG_URL``. When it is unreachable the PostgreSQL variants are skipped, except
in CI (``CI=true``), where they fail: a CI run must not pass by silently testing only SQLite.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from switchboard.store import SessionRecord, Store, make_engine
from tests.waiting import WAIT_S

PG_URL = os.environ.get("SWITCHBOARD_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
PG_CONNECT_TIMEOUT_S = 3.0

_pg_error: list[str] = []  # reachability is checked once per run


def pg_dsn() -> str:
    return make_url(PG_URL).set(drivername="postgresql").render_as_string(hide_password=False)


async def _pg_unreachable() -> str | None:
    if not _pg_error:
        try:
            conn = await asyncpg.connect(pg_dsn(), timeout=PG_CONNECT_TIMEOUT_S)
            await conn.close()
            _pg_error.append("")
        except (OSError, asyncpg.PostgresError, TimeoutError) as err:
            _pg_error.append(f"PostgreSQL at {make_url(PG_URL).render_as_string()} is unreachable: {err!r}")
    return _pg_error[0] or None


@dataclass
class Db:
    """One test database: a SQLite file, or a PostgreSQL schema of its own."""

    kind: str
    url: str
    schema: str | None = None
    path: Path | None = None
    stores: list[Store] = field(default_factory=list)

    def store(self, *, batch_max: int = 256, **engine_kw: Any) -> Store:
        """A store on this database (not migrated, not started); closed at teardown."""
        store = Store(make_engine(self.url, schema=self.schema, **engine_kw), batch_max=batch_max)
        self.stores.append(store)
        return store

    async def sql(self, statement: str, *args: Any) -> list[tuple[Any, ...]]:
        """Run raw SQL on a connection of its own (``?``-style placeholders on SQLite, ``$n`` on PostgreSQL)."""
        if self.kind == "sqlite":
            return await asyncio.to_thread(self.sql_sync, statement, *args)
        conn = await asyncpg.connect(pg_dsn(), server_settings={"search_path": self.schema or "public"})
        try:
            return [tuple(r) for r in await conn.fetch(statement, *args)]
        finally:
            await conn.close()

    def sql_sync(self, statement: str, *args: Any) -> list[tuple[Any, ...]]:
        """``sql`` from synchronous code (e.g. inside an ``on_durable`` callback), outside the event loop."""
        if self.kind == "sqlite":
            conn = sqlite3.connect(str(self.path), isolation_level=None)
            try:
                return list(conn.execute(statement, args).fetchall())
            finally:
                conn.close()
        box: list[Any] = []

        def run() -> None:
            try:
                box.append(asyncio.run(self.sql(statement, *args)))
            except BaseException as err:
                box.append(err)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if isinstance(box[0], BaseException):
            raise box[0]
        return list(box[0])

    def q(self, statement: str) -> str:
        """Turn ``?`` placeholders into ``$1, $2, ...`` on PostgreSQL."""
        if self.kind == "sqlite":
            return statement
        parts = statement.split("?")
        return "".join(p + (f"${i + 1}" if i < len(parts) - 1 else "") for i, p in enumerate(parts))


#: a test of what only PostgreSQL has (cluster mode): the ``db`` fixture without its SQLite parameter
ON_POSTGRESQL = pytest.mark.parametrize("db", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Db]:
    if request.param == "sqlite":
        path = tmp_path / "switchboard.db"
        database = Db("sqlite", f"sqlite+aiosqlite:///{path}", path=path)
        yield database
        for store in database.stores:
            await store.aclose()
        return
    problem = await _pg_unreachable()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{problem} (CI=true: the PostgreSQL tests must run; set SWITCHBOARD_TEST_PG_URL)")
        pytest.skip(problem)
    schema = f"sbtest_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_dsn())
    try:
        await admin.execute(f'CREATE SCHEMA "{schema}"')
        database = Db("postgresql", PG_URL, schema=schema)
        yield database
        for store in database.stores:
            await store.aclose()
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.close()


@pytest.fixture
async def store(db: Db) -> Store:
    """A migrated, started store with one session ``s1``."""
    s = db.store()
    await s.migrate()
    await s.start()
    await s.create_session(SessionRecord(id="s1", agent="demo", state="active"))
    return s


async def wait_for(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)
