"""Errors as ``application/problem+json`` (RFC 9457) with a stable ``code``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..control.cluster.ownership import NodeDeposed, NodeDraining
from ..control.host import (
    InvalidSessionConfig,
    ModelNotConfigured,
    SessionConflict,
    SessionQuotaExceeded,
    TooManySessions,
)
from ..runtime.agent import UnknownAgent
from ..runtime.executor import AlreadyEnded, NotCancellable, ToolCallNotFound
from ..runtime.speech import NotInterruptible
from ..runtime.status import SessionClosed, SessionSuspended
from ..runtime.takeover import HeldByOther, NotHeld
from ..store import DATABASE_ERRORS, ReceiptRefused, SessionFenced, is_transient
from .headers import problem_headers

logger = logging.getLogger("switchboard.api")

PROBLEM_JSON = "application/problem+json"
UNAVAILABLE_RETRY_AFTER_S = 2

_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class Problem(BaseModel):
    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    code: str
    errors: list[dict[str, Any]] | None = None


class ProblemError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        detail: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        errors: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(detail or code)
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers
        self.errors = errors


def problem_response(
    status: int,
    code: str,
    detail: str | None = None,
    *,
    headers: dict[str, str] | None = None,
    errors: list[dict[str, Any]] | None = None,
) -> JSONResponse:
    body = problem_document(status, code, detail, errors=errors)
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def problem_document(
    status: int, code: str, detail: str | None = None, *, errors: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The problem's JSON document (also written by the connection layer, which answers outside the app)."""
    body = Problem(
        type=f"https://switchboard.dev/problems/{code}",
        title=_TITLES.get(status, "Error"),
        status=status,
        detail=detail,
        code=code,
        errors=errors,
    )
    return body.model_dump(exclude_none=True)


# OpenAPI: what each problem status means, for the `responses=` of the routes that can answer it
_MEANINGS = {
    400: "Invalid `Idempotency-Key` header",
    401: "No credential, or an invalid or expired one",
    403: "The credential lacks the scope this route needs (or is a token of another session)",
    404: "Unknown session (or speech, or tool call)",
    408: "The request body did not arrive in time",
    409: "Conflict with the current state, or an `Idempotency-Key` reused with another body",
    413: "The request body, or its text, is too large",
    422: "Invalid parameters or body",
    429: "A budget of this credential (commands or reads a second, live sessions) or of the server is spent: retry "
    "after `Retry-After` seconds",
    503: "Not completed in time, or the database is unreachable: retry after `Retry-After` seconds",
}

# every /v1 HTTP route can answer these (applied where the routers are included)
API_ERRORS = (401, 403, 422, 429, 503)
# and a POST on a session these: the Idempotency-Key, the session, body limits, conflicts
POST_ERRORS = (400, 404, 408, 409, 413)


