"""What a write costs does not grow with what the database holds: every look-up the writer makes probes an index.

SQLite plans ``(a, b) IN (VALUES ...)`` as a scan of the whole index, or of the session's part of it (depending on
the number of keys and on what the tables hold), so the writer's duplicate check on chat items and its event-cursor
look-up once cost time proportional to a session's events (or every session's), in every batch.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from switchboard.runtime import event_types as ev
from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.events import EventLog
from switchboard.runtime.ports import Commit
from switchboard.store import SessionRecord, Store
from switchboard.store import models as m

from .conftest import Db


@pytest.fixture
def statements() -> Iterator[list[tuple[str, Any]]]:
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, parameters))

    event.listen(Engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", record)


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
async def test_the_writer_only_probes_indexes(db: Db, statements: list[tuple[str, Any]]) -> None:
    store = db.store()
    await store.migrate()
    await store.start()
    for sid in ("s1", "s2"):
        await store.create_session(SessionRecord(id=sid, agent="demo", state="active"))
    log = EventLog("s1", store.event_sink())
    statements.clear()
    for n in range(3):  # the first append reads the session's last position; later ones check duplicates only
        items = [ChatMessage(id=f"m{n}-{k}", role="user", text="hi") for k in range(n + 1)]
        await store.chat_store().commit("s1", Commit(items=items))
        await asyncio.gather(*(log.emit(ev.ChatItemAdded(item=it)) for it in items))

    plans = []
    with sqlite3.connect(str(db.path)) as conn:
        for statement, parameters in statements:
            rows = conn.execute(f"EXPLAIN QUERY PLAN {statement}", parameters).fetchall()
            plans.append((statement, [row[-1] for row in rows]))
    # every look-up of a batch goes straight to its rows by the full unique key; only the position read (once per
    # session and process) may range over a session's items
    tables = "|".join(m.metadata.tables)
    lookups = [(st, p) for st, p in plans if "max(" not in st]
    assert len(lookups) >= 6
    for statement, plan in lookups:
        on_tables = [d for d in plan if re.match(rf"(SCAN|SEARCH) ({tables})\b", d)]
        assert on_tables, (statement, plan)
        assert all(re.search(r"\(session_id=\? AND (item_id|seq)=\?\)", d) for d in on_tables), (statement, plan)


async def test_the_duplicate_check_finds_ids_the_store_encodes(store: Store) -> None:
    odd = ChatMessage(id="m\x00\x01é", role="user", text="hi")
    await store.chat_store().commit("s1", Commit(items=[odd]))
    await store.chat_store().commit("s1", Commit(items=[odd]))
    assert await store.chat_items("s1") == [odd]
