"""The Python client against a real server: every operation, problems as typed errors, idempotent retries."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchboard.client import (
    AsyncClient,
    ChatMessage,
    Client,
    Conflict,
    Forbidden,
    FunctionCall,
    FunctionCallOutput,
    NotFound,
    ToolCall,
    ToolStatus,
    Unauthorized,
    ValidationFailed,
)
from tests.waiting import WAIT_S, until
from tests.webhook_backend import FakeBackend

from .server import Server

pytestmark = pytest.mark.e2e

ADMIN = "client-admin-key-0123456789"
KEYS = json.dumps(
    [
        {
            "key": ADMIN,
            "scopes": [
                "sessions:read",
                "sessions:write",
                "sessions:control",
                "tools:cancel",
                "events:read",
                "metrics:read",
            ],
        }
    ]
)
LONG = " ".join(f"word{i}" for i in range(300))  # ~6 s of speech at 50 words per second
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents.yaml"
SECRET = "client-webhook-secret-0123456789abcd"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("client"), SWITCHBOARD_API_KEYS=KEYS).start()
    try:
        yield server
    finally:
        server.stop()


def scripted(*turns: dict[str, Any]) -> dict[str, Any]:
    return {"provider": "scripted", "turns": list(turns), "fallback": {"text": "OK."}}


SEARCH = {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "tables", "seconds": 30}}]}


async def test_every_operation_through_the_async_client(srv: Server):
    async with AsyncClient(srv.url, api_key=ADMIN) as sb:
        assert (await sb.health()).status == "ok"
        assert (await sb.ready()).status == "ok"
        assert "switchboard_ws_connections" in await sb.metrics()

        # sessions: create (again with the same body: the same session; with another: a conflict), list, read
        llm = scripted(SEARCH)
        session = await sb.create_session("tester", id="ops-a", llm=llm, metadata={"team": "a"}, max_tool_steps=2)
        assert (session.id, session.agent, session.state, session.metadata) == (
            "ops-a",
            "tester",
            "active",
            {"team": "a"},
        )
        again = await sb.create_session("tester", id="ops-a", llm=llm, metadata={"team": "a"}, max_tool_steps=2)
        assert again.id == "ops-a" and again.created_at == session.created_at
        with pytest.raises(Conflict) as conflict:
            await sb.create_session("other", id="ops-a")
        assert conflict.value.status == 409 and conflict.value.code == "session_exists"
        other = await sb.create_session("other", playout={"words_per_second": 50})
        page = await sb.list_sessions(state="active", limit=1)
        assert len(page.items) == 1 and page.next_cursor is not None
        listed = [s.id async for s in sb.iter_sessions(page_size=1)]
        assert {"ops-a", other.id} <= set(listed) and len(listed) == len(set(listed))
        assert (await sb.get_session("ops-a")).agent_state in ("initializing", "listening")

        # say something that may not be interrupted; interrupting it is a conflict unless forced
        said = await sb.say("ops-a", LONG, allow_interruptions=False)
        await until(lambda: _is_current(sb, "ops-a", said.speech_id))
        with pytest.raises(Conflict) as refused:
            await sb.interrupt("ops-a")
        assert refused.value.code == "not_interruptible"
        forced = await sb.interrupt("ops-a", force=True)
        assert forced.interrupted and forced.speech_id == said.speech_id
        speech = await sb.get_speech("ops-a", said.speech_id)
        assert speech.interrupted and speech.text == LONG and LONG.startswith(speech.played_text)
        assert speech.played_text != LONG and not speech.allow_interruptions

        # input starts a cancellable search: read it, find it among running calls, cancel it (twice: a conflict)
        accepted = await sb.input("ops-a", "Find me a table.")
        assert accepted.item_id and accepted.speech_id
        running = await until(lambda: _with_progress(sb.list_tool_calls("ops-a", status=ToolStatus.RUNNING)))
        call = await sb.get_tool_call("ops-a", running[0].call_id)
        assert (call.name, call.arguments, call.cancellable, call.ended) == (
            "search",
            SEARCH["tool_calls"][0]["arguments"],
            True,
            False,
        )
        assert call.progress[0].message == "searching tables"
        assert call.call_id in {c.call_id for c in await sb.list_running_tool_calls()}
        cancelled = await sb.cancel_tool_call("ops-a", call.call_id)
        assert cancelled.status == ToolStatus.CANCELLED and cancelled.ended_at is not None
        with pytest.raises(Conflict) as ended:
            await sb.cancel_tool_call("ops-a", call.call_id)
        assert ended.value.code == "already_ended"
        assert [c.status for c in await sb.list_tool_calls("ops-a")] == [ToolStatus.CANCELLED]

        chat = await sb.get_chat("ops-a")
        assert any(isinstance(i, ChatMessage) and i.role == "user" and i.text == "Find me a table." for i in chat)
        assert any(isinstance(i, FunctionCall) and i.call_id == call.call_id for i in chat)
        assert any(isinstance(i, FunctionCallOutput) and i.call_id == call.call_id for i in chat)

        # a session token reads this session and streams its events, and nothing more
        token = await sb.create_token("ops-a", ttl_s=60)
        assert token.session_id == "ops-a" and set(token.scopes) == {"sessions:read", "events:read"}
        async with AsyncClient(srv.url, api_key=token.token) as dashboard:
            assert (await dashboard.get_session("ops-a")).id == "ops-a"
            with pytest.raises(Forbidden):
                await dashboard.input("ops-a", "hello")
            with pytest.raises(Forbidden):
                await dashboard.get_session(other.id)
            first = await anext(aiter(dashboard.events("ops-a", types=["session.*"])))
            assert (first.seq, first.type) == (1, "session.started")

        # problems
        with pytest.raises(NotFound) as missing:
            await sb.get_session("no-such-session")
        assert (missing.value.status, missing.value.code) == (404, "session_not_found")
        with pytest.raises(NotFound) as missing_speech:
            await sb.get_speech("ops-a", "speech_nope")
        assert missing_speech.value.code == "speech_not_found"
        with pytest.raises(ValidationFailed) as invalid:
            await sb.create_session("tester", max_tool_steps=99)
        assert invalid.value.code == "invalid_request" and invalid.value.errors
        assert invalid.value.errors[0]["loc"] == ["body", "max_tool_steps"]
        with pytest.raises(ValidationFailed) as unknown:
            await sb.create_session("no-such-agent")
        assert unknown.value.code == "unknown_agent"
        async with AsyncClient(srv.url) as anonymous:
            with pytest.raises(Unauthorized) as unauthorized:
                await anonymous.list_sessions()
            assert unauthorized.value.code == "unauthenticated"

        # close: the log is then complete, replayed in order, and the stream ends
        await sb.close_session("ops-a")
        await sb.close_session(other.id)
        assert (await sb.get_session("ops-a")).state == "closed"
        with pytest.raises(Conflict) as closed:
            await sb.say("ops-a", "still there?")
        assert closed.value.code == "session_not_active"
        events = [e async for e in sb.events("ops-a")]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[-1].type == "session.closed" and all(e.session_id == "ops-a" for e in events)


async def _with_progress(calls: Awaitable[list[ToolCall]]) -> list[ToolCall]:
    return [c for c in await calls if c.progress]


async def _is_current(sb: AsyncClient, sid: str, speech_id: str) -> bool:
    session = await sb.get_session(sid)
    if session.current_speech_id != speech_id:
        return False
    return (await sb.get_speech(sid, speech_id)).state == "playing"


def wait_until(predicate: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return found


def test_every_operation_through_the_blocking_client(srv: Server):
    with Client(srv.url, api_key=ADMIN) as sb:
        assert sb.health().status == "ok" and sb.ready().status == "ok"
        assert "switchboard_" in sb.metrics()
        sid = sb.create_session("tester", id="ops-sync", llm=scripted(SEARCH), metadata={"by": "sync"}).id
        assert sb.create_session("tester", id=sid, llm=scripted(SEARCH), metadata={"by": "sync"}).id == sid
        assert sid in {s.id for s in sb.iter_sessions(state="active", page_size=2)}
        assert sb.list_sessions(limit=1).items
        said = sb.say(sid, LONG)
        wait_until(lambda: sb.get_session(sid).current_speech_id == said.speech_id)
        interrupted = sb.interrupt(sid)
        assert interrupted.speech_id == said.speech_id and interrupted.interrupted
        assert sb.get_speech(sid, said.speech_id).interrupted
        sb.input(sid, "Find me a table.")
        # once it has reported its first progress, as the async test waits too (cancelled before it, on a loaded
        # machine, the call has no `tool.progress` to stream)
        running = wait_until(lambda: [c for c in sb.list_tool_calls(sid, status="running") if c.progress])
        call_id = running[0].call_id
        assert sb.get_tool_call(sid, call_id).name == "search"
        assert call_id in {c.call_id for c in sb.list_running_tool_calls(limit=100)}
        assert sb.cancel_tool_call(sid, call_id).status == "cancelled"
        with pytest.raises(Conflict) as ended:
            sb.cancel_tool_call(sid, call_id)
        assert ended.value.code == "already_ended"
        assert any(isinstance(i, FunctionCallOutput) and i.call_id == call_id for i in sb.get_chat(sid))
        token = sb.create_token(sid)
        with Client(srv.url, api_key=token.token) as dashboard, pytest.raises(Forbidden):
            dashboard.close_session(sid)
        with pytest.raises(NotFound):
            sb.get_tool_call(sid, "call_nope")
        sb.close_session(sid)
        with sb.events(sid, types=["tool.*", "session.*"]) as stream:
            types = [e.type for e in stream]
        assert types == ["session.started", "tool.started", "tool.progress", "tool.ended", "session.closed"]
        # the whole session as one typed document, closed as it is; the operator's commands are in its log
        doc = sb.export_session(sid)
        assert doc.session.id == sid and doc.session.state == "closed" and doc.session.metadata == {"by": "sync"}
        assert [c.call_id for c in doc.tool_calls] == [call_id]
        assert any(isinstance(i, FunctionCallOutput) and i.call_id == call_id for i in doc.chat)
        actions = [e.data["action"] for e in doc.events if e.type == "operator.action"]
        assert actions == ["say", "interrupt", "input", "cancel_tool", "close"]
        assert [e.seq for e in doc.events] == list(range(1, len(doc.events) + 1))
        with pytest.raises(NotFound) as missing:
            sb.export_session("no-such-session")
        assert str(missing.value).startswith("No session 'no-such-session'.")


# -- idempotent retries against the real service --------------------------------------------------------------------


class LoseFirstAnswer(httpx.AsyncBaseTransport):
    """Delivers each request to the service, but for the first POST drops the answer as a cut connection would:
    the command was applied, the caller never heard."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.sent: list[httpx.Request] = []
        self.answers: list[httpx.Response] = []
        self.lost = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        response = await self.inner.handle_async_request(request)
        await response.aread()
        self.answers.append(response)
        if request.method == "POST" and not self.lost:
            self.lost = True
            raise httpx.ReadError("connection reset by peer", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_retried_command_is_applied_once(srv: Server):
    async with AsyncClient(srv.url, api_key=ADMIN) as sb:
        sid = (await sb.create_session("tester", llm=scripted())).id
        transport = LoseFirstAnswer()
        async with AsyncClient(srv.url, api_key=ADMIN, transport=transport) as flaky:
            accepted = await flaky.input(sid, "Book a table for two.", reply=False)
        posts = [r for r in transport.sent if r.method == "POST"]
        assert len(posts) == 2 and posts[0].headers["Idempotency-Key"] == posts[1].headers["Idempotency-Key"]
        first, replay = transport.answers
        assert "Idempotent-Replayed" not in first.headers and replay.headers["Idempotent-Replayed"] == "true"
        assert accepted.item_id == first.json()["item_id"]  # the answer of the attempt that applied it
        users = [i for i in await sb.get_chat(sid) if isinstance(i, ChatMessage) and i.role == "user"]
        assert [u.text for u in users] == ["Book a table for two."]
        await sb.close_session(sid)


# -- reports from a webhook tool's backend ---------------------------------------------------------------------------


async def test_a_webhook_backend_reports_progress_and_result_through_the_client(tmp_path: Path):
    async with FakeBackend(SECRET) as backend:
        agents = tmp_path / "agents.yaml"
        agents.write_text(EXAMPLE.read_text().replace("http://127.0.0.1:9000", backend.url()))
        server = Server(tmp_path, SWITCHBOARD_AGENTS_FILE=str(agents), ORDERS_WEBHOOK_SECRET=SECRET)
        await asyncio.to_thread(server.start)
        try:
            backend.answers["refund_order"] = [(202, None)]
            refund = {"order_id": "A-1042", "amount": 12.5, "reason": "late"}
            turns = [{"text": "Refunding.", "tool_calls": [{"name": "refund_order", "arguments": refund}]}]
            async with AsyncClient(server.url) as sb:
                sid = (await sb.create_session("orders", llm=scripted(*turns))).id
                await sb.input(sid, "Refund it.")
                call = await backend.next("call")
                cid, token = call["call_id"], call["report_token"]  # the delivery's report credential
                progressed = await sb.report_tool_progress(
                    sid, cid, "asking the bank", report_token=token, progress=0.5
                )
                assert progressed.status == "running" and not progressed.ended
                assert (await sb.get_tool_call(sid, cid)).progress[-1].progress == 0.5
                with Client(server.url) as blocking:  # the blocking client from a worker thread, as a backend would
                    more = await asyncio.to_thread(
                        functools.partial(blocking.report_tool_progress, sid, cid, "nearly", report_token=token)
                    )
                    assert more.status == "running"
                    done = await asyncio.to_thread(
                        functools.partial(blocking.report_tool_result, sid, cid, "Refunded.", report_token=token)
                    )
                assert done.status == "completed" and done.ended
                ended = await sb.get_tool_call(sid, cid)
                assert [p.message for p in ended.progress] == ["asking the bank", "nearly"]
                assert ended.output == "Refunded." and not ended.is_error
                with pytest.raises(Conflict) as twice:
                    await sb.report_tool_result(sid, cid, "Refunded twice.", report_token=token, is_error=True)
                assert twice.value.code == "already_ended"
                with pytest.raises(Forbidden) as elsewhere:  # a credential names one call: no other
                    await sb.report_tool_progress(sid, "call_nope", "?", report_token=token)
                assert elsewhere.value.code == "report_refused"
                await sb.close_session(sid)
        finally:
            await asyncio.to_thread(server.stop)
