"""Idempotency-Key support for POST routes (I7): a retry with the same key and body returns the first response."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..runtime.chat import utcnow
from ..store import IdempotencyRecord
from .problems import ProblemError

MAX_KEY_LEN = 200
Handler = Callable[[], Awaitable[tuple[int, Any]]]


class IdempotencyGuard:
    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def run(self, request: Request, body: Any, handler: Handler) -> Response:
        key = request.headers.get("idempotency-key")
        if key is None:
            status, payload = await handler()
            return _response(status, payload)
        if not key or len(key) > MAX_KEY_LEN:
            raise ProblemError(400, "invalid_idempotency_key", f"Idempotency-Key must be 1-{MAX_KEY_LEN} chars.")
        scope = f"{request.method} {request.url.path}"
        digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
        store = request.app.state.store
        lock = self._locks.setdefault((key, scope), asyncio.Lock())
        try:
            async with lock:
                found = await store.idempotency_get(key, scope)
                if found is not None:
                    if found.request_hash != digest:
                        raise ProblemError(
                            409,
                            "idempotency_key_reused",
                            "This Idempotency-Key was already used with a different request body.",
                        )
                    resp = _response(found.status_code, found.response_body)
                    resp.headers["Idempotent-Replayed"] = "true"
                    return resp
                status, payload = await handler()
                if status < 500:
                    await store.idempotency_put(
                        IdempotencyRecord(
                            key=key,
                            scope=scope,
                            request_hash=digest,
                            status_code=status,
                            response_body=payload,
                            created_at=utcnow(),
                        )
                    )
                return _response(status, payload)
        finally:
            if not lock.locked():
                self._locks.pop((key, scope), None)


def _response(status: int, payload: Any) -> Response:
    if status == 204 or payload is None:
        return Response(status_code=status)
    return JSONResponse(payload, status_code=status)
