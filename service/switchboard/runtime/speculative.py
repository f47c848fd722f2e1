"""Speculation: a reply generated from an interim transcript before the final one arrives (preemptive generation).

I2: it never starts while a tool call of the current reply is executing (it waits for the call to end), and its
result is used only when the final input is the text it was made for and the context has not changed since.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from . import event_types as ev
from .chat import ChatContext
from .events import EventLog
from .generation import Generation
from .llm.base import LLM, LLMRequest


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
    ) -> None:
        self.llm = llm
        self.events = events
        self._chat = chat
        self._enabled = enabled
        self._request_for = request_for
        self._tool_running = tool_running
        self._tasks = tasks
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
        """The final input arrived: hand over the speculative generation (if any) and forget the interim text."""
        spec, self._speculative = self._speculative, None
        self._interim_text, self._preempt_pending = None, False
        return spec

    async def use_or_drop(self, spec: Generation | None, *, text: str, role: str) -> Generation | None:
        """``spec`` if it answers the final ``text`` from the context it saw (then it is used), else None (it is
        dropped and its script turn given back)."""
        if spec is None:
            return None
        usable = (
            role == "user"
            and spec.user_text == text
            and spec.version == self._chat.version
            and not self._tool_running()
        )
        if not usable:
            await self._drop_generation(spec)
            self.events.emit(ev.GenerationSpeculative(state="discarded", user_text=spec.user_text))
            return None
        self.events.emit(ev.GenerationSpeculative(state="used", user_text=spec.user_text))
        return spec

    def still_fits(self, spec: Generation, context_version: int | None) -> bool:
        """Whether ``spec``, accepted for a reply queued on ``context_version``, may still be used now: nothing was
        added to the context since (a speech that played before the reply, a tool result) and no call is running."""
        return context_version is not None and self._chat.version == context_version and not self._tool_running()

    async def drop_stale(self, spec: Generation) -> None:
        """Drop a speculative generation accepted earlier whose context has changed since (its turn given back)."""
        await self._drop_generation(spec)
        self.events.emit(ev.GenerationSpeculative(state="discarded", user_text=spec.user_text))

    async def discard(self) -> None:
        """Drop the speculative generation, giving its script turn back."""
        spec, self._speculative = self._speculative, None
        if spec is not None:
            await self._drop_generation(spec)

    async def abandon(self) -> None:
        """Stop the speculative generation as it is (service shutdown)."""
        spec, self._speculative = self._speculative, None
        if spec is not None:
            await spec.aclose()

    def _start(self, text: str) -> None:
        self._preempt_pending = False
        old, self._speculative = self._speculative, None
        if old is not None:
            self._rollback(old)
            self.events.emit(ev.GenerationSpeculative(state="discarded", user_text=old.user_text))
            task = asyncio.create_task(old.aclose())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        before = self.llm.save_state()
        request = self._request_for(text)
        self._speculative = Generation(
            self.llm, request, version=self._chat.version, user_text=text, llm_state_before=before
        )
        self.events.emit(ev.GenerationSpeculative(state="started", user_text=text))

    def _rollback(self, gen: Generation) -> None:
        # A discarded speculative reply gives its script turn back, unless another generation has used the
        # model since (then its state is no longer ours to rewind).
        if gen.llm_state_before is not None and self.llm.save_state() == gen.llm_state_after:
            self.llm.load_state(gen.llm_state_before)

    async def _drop_generation(self, gen: Generation) -> None:
        self._rollback(gen)
        await gen.aclose()
