"""The simulation runs on its own virtual-time loops and checks tasks itself."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """Overrides the suite's asyncio check: every schedule closes its own loop, so nothing can leak into the next."""


@pytest.fixture(autouse=True)
def frozen_heap() -> Iterator[None]:
    """Each schedule ends with a full collection (a lost task is reported when it is collected): with what the worker
    holds frozen (``gc.freeze``), as the command-line drivers freeze their imports, it scans the schedule's own
    objects, not every module and test the worker has loaded before (the seeded run took 3-8x longer in the suite
    than alone)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
