"""Idempotency-Key support for POST routes (I7): a command sent with a key is applied at most once in the cluster,
and every request with that key gets the first one's answer.

A route is written plainly and decorated (below its ``@router.post``); a route whose command has a durable effect
takes the request's ``Idem`` and hands the command a receipt that renders the answer from the effect's result::

    @router.post("/{sid}/input", status_code=202)
    @idempotent
    async def inject_input(sid: str, body: InputCreate, host: HostDep, idem: Idem) -> InputAccepted:
        result = await session.input(body.text, receipt=idem.receipt(accepted))
        return accepted(result)

Records belong to the caller: a key is scoped by the credential (``auth.Principal.identity``: a digest of the API
key, never the key), the method and the path, so one caller can never replay another's answer. A route whose answer
holds a secret (a minted token) is decorated ``@idempotent_sealed(seal, unseal)``: the record keeps only the sealed
form, and a replay unseals it (see ``auth.seal_token``).

Without the header the route just runs. With it:

1. **Reserve.** The request inserts the key's row, ``pending``, naming its holder: this node and this process
   incarnation (``store.idempotency``). The row's primary key makes the reservation the cluster's: of two requests
   with the same key on two nodes (a client retrying after a load balancer's timeout), one holds it. A per-process
   lock per key (``KeyLocks``) is only a cheap first gate: correctness comes from the database.
2. **Run, and answer with the effect.** The holder runs the command. Its effect carries the completion (state
   ``done``, status, answer) in its own transaction: the session's insert for a create, the runtime commit that is
   the command's effect otherwise (``runtime.ports.Receipt``: the user message and its reply for an input, the
   speech for a say, the interrupted speech's commit for an interrupt, the call's end for a cancel or a reported
   result, the progress commit for a reported update). The effect and its answer are durable together or not at
   all: a connection reset or a crash can no longer leave one without the other. A completion the holder no longer
   holds (taken over, below) refuses the whole commit.
3. **Outcomes without an effect.** A problem answer (a 4xx or a 5xx: nothing happened) deletes the reservation, so a
   retry runs the command again; so does a command forwarded to the node that owns its session (that node applies
   the key: the scope is the same on every node), and one whose effect's commit the fence refused (the session was
   taken over by another node as the command was applied here): it answers 503 ``session_moved`` whatever the
   command returned, and its retry reaches the new owner. A success with no durable effect (an interrupt with nothing
   speaking, an interim transcript, a minted token) completes the reservation in a transaction of its own before it
   is answered: there is nothing to apply twice.
4. **Others wait.** A request that finds the key ``done`` replays it (``Idempotent-Replayed: true``), or gets 409
   ``idempotency_key_reused`` when its body differs. One that finds it ``pending`` polls the row until it is done
   (replay) or released (it runs the command), for at most the request timeout, then answers 503
   ``idempotency_key_in_use`` with ``Retry-After``. Unless its holder is dead: its node row is gone, no longer leased
   by the database's clock, or registered by another process incarnation. A dead holder's effect did not land (it
   would have completed the row in its transaction), so the request takes the reservation over (an update
   conditioned on the old holder) and runs the command.

The command runs in a task of its own, the route's own deadline (``deps.deadline``) does not cut it off, and a
cancelled caller only stops waiting: when the request's deadline fires (``limits.RequestDeadline``) the caller gets
503 (retry) while the command runs on, holding the key, and its retry waits for the answer, then replays it.

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
import logging
import types
import typing
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Depends, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import HTTPConnection

from ..control.settings import Settings
from ..runtime.ports import Completion, Receipt
from ..store import Holder, IdempotencyRecord, IdempotencyState, SessionFenced, Store, is_transient
from .auth import principal_of
from .deps import command_outlives_caller, services
from .problems import ProblemError

logger = logging.getLogger("switchboard.api.idempotency")

MAX_KEY_LEN = 200
R = TypeVar("R")
T = TypeVar("T")
BODY_PARAM = "body"
REPLAYED_HEADER = "Idempotent-Replayed"
POLL_FIRST_S = 0.02  # a request waiting for another holder of its key looks again after this, doubling
POLL_MAX_S = 0.25
SETTLE_FOR_S = 30.0  # a release or a completion is retried this long while the database is unavailable
# this process as a holder when it runs without a node lease (every service has one; a bare app in a test may not)
_PROCESS_INCARNATION = uuid.uuid4().hex


@dataclass(slots=True)
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # requests holding or waiting for the lock


class KeyLocks:
    """One lock per ``(key, scope)``, kept while any request holds it or waits for it: the cheap first gate for
    requests of one process (the reservation in the database is what holds across processes).

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


