"""A hang is an outage: a PostgreSQL that stops answering (here a proxy of the test's own that stops forwarding) makes
every call fail in bounded time, never wait forever. A write batch in flight is an outcome unknown: retried as the
database being unavailable, it lands once the database answers again; a read fails; readiness says unavailable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy import exc as sa_exc

from switchboard.runtime.ports import Commit
from switchboard.store import DATABASE_ERRORS, SessionRecord, Store, is_transient, make_engine

from .conftest import ON_POSTGRESQL, Db, pg_dsn, wait_for
from .tcp_proxy import PausableProxy
from .test_fencing import items, msg

pytestmark = [pytest.mark.timeout(90), ON_POSTGRESQL]

TIMEOUT_S = 1.0  # the bound of each call (production: DATABASE_TIMEOUT_S, 10 s); short for the test's sake
BOUND_S = 30.0  # generous, for a loaded machine: what "bounded" means here


@pytest.fixture
async def proxy(db: Db) -> AsyncIterator[PausableProxy]:
    proxy = await PausableProxy.before(db.url).start()
    try:
        yield proxy
    finally:
        await proxy.aclose()


async def through(db: Db, proxy: PausableProxy) -> Store:
    """A migrated, started store whose connections go through ``proxy``."""
    store = Store(make_engine(proxy.url_through(db.url), schema=db.schema, timeout_s=TIMEOUT_S))
    db.stores.append(store)
    await store.migrate()
    await store.start()
    await store.create_session(SessionRecord(id="s1", agent="demo", state="active"))
    await store.chat_store().commit("s1", Commit(items=[msg("before")]))
    return store


async def test_a_write_in_flight_while_the_database_hangs_is_retried_and_lands_once_it_answers(
    db: Db, proxy: PausableProxy
) -> None:
    store = await through(db, proxy)
    proxy.pause()
    try:
        write = asyncio.create_task(store.chat_store().commit("s1", Commit(items=[msg("during")])))
        # the batch's transaction gets no answer: the attempt times out, counts as the database being unavailable
        await wait_for(lambda: store.writer.retries >= 2, timeout_s=BOUND_S)
        assert store.writer.unavailable and not write.done()
        async with asyncio.timeout(BOUND_S):
            assert await store.ping() is False  # /readyz: the database is unavailable
    finally:
        proxy.resume()
    async with asyncio.timeout(BOUND_S):
        await write
    assert await items(db, "s1") == ["before", "during"]  # once, in order
    async with asyncio.timeout(BOUND_S):
        assert await store.ping() is True


async def test_a_read_while_the_database_hangs_fails_in_bounded_time(db: Db, proxy: PausableProxy) -> None:
    store = await through(db, proxy)
    proxy.pause()
    try:
        async with asyncio.timeout(BOUND_S):
            with pytest.raises((*DATABASE_ERRORS, sa_exc.TimeoutError)) as failed:
                await store.chat_items("s1")
        assert is_transient(failed.value)  # answered 503 database_unavailable by the API
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(DATABASE_ERRORS):
                await store.nodes.list_nodes()
    finally:
        proxy.resume()
    assert [item.id for item in await store.chat_items("s1")] == ["before"]


async def test_a_statement_held_by_a_lock_is_cancelled_by_the_server_and_retried(db: Db) -> None:
    """A lock held for good (another transaction that never ends): the server cancels the waiting statement
    (``statement_timeout``), and the batch is retried as the database being unavailable, not failed as a bad one."""
    store = Store(make_engine(db.url, schema=db.schema, timeout_s=TIMEOUT_S))
    db.stores.append(store)
    await store.migrate()
    await store.start()
    await store.create_session(SessionRecord(id="s1", agent="demo", state="active"))
    holder = await asyncpg.connect(pg_dsn(), server_settings={"search_path": db.schema or "public"})
    try:
        await holder.execute("BEGIN")
        await holder.execute("LOCK TABLE chat_items IN ACCESS EXCLUSIVE MODE")
        write = asyncio.create_task(store.chat_store().commit("s1", Commit(items=[msg("waited")])))
        await wait_for(lambda: store.writer.retries >= 2, timeout_s=BOUND_S)
        assert not write.done() and store.writer.failed_ops == 0
        await holder.execute("COMMIT")
        async with asyncio.timeout(BOUND_S):
            await write
    finally:
        await holder.close()
    assert await items(db, "s1") == ["waited"]
