"""The simulation runs on its own virtual-time loops and checks tasks itself."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """Overrides the suite's asyncio check: every schedule closes its own loop, so nothing can leak into the next."""
