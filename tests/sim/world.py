"""One simulated session under a schedule of commands and faults, with the oracles for I1-I7 and liveness.

A schedule is a list of ``Op`` tuples (printable, so a failing one pastes into a regression test). ``World.apply``
runs one op on the virtual-time loop; ``check_step`` runs after every op; ``finish`` clears the faults, lets the
session settle, checks the end-state oracles and closes everything.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.chat import FunctionCall, FunctionCallOutput, validate
from switchboard.runtime.llm.base import LLMChunk, LLMRequest
from switchboard.runtime.llm.scripted import ScriptedLLM, Turn
from switchboard.runtime.options import SessionOptions
from switchboard.runtime.playout import SimulatedPlayout
from switchboard.runtime.ports import Reported
from switchboard.runtime.recovery import recover
from switchboard.runtime.session import AgentSession
from switchboard.runtime.speech import NotInterruptible, SpeechHandle
from switchboard.runtime.status import SessionClosed

from .faults import Durable, FaultyStore, PermanentStoreError
from .vloop import VirtualTimeLoop
from .workload import AGENTS, EARLY_TOOLS, EFFECTS

Op = tuple[Any, ...]
SID = "sim"
WORDS_PER_SECOND = 20.0
SETTLE_S = 120.0
# work still under way after SETTLE_S gets more time, up to this: a tool that ignores cancellation works for a minute,
# and one may run in every step of every scripted turn (a dozen), one after the other
SETTLE_MAX_S = 1800.0
TEXTS = {
    "hello": "hello there",
    "long": " ".join(f"w{i}" for i in range(30)),
    "nul": "my ref is \x00 42",
    "control": "beep\x07 \x1b[2J cleared",
}
# what a command may answer with (the API maps each to a problem); the oracles then check nothing was left broken
EXPECTED_COMMAND_ERRORS = (SessionClosed, NotInterruptible, LookupError, PermanentStoreError)


def held_by_the_open_turn(session: AgentSession | None) -> set[str]:
    """Calls a speculative reply started early that wait for its verdict: the user's turn is still open (an interim
    transcript and no final one yet), so they end when it is confirmed or dropped, or when the session closes."""
    if session is None or session.speculation.generation is None:
        return set()
    return {rc.call_id for rc in session.speculation.generation.early.values() if not rc.ended}


class Violation(AssertionError):
    """An invariant broke; ``kind`` groups violations by class for the figures."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"[{kind}] {detail}")
        self.kind = kind


def expect(cond: bool, kind: str, detail: str) -> None:
    if not cond:
        raise Violation(kind, detail)


class CheckedLLM(ScriptedLLM):
    """The scripted model; every request it receives must be a context a provider accepts (I2)."""

    def stream(self, request: LLMRequest) -> Any:
        problems = validate(request.items)
        expect(not problems, "I2-broken-context", f"model received a broken context: {problems}")
        return super().stream(request)


