"""Typed errors: each ``application/problem+json`` answer, and each fatal event-stream close, as an exception.

Every error is a :class:`SwitchboardError` with the problem's ``status``, stable ``code`` and ``detail``; catch a
subclass for one kind (``NotFound``, ``Conflict``, ...) and branch on ``code`` within it::

    try:
        client.cancel_tool_call(sid, call_id)
    except Conflict as err:
        if err.code == "already_ended": ...
"""

from __future__ import annotations

from typing import Any

import httpx

#: A status of 0 marks an error that has no HTTP answer (the service could not be reached).
NO_STATUS = 0


class SwitchboardError(Exception):
    """A request the service refused or could not complete."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str | None = None,
        *,
        title: str | None = None,
        type: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{detail or code} ({code}, HTTP {status})" if status else (detail or code))
        self.status = status
        self.code = code
        self.detail = detail
        self.title = title
        self.type = type
        self.errors = errors
        self.retry_after = retry_after


class BadRequest(SwitchboardError):
    """400: a malformed request (for example an invalid ``Idempotency-Key``)."""


class Unauthorized(SwitchboardError):
    """401: no credential, or an invalid or expired one."""


class Forbidden(SwitchboardError):
    """403: the credential lacks the scope, or is a token of another session."""


class NotFound(SwitchboardError):
    """404: unknown session, speech or tool call (``code`` says which)."""


class RequestTimeout(SwitchboardError):
    """408: the request body did not arrive in time."""


class Conflict(SwitchboardError):
    """409: conflicts with the current state; ``code`` says how (``not_cancellable``, ``already_ended``,
    ``not_interruptible``, ``session_not_active``, ``session_exists``, ``idempotency_key_reused``, ...)."""


class PayloadTooLarge(SwitchboardError):
    """413: the body, or its text, is too large."""


class ValidationFailed(SwitchboardError):
    """422: invalid parameters or body; ``errors`` lists each field's problem."""


class TooManyRequests(SwitchboardError):
    """429: too many live sessions; retry after ``retry_after`` seconds."""


class ServerError(SwitchboardError):
    """500 (or another unexpected status): the service failed."""


class Unavailable(SwitchboardError):
    """503: not completed in time or the database is unreachable (after the client's own retries), or the service
    could not be reached at all (``status`` 0, code ``unreachable``); retry after ``retry_after`` seconds."""


_BY_STATUS: dict[int, type[SwitchboardError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    408: RequestTimeout,
    409: Conflict,
    413: PayloadTooLarge,
    422: ValidationFailed,
    429: TooManyRequests,
    503: Unavailable,
}

# close codes of the event streams that no reconnect can fix
_BY_CLOSE: dict[int, tuple[type[SwitchboardError], int]] = {
    1003: (BadRequest, 400),
    4400: (BadRequest, 400),
    4401: (Unauthorized, 401),
    4403: (Forbidden, 403),
    4404: (NotFound, 404),
}


def retry_after(response: httpx.Response) -> float | None:
    """The ``Retry-After`` header in seconds (the service sends delta-seconds only)."""
    raw = response.headers.get("retry-after")
    try:
        return max(0.0, float(raw)) if raw else None
    except ValueError:
        return None


def from_response(response: httpx.Response) -> SwitchboardError:
    """The typed error for a non-success answer, from its problem+json body when it has one."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    problem: dict[str, Any] = body if isinstance(body, dict) else {}
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else SwitchboardError)
    code = problem.get("code")
    return cls(
        status,
        str(code) if code else "http_error",
        problem.get("detail") or (response.text[:200] if not problem else None),
        title=problem.get("title"),
        type=problem.get("type"),
        errors=problem.get("errors"),
        retry_after=retry_after(response),
    )


def fatal_close(code: int, reason: str, session_id: str | None = None) -> SwitchboardError | None:
    """The error for an event-stream close that reconnecting cannot fix, or None when the stream may resume."""
    found = _BY_CLOSE.get(code)
    if found is None:
        return None
    cls, status = found
    if code == 4404 and session_id is not None:  # worded as the HTTP API words it
        return cls(status, reason or "session_not_found", f"No session {session_id!r}.")
    return cls(status, reason or f"closed_{code}", f"The event stream was closed ({code} {reason}).")


def unreachable(url: str, err: BaseException) -> Unavailable:
    return Unavailable(NO_STATUS, "unreachable", f"Cannot reach {url}: {err or type(err).__name__}")
