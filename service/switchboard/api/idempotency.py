"""Idempotency-Key support for POST routes (I7): a retry with the same key and body gets the first response.

A route is written plainly and decorated (below its ``@router.post``)::

    @router.post("/{sid}/input", status_code=202)
    @idempotent
    async def inject_input(sid: str, body: InputCreate, host: HostDep) -> InputAccepted: ...

Records belong to the caller: a key is scoped by the credential (``auth.Principal.identity``: a digest of the API
key, never the key), the method and the path, so one caller can never replay another's answer. A route whose answer
holds a secret (a minted token) is decorated ``@idempotent_sealed(seal, unseal)``: the record keeps only the sealed
form, and a replay unseals it (see ``auth.seal_token``).

Without the header the route just runs. With it, one request per key, caller and route runs at a time: the first to find
no record runs the route and records its outcome (status and body) unless it is a 5xx; the others replay it
(``Idempotent-Replayed: true``), or get 409 ``idempotency_key_reused`` when their body differs. A route that raises
(a problem answer) records nothing: the command had no effect, so a retry runs it again.

The command and its record are one unit that outlives the caller: it runs in a task of its own, the route's own
deadline (``deps.deadline``) does not cut it off, and a cancelled caller only stops waiting. When the request's
deadline fires (``limits.RequestDeadline``) the caller gets 503 (retry) while the command runs on, still holding the
key, and records its real answer; a retry with the same key waits for it, then replays it. So a command cut off
after its effect was durable is never applied twice (I7).

The body compared is the route's parameter named ``body``, as parsed (defaults filled in; a missing optional body
counts as its defaults). So whatever the route reads must run inside it, after the replay check: a session that
closed since the first attempt still replays that attempt's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import inspect
import json
import types
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Depends, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel

from ..control.settings import Settings
from ..runtime.chat import utcnow
from ..store import IdempotencyRecord, Store
from .auth import principal_of
from .deps import command_outlives_caller, services
from .problems import ProblemError

MAX_KEY_LEN = 200
R = TypeVar("R")
BODY_PARAM = "body"
REPLAYED_HEADER = "Idempotent-Replayed"


@dataclass(slots=True)
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # requests holding or waiting for the lock


class KeyLocks:
    """One lock per ``(key, scope)``, kept while any request holds it or waits for it.

    Dropping a lock as soon as it is free for an instant is wrong: between its release and the wake-up of the next
    waiter it is unlocked, and a request arriving then would make a second lock and run beside that waiter.
    """

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], _KeyLock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str, scope: str) -> AsyncIterator[None]:
        entry = self._locks.setdefault((key, scope), _KeyLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[(key, scope)]

    def __len__(self) -> int:
        return len(self._locks)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One request to an idempotent route: its key (None: no header), where records go, and its response."""

    key: str | None
    scope: str
    store: Store
    settings: Settings
    response: Response  # the route's own (FastAPI's sub-response): a route may set its status code
    default_status: int


async def _attempt(request: Request, response: Response) -> Attempt:
    key = request.headers.get("idempotency-key")
    if key is not None and (not key or len(key) > MAX_KEY_LEN):
        raise ProblemError(400, "invalid_idempotency_key", f"Idempotency-Key must be 1-{MAX_KEY_LEN} chars.")
    route = request.scope.get("route")
    default_status = route.status_code if isinstance(route, APIRoute) and route.status_code else 200
    # the caller first: records are never shared between credentials
    scope = f"{principal_of(request).identity} {request.method} {request.url.path}"
    found = services(request)
    return Attempt(key, scope, found.store, found.settings, response, default_status)


_ATTEMPT_PARAM = "idempotency_attempt"
AttemptDep = Annotated[Attempt, Depends(_attempt)]


