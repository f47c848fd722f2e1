"""One HTTP call with the client's retry policy, for the sync and the async client alike.

A command (a POST) carries an ``Idempotency-Key`` generated once per call and sent unchanged on each of its retries:
if the first attempt was applied but its answer lost (a cut connection, a timeout), the service answers the retry
with the first response instead of applying the command again.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx

from .errors import from_response, retry_after, unreachable

T = TypeVar("T")

IDEMPOTENCY_HEADER = "Idempotency-Key"
# failures after which the request may not have reached the service, or its answer was lost: safe to retry because
# reads are safe and every command carries its Idempotency-Key (a proxy or protocol misuse is not retried)
RETRYABLE_ERRORS = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)


def new_idempotency_key() -> str:
    return str(uuid.uuid4())


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a call is retried: on a connection error (exponential backoff) and on a 503 that
    carries ``Retry-After`` (as long as it asks, up to ``max_retry_after_s``; longer is left to the caller)."""

    retries: int = 3
    backoff_s: float = 0.2
    max_backoff_s: float = 2.0
    max_retry_after_s: float = 10.0

    def after_error(self, attempt: int) -> float | None:
        if attempt >= self.retries:
            return None
        return min(self.backoff_s * 2.0**attempt, self.max_backoff_s)

    def after_response(self, attempt: int, response: httpx.Response) -> float | None:
        if attempt >= self.retries or response.status_code != 503:
            return None
        wait_s = retry_after(response)
        if wait_s is None or wait_s > self.max_retry_after_s:
            return None
        return wait_s


NO_RETRIES = RetryPolicy(retries=0)


@dataclass(frozen=True)
class Call(Generic[T]):
    """One operation: what to send and how to read a successful answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    json: Any = None
    params: dict[str, Any] | None = None
    command: bool = False  # carries an Idempotency-Key
    idempotency_key: str | None = None
    success: tuple[int, ...] = ()  # other statuses whose body is an answer, not a problem (readyz's 503)
    headers: dict[str, str] = field(default_factory=dict)

    def prepared_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.command:
            headers[IDEMPOTENCY_HEADER] = self.idempotency_key or new_idempotency_key()
        return headers

    def outcome(self, response: httpx.Response) -> T:
        if response.is_success or response.status_code in self.success:
            return self.parse(response)
        raise from_response(response)


def send(http: httpx.Client, policy: RetryPolicy, call: Call[T]) -> T:
    headers = call.prepared_headers()  # once: every attempt sends the same key
    attempt = 0
    while True:
        try:
            response = http.request(call.method, call.path, json=call.json, params=call.params, headers=headers)
        except RETRYABLE_ERRORS as err:
            delay = policy.after_error(attempt)
            if delay is None:
                raise unreachable(str(http.base_url), err) from err
        else:
            delay = None if call.success else policy.after_response(attempt, response)
            if delay is None:
                return call.outcome(response)
        time.sleep(delay)
        attempt += 1


async def asend(http: httpx.AsyncClient, policy: RetryPolicy, call: Call[T]) -> T:
    headers = call.prepared_headers()
    attempt = 0
    while True:
        try:
            response = await http.request(call.method, call.path, json=call.json, params=call.params, headers=headers)
        except RETRYABLE_ERRORS as err:
            delay = policy.after_error(attempt)
            if delay is None:
                raise unreachable(str(http.base_url), err) from err
        else:
            delay = None if call.success else policy.after_response(attempt, response)
            if delay is None:
                return call.outcome(response)
        await asyncio.sleep(delay)
        attempt += 1


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
