"""A session on in-memory ports with a scripted model and a fast simulated clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Any

from switchboard.runtime.agent import Agent
from switchboard.runtime.chat import AgentHandoff, ChatItem, ChatMessage, FunctionCall, FunctionCallOutput, validate
from switchboard.runtime.events import Event
from switchboard.runtime.llm.base import LLM
from switchboard.runtime.llm.scripted import ScriptedLLM, Turn
from switchboard.runtime.memory import MemoryEventLog, MemoryStore
from switchboard.runtime.options import SessionOptions
from switchboard.runtime.playout import Playout, SimulatedPlayout
from switchboard.runtime.session import AgentSession
from switchboard.runtime.tools import TERMINAL_STATUSES
from tests.waiting import WAIT_S

WPS = 100.0  # 10 ms per word


class Harness:
    def __init__(
        self,
        agent: Agent,
        turns: list[dict[str, Any]] | None = None,
        *,
        fallback: dict[str, Any] | None = None,
        playout: Playout | None = None,
        session_id: str = "s1",
        llm: LLM | None = None,
        **options: Any,
    ) -> None:
        self.agent = agent
        self.llm = ScriptedLLM([Turn(**t) for t in turns or []], Turn(**fallback) if fallback else None)
        self.store = MemoryStore()
        self.events = MemoryEventLog()
        self.playout = playout or SimulatedPlayout(WPS)
        options.setdefault("interrupt_force_timeout_s", 2.0)
        options.setdefault("tool_cancel_grace_s", 0.2)
        options.setdefault("trust_model_call_ids", True)  # the scripts here name their calls ("c1")
        self.session = AgentSession(
            session_id=session_id,
            agent=agent,
            llm=llm or self.llm,  # another provider (a real model on a fake server) instead of the script
            playout=self.playout,
            store=self.store,
            events=self.events,
            options=SessionOptions(**options),
        )

    async def __aenter__(self) -> Harness:
        await self.session.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.aclose()

    @property
    def sid(self) -> str:
        return self.session.id

    # -- reading state --------------------------------------------------------------------------------------

    def chat(self) -> list[ChatItem]:
        """The committed chat, read back from the store (what survives)."""
        return self.store.chat(self.sid)

    def summary(self, skip: Collection[str] = ()) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        for it in self.chat():
            if it.id in skip:
                continue
            if isinstance(it, ChatMessage):
                out.append((it.role, it.text, *(("interrupted",) if it.interrupted else ())))
            elif isinstance(it, FunctionCall):
                out.append(("call", it.name))
            elif isinstance(it, FunctionCallOutput):
                out.append(("output", it.name, it.output))
            elif isinstance(it, AgentHandoff):
                out.append(("handoff", it.from_agent, it.to_agent))
        return out

    def types(self) -> list[str]:
        return self.events.types(self.sid)

    def of_type(self, type: str) -> list[Event]:
        return self.events.of_type(self.sid, type)

    async def wait_for(
        self, type: str, pred: Callable[[Event], bool] = lambda e: True, timeout: float = WAIT_S
    ) -> Event:
        """Wait for an event (already emitted or future) of ``type`` matching ``pred``."""
        async with asyncio.timeout(timeout):
            while True:
                for e in self.events.events[self.sid]:
                    if e.type == type and pred(e):
                        return e
                await asyncio.sleep(0.002)

    async def idle(self, timeout: float = WAIT_S) -> None:
        """Wait until no speech is playing or queued."""
        async with asyncio.timeout(timeout):
            while not self.session.idle:
                await asyncio.sleep(0.005)

    async def tools_done(self, timeout: float = WAIT_S) -> None:
        async with asyncio.timeout(timeout):
            while self.session.executor.running():
                await asyncio.sleep(0.005)

    def check_invariants(self) -> None:
        """I2 (valid context), I5 (one terminal status and one output per call), I6 (gap-free seq)."""
        items = self.chat()
        assert validate(items) == [], validate(items)
        outputs: dict[str, int] = {}
        for it in items:
            if isinstance(it, FunctionCallOutput):
                outputs[it.call_id] = outputs.get(it.call_id, 0) + 1
        calls = {it.call_id for it in items if isinstance(it, FunctionCall)}
        for info in self.store.tool_calls[self.sid].values():
            if info.speculative:  # dropped with its speculative reply: nothing of it in the chat
                assert info.call_id not in calls and info.call_id not in outputs, f"{info.call_id} is in the chat"
                continue
            if info.status in TERMINAL_STATUSES:
                assert outputs.get(info.call_id) == 1, f"{info.call_id} has {outputs.get(info.call_id)} outputs"
                if info.background:
                    assert outputs.get(f"{info.call_id}/final") == 1
        ended = [e.data["call_id"] for e in self.of_type("tool.ended")]
        assert len(ended) == len(set(ended)), "a tool call ended twice"
        seqs = [e.seq for e in self.events.events[self.sid]]
        assert seqs == list(range(1, len(seqs) + 1)), "event seq has gaps"
