"""A webhook call whose session stops where it runs while the backend works (a move to another node: a drain, a lost
lease, a crash; or a restart of a single node) goes on where the session runs next: recovery resumes it
(``on_restart="resume"``, the default of webhook tools), it is not delivered again, and the backend's result, reported
afterwards, is committed ``completed`` and replied to (I1: the work the backend did is never lost). Each test plays
each process with its own webhook machinery (the broker of waiting calls is a process's), on one in-memory store."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import httpx
import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.control.webhook_reports import apply_result
from switchboard.integrations.webhooks import (
    BackendResult,
    CallAlreadyEnded,
    WebhookEndpoint,
    Webhooks,
    WebhookTool,
)
from switchboard.runtime.chat import FunctionCall, FunctionCallOutput, utcnow
from switchboard.runtime.memory import MemoryEventLog, MemoryStore
from switchboard.runtime.options import SessionOptions
from switchboard.runtime.playout import SimulatedPlayout
from switchboard.runtime.ports import Reported
from switchboard.runtime.recovery import RESTART_OUTPUT, recover
from switchboard.runtime.session import AgentSession
from switchboard.runtime.tools import ToolPolicy, ToolStatus
from tests.waiting import WAIT_S

from .harness import WPS, Harness

SECRET = "resume-secret-0123456789abcdef"
PARAMS = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}
CALL = {"id": "c1", "name": "lookup", "arguments": {"order_id": "A-1"}}


class Backend:
    """The backend: it accepts every call (202) and records deliveries and cancel notices, whichever process sent
    them."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.call_headers: list[httpx.Headers] = []  # the headers of each delivery in ``calls``
        self.cancels: list[dict[str, Any]] = []

    def _handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/cancel"):
            self.cancels.append(body)
            return httpx.Response(200)
        self.calls.append(body)
        self.call_headers.append(request.headers)
        return httpx.Response(202)

    def webhooks(self) -> Webhooks:
        """One process's webhook machinery (its own broker), delivering here."""
        return Webhooks(transport=httpx.MockTransport(self._handle), report_secret=SECRET)

    async def delivered(self, n: int) -> None:
        """Until ``n`` deliveries came (a call waits for its report as its delivery is still on its way)."""
        async with asyncio.timeout(WAIT_S):
            while len(self.calls) < n:
                await asyncio.sleep(0.005)

    async def cancelled(self) -> dict[str, Any]:
        async with asyncio.timeout(WAIT_S):
            while not self.cancels:
                await asyncio.sleep(0.005)
        return self.cancels[-1]


def agent_with(webhooks: Webhooks, *, timeout_s: float = 30.0, policy: ToolPolicy | None = None) -> Agent:
    url = "http://backend.invalid/tools/lookup"
    endpoint = WebhookEndpoint(url, url + "/cancel", timeout_s, SECRET)
    extra = {"policy": policy} if policy is not None else {}
    tool = WebhookTool(
        name="lookup", description="Look up an order.", parameters=PARAMS, endpoint=endpoint, webhooks=webhooks, **extra
    )
    return Agent(instructions="Use the tool.", tools=[tool])


