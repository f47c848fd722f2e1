"""What exports may cost: how many run at once (in the process, and of one caller) and how many bytes a second one
caller's exports send together.

An export reads a whole session and encodes it: thirty at once by one read-only token held another session's
interrupt up for seconds. Slots bound how many run; a slot is taken before the answer starts and given back when the
answer ends in any way (sent, failed, the client gone), by ``ExportResponse``. The byte budget paces a caller's
exports instead of refusing them: an export that has sent its share waits for more, so a client sees a slower
download, never a cut document.

Each page of an export is encoded off the event loop, on the exports' own thread (``encode``).

A caller is the principal a credential spends for (``Principal.budget``: a session token's minter, else the
credential). With auth off there is one caller, the operator: only the process's cap holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

EXPORT_RETRY_AFTER_S = 2  # an export takes seconds: asking again sooner mostly finds the slots still taken
BYTES_BURST_S = 1.0  # a caller's exports may send this many seconds of their budget at once
# Every export's pages are encoded on one thread of their own: off the event loop, and never more than one thread
# contending with it for the GIL (the loop waits a switch interval, 5 ms, per thread ahead of it), nor taking the
# default executor's threads from the rest of the service.
ENCODE_THREADS = 1

T = TypeVar("T")


class ExportsBusy(Exception):
    """No export slot is free: the detail says whose."""


@dataclass
class ExportBudget:
    """Export slots, byte budgets and the encoding thread: ``enter()`` for a slot, ``encode()`` a page, ``spend()``
    before sending it; ``close()`` when the service stops."""

    max_running: int
    max_per_caller: int
    bytes_per_s: int  # 0: not paced
    clock: Callable[[], float] = time.monotonic
    _running: int = 0
    _by_caller: dict[str, int] = field(default_factory=dict)
    # each caller's byte bucket as a GCRA theoretical arrival time: when its sends so far would all have been paid
    _paid_until: dict[str, float] = field(default_factory=dict)
    _encoder: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="export-encode")
    )

    def enter(self, caller: str | None) -> Callable[[], None]:
        """Take a slot for an export by ``caller`` (None: auth off, no caller's cap): the function that gives it back
        (calling it again does nothing). Raises ``ExportsBusy``."""
        if self._running >= self.max_running:
            raise ExportsBusy(f"The server is running {self._running} exports, its most at once; retry later.")
        if caller is not None:
            if self._by_caller.get(caller, 0) >= self.max_per_caller:
                raise ExportsBusy(
                    f"This credential is running {self.max_per_caller} exports, its most at once; retry later."
                )
            self._by_caller[caller] = self._by_caller.get(caller, 0) + 1
        self._running += 1
        released = False

        def leave() -> None:
            nonlocal released
            if not released:
                released = True
                self._leave(caller)

        return leave

    def _leave(self, caller: str | None) -> None:
        self._running -= 1
        if caller is None:
            return
        left = self._by_caller.pop(caller) - 1
        if left:
            self._by_caller[caller] = left
        elif self._paid_until.get(caller, 0.0) <= self.clock():
            self._paid_until.pop(caller, None)  # idle with a full bucket: nothing to remember

    async def spend(self, caller: str | None, size: int) -> None:
        """Wait until ``caller`` may send ``size`` more bytes (at once while its bucket holds them)."""
        if caller is None or self.bytes_per_s <= 0:
            return
        now = self.clock()
        paid_until = max(self._paid_until.get(caller, now), now) + size / self.bytes_per_s
        self._paid_until[caller] = paid_until
        wait_s = paid_until - BYTES_BURST_S - now
        if wait_s <= 0:
            return
        try:
            await asyncio.sleep(wait_s)
        except asyncio.CancelledError:
            self._paid_until[caller] -= size / self.bytes_per_s  # never sent (the client went away): not spent
            raise

    async def encode(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on the exports' thread."""
        return await asyncio.get_running_loop().run_in_executor(self._encoder, work, *args)

    def close(self) -> None:
        self._encoder.shutdown(wait=False, cancel_futures=True)

    def running(self, caller: str | None = None) -> int:
        """The exports running: all of them, or ``caller``'s."""
        return self._running if caller is None else self._by_caller.get(caller, 0)


class ExportResponse(StreamingResponse):
    """A streamed export that gives its slot back however the answer ends (``release``, also called by the document
    itself when it ends: whichever comes first), and stops reading the session then."""

    def __init__(self, content: AsyncIterator[bytes], *, release: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="application/json", headers=headers)
        self._content = content
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                await aclose()
