"""Persistence: SQLAlchemy 2 async on SQLite or PostgreSQL, implementing the runtime's ports.

Never imports the web layer. Alembic owns the schema (``migrations/``); ``Store.migrate()`` upgrades to head.
"""

from .engine import make_engine
from .migrate import downgrade, upgrade
from .records import (
    IdempotencyRecord,
    ReadError,
    SessionData,
    SessionExists,
    SessionRecord,
    StoreClosed,
    StoreError,
)
from .store import InvalidCursor, Store
from .writer import DATABASE_ERRORS, is_transient

__all__ = [
    "DATABASE_ERRORS",
    "IdempotencyRecord",
    "InvalidCursor",
    "ReadError",
    "SessionData",
    "SessionExists",
    "SessionRecord",
    "Store",
    "StoreClosed",
    "StoreError",
    "downgrade",
    "is_transient",
    "make_engine",
    "upgrade",
]
