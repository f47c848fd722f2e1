"""The handoff step: a tool asked to hand the session to another agent; the session does it, or says why not.

A handoff is applied once the speech holding the call has played the step that made the call (the user heard the
preamble), and refused when that speech is interrupted first: the tool's result is kept (its work was done) with
a note that the handoff was not. A call no speech holds any more (in the background, or re-run after a restart)
hands off as soon as it returns.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from .agent import Agent
from .aio import first_of, resolve, spawn
from .chat import AgentHandoff, new_id
from .executor import Handoff, RunningCall, ToolExecutor
from .ports import SessionState
from .speech import SpeechInterrupted

logger = logging.getLogger("switchboard.runtime.handoff")

NOT_DONE_INTERRUPTED = "the agent was interrupted before the handoff"
NOT_DONE_BUSY = "another handoff was in progress"


class HandoffHost(Protocol):
    """What the handoff step needs from its session (``AgentSession`` implements it)."""

    id: str
    agent: Agent
    executor: ToolExecutor
    # the current agent's ``on_enter`` has run (or is running): false while it is owed, persisted with the session
    entered: bool

    @property
    def runs_hooks(self) -> bool:
        """The agents' hooks run now (the session is active, not being handed over or closed)."""
        ...

    def snapshot(self) -> SessionState: ...

    def agent_changed(self, old: Agent, new: Agent) -> None:
        """The handoff is committed: run the old agent's ``on_exit`` and the new one's ``on_enter``."""
        ...


class HandoffStep:
    """Performs the handoffs the executor reports, one at a time, each in a task of its own (in ``tasks``)."""

    def __init__(self, host: HandoffHost) -> None:
        self._host = host
        self._call: RunningCall | None = None  # the call whose handoff is being performed
        self.tasks: set[asyncio.Task[Any]] = set()
        # resolved when the session moves to another process: the handoff under way is done at once
        self._moving: asyncio.Future[None] | None = None

    def _moving_fut(self) -> asyncio.Future[None]:
        if self._moving is None:
            self._moving = asyncio.get_running_loop().create_future()
        return self._moving

    async def hand_over(self) -> None:
        """The session moves to another process (a drain, a graceful restart): a handoff under way is done now, its
        call's result and the switch of agent committed together, instead of waiting for the old agent's other
        calls (the next owner settles those, as after a crash). The new agent's ``on_enter`` stays owed
        (``entered`` false in the store): the next owner runs it."""
        resolve(self._moving_fut(), None)
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def request(self, rc: RunningCall) -> None:
        # in a task of its own: the executor only reports the request and never waits on the session
        spawn(self._hand_off(rc), name=f"handoff:{self._host.id}:{rc.call_id}", tasks=self.tasks)

    async def _hand_off(self, rc: RunningCall) -> None:
        """Wait for the speech holding ``rc``, drain the agent-scoped calls, switch the agent, and end ``rc`` with
        the handoff committed together with its pair (I1, I5: one commit, once)."""
        host = self._host
        new_agent = rc.handoff_to
        if new_agent is None:
            return
        if self._call is not None:
            # one handoff at a time: the one in progress drains (awaits) this call, so this one must not wait for it
            await host.executor.end_without_handoff(rc, NOT_DONE_BUSY)
            return
        self._call = rc
        old = host.agent
        try:
            if not await _speech_played(rc):
                await host.executor.end_without_handoff(rc, NOT_DONE_INTERRUPTED)
                return
            # the agent's other calls end first (cancelled, or awaited), unless the session moves meanwhile
            await first_of(host.executor.drain(scope="agent", exclude={rc.call_id}), self._moving_fut())
            if new_agent.mcp_servers:  # its MCP tools, listed before the model sees them (bounded by their timeouts)
                await first_of(new_agent.load_tools(), self._moving_fut())
            if _held_by_interrupted_speech(rc):  # interrupted while the other calls were drained
                await host.executor.end_without_handoff(rc, NOT_DONE_INTERRUPTED)
                return
            host.agent, entered = new_agent, host.entered
            host.entered = host.runs_hooks  # else its on_enter is owed, and runs where the session runs next
            item = AgentHandoff(id=new_id("item"), from_agent=old.name, to_agent=new_agent.name)
            if not await host.executor.end_with_handoff(rc, Handoff(item, host.snapshot())):
                host.agent, host.entered = old, entered  # a teardown ended the call meanwhile: no handoff
                return
        finally:
            self._call = None
        logger.info("session %s: handoff %s -> %s", host.id, old.name, new_agent.name, extra={"session_id": host.id})
        host.agent_changed(old, new_agent)


def _held_by_interrupted_speech(rc: RunningCall) -> bool:
    return rc.speech is not None and not rc.info.background and rc.speech.interrupted and not rc.speech.moved


async def _speech_played(rc: RunningCall) -> bool:
    """Wait until the step of the speech that made the call has played; False when the speech was interrupted."""
    if rc.speech is None or rc.info.background:
        return True
    try:
        await rc.speech.wait_for_step(rc.step)
    except SpeechInterrupted:
        return rc.speech.moved  # a move is not an interruption: the tool asked for the handoff, it is done
    return True


__all__ = ["HandoffHost", "HandoffStep"]
