"""No request waits on a thread hop: every route's endpoint and dependencies are coroutines.

FastAPI runs a plain function (endpoint or dependency) in its thread pool. For a lookup of a few microseconds the hop
costs far more, and on a busy event loop a thread waits for the interpreter lock for milliseconds: it was a sixth of
the server's time on the input path with 200 speaking sessions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, APIWebSocketRoute

from switchboard.api.app import create_app

from .conftest import Api, make_settings


def _is_coroutine(call: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(call) or inspect.iscoroutinefunction(getattr(call, "__call__", None))  # noqa: B004


def _calls(dependant: Dependant) -> Iterator[Callable[..., Any]]:
    for sub in dependant.dependencies:
        if sub.call is not None:
            yield sub.call
        yield from _calls(sub)


def _routes(routes: list[Any]) -> Iterator[APIRoute | APIWebSocketRoute]:
    for route in routes:
        if isinstance(route, APIRoute | APIWebSocketRoute):
            yield route
        included = getattr(route, "original_router", None)  # a router included in another
        if included is not None:
            yield from _routes(included.routes)


def test_every_endpoint_and_dependency_is_a_coroutine(tmp_path: Any) -> None:
    app = create_app(make_settings(tmp_path))
    sync = []
    checked = 0
    for route in _routes(app.routes):
        for call in [route.endpoint, *_calls(route.dependant)]:
            checked += 1
            if not _is_coroutine(call):
                sync.append(f"{route.path}: {getattr(call, '__qualname__', call)!r}")
    assert checked > 50
    assert sync == []


async def test_commands_never_use_the_thread_pool(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    import fastapi.dependencies.utils
    import fastapi.routing

    hops: list[str] = []

    async def record(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(func, "__qualname__", repr(func)))
        return func(*args, **kwargs)

    monkeypatch.setattr(fastapi.dependencies.utils, "run_in_threadpool", record)
    monkeypatch.setattr(fastapi.routing, "run_in_threadpool", record)
    sid = (await api.create(llm={"provider": "scripted", "turns": [{"text": "hello there"}]}))["id"]
    c = api.client
    assert (await c.post(f"/v1/sessions/{sid}/input", json={"text": "hi"})).status_code == 202
    assert (await c.post(f"/v1/sessions/{sid}/interrupt", json={})).status_code in (200, 409)
    assert (await c.post(f"/v1/sessions/{sid}/say", json={"text": "ok"}, headers={"Idempotency-Key": "k1"})).is_success
    assert (await c.get(f"/v1/sessions/{sid}/chat")).status_code == 200
    assert hops == []
