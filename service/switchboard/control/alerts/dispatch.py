"""Deliveries of alerts to webhook sinks: one worker and one bounded queue per sink, so that a dead sink holds up only
its own deliveries and never grows memory; sessions never wait for any of it (a delivery is queued without waiting).

Each delivery is one Standard Webhooks message: its ``webhook-id`` names the alert and its transition and is the same on
every attempt (a receiver drops a repeat), ``webhook-timestamp`` is the attempt's, ``webhook-signature`` signs both with
the body. An attempt that fails (no answer within the sink's ``timeout_s``, or an answer outside 2xx) is tried again
after ``backoff_s``, doubled each time up to ``backoff_max_s``, at most ``max_attempts`` times; then it is ``failed``.
When a sink's queue is full the oldest waiting delivery is ``dropped`` to make room.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import httpx

from ... import __version__
from ...integrations.signing import signed_headers
from ...runtime.aio import cancel_and_wait
from ...runtime.chat import utcnow
from ...store.alerts import CLEARED, AlertRecord, Delivery, DeliveryState
from ..settings import AlertSink

logger = logging.getLogger("switchboard.control.alerts")

CONNECT_TIMEOUT_S = 5.0
ERROR_MAX_CHARS = 200
JITTER = 0.1  # each wait is up to a tenth longer, so that nodes retrying one sink do not do it in step


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 8
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    queue_max: int = 1000

    def wait_s(self, failed_attempts: int) -> float:
        """The wait after the ``failed_attempts``-th failed attempt."""
        base = min(self.backoff_max_s, self.backoff_s * 2.0 ** (failed_attempts - 1))
        return base * (1 + JITTER * random.random())


class DeliveryObserver(Protocol):
    def alert_attempt(self, sink: str, ok: bool) -> None: ...

    def alert_delivery(self, sink: str, kind: str, state: str) -> None: ...


@dataclass
class Job:
    """One transition of one alert, for one sink."""

    alert_id: str
    session_id: str
    kind: str  # opened or cleared
    sink: str
    body: bytes
    status: Delivery

    @property
    def message_id(self) -> str:
        return f"{self.alert_id}-{self.kind}"


def payload(alert: AlertRecord, kind: str) -> bytes:
    """The body of a delivery: a Standard Webhooks payload (``type``, ``timestamp``, ``data``)."""
    at = alert.cleared_at if kind == CLEARED and alert.cleared_at is not None else alert.opened_at
    data = {
        "alert_id": alert.id,
        "session_id": alert.session_id,
        "agent": alert.agent,
        "reason": alert.reason,
        "message": alert.message,
        "since": alert.since.isoformat(),
        "opened_at": alert.opened_at.isoformat(),
        "cleared_at": alert.cleared_at.isoformat() if alert.cleared_at is not None else None,
    }
    body = {"type": f"alert.{kind}", "timestamp": at.isoformat(), "data": data}
    return json.dumps(body, separators=(",", ":")).encode()


def _error_text(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return text[:ERROR_MAX_CHARS]


class SinkWorker:
    """The deliveries waiting for one sink, sent one at a time in the order they were queued."""

    def __init__(
        self,
        sink: AlertSink,
        client: httpx.AsyncClient,
        policy: RetryPolicy,
        on_status: Callable[[Job], Awaitable[None]],
        observer: DeliveryObserver | None,
    ) -> None:
        self.sink = sink
        self._client = client
        self._policy = policy
        self._on_status = on_status
        self._observer = observer
        self._queue: deque[Job] = deque()
        self._ready = asyncio.Event()
        self.current: Job | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        return len(self._queue) + (self.current is not None)

    def put(self, job: Job) -> Job | None:
        """Queue ``job``; the oldest waiting job when the queue was full (dropped, for the caller to record)."""
        self._queue.append(job)
        self._ready.set()
        if len(self._queue) + (self.current is not None) <= self._policy.queue_max:
            return None
        return self._queue.popleft()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            if not self._queue:
                self._ready.clear()
                continue
            self.current = self._queue.popleft()
            try:
                await self._deliver(self.current)
            finally:
                self.current = None

    async def _attempt(self, job: Job) -> str | None:
        """One attempt: None when the sink took it, else why not."""
        headers = signed_headers(self.sink.secret, job.body, message_id=job.message_id, signature="standard")
        try:
            async with asyncio.timeout(self.sink.timeout_s):
                response = await self._client.post(self.sink.url, content=job.body, headers=headers)
        except (httpx.HTTPError, TimeoutError, OSError) as err:
            return _error_text(err)
        if 200 <= response.status_code < 300:
            return None
        return f"HTTP {response.status_code}"

    async def _deliver(self, job: Job) -> None:
        while True:
            error = await self._attempt(job)
            job.status.attempts += 1
            job.status.last_error = error
            job.status.updated_at = utcnow()
            if self._observer is not None:
                self._observer.alert_attempt(self.sink.name, error is None)
            if error is None or job.status.attempts >= self._policy.max_attempts:
                job.status.state = DeliveryState.DELIVERED if error is None else DeliveryState.FAILED
                self._log_final(job)
                await self._on_status(job)
                return
            wait_s = self._policy.wait_s(job.status.attempts)
            logger.warning(
                "alert %s (%s, message %s) to sink %s: attempt %d failed (%s); retrying in %.1f s",
                job.alert_id,
                job.kind,
                job.message_id,
                self.sink.name,
                job.status.attempts,
                error,
                wait_s,
                extra={"session_id": job.session_id},
            )
            await self._on_status(job)
            await asyncio.sleep(wait_s)

    def _log_final(self, job: Job) -> None:
        if self._observer is not None:
            self._observer.alert_delivery(self.sink.name, job.kind, job.status.state.value)
        level = logging.INFO if job.status.state == DeliveryState.DELIVERED else logging.ERROR
        logger.log(
            level,
            "alert %s (%s, message %s) to sink %s: %s after %d attempt(s)%s",
            job.alert_id,
            job.kind,
            job.message_id,
            self.sink.name,
            job.status.state.value,
            job.status.attempts,
            f" ({job.status.last_error})" if job.status.last_error else "",
            extra={"session_id": job.session_id},
        )


class Dispatcher:
    """A worker per configured sink."""

    def __init__(
        self,
        sinks: list[AlertSink],
        policy: RetryPolicy,
        on_status: Callable[[Job], Awaitable[None]],
        observer: DeliveryObserver | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),  # each sink's timeout_s bounds an attempt
            follow_redirects=False,
            headers={"user-agent": f"switchboard/{__version__}"},
            transport=transport,
        )
        self._on_status = on_status
        self._observer = observer
        self.workers = {s.name: SinkWorker(s, self._client, policy, on_status, observer) for s in sinks}

    def start(self) -> None:
        for name, worker in self.workers.items():
            worker.task = asyncio.create_task(worker.run(), name=f"alert-sink:{name}")

    async def put(self, job: Job) -> None:
        """Queue ``job`` for its sink (never waits for the sink); one dropped to make room is recorded."""
        worker = self.workers.get(job.sink)
        if worker is None:
            return
        dropped = worker.put(job)
        if dropped is None:
            return
        dropped.status.state = DeliveryState.DROPPED
        dropped.status.updated_at = utcnow()
        if self._observer is not None:
            self._observer.alert_delivery(dropped.sink, dropped.kind, DeliveryState.DROPPED.value)
        logger.error(
            "alert %s (%s) to sink %s: dropped, its queue is full (%d waiting)",
            dropped.alert_id,
            dropped.kind,
            dropped.sink,
            worker.waiting,
            extra={"session_id": dropped.session_id},
        )
        await self._on_status(dropped)

    def waiting(self) -> dict[str, int]:
        return {name: worker.waiting for name, worker in self.workers.items()}

    async def aclose(self) -> None:
        await cancel_and_wait(*(w.task for w in self.workers.values()))
        await self._client.aclose()
