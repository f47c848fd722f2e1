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

from ..waiting import until
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


def test_a_create_solves_only_the_dependencies_that_read_the_request(tmp_path: Any) -> None:
    """FastAPI solves every dependency a route names on every request, a cached one too: a create names only its
    credential check and its idempotency attempt (the service's parts come from the request itself)."""
    app = create_app(make_settings(tmp_path))
    create = next(r for r in _routes(app.routes) if isinstance(r, APIRoute) and r.operation_id == "createSession")
    names = [getattr(call, "__qualname__", type(call).__qualname__) for call in _calls(create.dependant)]
    assert sorted(names) == ["Require", "_attempt"]


async def test_sessions_of_an_agent_share_its_parsed_script_and_keep_their_own_requests(api: Api) -> None:
    host = api.app.state.services.host
    first, second = [(await api.create(agent="demo"))["id"] for _ in range(2)]
    models = [host.sessions[sid].llm.llm for sid in (first, second)]  # inside the metering wrapper
    assert models[0] is not models[1]
    assert models[0].rules is not None and models[0].rules is models[1].rules  # parsed once, for the agent
    assert (await api.client.post(f"/v1/sessions/{first}/input", json={"text": "my order"})).status_code == 202
    await until(lambda: len(models[0].requests) == 1)
    assert len(models[1].requests) == 0
