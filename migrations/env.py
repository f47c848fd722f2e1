"""Alembic environment (async). Used two ways:

- programmatically (``switchboard.store.upgrade`` / ``Store.migrate``): a connection is passed in
  ``config.attributes["connection"]`` and the migration runs in its transaction;
- from the repository root: ``alembic -x url=sqlite+aiosqlite:///var/switchboard.db upgrade head``
  (or ``SWITCHBOARD_DATABASE_URL`` in the environment; ``-x schema=...`` sets the PostgreSQL search_path).
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection

from switchboard.store.engine import make_engine
from switchboard.store.models import metadata

config = context.config
target_metadata = metadata

if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _option(name: str, env: str | None = None) -> str | None:
    value = context.get_x_argument(as_dictionary=True).get(name)
    if value is None and env is not None:
        value = os.environ.get(env)
    return value


def _url() -> str:
    url = _option("url", "SWITCHBOARD_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass -x url=... or set SWITCHBOARD_DATABASE_URL")
    return url


def run_migrations(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations() -> None:
    engine = make_engine(_url(), schema=_option("schema"))
    try:
        async with engine.connect() as connection:
            await connection.run_sync(run_migrations)
            await connection.commit()
    finally:
        await engine.dispose()


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    connection = config.attributes.get("connection")
    if connection is not None:
        run_migrations(connection)
    else:
        asyncio.run(run_async_migrations())
