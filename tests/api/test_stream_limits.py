"""What one ``events:read`` credential can cost the service through event streams, and where it is stopped.

The attacks, each in a bounded loop: open streams until the process runs out of memory or descriptors; send a filter
of thousands of globs (compiled per connection on the event loop; over a thousand on a session stream exceed the
store's expression limit and end in 1011); replay a large session to a reader that never reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchboard.api.app import create_app
from switchboard.api.streams.events import (
    MAX_TYPE_CHARS,
    MAX_TYPE_GLOB_CHARS,
    MAX_TYPE_GLOBS,
    MAX_TYPE_WILDCARDS,
    REPLAY_PAGE,
)
from switchboard.control.settings import ALL_SCOPES, ApiKey
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.events import type_matcher

from .conftest import make_settings
from .test_observability import AsgiWebSocket

ADMIN = "admin-key-0123456789abcdef"
READER = "reader-key-0123456789abcdef"
OTHER = "other-reader-0123456789abcdef"
KEYS = [
    ApiKey(key=ADMIN, scopes=list(ALL_SCOPES), name="admin"),
    ApiKey(key=READER, scopes=["events:read"], name="reader"),
    ApiKey(key=OTHER, scopes=["events:read"], name="other"),
]


def _auth(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


@pytest.fixture
async def service(tmp_path: Path, registry: AgentRegistry) -> AsyncIterator[tuple[Any, str]]:
    settings = make_settings(tmp_path, api_keys=KEYS, ws_max_streams=8, ws_max_streams_per_credential=5)
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            r = await client.post(
                "/v1/sessions", json={"agent": "tester"}, headers={"authorization": f"Bearer {ADMIN}"}
            )
            assert r.status_code == 201, r.text
            yield app, r.json()["id"]


async def _open(app: Any, path: str, key: str, query: str = "") -> AsgiWebSocket:
    ws = AsgiWebSocket(app, path, query, headers=_auth(key))
    await asyncio.sleep(0.05)
    return ws


async def test_streams_are_capped_per_credential_and_per_process(service: tuple[Any, str]) -> None:
    app, sid = service
    paths = [f"/v1/sessions/{sid}/events", "/v1/events"]
    mine = [await _open(app, paths[i % 2], READER) for i in range(5)]
    assert all(ws.accepted and ws.close is None for ws in mine)
    for path in paths:  # one more from the same key: refused at once, whichever stream
        code, reason = await AsgiWebSocket(app, path, headers=_auth(READER)).closed()
        assert code == 4429 and "credential" in reason and "5" in reason, (code, reason)
    others = [await _open(app, "/v1/events", OTHER) for _ in range(3)]  # another key still gets in...
    assert all(ws.close is None for ws in others)
    code, reason = await AsgiWebSocket(app, "/v1/events", headers=_auth(ADMIN)).closed()  # ...until the server is full
    assert code == 4429 and "server" in reason, (code, reason)
    await mine[0].disconnect()  # a closed stream frees its slot
    again = await _open(app, paths[0], READER)
    assert again.accepted and again.close is None
    for ws in [*mine[1:], *others, again]:
        await ws.disconnect()


@pytest.mark.parametrize("stream", ["session", "multi"])
async def test_filters_are_bounded(service: tuple[Any, str], stream: str) -> None:
    app, sid = service
    path = f"/v1/sessions/{sid}/events" if stream == "session" else "/v1/events"
    many = ",".join(f"tool.x{i}*" for i in range(1200))  # past the store's expression limit (was a 1011)
    code, reason = await AsgiWebSocket(app, path, f"types={many}", headers=_auth(READER)).closed()
    assert code == 4400 and "globs" in reason, (code, reason)
    long = "tool." + "*a" * 200
    code, reason = await AsgiWebSocket(app, path, f"types={long}", headers=_auth(READER)).closed()
    assert code == 4400 and "characters" in reason, (code, reason)
    # within those, a filter whose compiling took ~45 ms of the event loop, for every connection with a new one
    costly = ",".join(("*a" * 50)[: MAX_TYPE_GLOB_CHARS - 2] + f"{i:02d}" for i in range(MAX_TYPE_GLOBS))
    code, reason = await AsgiWebSocket(app, path, f"types={costly}", headers=_auth(READER)).closed()
    assert code == 4400 and f"{MAX_TYPE_CHARS} characters in all" in reason, (code, reason)
    starry = ",".join("*" * 20 for _ in range(4))
    code, reason = await AsgiWebSocket(app, path, f"types={starry}", headers=_auth(READER)).closed()
    assert code == 4400 and f"{MAX_TYPE_WILDCARDS} wildcards" in reason, (code, reason)
    ok = ",".join(f"tool.x{i}*" for i in range(MAX_TYPE_GLOBS))
    ws = await _open(app, path, READER, f"types={ok}")
    assert ws.accepted and ws.close is None
    await ws.disconnect()


async def test_too_many_session_ids_are_4400(service: tuple[Any, str]) -> None:
    app, _ = service
    ids = ",".join(f"sess_{i}" for i in range(2000))
    code, reason = await AsgiWebSocket(app, "/v1/events", f"session_ids={ids}", headers=_auth(READER)).closed()
    assert code == 4400 and "session_ids" in reason


def test_matchers_are_compiled_once_per_filter() -> None:
    globs = [f"tool.kind{i}.*" for i in range(MAX_TYPE_GLOBS)]
    first = type_matcher(globs)
    assert type_matcher(list(globs)) is first  # a reconnect with the same filter compiles nothing
    assert first("tool.kind3.started") and not first("speech.created")
    assert type_matcher(None)("anything") and type_matcher([])("anything")


def test_a_replay_page_is_small() -> None:
    # what a reader that never reads holds while a large session is replayed to it
    assert REPLAY_PAGE <= 100
