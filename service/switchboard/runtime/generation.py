"""Generation: one LLM request run as a task, buffered so it can be consumed later (speculative replies)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from .aio import cancel_and_wait
from .llm.base import LLM, LLMChunk, LLMRequest
from .tools import DropReason

if TYPE_CHECKING:
    from .tool_call import RunningCall


class Generation:
    """Runs ``llm.stream(request)`` in the background and keeps every chunk.

    Iterating yields all chunks from the first, then live ones, and re-raises the provider's error at the end.
    A speculative generation remembers the context ``version`` and user text it was made for, and the calls it
    started early (``early``: by the index of the call among its tool calls; tools free of side effects); closing it
    drops those its reply did not confirm (``drop_call``), saying why.
    """

    def __init__(
        self,
        llm: LLM,
        request: LLMRequest,
        *,
        version: int = 0,
        user_text: str | None = None,
        llm_state_before: dict[str, Any] | None = None,
    ) -> None:
        self.request = request
        self.version = version
        self.user_text = user_text
        self.llm_state_before = llm_state_before
        self.chunks: list[LLMChunk] = []
        self.early: dict[int, RunningCall] = {}
        self.drop_call: Callable[[RunningCall, DropReason], None] | None = None
        self.barged_in = False  # an interruption changed the context since it started
        self.error: BaseException | None = None
        self._changed = asyncio.Event()
        self._finished = False
        stream = llm.stream(request)
        self.llm_state_after = llm.save_state()
        self._task = asyncio.create_task(self._pump(stream), name=f"generation:{request.speech_id}")

    async def _pump(self, stream: AsyncIterator[LLMChunk]) -> None:
        try:
            async for chunk in stream:
                self.chunks.append(chunk)
                self._changed.set()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # surfaced to the consumer
            self.error = err
        finally:
            self._finished = True
            self._changed.set()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def __aiter__(self) -> AsyncIterator[LLMChunk]:
        index = 0
        while True:
            while index < len(self.chunks):
                yield self.chunks[index]
                index += 1
            if self._finished:
                break
            self._changed.clear()
            await self._changed.wait()
        if self.error is not None:
            raise self.error

    def drop_calls(self, reason: DropReason) -> None:
        """Drop the calls started early that its reply has not confirmed (a confirmed one is no longer dropped)."""
        if self.drop_call is not None:
            for rc in self.early.values():
                self.drop_call(rc, reason)

    async def aclose(self, reason: DropReason = "session_stopped") -> None:
        self.drop_calls(reason)
        await cancel_and_wait(self._task)
