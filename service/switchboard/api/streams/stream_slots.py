"""How many event streams may be open at once: per credential and for the whole process.

An idle stream costs memory (its socket, buffers and tasks: see docs/benchmarks.md) and a file descriptor, and a
credential that may read events could otherwise open streams until the process runs out of either. A stream over a
cap is closed at once with ``CLOSE_TOO_MANY_STREAMS`` before it subscribes to anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


class TooManyStreams(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StreamSlots:
    """Counts open streams by credential name (an API key's name, a session token's session)."""

    def __init__(self, *, per_process: int, per_credential: int) -> None:
        self.per_process = per_process
        self.per_credential = per_credential
        self._open: Counter[str] = Counter()
        self._total = 0

    @property
    def total(self) -> int:
        return self._total

    def acquire(self, credential: str) -> Callable[[], None]:
        """Take a slot for one stream; returns its release (call it once). ``TooManyStreams`` when none is free."""
        if self._total >= self.per_process:
            raise TooManyStreams(f"too many event streams on this server (at most {self.per_process})")
        if self._open[credential] >= self.per_credential:
            raise TooManyStreams(f"too many event streams for this credential (at most {self.per_credential})")
        self._open[credential] += 1
        self._total += 1

        def release() -> None:
            self._total -= 1
            self._open[credential] -= 1
            if not self._open[credential]:
                del self._open[credential]

        return release
