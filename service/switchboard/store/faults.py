"""A lost database connection, however it surfaces, and an engine that treats it as one.

asyncpg reports a connection that went away (a reset, a server that ended the session) in whatever form the moment it
noticed gives: an ``OSError`` (``ConnectionResetError``; its own ``TimeoutError`` when the server stopped answering),
one of its errors of SQLSTATE class 08 (``ConnectionDoesNotExistError``: "connection was closed in the middle of
operation"), or, on uvloop, a ``RuntimeError`` from writing to a transport the event loop closed before asyncpg heard
of it ("unable to perform operation on <TCPTransport closed=True ...>; the handler is closed"). SQLAlchemy wraps only
the errors the dialect translates, and takes fewer still for a disconnect: the others reached the caller raw (the API
answered them 500) and left the dead connection in the pool for the next request.

``watch_connections`` makes an engine take every one of them for a disconnect: the connection is thrown away with
those opened before it, a raw error becomes an ``OperationalError``, and a pooled connection found dead by its
pre-ping is replaced at once rather than failing the request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.ext.asyncio import AsyncEngine

# SQLSTATE class 08, "connection exception"; and the codes with which the server ends a session: an idle transaction
# or an idle session past its timeout, an administrator's or a crash's shutdown
_LOST_SQLSTATE_CLASS = "08"
_SESSION_ENDED = frozenset({"25P03", "57P01", "57P02", "57P05"})
_CLOSED_TRANSPORT = "the handler is closed"


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, then the driver's error SQLAlchemy wrapped in it (``orig``; the dialect's adapter of an asyncpg error
    carries its SQLSTATE). Never an arbitrary ``__cause__``: an error raised *from* a database error is not one."""
    found: BaseException | None = err
    for _ in range(3):  # the error, the driver's under it, and no further: a bound, whatever ``orig`` holds
        if found is None:
            return
        yield found
        orig = getattr(found, "orig", None)
        found = orig if isinstance(orig, BaseException) and orig is not found else None


def connection_lost(err: BaseException) -> bool:
    """True when ``err`` says the connection it came from is gone: nothing more can be done on it."""
    for cause in _causes(err):
        if isinstance(cause, OSError):
            return True
        if isinstance(cause, RuntimeError) and _CLOSED_TRANSPORT in str(cause):
            return True
        code = getattr(cause, "sqlstate", None)
        if isinstance(code, str) and (code.startswith(_LOST_SQLSTATE_CLASS) or code in _SESSION_ENDED):
            return True
    return False


def _on_error(ctx: ExceptionContext) -> BaseException | None:
    err = ctx.original_exception
    if not isinstance(err, Exception) or not connection_lost(err):
        return None
    ctx.is_disconnect = True  # invalidated, and the pool's older connections with it: they went through the same path
    if ctx.sqlalchemy_exception is not None:
        return None  # already a DBAPIError, marked invalidated by SQLAlchemy
    return sa_exc.OperationalError(
        ctx.statement, ctx.parameters, err, hide_parameters=True, connection_invalidated=True
    )


def _ping_or_replace(ping: Callable[[Any], bool], dbapi_error: type[Exception]) -> Callable[[Any], bool]:
    """The pool's pre-ping, for which a raw lost-connection error (SQLAlchemy only looks at the driver's own errors)
    means "dead: open another one", not a failed checkout."""

    def do_ping(dbapi_connection: Any) -> bool:
        try:
            return ping(dbapi_connection)
        except Exception as err:
            if isinstance(err, dbapi_error) or not connection_lost(err):
                raise
            return False

    return do_ping


def watch_connections(engine: AsyncEngine) -> None:
    """Make ``engine`` (PostgreSQL) treat every form of a lost connection as a disconnect (see the module)."""
    dialect = engine.sync_engine.dialect
    event.listen(engine.sync_engine, "handle_error", _on_error)
    # per engine: each has its own dialect instance
    dialect.do_ping = _ping_or_replace(dialect.do_ping, dialect.loaded_dbapi.Error)  # type: ignore[method-assign,assignment]
