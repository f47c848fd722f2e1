"""Persistence: SQLAlchemy 2 async on SQLite or PostgreSQL, implementing the runtime's ports.

Never imports the web layer. Alembic owns the schema (``migrations/``); ``Store.migrate()`` upgrades to head.
"""

from .engine import make_engine, sibling_engine
from .migrate import downgrade, upgrade
from .ownership import Fence, NodeMode, NodeRecord, Nodes, NodeState
from .records import (
    Claim,
    Holder,
    IdempotencyRecord,
    IdempotencyState,
    QuotaFull,
    ReadError,
    ReceiptRefused,
    SessionData,
    SessionExists,
    SessionFenced,
    SessionRecord,
    StoreClosed,
    StoreError,
)
from .store import InvalidCursor, Store
from .writer import DATABASE_ERRORS, is_transient

__all__ = [
    "DATABASE_ERRORS",
    "Claim",
    "Fence",
    "Holder",
    "IdempotencyRecord",
    "IdempotencyState",
    "InvalidCursor",
    "NodeMode",
    "NodeRecord",
    "NodeState",
    "Nodes",
    "QuotaFull",
    "ReadError",
    "ReceiptRefused",
    "SessionData",
    "SessionExists",
    "SessionFenced",
    "SessionRecord",
    "Store",
    "StoreClosed",
    "StoreError",
    "downgrade",
    "is_transient",
    "make_engine",
    "sibling_engine",
    "upgrade",
]