def _body_model(annotation: Any) -> type[BaseModel]:
    """The model of a ``body`` parameter annotated ``Model`` or ``Model | None``."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if union else (annotation,)
    models = [t for t in options if isinstance(t, type) and issubclass(t, BaseModel)]
    if len(models) != 1:
        raise TypeError(f"the {BODY_PARAM!r} parameter of an idempotent route must be one pydantic model")
    return models[0]


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _response(status: int, payload: Any) -> Response:
    if status == 204 or payload is None:
        return Response(status_code=status)
    return JSONResponse(payload, status_code=status)


Seal = Callable[[Settings, Any], Any]  # an answer (JSON) -> what its record keeps, and back


@dataclass(frozen=True, slots=True)
class Sealing:
    seal: Seal
    unseal: Seal  # raises ProblemError when the record can no longer be replayed


def _kept(settings: Settings, payload: Any) -> Any:
    return payload


PLAIN = Sealing(_kept, _kept)


async def _run(
    attempt: Attempt,
    key: str,
    body: Any,
    locks: KeyLocks,
    call: Callable[[], Awaitable[Any]],
    tasks: set[asyncio.Task[Response]],
    sealing: Sealing,
) -> Response:
    task = asyncio.create_task(_run_once(attempt, key, _digest(body), locks, call, sealing), name=f"idempotent:{key}")
    tasks.add(task)
    task.add_done_callback(_settled(tasks))
    return await asyncio.shield(task)


def _settled(tasks: set[asyncio.Task[Response]]) -> Callable[[asyncio.Task[Response]], None]:
    def done(task: asyncio.Task[Response]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # a caller that was cut off never reads it; a problem answer needs no log

    return done


async def _run_once(
    attempt: Attempt, key: str, digest: str, locks: KeyLocks, call: Callable[[], Awaitable[Any]], sealing: Sealing
) -> Response:
    """Replay the key's record, or run the command and record its outcome: one unit, whatever the caller does."""
    command_outlives_caller.set(True)  # in this task's own context only
    async with locks.hold(key, attempt.scope):
        found = await attempt.store.idempotency_get(key, attempt.scope)
        if found is not None:
            if found.request_hash != digest:
                raise ProblemError(
                    409,
                    "idempotency_key_reused",
                    "This Idempotency-Key was already used with a different request body.",
                )
            replay = _response(found.status_code, sealing.unseal(attempt.settings, found.response_body))
            replay.headers[REPLAYED_HEADER] = "true"
            return replay
        result = await call()
        status = attempt.response.status_code or attempt.default_status
        payload = jsonable_encoder(result)
        if status < 500:
            record = IdempotencyRecord(
                key=key,
                scope=attempt.scope,
                request_hash=digest,
                status_code=status,
                response_body=sealing.seal(attempt.settings, payload),
                created_at=utcnow(),
            )
            await attempt.store.idempotency_put(record)
        return _response(status, payload)


class _IdempotentRoute(Generic[R]):
    """The endpoint FastAPI sees: the route's own parameters plus the attempt, with annotations resolved."""

    def __init__(self, endpoint: Callable[..., Awaitable[R]], sealing: Sealing = PLAIN) -> None:
        functools.update_wrapper(self, endpoint)  # name and docstring (the operation's description)
        self._endpoint = endpoint
        self._sealing = sealing
        self._locks = KeyLocks()  # one table per route: the scope of a record is its route's method and path
        self._tasks: set[asyncio.Task[Response]] = set()  # commands running on after their caller was answered
        hints = typing.get_type_hints(endpoint, include_extras=True)
        signature = inspect.signature(endpoint)
        self._body_model = _body_model(hints[BODY_PARAM]) if BODY_PARAM in signature.parameters else None
        params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
        params.append(inspect.Parameter(_ATTEMPT_PARAM, inspect.Parameter.KEYWORD_ONLY, annotation=AttemptDep))
        self.__signature__ = signature.replace(
            parameters=params, return_annotation=hints.get("return", signature.return_annotation)
        )

    async def __call__(self, **kwargs: Any) -> R | Response:
        attempt: Attempt = kwargs.pop(_ATTEMPT_PARAM)
        if attempt.key is None:
            return await self._endpoint(**kwargs)
        body: Any = {}
        if self._body_model is not None:
            parsed = kwargs[BODY_PARAM]
            body = (parsed if parsed is not None else self._body_model()).model_dump(mode="json")
        call = functools.partial(self._endpoint, **kwargs)
        return await _run(attempt, attempt.key, body, self._locks, call, self._tasks, self._sealing)


def idempotent(endpoint: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R | Response]]:
    """Make a POST route honour ``Idempotency-Key`` (see the module docstring)."""
    return _IdempotentRoute(endpoint)


def idempotent_sealed(
    seal: Seal, unseal: Seal
) -> Callable[[Callable[..., Awaitable[R]]], Callable[..., Awaitable[R | Response]]]:
    """``idempotent`` for a route whose answer holds a secret: its record keeps ``seal(answer)`` only."""

    def decorate(endpoint: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R | Response]]:
        return _IdempotentRoute(endpoint, Sealing(seal, unseal))

    return decorate