Seal = Callable[[Settings, Any], Any]  # an answer (JSON) -> what its record keeps, and back


@dataclass(frozen=True, slots=True)
class Sealing:
    seal: Seal
    unseal: Seal  # raises ProblemError when the record can no longer be replayed


def _kept(settings: Settings, payload: Any) -> Any:
    return payload


PLAIN = Sealing(_kept, _kept)


@dataclass(eq=False, slots=True)
class Attempt:
    """One request to an idempotent route: its key (None: no header), where records go, who holds its reservation,
    and its response. A route takes it (``Idem``) to hand its command a ``receipt``."""

    key: str | None
    scope: str
    store: Store
    settings: Settings
    response: Response  # the route's own (FastAPI's sub-response): a route may set its status code
    default_status: int
    holder: Holder
    sealing: Sealing = PLAIN
    held: bool = False  # this request holds the key's reservation: its command runs
    issued: _Receipt[Any] | None = None

    @property
    def status(self) -> int:
        return self.response.status_code or self.default_status

    def receipt(self, render: Callable[[T], Any]) -> Receipt[T] | None:
        """The receipt this request's command hands the one change that is its effect: ``render`` makes the answer
        (a model, or None when a result does not answer this command) from that change's result. None without an
        Idempotency-Key."""
        if not self.held:
            return None
        self.issued = _Receipt(self, render)
        return self.issued

    def completion(self, payload: Any) -> Completion:
        """The reservation completed with ``payload`` (JSON) and the route's status."""
        assert self.key is not None
        return Completion(
            key=self.key,
            scope=self.scope,
            holder_node=self.holder.node,
            holder_incarnation=self.holder.incarnation,
            status_code=self.status,
            body=self.sealing.seal(self.settings, payload),
        )

    @property
    def answered_by_effect(self) -> bool:
        """The command's effect landed with its completion: the record is written."""
        issued = self.issued
        return issued is not None and issued.completion is not None and issued.completion.landed

    @property
    def fenced(self) -> SessionFenced | None:
        """The commit of the command's effect, carrying its completion, was refused by the fence: its session was
        taken over by another node as the command was applied here (this node's copy was stale). Nothing of the
        effect landed, and nothing of it will from here, whatever the command itself made of it."""
        issued = self.issued
        refused = issued.completion.refused if issued is not None and issued.completion is not None else None
        return refused if isinstance(refused, SessionFenced) else None


class _Receipt(Generic[T]):
    """``runtime.ports.Receipt`` for one request: renders the answer once, for the first effect that produces one."""

    def __init__(self, attempt: Attempt, render: Callable[[T], Any]) -> None:
        self._attempt = attempt
        self._render = render
        self.completion: Completion | None = None

    def complete(self, result: T) -> Completion | None:
        if self.completion is not None:
            return None
        answer = self._render(result)
        if answer is None:
            return None
        self.completion = self._attempt.completion(jsonable_encoder(answer))
        return self.completion


def _holder(request: HTTPConnection) -> Holder:
    lease = services(request).host.lease
    if lease is None:
        return Holder("local", _PROCESS_INCARNATION)
    return Holder(lease.node_id, lease.incarnation)


def _path(request: Request) -> str:
    """``request.url.path`` (part of a record's scope on every node, whatever its version), without building the whole
    URL: the path as sent, unless it holds what a URL escapes or drops."""
    path: str = request.scope["path"]
    if not path.startswith("/") or not path.isprintable() or "?" in path or "#" in path or "\\" in path:
        return request.url.path
    return path


