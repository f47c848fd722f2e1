"""Speculation: a reply generated from an interim transcript before the final one arrives (preemptive generation).

I2: it never starts while a tool call of the current reply is executing (it waits for the call to end), and its
result is used only when the final input is the text it was made for and the context has not changed since.

A call it makes to a tool declared free of side effects (``side_effects=False``) starts at once, as a speculative call
(``ToolExecutor.start``): the reply confirms it when it plays, or drops it with the speculation, saying why. A call of
any other tool waits in the generation: it starts only if the reply is confirmed, and a dropped one never started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import event_types as ev
from .aio import cancel_and_wait
from .chat import ChatContext
from .events import EventLog
from .generation import Generation
from .llm.base import LLM, LLMRequest, ToolCallChunk
from .tools import DropReason

if TYPE_CHECKING:
    from .tool_call import RunningCall

#: starts the ``index``-th call of a speculative generation early, when its tool allows it (else None)
StartEarly = Callable[[ToolCallChunk, int], "RunningCall | None"]


class Speculation:
    """The speculative reply of one session, if any.

    ``request_for(text)`` builds the model request for a pending user ``text``; ``tool_running()`` tells whether a
    foreground tool call is executing; background work (closing a superseded generation) goes to ``tasks``.
    """

    def __init__(
        self,
        *,
        llm: LLM,
        events: EventLog,
        chat: ChatContext,
        enabled: bool,
        request_for: Callable[[str], LLMRequest],
        tool_running: Callable[[], bool],
        tasks: set[asyncio.Task[Any]],
        start_early: StartEarly,
        drop_call: Callable[[RunningCall, DropReason], None],
    ) -> None:
        self.llm = llm
        self.events = events
        self._chat = chat
        self._enabled = enabled
        self._request_for = request_for
        self._tool_running = tool_running
        self._tasks = tasks
        self._start_early = start_early
        self._drop_call = drop_call
        self._watchers: dict[Generation, asyncio.Task[None]] = {}
        self._speculative: Generation | None = None
        self._interim_text: str | None = None
        self._preempt_pending = False

    @property
    def generation(self) -> Generation | None:
        """The speculative generation running (or finished) now, waiting for the final input."""
        return self._speculative

    def on_interim(self, text: str) -> None:
        self._interim_text = text
        if not self._enabled:
            return
        if self._tool_running():
            self._preempt_pending = True  # started when the tool ends, never while it runs
            return
        self._start(text)

    def start_pending(self, *, quiet: bool) -> None:
        """Start a speculative reply that waited for tools, once nothing is about to change the context: ``quiet``
        (no speech playing or queued: a tool reply would invalidate it at once) and no foreground tool running."""
        if self._preempt_pending and self._interim_text and quiet and not self._tool_running():
            self._start(self._interim_text)

    def take(self) -> Generation | None:
        """The final input arrived: hand over the speculative generation (if any) and forget the interim text. From
        now on it starts no call early: its reply starts (or confirms) its calls as it plays."""
        spec, self._speculative = self._speculative, None
        self._interim_text, self._preempt_pending = None, False
        if spec is not None:
            self._stop_watching(spec)
        return spec

    def barge_in(self) -> None:
        """An interruption changed the context: a speculation dropped for it says so (``barge_in``)."""
        if self._speculative is not None:
            self._speculative.barged_in = True

    async def use_or_drop(
        self, spec: Generation | None, *, text: str, role: str, barge_in: bool = False
    ) -> Generation | None:
        """``spec`` if it answers the final ``text`` from the context it saw (then it is used), else None (it is
        dropped and its script turn given back). ``barge_in``: the final input interrupted a speech."""
        if spec is None:
            return None
        if role != "user" or spec.user_text != text:
            reason: DropReason | None = "turn_resumed"
        elif spec.version != self._chat.version or self._tool_running():
            reason = self._changed(spec, barge_in=barge_in)
        else:
            reason = None
        if reason is not None:
            await self._drop_generation(spec, reason)
            return None
        self.events.emit(ev.GenerationSpeculative(state="used", user_text=spec.user_text))
        return spec

    def still_fits(self, spec: Generation, context_version: int | None) -> bool:
        """Whether ``spec``, accepted for a reply queued on ``context_version``, may still be used now: nothing was
        added to the context since (a speech that played before the reply, a tool result) and no call is running."""
        return context_version is not None and self._chat.version == context_version and not self._tool_running()

    async def drop_stale(self, spec: Generation) -> None:
        """Drop a speculative generation accepted earlier whose context has changed since (its turn given back)."""
        await self._drop_generation(spec, self._changed(spec))

    async def discard(self) -> None:
        """Drop the speculative generation, giving its script turn back (the session closes)."""
        spec, self._speculative = self._speculative, None
        if spec is not None:
            await self._drop_generation(spec, "session_stopped", report=False)

    async def abandon(self) -> None:
        """Stop the speculative generation as it is (service shutdown)."""
        spec, self._speculative = self._speculative, None
        if spec is not None:
            await self._close(spec, "session_stopped")

    @staticmethod
    def _changed(spec: Generation, *, barge_in: bool = False) -> DropReason:
        return "barge_in" if barge_in or spec.barged_in else "context_changed"

    def _start(self, text: str) -> None:
        self._preempt_pending = False
        old, self._speculative = self._speculative, None
        if old is not None:  # the user went on speaking
            self._rollback(old)
            self._stop_watching(old)
            old.drop_calls("turn_resumed")
            self.events.emit(
                ev.GenerationSpeculative(state="discarded", user_text=old.user_text, reason="turn_resumed")
            )
            task = asyncio.create_task(self._close(old, "turn_resumed"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        before = self.llm.save_state()
        request = self._request_for(text)
        spec = Generation(self.llm, request, version=self._chat.version, user_text=text, llm_state_before=before)
        spec.drop_call = self._drop_call
        self._speculative = spec
        self.events.emit(ev.GenerationSpeculative(state="started", user_text=text))
        watcher = asyncio.create_task(self._watch(spec), name=f"speculation-calls:{text[:20]}")
        self._watchers[spec] = watcher
        self._tasks.add(watcher)
        watcher.add_done_callback(self._tasks.discard)

    async def _watch(self, spec: Generation) -> None:
        """Start the speculation's calls that may run early as soon as the model has made them (until it is taken)."""
        index = 0
        with contextlib.suppress(Exception):  # the model's error is its reply's to report
            async for chunk in spec:
                if isinstance(chunk, ToolCallChunk):
                    rc = self._start_early(chunk, index)
                    if rc is not None:
                        spec.early[index] = rc
                    index += 1

    def _stop_watching(self, spec: Generation) -> None:
        watcher = self._watchers.pop(spec, None)
        if watcher is not None:
            watcher.cancel()  # it never awaits anything but the generation's next chunk

    async def _close(self, spec: Generation, reason: DropReason) -> None:
        watcher = self._watchers.pop(spec, None)
        if watcher is not None:
            await cancel_and_wait(watcher)
        await spec.aclose(reason)

    def _rollback(self, gen: Generation) -> None:
        # A discarded speculative reply gives its script turn back, unless another generation has used the
        # model since (then its state is no longer ours to rewind).
        if gen.llm_state_before is not None and self.llm.save_state() == gen.llm_state_after:
            self.llm.load_state(gen.llm_state_before)

    async def _drop_generation(self, gen: Generation, reason: DropReason, *, report: bool = True) -> None:
        self._rollback(gen)
        gen.drop_calls(reason)
        if report:
            self.events.emit(ev.GenerationSpeculative(state="discarded", user_text=gen.user_text, reason=reason))
        await self._close(gen, reason)
