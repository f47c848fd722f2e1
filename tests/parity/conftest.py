"""The parity scenarios run on virtual-time loops of their own and check their tasks themselves (``clock.py``)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """Overrides the suite's asyncio check: ``on_virtual_clock`` checks each scenario's loop before closing it."""