async def _attempt(request: Request, response: Response) -> Attempt:
    key = request.headers.get("idempotency-key")
    if key is not None and (not key or len(key) > MAX_KEY_LEN):
        raise ProblemError(400, "invalid_idempotency_key", f"Idempotency-Key must be 1-{MAX_KEY_LEN} chars.")
    route = request.scope.get("route")
    default_status = route.status_code if isinstance(route, APIRoute) and route.status_code else 200
    # the caller first: records are never shared between credentials
    scope = f"{principal_of(request).identity} {request.method} {_path(request)}"
    found = services(request)
    return Attempt(key, scope, found.store, found.settings, response, default_status, _holder(request))


_ATTEMPT_PARAM = "idempotency_attempt"
AttemptDep = Annotated[Attempt, Depends(_attempt)]
Idem = AttemptDep  # what a route takes to hand its command a receipt (the same object its wrapper gets)


def _is_attempt(annotation: Any) -> bool:
    """``annotation`` is ``Idem`` (``AttemptDep``): the attempt, as a dependency."""
    return any(getattr(m, "dependency", None) is _attempt for m in getattr(annotation, "__metadata__", ()))


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


async def _run(
    attempt: Attempt,
    key: str,
    body: Any,
    locks: KeyLocks,
    call: Callable[[], Awaitable[Any]],
    tasks: set[asyncio.Task[Response]],
) -> Response:
    task = asyncio.create_task(_run_once(attempt, key, _digest(body), locks, call), name=f"idempotent:{key}")
    tasks.add(task)
    task.add_done_callback(_settled(tasks))
    return await asyncio.shield(task)


class KeyedCommands:
    """Keyed commands that do not come as HTTP requests of their own (a media edge's final transcript, keyed by its
    ``id``), applied at most once like an idempotent route's: ``run`` reserves the key in the database, runs the
    command in a task of its own (a caller that goes away only stops waiting, and the key's answer is still recorded)
    and returns the answer, or replays it for a key already done."""

    def __init__(self) -> None:
        self._locks = KeyLocks()
        self._tasks: set[asyncio.Task[Response]] = set()

    async def run(
        self, conn: HTTPConnection, key: str, scope: str, body: Any, call: Callable[[Attempt], Awaitable[Any]]
    ) -> Any:
        """The answer (JSON) of the command ``call`` (given the attempt, to hand its effect a receipt) under ``key``
        and ``scope`` for ``body``; raises what the command raised, or ``ProblemError`` (409 the key was used for
        another body, 503 another holder still applies it)."""
        found = services(conn)
        attempt = Attempt(key, scope, found.store, found.settings, Response(status_code=200), 200, _holder(conn))
        answer = await _run(attempt, key, body, self._locks, lambda: call(attempt), self._tasks)
        return json.loads(bytes(answer.body)) if answer.body else None


