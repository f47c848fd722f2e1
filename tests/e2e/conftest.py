from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .console_support import launch_chromium, require_chromium
from .media_support import KEY as MEDIA_KEY
from .media_support import KEYS as MEDIA_KEYS
from .server import Server


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