class Billing(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You bill.", name="billing")


class Front(Agent):
    """Hands the caller to billing while its lookup runs on a backend."""

    def __init__(self, webhooks: Webhooks) -> None:
        super().__init__(instructions="You route.", tools=agent_with(webhooks).tools.values(), name="front")

    @function_tool
    async def transfer(self, ctx: RunContext) -> tuple[Agent, str]:
        """Hand the caller to billing."""
        return Billing(), "transferred"


class Process:
    """One process running the session: its webhook machinery and its incarnation of the session."""

    def __init__(self, backend: Backend, h: Harness, webhooks: Webhooks) -> None:
        self.backend = backend
        self.h = h
        self.webhooks = webhooks

    @classmethod
    async def first(cls, backend: Backend, turns: list[dict[str, Any]], front: bool = False, **tool: Any) -> Process:
        webhooks = backend.webhooks()
        agent = Front(webhooks) if front else agent_with(webhooks, **tool)
        h = Harness(agent, turns, shutdown_tool_grace_s=0.05)
        await h.session.start()
        return cls(backend, h, webhooks)

    async def next_owner(self, turns: list[dict[str, Any]], **tool: Any) -> Process:
        """Another process (or this one restarted): the session rebuilt from the store alone and recovered."""
        webhooks = self.backend.webhooks()
        agents = {"front": lambda: Front(webhooks), "billing": Billing}
        state = self.h.store.sessions.get(self.h.sid)
        agent = agents[state.agent]() if state is not None and state.agent in agents else agent_with(webhooks, **tool)
        h = Harness(agent, turns)
        store: MemoryStore = self.h.store
        events: MemoryEventLog = self.h.events
        h.store, h.events = store, events
        sid = self.h.sid
        h.session = AgentSession(
            session_id=sid,
            agent=agent,
            llm=h.llm,
            playout=SimulatedPlayout(WPS),
            store=store,
            events=events,
            options=SessionOptions(trust_model_call_ids=True, tool_cancel_grace_s=0.2),
            items=store.chat(sid),
            last_seq=events.events[sid][-1].seq,
        )
        await recover(
            h.session,
            tool_calls=list(store.tool_calls[sid].values()),
            speeches=list(store.speeches[sid].values()),
            reported=Reported.of(events.events[sid]),
            tools_of=lambda name: agents[name]().tools if name in agents else {},
        )
        return Process(self.backend, h, webhooks)

    async def moved(self, how: str) -> None:
        """The session stops here: handed over by a drain, or dropped as a fenced node drops it (nothing more is
        written here, as after a crash)."""
        await self.h.session.suspend(tool_grace=how == "drain")
        await self.webhooks.aclose()

    async def waiting(self, call_id: str = "c1") -> None:
        """Until the call waits here for its backend's report and the backend holds its delivery. A call waits for
        its report from before its delivery is sent, so a test that moved the session as soon as the call waited
        could stop the delivery on its way; a resumed call is not delivered again: its first delivery counts."""
        async with asyncio.timeout(WAIT_S):
            while self.webhooks.broker.waiting(self.h.sid, call_id) is None or not any(
                c["call_id"] == call_id for c in self.backend.calls
            ):
                await asyncio.sleep(0.002)

    async def result(self, output: str, call_id: str = "c1") -> None:
        await apply_result(self.webhooks.broker, self.h.sid, call_id, BackendResult(output=output))

    async def aclose(self) -> None:
        await self.h.session.aclose()
        await self.webhooks.aclose()

    def call(self, call_id: str = "c1") -> Any:
        return self.h.store.tool_calls[self.h.sid][call_id]


def outputs(h: Harness, call_id: str) -> list[str]:
    return [it.output for it in h.chat() if isinstance(it, FunctionCallOutput) and it.call_id == call_id]


@pytest.mark.parametrize("how", ["drain", "crash"])
async def test_a_call_whose_session_moved_is_resumed_and_its_result_committed_and_replied_to(how: str) -> None:
    backend = Backend()
    first = await Process.first(backend, [{"text": "Checking.", "tool_calls": [CALL]}])
    await first.h.session.input("where is my order?")
    await first.waiting()
    assert len(backend.calls) == 1
    await first.moved(how)
    assert first.call().status == ToolStatus.RUNNING  # a move is not an end

    nxt = await first.next_owner([{"text": "Still checking."}, {"text": "Found: {{tool_output:lookup}}"}])
    try:
        recovered = nxt.h.of_type("session.recovered")[-1].data
        assert recovered["resumed_calls"] == ["c1"]
        assert recovered["interrupted_calls"] == [] and recovered["retried_calls"] == []
        await nxt.waiting()
        assert nxt.h.of_type("tool.started") == first.h.of_type("tool.started")  # it did not start again
        await nxt.result("shipped on Monday")
        done = nxt.call()
        assert done.status == ToolStatus.COMPLETED and done.output == "shipped on Monday"
        assert outputs(nxt.h, "c1") == ["shipped on Monday"]
        await nxt.h.wait_for("chat.item", lambda e: e.data["item"].get("text") == "Found: shipped on Monday")
        assert len(backend.calls) == 1 and backend.cancels == []  # not delivered again, never cancelled
    finally:
        await nxt.aclose()
    nxt.h.check_invariants()


async def test_a_call_in_the_background_stays_there_and_takes_progress_after_it_resumed() -> None:
    backend = Backend()
    turns = [{"text": "Checking.", "tool_calls": [CALL]}, {"text": "It runs in the background."}]
    first = await Process.first(backend, turns)
    await first.h.session.input("where is my order?")
    await first.waiting()
    await first.webhooks.broker.progress(first.h.sid, "c1", "asking the warehouse", 0.3)
    await first.h.idle()
    await first.moved("crash")

    nxt = await first.next_owner([{"text": "Found: {{tool_output:lookup}}"}])
    try:
        await nxt.waiting()
        await nxt.webhooks.broker.progress(nxt.h.sid, "c1", "packing", 0.8)
        progress = [e.data["message"] for e in nxt.h.of_type("tool.progress")]
        assert progress == ["asking the warehouse", "packing"]
        running = nxt.call()
        assert running.background and [p.message for p in running.progress] == ["asking the warehouse", "packing"]
        await nxt.result("shipped")
        calls = [it.call_id for it in nxt.h.chat() if isinstance(it, FunctionCall)]
        # one "running in the background" pair, one pair per later update, then the result's own pair
        assert calls == ["c1", "c1/update/2", "c1/final"]
        assert outputs(nxt.h, "c1/final") == ["shipped"]
        await nxt.h.wait_for("chat.item", lambda e: e.data["item"].get("text") == "Found: shipped")
        assert len(backend.calls) == 1
    finally:
        await nxt.aclose()
    nxt.h.check_invariants()


async def test_a_resumed_call_waits_for_its_result_only_until_its_own_deadline() -> None:
    """The deadline is the call's start plus the endpoint's timeout, not a new timeout from the resume."""
    backend = Backend()
    first = await Process.first(backend, [{"text": "Checking.", "tool_calls": [CALL]}], timeout_s=1.0)
    await first.h.session.input("where is my order?")
    await first.waiting()
    await first.moved("crash")
    store, sid = first.h.store, first.h.sid
    started = utcnow() - timedelta(seconds=0.7)  # 0.3 s of its 1 s are left
    store.tool_calls[sid]["c1"] = store.tool_calls[sid]["c1"].model_copy(update={"started_at": started})

    nxt = await first.next_owner([{"text": "Sorry."}], timeout_s=1.0)
    try:
        ended = await nxt.h.wait_for("tool.ended")
        assert ended.data["status"] == "failed"
        assert ended.data["output"] == "lookup failed: no result from its backend within 1 s."
        assert (await backend.cancelled())["reason"] == "timed out"  # the backend has the call: it hears of the end
        with pytest.raises(CallAlreadyEnded):
            await nxt.result("too late")
        assert nxt.call().status == ToolStatus.FAILED and len(backend.calls) == 1
    finally:
        await nxt.aclose()
    nxt.h.check_invariants()


async def test_a_call_resumed_past_its_deadline_ends_at_once_and_its_backend_is_told() -> None:
    backend = Backend()
    first = await Process.first(backend, [{"text": "Checking.", "tool_calls": [CALL]}], timeout_s=5.0)
    await first.h.session.input("where is my order?")
    await first.waiting()
    await first.moved("crash")
    store, sid = first.h.store, first.h.sid
    store.tool_calls[sid]["c1"] = store.tool_calls[sid]["c1"].model_copy(
        update={"started_at": utcnow() - timedelta(seconds=60)}
    )

    nxt = await first.next_owner([{"text": "Sorry."}], timeout_s=5.0)
    try:
        ended = await nxt.h.wait_for("tool.ended")
        assert (ended.data["status"], ended.data["output"]) == (
            "failed",
            "lookup failed: no result from its backend within 5 s.",
        )
        assert (await backend.cancelled())["call_id"] == "c1"
    finally:
        await nxt.aclose()
    nxt.h.check_invariants()


async def test_a_call_resumed_by_an_owner_that_dies_before_the_report_is_resumed_again_and_ends_once() -> None:
    backend = Backend()
    first = await Process.first(backend, [{"text": "Checking.", "tool_calls": [CALL]}])
    await first.h.session.input("where is my order?")
    await first.waiting()
    await first.moved("drain")
    second = await first.next_owner([{"text": "Still checking."}])
    await second.waiting()
    await second.moved("crash")  # it dies after resuming the call, before the backend reports

    third = await second.next_owner([{"text": "Found: {{tool_output:lookup}}"}])
    try:
        assert third.h.of_type("session.recovered")[-1].data["resumed_calls"] == ["c1"]
        await third.waiting()
        await third.result("shipped")
        with pytest.raises(CallAlreadyEnded):  # the backend reports twice: the second changes nothing
            await third.result("shipped twice")
        assert outputs(third.h, "c1") == ["shipped"] and third.call().output == "shipped"
        assert [e.data["status"] for e in third.h.of_type("tool.ended")] == ["completed"]
        assert len(backend.calls) == 1
    finally:
        await third.aclose()
    third.h.check_invariants()


async def test_a_call_of_the_agent_handed_off_from_as_the_session_moved_is_resumed_with_its_own_tool() -> None:
    """A handoff waits for the agent's other calls; a drain does it at once instead, leaving the lookup running. The
    next owner runs billing, which has no lookup: the call resumes with the tool of the agent that made it."""
    backend = Backend()
    turns = [{"text": "Checking.", "tool_calls": [CALL, {"id": "h1", "name": "transfer", "arguments": {}}]}]
    first = await Process.first(backend, turns, front=True)
    await first.h.session.input("where is my order, and then billing please")
    await first.waiting()
    await first.h.wait_for("tool.started", lambda e: e.data["name"] == "transfer")
    await first.moved("drain")
    state = first.h.store.sessions[first.h.sid]
    assert (state.agent, state.state) == ("billing", "active") and first.call().status == ToolStatus.RUNNING

    nxt = await first.next_owner([{"text": "Billing here."}, {"text": "Found: {{tool_output:lookup}}"}])
    try:
        assert nxt.h.session.agent.name == "billing"
        assert nxt.h.of_type("session.recovered")[-1].data["resumed_calls"] == ["c1"]
        await nxt.waiting()
        await nxt.result("shipped")
        assert (nxt.call().status, nxt.call().output) == (ToolStatus.COMPLETED, "shipped")
        assert len(backend.calls) == 1
    finally:
        await nxt.aclose()
    nxt.h.check_invariants()


async def test_an_explicit_policy_is_kept_fail_ends_the_call_and_retry_delivers_it_again() -> None:
    backend = Backend()
    fail = ToolPolicy(on_restart="fail")
    first = await Process.first(backend, [{"text": "Checking.", "tool_calls": [CALL]}], policy=fail)
    await first.h.session.input("where is my order?")
    await first.waiting()
    await first.moved("crash")
    nxt = await first.next_owner([{"text": "Sorry."}], policy=fail)
    try:
        assert nxt.h.of_type("session.recovered")[-1].data["interrupted_calls"] == ["c1"]
        assert nxt.call().status == ToolStatus.INTERRUPTED and nxt.call().output == RESTART_OUTPUT
    finally:
        await nxt.aclose()

    retry = ToolPolicy(on_restart="retry")
    backend = Backend()
    first = await Process.first(backend, [{"text": "Checking.", "tool_calls": [CALL]}], policy=retry)
    await first.h.session.input("where is my order?")
    await first.waiting()
    await first.moved("crash")
    nxt = await first.next_owner([{"text": "Sorry."}], policy=retry)
    try:
        await nxt.waiting()
        await backend.delivered(2)
        assert len(backend.calls) == 2  # the call's work is asked for again: a second effect, as declared
        # ... as the same message: one webhook-id, which a backend can dedupe on if it would rather not
        assert [h["webhook-id"] for h in backend.call_headers] == ["msg_c1", "msg_c1"]
        await nxt.result("shipped")
    finally:
        await nxt.aclose()


def test_only_a_tool_that_can_resume_may_be_declared_to_resume() -> None:
    with pytest.raises(ValueError, match="on_restart='resume' needs a tool that can resume"):

        @function_tool(on_restart="resume")
        async def book(ctx: RunContext, what: str) -> str:
            return what

    tool = agent_with(Backend().webhooks()).tools["lookup"]
    assert tool.can_resume and tool.policy.on_restart == "resume"  # a webhook tool's default
