"""Running the Alembic migrations in ``migrations/`` programmatically (``switchboard serve`` upgrades on start)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from .engine import make_engine, sibling_engine

MIGRATIONS_DIR_ENV = "SWITCHBOARD_MIGRATIONS_DIR"


class MigrationsNotFound(Exception):
    """No migrations where they were looked for: an install without them, not a database that is unavailable (an
    ``OSError`` would be taken for one and waited on)."""


def script_location() -> Path:
    """The ``migrations/`` folder: ``$SWITCHBOARD_MIGRATIONS_DIR``, else the copy an installed package carries
    (``store/alembic``, a link to the repository's ``migrations/`` in a checkout)."""
    override = os.environ.get(MIGRATIONS_DIR_ENV)
    candidates = [Path(override)] if override else []
    candidates.append(Path(__file__).parent / "alembic")
    for path in candidates:
        if (path / "env.py").is_file():
            return path
    raise MigrationsNotFound(
        f"Alembic migrations not found (looked in {', '.join(map(str, candidates))}); set {MIGRATIONS_DIR_ENV}"
    )


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config for ``migrations/``; with ``connection``, env.py migrates on it (in its transaction)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _upgrade(connection: Connection, revision: str) -> None:
    command.upgrade(alembic_config(connection), revision)


def _downgrade(connection: Connection, revision: str) -> None:
    command.downgrade(alembic_config(connection), revision)


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


@asynccontextmanager
async def _unbounded(engine: AsyncEngine) -> AsyncIterator[AsyncEngine]:
    """An engine like ``engine`` whose statements are not bounded in time (``make_engine``'s ``timeout_s``): a
    migration may build an index on a large table."""
    if engine.dialect.name != "postgresql":
        yield engine
        return
    own = sibling_engine(engine, timeout_s=None)
    try:
        yield own
    finally:
        await own.dispose()


async def upgrade_engine(engine: AsyncEngine, revision: str = "head") -> None:
    async with _unbounded(engine) as unbounded, unbounded.begin() as conn:
        await conn.run_sync(_upgrade, revision)


async def downgrade_engine(engine: AsyncEngine, revision: str) -> None:
    async with _unbounded(engine) as unbounded, unbounded.begin() as conn:
        await conn.run_sync(_downgrade, revision)


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(_current)


async def upgrade(url: str, revision: str = "head", *, schema: str | None = None) -> None:
    """``alembic upgrade <revision>`` on ``url`` (SQLite file or PostgreSQL; ``schema`` sets the search_path)."""
    engine = make_engine(url, schema=schema)
    try:
        await upgrade_engine(engine, revision)
    finally:
        await engine.dispose()


async def downgrade(url: str, revision: str, *, schema: str | None = None) -> None:
    """``alembic downgrade <revision>`` on ``url`` (``"base"`` drops every table)."""
    engine = make_engine(url, schema=schema)
    try:
        await downgrade_engine(engine, revision)
    finally:
        await engine.dispose()