@dataclass
class Generation:
    """One process lifetime: its store view, its session, the tasks it started."""

    number: int
    store: FaultyStore
    session: AgentSession | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class World:
    def __init__(self, loop: VirtualTimeLoop, turns: list[dict[str, Any]], *, options: dict[str, Any] | None = None):
        self.loop = loop
        self.turns = [Turn(**t) for t in turns]
        self.options = SessionOptions(
            interrupt_force_timeout_s=5.0, tool_cancel_grace_s=0.5, close_timeout_s=10.0, **(options or {})
        )
        self.registry = AgentRegistry(AGENTS)
        self.durable: dict[str, Durable] = {}
        self.generations: list[Generation] = []
        self.closed = False
        self.accepted_speeches: set[str] = set()
        # (generation, user item id, reply speech id) of the latest input that asked for a reply
        self.last_reply_input: tuple[int, str, str] | None = None
        # an interrupt (or an interrupting input) was applied after the latest input that asked for a reply
        self.interrupted_since_input = False
        self.forced_before = SpeechHandle.forced_cancels
        self.log: list[str] = []
        EFFECTS.runs.clear()
        EFFECTS.completions.clear()
        EFFECTS.playout_waits.clear()

    # -- process lifetimes ----------------------------------------------------------------------------------

    @property
    def gen(self) -> Generation:
        return self.generations[-1]

    @property
    def session(self) -> AgentSession | None:
        return self.gen.session if self.generations else None

    def _llm(self, state: dict[str, Any] | None) -> CheckedLLM:
        llm = CheckedLLM(self.turns, Turn(text="OK."))
        llm.load_state(state)
        return llm

    async def start(self) -> None:
        store = FaultyStore(self.durable, generation=1)
        gen = Generation(1, store)
        self.generations.append(gen)
        gen.session = AgentSession(
            session_id=SID,
            agent=self.registry.create("desk"),
            llm=self._llm(None),
            playout=SimulatedPlayout(WORDS_PER_SECOND),
            store=store,
            events=store,
            options=self.options,
        )
        await gen.session.start()

    async def restart(self) -> None:
        """Start a new process on what is durable: the real recovery path."""
        d = self.durable.get(SID)
        number = len(self.generations) + 1
        store = FaultyStore(self.durable, generation=number)
        gen = Generation(number, store)
        self.generations.append(gen)
        if d is None or d.session is None or d.session.state in ("closed", "failed"):
            self.closed = d is not None and d.session is not None
            return
        session = AgentSession(
            session_id=SID,
            agent=self.registry.create(d.session.agent),
            llm=self._llm(d.session.llm_state),
            playout=SimulatedPlayout(WORDS_PER_SECOND),
            store=store,
            events=store,
            options=self.options,
            items=d.chat(),
            last_seq=d.last_seq,
        )
        gen.session = session
        await recover(
            session,
            tool_calls=list(d.tool_calls.values()),
            speeches=list(d.speeches.values()),
            reported=Reported.of(d.events),
        )

    def crash(self) -> None:
        """The process dies: nothing more becomes durable, and its tasks are stopped where they stand (what they
        would still do can only hang on the dead store)."""
        self.gen.store.crashed = True
        for task in asyncio.all_tasks(self.loop):
            if task is not asyncio.current_task() and not task.done():
                self.gen.tasks.add(task)
                task.cancel()

    # -- commands -------------------------------------------------------------------------------------------

    async def apply(self, op: Op) -> None:
        self.log.append(repr(op))
        kind = op[0]
        if kind == "advance":
            await asyncio.sleep(op[1] / 1000)
            return
        if kind == "outage":
            self.gen.store.outage_until = self.loop.time() + op[1] / 1000
            return
        if kind == "poison":
            self.gen.store.poison_next = op[1]
            return
        if kind == "slow":
            self.gen.store.commit_delay_s = op[1] / 1000
            self.gen.store.event_delay_s = op[1] / 2000
            return
        if kind == "crash":
            self.crash()
            await self.restart()
            return
        if kind == "suspend":
            await self._suspend_and_exit(flush=True)
            return
        if kind == "exit":  # a shutdown cut short: the process exits as soon as its sessions are suspended
            if op[1]:  # ... while the database is down: the suspend's bounded waits give up, the process exits anyway
                self.gen.store.outage_until = self.loop.time() + op[1] / 1000
            await self._suspend_and_exit(flush=False)
            # a speech that cannot be ended against a dead store is cut by the safety net: the process is leaving
            self.forced_before = SpeechHandle.forced_cancels
            return
        if kind == "recover-exit":  # a restart, then a shutdown before the recovered session got anywhere
            self.crash()
            await self.restart()
            await self._suspend_and_exit(flush=False)
            return
        if kind == "abort":  # a caller cancelled mid-command (a deadline, a disconnect)
            inner, after_ms = op[1], op[2]
            task = asyncio.ensure_future(self._command(inner))
            await asyncio.sleep(after_ms / 1000)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, *EXPECTED_COMMAND_ERRORS):
                await task
            return
        await self._command(op)

    async def _suspend_and_exit(self, *, flush: bool) -> None:
        """A graceful shutdown: suspend the session, then (``flush``) wait for the store's last writes, then the
        process exits: whatever of it still runs writes nothing more. Without ``flush`` only what the suspend itself
        waited for is durable (its wait is bounded: an outage outlasts it)."""
        if self.session is not None:
            with contextlib.suppress(PermanentStoreError):
                await self._bounded(self.session.suspend(), "suspend")
        if flush:
            await self._bounded(self.gen.store.flush(), "store flush at shutdown")
        self.crash()
        await self.restart()

    async def _command(self, op: Op) -> None:
        session = self.session
        if session is None:
            return
        kind = op[0]
        try:
            if kind == "turn":  # a user's turn: heard as an interim transcript first (a speculative reply may start)
                _, text, pause_ms = op
                await session.input(TEXTS[text], final=False)
                await asyncio.sleep(pause_ms / 1000)
                await self._command(("input", text, True, True, False, True))
            elif kind == "input":
                _, text, final, interrupt, force, reply = op
                if final and interrupt:  # set first: the caller may be cut off once the input is applied
                    self.interrupted_since_input = True
                result = await session.input(TEXTS[text], final=final, interrupt=interrupt, force=force, reply=reply)
                if result.speech_id is not None:
                    self.accepted_speeches.add(result.speech_id)
                    self.last_reply_input = (self.gen.number, result.item_id or "", result.speech_id)
                    self.interrupted_since_input = False
            elif kind == "say":
                _, text, allow, add = op
                speech = await session.say(TEXTS[text], allow_interruptions=allow, add_to_chat=add)
                self.accepted_speeches.add(speech.id)
            elif kind == "interrupt":
                self.interrupted_since_input = True  # set first: the caller may be cut off once it is applied
                await session.interrupt(force=op[1])
            elif kind == "cancel":
                running = [info for info in session.tool_calls() if not info.ended]
                if running:
                    await session.cancel_tool(running[op[1] % len(running)].call_id)
            elif kind == "close":
                await self._bounded(session.aclose(), "close")
                self.closed = True
            else:
                raise ValueError(f"unknown op {op!r}")
        except EXPECTED_COMMAND_ERRORS:
            pass
        except Exception as err:  # a command may fail with a clear error, never leave things broken (checked after)
            if type(err).__name__ not in ("NotCancellable", "AlreadyEnded", "ToolCallNotFound"):
                raise

    async def _bounded(self, aw: Any, what: str) -> None:
        started = self.loop.time()
        try:
            async with asyncio.timeout(self.options.close_timeout_s + 10.0):
                await aw
        except TimeoutError:
            raise Violation("liveness-close-hangs", f"{what} did not return within its bound") from None
        expect(
            self.loop.time() - started <= self.options.close_timeout_s + 10.0,
            "liveness-close-hangs",
            f"{what} took {self.loop.time() - started:.1f}s",
        )

    # -- oracles --------------------------------------------------------------------------------------------

    def check_step(self) -> None:
        expect(SpeechHandle.forced_cancels == self.forced_before, "I3-safety-net-fired", "the forced cancel fired")
        d = self.durable.get(SID)
        if d is None:
            return
        seqs = [e.seq for e in d.events]
        expect(seqs == list(range(1, len(seqs) + 1)), "I6-gap", f"durable seqs {seqs[-8:]} are not gap-free")
        outputs = Counter(it.call_id for it in d.items.values() if isinstance(it, FunctionCallOutput))
        for call_id, n in outputs.items():
            expect(n == 1, "I5-two-outputs", f"call {call_id} has {n} outputs in the store")
        calls = {it.call_id for it in d.items.values() if isinstance(it, FunctionCall)}
        for info in d.tool_calls.values():
            if info.speculative:  # of a speculative reply never confirmed: nothing of it may reach the chat
                expect(
                    info.call_id not in calls and info.call_id not in outputs,
                    "spec-dropped-in-chat",
                    f"{info.call_id} of a speculative reply never confirmed is in the stored chat",
                )
            elif info.ended:
                expect(outputs.get(info.call_id) == 1, "I5-ended-without-output", f"{info.call_id} ended, no output")
        ends = Counter(e.data["call_id"] for e in d.events if e.type == "tool.ended")
        for call_id, n in ends.items():
            expect(n == 1, "I5-two-ends", f"call {call_id} has {n} tool.ended events")
        session = self.session
        if session is not None:
            live = Counter(it.call_id for it in session.chat.items if isinstance(it, FunctionCallOutput))
            for call_id, n in live.items():
                expect(n == 1, "I5-two-outputs", f"call {call_id} has {n} outputs in memory")
            speculative = {info.call_id for info in session.tool_calls() if info.speculative}
            in_chat = {it.call_id for it in session.chat.items if isinstance(it, FunctionCall | FunctionCallOutput)}
            expect(
                not speculative & in_chat,
                "spec-dropped-in-chat",
                f"calls of a speculative reply never confirmed in the live chat: {sorted(speculative & in_chat)}",
            )

    async def settle(self) -> None:
        """Clear the faults and let everything that can finish, finish."""
        store = self.gen.store
        store.outage_until = -1.0
        store.poison_next = 0
        store.commit_delay_s = store.event_delay_s = 0.0
        await asyncio.sleep(SETTLE_S)
        waited = SETTLE_S
        while self._busy() and waited < SETTLE_MAX_S:
            await asyncio.sleep(SETTLE_S / 4)
            waited += SETTLE_S / 4

    def _busy(self) -> bool:
        """The live session still has work under way that will end on its own (a speech, a tool, a write)."""
        session = self.session
        if session is None or session.state != "active":
            return False
        held = self._held_by_the_open_turn()
        running = any(not i.ended and i.call_id not in held for i in session.tool_calls())
        return not session.idle or session.pending_writes > 0 or running

    def _held_by_the_open_turn(self) -> set[str]:
        return held_by_the_open_turn(self.session)

    def check_end(self) -> None:
        d = self.durable.get(SID)
        if d is None:
            return
        session = self.session
        durable_types = [e.type for e in d.events]
        chat_events = {e.data["item"]["id"] for e in d.events if e.type == "chat.item"}
        for item_id in d.items:
            expect(item_id in chat_events, "I6-durable-without-event", f"chat item {item_id} has no chat.item event")
        ended_events = {e.data["call_id"] for e in d.events if e.type == "tool.ended"}
        self._check_speculative_calls(d)
        for info in d.tool_calls.values():
            if info.ended:
                expect(info.call_id in ended_events, "I6-durable-without-event", f"{info.call_id} has no tool.ended")
            else:
                expect(
                    session is not None and session.state == "active",
                    "I5-left-running",
                    f"{info.call_id} is still running in the store of a session that is {self._state()}",
                )
        done = {e.data["speech_id"] for e in d.events if e.type == "speech.done"}
        for speech_id in self.accepted_speeches:
            stored = d.speeches.get(speech_id)
            if stored is not None and speech_id not in done:
                # ended in the store but never reported is the event log's gap, not a speech left unfinished
                kind = "I6-durable-without-event" if stored.state == "done" else "liveness-speech-never-done"
                expect(False, kind, f"speech {speech_id} is {stored.state} in the store and has no speech.done")
        if session is not None and session.state == "active":
            # after the settle every tool of the workload has finished (or was abandoned): nothing may be running
            held = self._held_by_the_open_turn()
            for info in session.tool_calls():
                expect(
                    info.ended or info.call_id in held,
                    "I5-left-running",
                    f"{info.call_id} is still running after the session settled",
                )
            live_ids = {it.id for it in session.chat.items}
            expect(live_ids == set(d.items), "I8-live-vs-durable", self._diff(live_ids, set(d.items)))
            for info in session.tool_calls():
                stored = d.tool_calls.get(info.call_id)
                expect(
                    stored is not None and stored.status == info.status,
                    "I8-live-vs-durable",
                    f"call {info.call_id}: live {info.status}, stored {stored.status if stored else None}",
                )
            if self.last_reply_input is not None:
                _, item_id, speech_id = self.last_reply_input
                expect(
                    self._answered(d, item_id, speech_id),
                    "liveness-input-unanswered",
                    f"input {item_id} was accepted and never answered",
                )
        del durable_types

    def check_calls_ended(self) -> None:
        """Once the session is closed (or gone): no call of any speculation is left without its end."""
        d = self.durable.get(SID)
        if d is not None:
            self._check_speculative_calls(d)

    def _check_speculative_calls(self, d: Durable) -> None:
        """Every started call ended (no orphan ``tool.started``), but those the open turn holds; one a speculative
        reply started early either was confirmed (its output is in the chat: never lost) or was dropped (a
        ``reason``, and nothing in the chat)."""
        held = self._held_by_the_open_turn()
        outputs = {it.call_id for it in d.items.values() if isinstance(it, FunctionCallOutput)}
        ends = {e.data["call_id"]: e.data for e in d.events if e.type == "tool.ended"}
        for e in d.events:
            if e.type != "tool.started":
                continue
            call_id = e.data["call_id"]
            expect(
                not e.data.get("speculative") or e.data["name"] in EARLY_TOOLS,
                "spec-unsafe-early",
                f"{call_id} ({e.data['name']}) has side effects and started before its turn was confirmed",
            )
            end = ends.get(call_id)
            if end is None and call_id in held:
                continue
            expect(end is not None, "orphan-call", f"{call_id} started and never ended")
            assert end is not None
            stored = d.tool_calls.get(call_id)
            if "reason" in end:
                expect(
                    e.data.get("speculative", False) and stored is not None and stored.speculative,
                    "spec-dropped-in-chat",
                    f"{call_id} was dropped ({end['reason']}) but was not a call of a speculative reply",
                )
            elif e.data.get("speculative"):
                expect(
                    call_id in outputs and stored is not None and not stored.speculative,
                    "spec-confirmed-output-lost",
                    f"{call_id}, started early and confirmed, has no output in the chat",
                )

    def _ended_by_a_later_interrupt(self, e: Any, speech_id: str) -> bool:
        """An interrupt ends the queued speeches after the current one too (LiveKit's semantics): a reply still queued
        when a later interrupt came is ended, not owed."""
        own_end = e.type == "speech.done" and e.data["speech_id"] == speech_id and e.data["interrupted"]
        return bool(own_end and self.interrupted_since_input)

    def _answered(self, d: Durable, item_id: str, speech_id: str) -> bool:
        """The input got a reply: a generation started after it."""
        after = False
        reported = any(e.type == "user.input" and e.data.get("item_id") == item_id for e in d.events)
        for e in d.events:
            if e.type == "user.input" and e.data.get("item_id") == item_id:
                after = True
            elif e.type == "generation.started" and (after or (not reported and e.data["speech_id"] == speech_id)):
                # an input whose user.input event was lost (an event-log gap, reported as such) is answered when its
                # own reply generates
                return True
            elif self._ended_by_a_later_interrupt(e, speech_id):
                return True
        for gen in self.generations:
            # a crash may lose the generation.started that a process published (it never became durable): the reply
            # had started, and recovery ends a reply that had started as interrupted, by design
            if any(e.type == "generation.started" and e.data["speech_id"] == speech_id for e in gen.store.published):
                return True
        return False

    def _state(self) -> str:
        session = self.session
        return session.state if session is not None else "gone"

    @staticmethod
    def _diff(live: set[str], durable: set[str]) -> str:
        return f"only live: {sorted(live - durable)[:4]}, only durable: {sorted(durable - live)[:4]}"

    async def probe_answers(self) -> None:
        """A live session must still answer: a new input gets a reply (the scheduler is alive)."""
        session = self.session
        if session is None or session.state != "active":
            return
        before = len(self.durable[SID].events)
        with contextlib.suppress(*EXPECTED_COMMAND_ERRORS):
            await session.input("are you there?", interrupt=True, force=True)
        await asyncio.sleep(30.0)
        started = any(e.type == "generation.started" for e in self.durable[SID].events[before:])
        expect(started, "liveness-session-deaf", "a new input got no reply")

    async def shutdown(self) -> None:
        """Close the live session (bounded) and drop the dead processes' tasks."""
        session = self.session
        if session is not None and session.state == "active":
            await self._bounded(session.aclose(), "close")
        dead = [t for g in self.generations[:-1] for t in g.tasks if not t.done()]
        dead += [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task() and not t.done()]
        for task in dead:
            task.cancel()
        # a tool that swallows cancellation may need a few rounds; the dead never resume on their own
        for _ in range(5):
            pending = [t for t in dead if not t.done()]
            if not pending:
                break
            await asyncio.wait(pending, timeout=1.0)  # bound: then the tasks still running are cancelled again
            for t in pending:
                t.cancel()


_ = LLMChunk  # re-exported type used by typing in tests
