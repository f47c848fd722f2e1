"""Alembic owns the schema: migrations go up and down cleanly and match the models exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from switchboard.store import Store, downgrade, upgrade
from switchboard.store.migrate import current_revision, script_location
from switchboard.store.models import metadata

from .conftest import Db

REPO = Path(__file__).resolve().parents[2]
HEAD = "0013"
TABLES = {"sessions", "chat_items", "tool_calls", "speeches", "events", "idempotency_keys", "nodes", "pending_commands"}


def _diff(conn: Connection) -> list[Any]:
    with warnings.catch_warnings():
        # SQLite cannot reflect an index on an expression (ix_sessions_live_owner): PostgreSQL compares it
        warnings.filterwarnings("ignore", "Skipped unsupported reflection of expression-based index")
        warnings.filterwarnings("ignore", "autogenerate skipping metadata-specified expression-based index")
        return list(compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata))


def _tables(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names())


async def _state(store: Store) -> tuple[set[str], list[Any], str | None]:
    async with store.engine.connect() as conn:
        tables = await conn.run_sync(_tables)
        diff = await conn.run_sync(_diff)
    return tables, diff, await current_revision(store.engine)


async def test_upgrade_downgrade_upgrade_and_no_autogenerate_diff(db: Db) -> None:
    store = db.store()
    await upgrade(db.url, schema=db.schema)
    tables, diff, rev = await _state(store)
    assert tables >= TABLES
    assert diff == [], f"models and migrations disagree: {diff}"
    assert rev == HEAD

    await downgrade(db.url, "base", schema=db.schema)
    tables, _, rev = await _state(store)
    assert not tables & TABLES
    assert rev is None

    await store.migrate()  # the method the service calls on start
    tables, diff, rev = await _state(store)
    assert tables >= TABLES
    assert diff == []
    assert rev == HEAD
    await store.migrate()  # idempotent at head
    assert await current_revision(store.engine) == HEAD


def test_migrations_are_found_from_the_package_and_from_the_repo_root() -> None:
    assert script_location().resolve() == REPO / "migrations"  # the package's link to it, in a checkout
    cfg = Config(str(REPO / "alembic.ini"))
    assert ScriptDirectory.from_config(cfg).get_current_head() == HEAD


def test_alembic_command_line_from_the_repo_root(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    alembic = [sys.executable, "-m", "alembic", "-x", f"url={url}"]
    up = subprocess.run([*alembic, "upgrade", "head"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr
    current = subprocess.run([*alembic, "current"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert f"{HEAD} (head)" in current.stdout, current.stdout + current.stderr


async def test_text_already_holding_the_escape_character_reads_back_unchanged_after_upgrade(db: Db) -> None:
    """Rows written before text was encoded may hold U+E000: the upgrade escapes it, so it is not read as an escape."""
    await upgrade(db.url, "0002", schema=db.schema)
    stored = "\ue0000 and \ue000e"  # what would decode to "\x00 and \ue000" if left as it was
    await db.sql(
        "INSERT INTO sessions (id, agent, state, config, metadata, created_at, updated_at) VALUES "
        + (
            "(?, 'a', 'active', ?, '{}', '2024-01-01', '2024-01-01')"
            if db.kind == "sqlite"
            else "($1, 'a', 'active', $2::jsonb, '{}', now(), now())"
        ),
        "s1",
        json.dumps({"k": stored}, ensure_ascii=False),
    )
    await db.sql(
        "INSERT INTO speeches (session_id, id, source, state, interrupted, allow_interruptions, text, played_text,"
        " created_at) VALUES "
        + (
            "(?, 'sp1', 'say', 'done', 0, 1, ?, '', '2024-01-01')"
            if db.kind == "sqlite"
            else "($1, 'sp1', 'say', 'done', false, true, $2, '', now())"
        ),
        "s1",
        stored,
    )
    await upgrade(db.url, "head", schema=db.schema)
    store = db.store()
    rec = await store.get_session("s1")
    assert rec is not None and rec.config == {"k": stored}
    (speech,) = await store.speeches("s1")
    assert speech.text == stored
    await downgrade(db.url, "0002", schema=db.schema)
    assert await db.sql("SELECT text FROM speeches") == [(stored,)]


async def test_events_written_before_the_subject_column_are_reported_after_upgrade(db: Db) -> None:
    """Recovery reads ``events.subject`` to find durable changes without an event: the upgrade fills it in for the
    events already stored, or recovery would emit them all a second time."""
    await upgrade(db.url, "0003", schema=db.schema)
    now = "'2024-01-01'" if db.kind == "sqlite" else "now()"
    await db.sql(
        f"INSERT INTO sessions (id, agent, state, config, metadata, created_at, updated_at)"
        f" VALUES ('s1', 'a', 'active', '{{}}', '{{}}', {now}, {now})"
    )
    for seq, (kind, data) in enumerate(
        [
            ("chat.item", '{"item": {"id": "i1"}}'),
            ("tool.ended", '{"call_id": "c1"}'),
            ("speech.done", '{"speech_id": "p1"}'),
            ("agent.state", '{"state": "idle"}'),
        ],
        start=1,
    ):
        await db.sql(
            f"INSERT INTO events (session_id, seq, type, at, data) VALUES ('s1', {seq}, '{kind}', {now}, '{data}')"
        )
    await upgrade(db.url, "head", schema=db.schema)
    reported = (await db.store().load_sessions_bulk(["s1"]))["s1"].reported
    assert (reported.items, reported.ended_calls, reported.done_speeches) == ({"i1"}, {"c1"}, {"p1"})