def problem_responses(*statuses: int | tuple[int, str]) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=`` for problem answers: each status, or ``(status, description)``, as problem+json.

    >>> @router.post("/x", responses=problem_responses(404, (409, "not_cancellable or already_ended")))
    """
    out: dict[int | str, dict[str, Any]] = {}
    for entry in statuses:
        status, description = entry if isinstance(entry, tuple) else (entry, _MEANINGS[entry])
        schema = {"$ref": "#/components/schemas/Problem"}
        out[status] = {"description": description, "content": {PROBLEM_JSON: {"schema": schema}}}
    return out


def not_found(what: str, ident: str) -> ProblemError:
    return ProblemError(404, f"{what}_not_found", f"No {what.replace('_', ' ')} {ident!r}.")


E = TypeVar("E", bound=Exception)


@dataclass(frozen=True, slots=True)
class DomainProblem(Generic[E]):
    """How a domain error of the runtime or the host is answered: status, code, detail (the error's message by
    default) and headers."""

    status: int
    code: str
    detail: Callable[[E], str] = str
    headers: dict[str, str] | None = None


def _already_ended(err: AlreadyEnded) -> str:
    return f"Tool call {err.info.call_id!r} already ended ({err.info.status.value})."


def _tool_call_not_found(err: ToolCallNotFound) -> str:
    return f"No tool call {err.args[0]!r}."


def _session_fenced(err: SessionFenced) -> str:
    return f"Session {err.session_id!r} is no longer run by this node ({err.detail})."


def _receipt_refused(err: ReceiptRefused) -> str:
    return "Another request took this Idempotency-Key over and applies it; retry to get its answer."


def _session_exists(err: SessionConflict) -> str:
    return f"Session {err.session_id!r} exists with a different body."


#: Every domain error a route lets through, and the problem it becomes (installed as exception handlers).
DOMAIN_PROBLEMS: dict[type[Exception], DomainProblem[Any]] = {
    SessionSuspended: DomainProblem(503, "session_moving", headers={"Retry-After": "1"}),
    SessionClosed: DomainProblem(409, "session_not_active"),
    NotInterruptible: DomainProblem(409, "not_interruptible"),
    HeldByOther: DomainProblem(409, "held_by_other"),
    NotHeld: DomainProblem(409, "not_held"),
    NotCancellable: DomainProblem(409, "not_cancellable"),
    AlreadyEnded: DomainProblem(409, "already_ended", _already_ended),
    ToolCallNotFound: DomainProblem(404, "tool_call_not_found", _tool_call_not_found),
    UnknownAgent: DomainProblem(422, "unknown_agent"),
    ModelNotConfigured: DomainProblem(422, "model_not_configured"),
    InvalidSessionConfig: DomainProblem(422, "invalid_session_config"),
    SessionConflict: DomainProblem(409, "session_exists", _session_exists),
    SessionQuotaExceeded: DomainProblem(429, "session_quota_exceeded", headers={"Retry-After": "5"}),
    TooManySessions: DomainProblem(429, "too_many_sessions", headers={"Retry-After": "5"}),
    SessionFenced: DomainProblem(503, "session_moved", _session_fenced, headers={"Retry-After": "1"}),
    NodeDeposed: DomainProblem(503, "node_fenced"),
    NodeDraining: DomainProblem(503, "node_draining", headers={"Retry-After": "1"}),
    ReceiptRefused: DomainProblem(503, "idempotency_key_in_use", _receipt_refused, headers={"Retry-After": "1"}),
}


class ProblemAPI(FastAPI):
    """FastAPI whose OpenAPI document holds the Problem schema that ``problem_responses`` refer to."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            spec = super().openapi()
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            schemas["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
            return spec
        return self.openapi_schema


#: close codes of a WebSocket whose route raised: the database is away (retry later), or anything else
UNAVAILABLE_CLOSE = 1013
UNEXPECTED_CLOSE = 1011


async def _close_stream(ws: WebSocket, what: str, exc: Exception, code: int) -> None:
    """A WebSocket route raised: log it with the stream's path and ids, and close the socket with ``code`` (a
    handler of a WebSocket has no response to give)."""
    ids = {k: v for k, v in ws.path_params.items() if k in ("sid", "session_id")}
    level = logging.WARNING if code == UNAVAILABLE_CLOSE else logging.ERROR
    logger.log(level, "WebSocket %s: %s (%r)", ws.url.path, what, exc, exc_info=level == logging.ERROR, extra=ids)
    with contextlib.suppress(Exception):  # already closed, or never accepted: nothing more to say
        await ws.close(code, reason=what)


def install(app: FastAPI) -> None:
    @app.exception_handler(ProblemError)
    async def _problem(_: Request, exc: ProblemError) -> JSONResponse:
        return problem_response(exc.status, exc.code, exc.detail, headers=exc.headers, errors=exc.errors)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        first = errors[0] if errors else None
        detail = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}" if first else "invalid request"
        return problem_response(422, "invalid_request", detail, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return problem_response(exc.status_code, code, str(exc.detail), headers=getattr(exc, "headers", None))

    # a handler is called with the WebSocket of a WebSocket route (``Any``: Starlette types the two kinds apart)
    async def _database(request: Any, exc: Exception) -> Any:
        if not is_transient(exc):
            return await _unexpected(request, exc)
        if isinstance(request, WebSocket):
            await _close_stream(request, "the database is unavailable", exc, UNAVAILABLE_CLOSE)
            return None
        logger.warning("%s %s: the database is unavailable (%r)", request.method, request.url.path, exc)
        return problem_response(
            503,
            "database_unavailable",
            "The database is unreachable; retry.",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )

    async def _domain(_: Request, exc: Exception) -> JSONResponse:
        problem = next(DOMAIN_PROBLEMS[t] for t in type(exc).__mro__ if t in DOMAIN_PROBLEMS)
        return problem_response(problem.status, problem.code, problem.detail(exc), headers=problem.headers)

    for exc_type in DOMAIN_PROBLEMS:
        app.add_exception_handler(exc_type, _domain)

    for exc_type in DATABASE_ERRORS:  # handled here, not as a 500 that the server logs again with a traceback
        app.add_exception_handler(exc_type, _database)

    @app.exception_handler(Exception)
    async def _unexpected(request: Any, exc: Exception) -> Any:
        if isinstance(request, WebSocket):
            await _close_stream(request, "unhandled error", exc, UNEXPECTED_CLOSE)
            return None
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        # answered from outside every middleware (Starlette's ServerErrorMiddleware): the headers come from here
        return problem_response(500, "internal_error", "An internal error occurred.", headers=problem_headers())
