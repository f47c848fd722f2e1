from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .console_support import launch_chromium, require_chromium
from .server import Server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium, one per test module that asks for it (skipped without it, except under CI)."""
    require_chromium()
    with launch_chromium() as b:
        yield b