def _settled(tasks: set[asyncio.Task[Response]]) -> Callable[[asyncio.Task[Response]], None]:
    def done(task: asyncio.Task[Response]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # a caller that was cut off never reads it; a problem answer needs no log

    return done


async def _run_once(
    attempt: Attempt, key: str, digest: str, locks: KeyLocks, call: Callable[[], Awaitable[Any]]
) -> Response:
    """Replay the key's answer, or hold its reservation and run the command: one unit, whatever the caller does."""
    command_outlives_caller.set(True)  # in this task's own context only
    async with locks.hold(key, attempt.scope):
        replay = await _reserve(attempt, key, digest)
        if replay is not None:
            return replay
        attempt.held = True
        try:
            result = await call()
            if (fenced := attempt.fenced) is not None:
                # whatever the route answered (a command may go on without its write, as progress does), its effect
                # is not durable: the key is released, and the retry reaches the session's new owner
                raise fenced
        except BaseException:  # no effect (or one that carried its answer): a retry runs it again, or replays it
            await _settle(attempt, "release", _release(attempt))
            raise
        status, payload = attempt.status, jsonable_encoder(result)
        if status >= 500:
            await _settle(attempt, "release", _release(attempt))
        elif not attempt.answered_by_effect:  # nothing durable to ride on (or it landed without the answer)
            await _settle(attempt, "complete", _complete(attempt, attempt.completion(payload)))
        return _response(status, payload)


async def _reserve(attempt: Attempt, key: str, digest: str) -> Response | None:
    """Hold the key's reservation (None: run the command), or the answer instead: the key's answer replayed, 409
    when the key was used for another body, 503 when its live holder still runs it after as long as a request
    waits."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + attempt.settings.request_timeout_s
    pause = POLL_FIRST_S
    while True:
        try:
            claim = await attempt.store.idempotency.reserve(key, attempt.scope, digest, attempt.holder)
        except Exception:
            # the reservation may have landed before the error: no node must wait on one nobody runs (one try: the
            # database is likely away, and the answer should say so now)
            with contextlib.suppress(Exception):
                await _release(attempt)()
            raise
        if claim.held:
            if claim.taken_from is not None:
                logger.warning(
                    "idempotency key %r: took its reservation over from node %s (its process is gone)",
                    key,
                    claim.taken_from.node,
                    extra={"idempotency_key": key},
                )
            return None
        found = claim.record
        if found is None or found.request_hash != digest:
            why = "its record cannot be read" if found is None else "it was used with a different request body"
            raise ProblemError(409, "idempotency_key_reused", f"This Idempotency-Key cannot be used: {why}.")
        if found.state is IdempotencyState.DONE:
            return _replay(attempt, found)
        if loop.time() + pause > give_up_at:
            raise ProblemError(
                503,
                "idempotency_key_in_use",
                "Another request with this Idempotency-Key is still being applied; retry to get its answer.",
                headers={"Retry-After": "1"},
            )
        await asyncio.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)


def _replay(attempt: Attempt, found: IdempotencyRecord) -> Response:
    replay = _response(found.status_code, attempt.sealing.unseal(attempt.settings, found.response_body))
    replay.headers[REPLAYED_HEADER] = "true"
    return replay


def _release(attempt: Attempt) -> Callable[[], Awaitable[None]]:
    async def release() -> None:
        assert attempt.key is not None
        await attempt.store.idempotency.release(attempt.key, attempt.scope, attempt.holder)

    return release


def _complete(attempt: Attempt, done: Completion) -> Callable[[], Awaitable[None]]:
    async def complete() -> None:
        if not await attempt.store.idempotency.complete(done):
            logger.warning(
                "idempotency key %r: answered, but its reservation was taken over meanwhile",
                done.key,
                extra={"idempotency_key": done.key},
            )

    return complete


async def _settle(attempt: Attempt, what: str, op: Callable[[], Awaitable[None]]) -> None:
    """Release or complete the reservation, retrying while the database is unavailable (for ``SETTLE_FOR_S``): a
    reservation a live process leaves pending keeps every other node's request with that key waiting."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + SETTLE_FOR_S
    delay = POLL_FIRST_S
    while True:
        try:
            await op()
            return
        except Exception as err:
            if not is_transient(err) or loop.time() >= give_up_at:
                logger.error(
                    "idempotency key %r: could not %s its reservation: %r",
                    attempt.key,
                    what,
                    err,
                    extra={"idempotency_key": attempt.key},
                )
                return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


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
        # a route that takes the attempt itself (``Idem``) shares its parameter: one dependency fewer to solve on every
        # request (FastAPI solves a dependency each time it is named, even when its value is cached)
        own = [p.name for p in params if _is_attempt(p.annotation)]
        self._attempt_param = own[0] if own else _ATTEMPT_PARAM
        self._own_attempt = bool(own)
        if not own:
            params.append(inspect.Parameter(_ATTEMPT_PARAM, inspect.Parameter.KEYWORD_ONLY, annotation=AttemptDep))
        self.__signature__ = signature.replace(
            parameters=params, return_annotation=hints.get("return", signature.return_annotation)
        )

    async def __call__(self, **kwargs: Any) -> R | Response:
        attempt: Attempt = kwargs[self._attempt_param] if self._own_attempt else kwargs.pop(_ATTEMPT_PARAM)
        if attempt.key is None:
            return await self._endpoint(**kwargs)
        body: Any = {}
        if self._body_model is not None:
            parsed = kwargs[BODY_PARAM]
            body = (parsed if parsed is not None else self._body_model()).model_dump(mode="json")
        call = functools.partial(self._endpoint, **kwargs)
        attempt.sealing = self._sealing
        return await _run(attempt, attempt.key, body, self._locks, call, self._tasks)


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
