from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from .cluster_support import RedisServer
from .console_support import launch_chromium, require_chromium
from .media_support import KEY as MEDIA_KEY
from .media_support import KEYS as MEDIA_KEYS
from .server import Server
from .test_faults import PG_URL, pg_database


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def media_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose API keys include one with `media:connect` (the reference media edges' tests)."""
    srv = Server(tmp_path_factory.mktemp("media"), SWITCHBOARD_API_KEYS=MEDIA_KEYS).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def media_client(media_srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=media_srv.url, headers={"Authorization": f"Bearer {MEDIA_KEY}"}, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium, one per test module that asks for it (skipped without it, except under CI)."""
    require_chromium()
    with launch_chromium() as b:
        yield b


@pytest.fixture
async def database_url() -> AsyncIterator[str]:
    """A fresh PostgreSQL database for the test (the cluster tests; a module may define its own)."""
    async with pg_database() as name:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, on a free port (a test may stop it)."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
