"""One virtual-time loop for every node of the cluster, where a node can be paused (SIGSTOP) or killed.

Each node's code runs in tasks whose context names the node (``NODE``, set when the node starts and inherited by
every task it creates). A paused node's callbacks are held back instead of run: ready ones, and timers as they come
due. Resuming puts them back in the order they were held; a killed node is paused for good. The clients, the
database and the load balancer run in no node's context: a pause never stops them.
"""

from __future__ import annotations

import contextvars
import heapq
import time
from asyncio import Handle, TimerHandle, base_events
from collections import deque
from typing import Any

from ..vloop import Livelock, Stalled, VirtualTimeLoop

NODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("sim_node", default=None)


def _node_of(handle: Handle) -> str | None:
    context: contextvars.Context | None = getattr(handle, "_context", None)
    return context.get(NODE) if context is not None else None


class ClusterLoop(VirtualTimeLoop):
    def __init__(self) -> None:
        super().__init__()
        self.paused: set[str] = set()
        self.killed: set[str] = set()
        self._held: dict[str, list[Handle]] = {}

    def pause(self, node: str) -> None:
        self.paused.add(node)

    def resume(self, node: str) -> None:
        if node in self.killed:
            return
        self.paused.discard(node)
        ready: deque[Handle] = self._ready  # type: ignore[attr-defined]
        ready.extend(self._held.pop(node, []))

    def kill(self, node: str) -> None:
        """The node's process is gone: none of its callbacks ever runs again."""
        self.killed.add(node)
        self.paused.add(node)

    def held(self) -> list[Handle]:
        return [h for handles in self._held.values() for h in handles]

    def _hold_paused(self) -> None:
        ready: deque[Handle] = self._ready  # type: ignore[attr-defined]
        if self.paused and ready:
            keep: deque[Handle] = deque()
            for handle in ready:
                node = _node_of(handle)
                if node in self.paused:
                    self._held.setdefault(node, []).append(handle)
                else:
                    keep.append(handle)
            ready.clear()
            ready.extend(keep)

    def _hold_due_timers(self) -> None:
        """Take the due timers of paused nodes out of the heap (they are held like ready callbacks)."""
        scheduled: list[TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        if not self.paused:
            return
        horizon = self._now + self._clock_resolution
        while scheduled and scheduled[0].when() < horizon:
            first = scheduled[0]
            if first.cancelled():
                heapq.heappop(scheduled)
                self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
                continue
            node = _node_of(first)
            if node not in self.paused:
                # a due timer of a running node: the base loop runs it; look past it for paused ones
                due = self._due_paused(scheduled, horizon)
                if due:
                    for handle in due:
                        handle._scheduled = False  # type: ignore[attr-defined]
                        self._held.setdefault(_node_of(handle) or "", []).append(handle)
                    scheduled[:] = [h for h in scheduled if not any(h is d for d in due)]
                    heapq.heapify(scheduled)
                return
            heapq.heappop(scheduled)
            first._scheduled = False  # type: ignore[attr-defined]
            self._held.setdefault(node or "", []).append(first)

    def _due_paused(self, scheduled: list[TimerHandle], horizon: float) -> list[TimerHandle]:
        """The due timers of paused nodes, in the heap's order: only the heap's due part is walked (a timer's
        children are never due before it), not every timer of every node."""
        found: list[int] = []
        stack = [0]
        while stack:
            i = stack.pop()
            if i < len(scheduled) and scheduled[i].when() < horizon:
                if _node_of(scheduled[i]) in self.paused:
                    found.append(i)
                stack += (2 * i + 1, 2 * i + 2)
        return [scheduled[i] for i in sorted(found)]

    def _run_once(self) -> None:
        if time.monotonic() > self._real_deadline:
            raise Livelock(f"still running after the real-time limit (virtual t={self._now:.3f}s)")
        scheduled: list[TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        while True:
            self._hold_paused()
            self._hold_due_timers()
            while scheduled and scheduled[0].cancelled():
                heapq.heappop(scheduled)
                self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
            if self._ready or self._stopping:  # type: ignore[attr-defined]
                if scheduled and scheduled[0].when() < self._now + self._clock_resolution:
                    self._now = max(self._now, scheduled[0].when())
                break
            if not scheduled:
                raise Stalled(f"nothing can run at t={self._now:.3f}s: every task waits forever")
            if scheduled[0].when() < self._now + self._clock_resolution:
                self._now = max(self._now, scheduled[0].when())
                break  # a due timer of a running node: the base loop runs it
            self._now = scheduled[0].when()
        base_events.BaseEventLoop._run_once(self)  # type: ignore[attr-defined]


def run_in_node(node: str, fn: Any, *args: Any) -> Any:
    """Call ``fn`` in a copy of the current context naming ``node``: tasks it creates belong to that node."""
    ctx = contextvars.copy_context()
    ctx.run(NODE.set, node)
    return ctx.run(fn, *args)
