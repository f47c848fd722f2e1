"""How many event streams may be open at once: per caller and for the whole process, with a reserve for operators.

An idle stream costs memory (its socket, buffers and tasks: see docs/benchmarks.md) and a file descriptor, and a
credential that may read events could otherwise open streams until the process runs out of either. A stream over a
cap is closed at once with ``CLOSE_TOO_MANY_STREAMS`` (or answered 429) before it subscribes to anything.

A caller is counted by its budget (``Principal.budget``: an API key, or the key that minted a session token), so
minting tokens never multiplies a key's share. Whatever the callers together hold, the last ``reserve`` slots of the
process are kept for operators (``Principal.operator``): readers filling the server never lock out the people who
would act on it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


class TooManyStreams(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StreamSlots:
    """Counts open streams by budget (``Principal.budget``)."""

    def __init__(self, *, per_process: int, per_credential: int, reserve: int = 0) -> None:
        if not 0 <= reserve < per_process:
            raise ValueError(f"the operators' reserve ({reserve}) must be below the process cap ({per_process})")
        self.per_process = per_process
        self.per_credential = per_credential
        self.reserve = reserve
        self._open: Counter[str] = Counter()
        self._total = 0

    @property
    def total(self) -> int:
        return self._total

    def acquire(self, budget: str, *, operator: bool = False) -> Callable[[], None]:
        """Take a slot for one stream of ``budget``; returns its release (call it once). ``TooManyStreams`` when none
        is free: an operator may take the reserve, any other caller only what is left above it."""
        if self._total >= self.per_process:
            raise TooManyStreams(f"too many event streams on this server (at most {self.per_process})")
        if not operator and self._total >= self.per_process - self.reserve:
            raise TooManyStreams(
                f"too many event streams on this server (at most {self.per_process}; "
                f"the last {self.reserve} are kept for operators)"
            )
        if self._open[budget] >= self.per_credential:
            raise TooManyStreams(f"too many event streams for this credential (at most {self.per_credential})")
        self._open[budget] += 1
        self._total += 1

        def release() -> None:
            self._total -= 1
            self._open[budget] -= 1
            if not self._open[budget]:
                del self._open[budget]

        return release
