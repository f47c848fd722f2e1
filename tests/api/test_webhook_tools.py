"""Webhook tools against a real backend on loopback, through the in-process API: they behave like Python tools."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from switchboard.api.app import create_app
from switchboard.integrations.webhooks import REPORT_TOKEN_HEADER
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.tools import MAX_PROGRESS_CHARS
from tests.agents_fixture import AGENTS as TEST_AGENTS
from tests.ports import free_port
from tests.webhook_backend import FakeBackend

from .conftest import make_settings
from .test_sessions_api import assert_problem, until

SECRET_ENV = "SB_TEST_WEBHOOK_SECRET"
SECRET = "test-secret-0123456789abcdefghijklmn"
ORDER = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}


# the result timeout of a call the backend accepts and never answers: it runs from the delivery on, so it is long
# enough for the delivery itself to reach the backend on a loaded machine
SLOWPOKE_S = 3.0


def agents_file(tmp_path: Path, backend: FakeBackend) -> Path:
    def hook(name: str, **kw: Any) -> dict[str, Any]:
        spec = {
            "kind": "webhook",
            "name": name,
            "description": f"The {name} tool.",
            "parameters": ORDER,
            "url": backend.url(f"/tools/{name}"),
            "timeout_s": 5,
            "secret_env": SECRET_ENV,
        }
        return {**spec, **kw}

    agents = [
        {
            "name": "hooks",
            "instructions": "You use webhook tools.",
            "llm": {"provider": "scripted", "turns": [{"text": "I am the default model."}]},
            "tools": [
                hook("lookup"),
                hook("refund", allow_cancellation=True),
                hook("exclusive", on_duplicate="reject"),
                hook("replaceable", on_duplicate="replace", allow_cancellation=True),
                hook("slowpoke", timeout_s=SLOWPOKE_S),
                hook("flaky"),
                hook("refused"),
                hook("unreachable", url=f"http://127.0.0.1:{free_port()}/tools/unreachable", timeout_s=0.4),
            ],
        }
    ]
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(agents))
    return path


class Hooks:
    def __init__(self, client: httpx.AsyncClient, backend: FakeBackend) -> None:
        self.client = client
        self.backend = backend

    async def session(self, *turns: dict[str, Any], sid: str | None = None) -> str:
        body: dict[str, Any] = {"agent": "hooks", "llm": {"provider": "scripted", "turns": list(turns)}}
        if sid:
            body["id"] = sid
        r = await self.client.post("/v1/sessions", json=body)
        assert r.status_code == 201, r.text
        sid = str(r.json()["id"])
        r = await self.client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
        assert r.status_code == 202, r.text
        return sid

    async def call(self, sid: str, name: str, status: str | None = None) -> dict[str, Any]:
        """The session's latest call of ``name`` (once it has ``status``, if given)."""

        async def find() -> dict[str, Any] | None:
            items = (await self.client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
            found = [c for c in items if c["name"] == name]
            if found and (status is None or found[-1]["status"] == status):
                return dict(found[-1])
            return None

        return dict(await until(find))

    async def chat(self, sid: str) -> list[dict[str, Any]]:
        return list((await self.client.get(f"/v1/sessions/{sid}/chat")).json()["items"])

    async def said(self, sid: str, text: str) -> None:
        """Wait until the agent said ``text``."""

        async def found() -> bool:
            return any(i.get("role") == "assistant" and i.get("text") == text for i in await self.chat(sid))

        await until(found)

    def token(self, sid: str, call_id: str) -> str | None:
        """The report credential the backend received with this call (None: it never received it)."""
        delivered = [c for c in self.backend.calls if (c["session_id"], c["call_id"]) == (sid, call_id)]
        return str(delivered[-1]["report_token"]) if delivered else None

    def _as_backend(self, sid: str, call_id: str, headers: dict[str, str] | None) -> dict[str, str]:
        token = self.token(sid, call_id)
        return {**({REPORT_TOKEN_HEADER: token} if token else {}), **(headers or {})}

    async def progress(
        self,
        sid: str,
        call_id: str,
        message: str,
        progress: float | None = None,
        headers: Any = None,
        *,
        silent: bool | None = None,
    ) -> Any:
        body: dict[str, Any] = {"message": message} if progress is None else {"message": message, "progress": progress}
        if silent is not None:
            body["silent"] = silent
        url = f"/v1/sessions/{sid}/tool-calls/{call_id}/progress"
        return await self.client.post(url, json=body, headers=self._as_backend(sid, call_id, headers))

    async def result(self, sid: str, call_id: str, output: str, headers: Any = None) -> Any:
        url = f"/v1/sessions/{sid}/tool-calls/{call_id}/result"
        return await self.client.post(url, json={"output": output}, headers=self._as_backend(sid, call_id, headers))


@pytest.fixture
async def backend() -> AsyncIterator[FakeBackend]:
    async with FakeBackend(SECRET) as b:
        yield b


@pytest.fixture
async def hooks(tmp_path: Path, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Hooks]:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    settings = make_settings(tmp_path, agents_file=agents_file(tmp_path, backend))
    app = create_app(settings, registry=AgentRegistry(TEST_AGENTS))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield Hooks(client, backend)


def call_turn(name: str, text: str = "On it.", **arguments: Any) -> dict[str, Any]:
    return {"text": text, "tool_calls": [{"name": name, "arguments": arguments or {"order_id": "A-1"}}]}


async def test_a_200_answer_is_the_result_and_the_backend_sees_a_signed_call(hooks: Hooks):
    hooks.backend.answers["lookup"] = [(200, {"output": "A-1 shipped on Monday"})]
    sid = await hooks.session(call_turn("lookup"), {"text": "Result: {{tool_output:lookup}}"})
    call = await hooks.call(sid, "lookup", "completed")
    assert call["output"] == "A-1 shipped on Monday" and not call["is_error"]
    delivered = hooks.backend.calls[0]
    assert delivered == {
        "call_id": call["call_id"],
        "session_id": sid,
        "tool": "lookup",
        "arguments": {"order_id": "A-1"},
        "report_token": hooks.token(sid, call["call_id"]),
    }
    assert str(delivered["report_token"]).startswith("sbr_")
    assert hooks.backend.bad_signatures == 0

    async def replied() -> bool:
        return any(i.get("text") == "Result: A-1 shipped on Monday" for i in await hooks.chat(sid))

    await until(replied)
    pairs = [(i["type"], i.get("output")) for i in await hooks.chat(sid) if i["type"].startswith("function")]
    assert pairs == [("function_call", None), ("function_call_output", "A-1 shipped on Monday")]


async def test_a_backend_never_sees_a_call_id_a_script_picked(hooks: Hooks):
    """Two sessions whose scripts name their calls alike: the backend dedupes on call_id, so a picked id could
    make it drop (or answer with the result of) another session's call. Deliveries carry the service's own ids."""
    turn = {"text": "On it.", "tool_calls": [{"name": "lookup", "arguments": {"order_id": "A-1"}, "id": "c1"}]}
    first = await hooks.session(turn)
    second = await hooks.session(turn)
    delivered = [await hooks.backend.next("call") for _ in range(2)]
    assert {d["session_id"] for d in delivered} == {first, second}
    ids = [d["call_id"] for d in delivered]
    assert ids[0] != ids[1] and "c1" not in ids and all(i.startswith("call_") for i in ids)


async def test_an_is_error_answer_fails_the_call(hooks: Hooks):
    hooks.backend.answers["lookup"] = [(200, {"output": "No order A-1.", "is_error": True})]
    sid = await hooks.session(call_turn("lookup"))
    call = await hooks.call(sid, "lookup", "failed")
    assert call["output"] == "No order A-1." and call["is_error"]


async def test_202_then_progress_and_result_over_the_api(hooks: Hooks):
    hooks.backend.answers["refund"] = [(202, None)]
    sid = await hooks.session(
        call_turn("refund", "Refunding."), {"text": "Started."}, {"text": "{{tool_output:refund}}"}
    )
    delivered = await hooks.backend.next("call")
    call_id = delivered["call_id"]
    assert (await hooks.call(sid, "refund"))["status"] == "running"

    r = await hooks.progress(sid, call_id, "contacting the bank", 0.25)
    assert r.status_code == 200, r.text
    assert r.json() == {"call_id": call_id, "status": "running"}  # the call's status, nothing more
    body = await hooks.call(sid, "refund")
    assert body["status"] == "running" and body["background"] is True
    assert [(p["message"], p["progress"]) for p in body["progress"]] == [("contacting the bank", 0.25)]
    r = await hooks.progress(sid, call_id, "almost there", 0.9, headers={"Idempotency-Key": "p2"})
    assert r.status_code == 200 and len((await hooks.call(sid, "refund"))["progress"]) == 2
    again = await hooks.progress(sid, call_id, "almost there", 0.9, headers={"Idempotency-Key": "p2"})
    assert (
        again.headers.get("Idempotent-Replayed") == "true" and len((await hooks.call(sid, "refund"))["progress"]) == 2
    )

    r = await hooks.result(sid, call_id, "refunded 12 EUR", headers={"Idempotency-Key": "r1"})
    assert r.status_code == 200, r.text
    assert r.json() == {"call_id": call_id, "status": "completed"}
    ended = await hooks.call(sid, "refund")
    assert ended["status"] == "completed" and ended["output"] == "refunded 12 EUR" and ended["ended_at"]

    async def final_reply() -> bool:
        return any(i.get("text") == "refunded 12 EUR" for i in await hooks.chat(sid))

    await until(final_reply)
    chat = await hooks.chat(sid)
    calls = [(i["type"], i["call_id"]) for i in chat if i["type"].startswith("function")]
    # the background pair at the first progress report, the second report as a pair of its own (once: its replay
    # adds nothing), then the result as its own pair (like a Python tool)
    assert calls == [
        ("function_call", call_id),
        ("function_call_output", call_id),
        ("function_call", f"{call_id}/update/2"),
        ("function_call_output", f"{call_id}/update/2"),
        ("function_call", f"{call_id}/final"),
        ("function_call_output", f"{call_id}/final"),
    ]

    # the same report again is a replay; any other late report is refused and changes nothing
    replay = await hooks.result(sid, call_id, "refunded 12 EUR", headers={"Idempotency-Key": "r1"})
    assert replay.status_code == 200 and replay.headers.get("Idempotent-Replayed") == "true"
    assert_problem(await hooks.result(sid, call_id, "refunded twice"), 409, "already_ended")
    assert_problem(await hooks.progress(sid, call_id, "still here?"), 409, "already_ended")
    assert await hooks.chat(sid) == chat
    final = await hooks.call(sid, "refund")
    assert final["output"] == "refunded 12 EUR" and len(final["progress"]) == 2


async def test_a_silent_progress_report_asks_for_no_reply_of_its_own(hooks: Hooks):
    hooks.backend.answers["refund"] = [(202, None)]
    sid = await hooks.session(call_turn("refund", "Refunding."), {"text": "{{tool_output:refund}}"})
    call_id = (await hooks.backend.next("call"))["call_id"]
    r = await hooks.progress(sid, call_id, "contacting the bank", 0.25, silent=True)
    assert r.status_code == 200, r.text
    call = await hooks.call(sid, "refund")
    assert call["status"] == "running" and [p["message"] for p in call["progress"]] == ["contacting the bank"]
    assert (await hooks.result(sid, call_id, "refunded 12 EUR")).status_code == 200
    await hooks.said(sid, "refunded 12 EUR")  # the result is answered by the script's next turn: no step took it
    said = [i["text"] for i in await hooks.chat(sid) if i.get("role") == "assistant"]
    assert said == ["Refunding.", "refunded 12 EUR"]


async def test_reports_for_unknown_sessions_and_calls(hooks: Hooks):
    """Without the call's report credential, every report gets one answer: nothing says which sessions exist."""
    sid = await hooks.session({"text": "Hello."})
    assert_problem(await hooks.result("nope", "c1", "x"), 403, "report_refused")
    assert_problem(await hooks.progress(sid, "c1", "x"), 403, "report_refused")
    # a credential of another call names nothing here either
    hooks.backend.answers["lookup"] = [(202, None)]
    other = await hooks.session(call_turn("lookup"))
    call_id = (await hooks.backend.next("call"))["call_id"]
    headers = {REPORT_TOKEN_HEADER: str(hooks.token(other, call_id))}
    assert_problem(await hooks.result(sid, call_id, "x", headers=headers), 403, "report_refused")
    assert_problem(await hooks.result(other, "c1", "x", headers=headers), 403, "report_refused")
    assert_problem(
        await hooks.client.post(
            f"/v1/sessions/{other}/tool-calls/{call_id}/result", json={"is_error": True}, headers=headers
        ),
        422,
        "invalid_request",
    )
    assert_problem(await hooks.progress(other, call_id, "x", 1.5), 422, "invalid_request")


async def test_cancel_ends_the_call_at_once_and_notifies_the_backend(hooks: Hooks):
    hooks.backend.answers["refund"] = [(202, None)]
    sid = await hooks.session(call_turn("refund"))
    call_id = (await hooks.backend.next("call"))["call_id"]
    await hooks.progress(sid, call_id, "working")
    r = await hooks.client.post(f"/v1/sessions/{sid}/tool-calls/{call_id}/cancel")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled" and r.json()["is_error"]
    notice = await hooks.backend.next("cancel")
    # the notice says who cancelled, as the chat does
    assert notice == {"call_id": call_id, "session_id": sid, "tool": "refund", "reason": "cancelled by an operator"}
    assert "(cancelled by an operator)" in (await hooks.call(sid, "refund"))["output"]
    assert hooks.backend.bad_signatures == 0
    assert_problem(await hooks.result(sid, call_id, "done anyway"), 409, "already_ended")
    assert (await hooks.call(sid, "refund"))["status"] == "cancelled"


async def test_not_cancellable_and_not_awaiting_reports_like_python_tools(hooks: Hooks):
    hooks.backend.answers["lookup"] = [(202, None)]
    sid = await hooks.session(call_turn("lookup"))
    call_id = (await hooks.backend.next("call"))["call_id"]
    cancel = await hooks.client.post(f"/v1/sessions/{sid}/tool-calls/{call_id}/cancel")
    assert_problem(cancel, 409, "not_cancellable")
    assert (await hooks.result(sid, call_id, "found")).json()["status"] == "completed"


async def test_a_call_without_a_result_in_time_fails_and_the_backend_is_told(hooks: Hooks):
    hooks.backend.answers["slowpoke"] = [(202, None)]
    sid = await hooks.session(call_turn("slowpoke"))
    call_id = (await hooks.backend.next("call"))["call_id"]
    call = await hooks.call(sid, "slowpoke", "failed")
    assert call["is_error"]
    assert call["output"] == f"slowpoke failed: no result from its backend within {SLOWPOKE_S:g} s."
    assert (await hooks.backend.next("cancel"))["reason"] == "timed out"
    assert_problem(await hooks.result(sid, call_id, "too late"), 409, "already_ended")
    outputs = [i["output"] for i in await hooks.chat(sid) if i["type"] == "function_call_output"]
    assert outputs == [call["output"]]


async def test_5xx_is_retried_4xx_is_not_and_an_unreachable_backend_times_out(
    hooks: Hooks, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="switchboard.integrations.webhooks")
    hooks.backend.answers["flaky"] = [(503, None), (502, None), (200, {"output": "third time lucky"})]
    hooks.backend.answers["refused"] = [(400, {"detail": "order_id must look like A-1234"})]
    sid = await hooks.session(
        {"text": "Three.", "tool_calls": [{"name": n, "arguments": {"order_id": "A-1"}} for n in ("flaky", "refused")]},
        call_turn("unreachable"),
    )
    flaky = await hooks.call(sid, "flaky", "completed")
    assert flaky["output"] == "third time lucky" and hooks.backend.attempts["flaky"] == 3
    refused = await hooks.call(sid, "refused", "failed")
    assert (
        refused["output"] == "refused failed: its backend refused the call (HTTP 400: order_id must look like A-1234)."
    )
    assert hooks.backend.attempts["refused"] == 1
    r = await hooks.client.post(f"/v1/sessions/{sid}/input", json={"text": "again"})
    assert r.status_code == 202
    unreachable = await hooks.call(sid, "unreachable", "failed")
    assert unreachable["output"].startswith("unreachable failed: its backend could not be reached within 0.4 s (")
    assert unreachable["is_error"]
    # every failed delivery is an operator's business: WARNING, with the ids
    failed = [r for r in caplog.records if r.getMessage().startswith("webhook delivery of")]
    assert {r.getMessage().split(" (")[0] for r in failed} >= {
        "webhook delivery of flaky failed",
        "webhook delivery of unreachable failed",
    }
    assert all(r.levelno == logging.WARNING and getattr(r, "session_id", None) == sid for r in failed)


async def test_bad_arguments_never_reach_the_backend(hooks: Hooks):
    sid = await hooks.session(call_turn("lookup", order_id=5))
    call = await hooks.call(sid, "lookup", "failed")
    assert call["output"] == "Invalid arguments for lookup: order_id: Input should be a valid string"
    assert hooks.backend.attempts["lookup"] == 0


async def test_on_duplicate_reject_and_replace(hooks: Hooks):
    hooks.backend.answers["exclusive"] = [(202, None)]
    hooks.backend.answers["replaceable"] = [(202, None)]
    sid = await hooks.session(call_turn("exclusive"), {"text": "Started."}, call_turn("exclusive"), {"text": "Hm."})
    first = (await hooks.backend.next("call"))["call_id"]
    await hooks.progress(sid, first, "queued")  # moves it to the background: the reply goes on
    await hooks.said(sid, "Started.")
    await hooks.client.post(f"/v1/sessions/{sid}/input", json={"text": "again"})
    second = await hooks.call(sid, "exclusive", "rejected")
    assert second["output"] == f"Not started: exclusive is already running (call {first}). Wait for its result."
    assert second["is_error"] and hooks.backend.attempts["exclusive"] == 1
    assert (await hooks.result(sid, first, "done")).json()["status"] == "completed"

    sid2 = await hooks.session(call_turn("replaceable"), {"text": "Started."}, call_turn("replaceable"))
    old = (await hooks.backend.next("call"))["call_id"]
    await hooks.progress(sid2, old, "queued")
    await hooks.said(sid2, "Started.")
    await hooks.client.post(f"/v1/sessions/{sid2}/input", json={"text": "again"})
    # the running call is cancelled (and its backend told) before the new one starts, as for a Python tool
    notice = await hooks.backend.next("cancel")
    assert notice["call_id"] == old and notice["tool"] == "replaceable"
    assert notice["reason"] == f"replaced by {(await hooks.backend.next('call'))['call_id']}"
    new = (await hooks.call(sid2, "replaceable", "running"))["call_id"]
    assert new != old
    replaced = await hooks.call(sid2, "replaceable")
    assert replaced["call_id"] == new and replaced["status"] == "running"
    items = (await hooks.client.get(f"/v1/sessions/{sid2}/tool-calls")).json()["items"]
    assert [(c["call_id"], c["status"]) for c in items] == [(old, "cancelled"), (new, "running")]
    assert (await hooks.result(sid2, new, "done")).json()["status"] == "completed"


async def test_the_agents_default_llm_is_used_when_a_session_gives_none(hooks: Hooks):
    r = await hooks.client.post("/v1/sessions", json={"agent": "hooks"})
    sid = r.json()["id"]
    await hooks.client.post(f"/v1/sessions/{sid}/input", json={"text": "hi"})

    async def answered() -> bool:
        return any(i.get("text") == "I am the default model." for i in await hooks.chat(sid))

    await until(answered)


async def test_reports_need_the_tools_report_scope_and_the_calls_own_credential(
    tmp_path: Path, backend: FakeBackend, monkeypatch: Any
):
    """A tools:report key meant for one backend used to complete another session's call with a forged output, and
    the answer carried that call's arguments; the answers also told which sessions exist. Now a report needs the
    credential its call's delivery carried, and every report without it gets the very same answer."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    operator, reporter, intruder = "o" * 16, "r" * 16, "i" * 16
    keys = [
        {"key": operator, "scopes": ["sessions:read", "sessions:write", "sessions:control"]},
        {"key": reporter, "scopes": ["tools:report"]},
        {"key": intruder, "scopes": ["tools:report"]},  # another backend's key
    ]
    settings = make_settings(tmp_path, agents_file=agents_file(tmp_path, backend), api_keys=keys)
    app = create_app(settings, registry=AgentRegistry(TEST_AGENTS))
    backend.answers["lookup"] = [(202, None)]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.headers["authorization"] = f"Bearer {operator}"
            hooks = Hooks(client, backend)
            sid = await hooks.session(call_turn("lookup", order_id="SECRET-ORDER-42"))
            call_id = (await backend.next("call"))["call_id"]
            assert_problem(await hooks.result(sid, call_id, "found"), 403, "forbidden")

            as_intruder = {"authorization": f"Bearer {intruder}"}
            refusals = []
            for target_sid, target_call, token in (
                (sid, call_id, None),  # a running call, no credential
                (sid, call_id, "sbr_" + "A" * 43),  # a forged one
                (sid, call_id, "\u00e9t\u00e9".encode("latin-1")),  # one it cannot even compare
                (sid, "no-such-call", None),
                ("no-such-session", call_id, None),
            ):
                for kind in ("result", "progress"):
                    url = f"/v1/sessions/{target_sid}/tool-calls/{target_call}/{kind}"
                    headers = {**as_intruder, **({REPORT_TOKEN_HEADER: token} if token else {})}
                    body = {"output": "forged"} if kind == "result" else {"message": "forged"}
                    r = await client.post(url, json=body, headers=headers)
                    refusals.append((r.status_code, r.json()))
            assert all(refusal == refusals[0] for refusal in refusals), refusals
            assert refusals[0][0] == 403 and refusals[0][1]["code"] == "report_refused"
            assert "SECRET-ORDER-42" not in str(refusals)
            call = await hooks.call(sid, "lookup")
            assert call["status"] == "running" and call["progress"] == []  # nothing forged landed

            as_reporter = {"authorization": f"Bearer {reporter}"}
            r = await hooks.result(sid, call_id, "found", headers=as_reporter)
            assert r.status_code == 200 and r.json() == {"call_id": call_id, "status": "completed"}
            assert "SECRET-ORDER-42" not in r.text  # a report's answer never echoes the call's arguments
            # the rightful backend hears how its call stands; the intruder still hears nothing
            assert_problem(await hooks.result(sid, call_id, "again", headers=as_reporter), 409, "already_ended")
            assert (
                await client.post(
                    f"/v1/sessions/{sid}/tool-calls/{call_id}/result", json={"output": "x"}, headers=as_intruder
                )
            ).json() == refusals[0][1]


async def test_lone_surrogates_from_a_backend_answer_and_reports_become_the_replacement_character(hooks: Hooks):
    """A backend's ``\\ud800`` has no UTF-8 form: its answer, progress and result are taken with U+FFFD in its place
    (not refused, not a write that fails), and NUL is kept."""
    hooks.backend.answers["lookup"] = [(200, b'{"output": "A-1 \\ud800 shipped\\u0000"}')]
    sid = await hooks.session(call_turn("lookup"))
    call = await hooks.call(sid, "lookup", "completed")
    assert call["output"] == "A-1 \ufffd shipped\x00" and not call["is_error"]
    await hooks.backend.next("call")  # that delivery

    hooks.backend.answers["refund"] = [(202, None)]
    sid = await hooks.session(call_turn("refund", "Refunding."), {"text": "Started."})
    call_id = (await hooks.backend.next("call"))["call_id"]
    headers = {"content-type": "application/json", REPORT_TOKEN_HEADER: str(hooks.token(sid, call_id))}
    url = f"/v1/sessions/{sid}/tool-calls/{call_id}"
    r = await hooks.client.post(f"{url}/progress", content=b'{"message": "bank \\udc00\\u0000"}', headers=headers)
    assert r.status_code == 200, r.text
    assert (await hooks.call(sid, "refund"))["progress"][0]["message"] == "bank \ufffd\x00"
    r = await hooks.client.post(f"{url}/result", content=b'{"output": "refunded \\ud83d"}', headers=headers)
    assert r.status_code == 200, r.text
    assert (await hooks.call(sid, "refund"))["output"] == "refunded \ufffd"


# -- answers too big to take -----------------------------------------------------------------------------------------


async def test_a_progress_message_is_cut_to_its_limit_with_a_marker(hooks: Hooks):
    """A report's message reaches the call's record (its latest 50), the events, the chat and the model: 60,000
    characters a report once went everywhere whole (5.8 MB of tool calls after 96 reports)."""
    hooks.backend.answers["refund"] = [(202, None)]
    sid = await hooks.session(call_turn("refund", "Refunding."), {"text": "Started."})
    call_id = (await hooks.backend.next("call"))["call_id"]
    for _ in range(2):  # the first update moves the call to the background, each later one is a pair of its own
        assert (await hooks.progress(sid, call_id, "p" * 60_000)).status_code == 200
    marker = f"[output truncated: {60_000 - MAX_PROGRESS_CHARS} more characters not shown]"
    messages = [p["message"] for p in (await hooks.call(sid, "refund"))["progress"]]
    assert messages == [messages[0]] * 2 and messages[0] == "p" * MAX_PROGRESS_CHARS + "\n" + marker
    outputs = [i["output"] for i in await hooks.chat(sid) if i["type"] == "function_call_output"]
    assert len(outputs) == 2 and all(len(o) < MAX_PROGRESS_CHARS + 300 and marker in o for o in outputs)


async def test_an_answer_bigger_than_the_cap_fails_the_call_unread(hooks: Hooks):
    huge = "x" * (3 * 1024 * 1024)  # past SWITCHBOARD_MAX_WEBHOOK_RESPONSE_BYTES (1 MiB by default)
    hooks.backend.answers["lookup"] = [(200, {"output": huge})]
    sid = await hooks.session(call_turn("lookup"))
    call = await hooks.call(sid, "lookup", "failed")
    assert call["is_error"] and "more than 1048576 bytes" in call["output"], call["output"][:200]
    outputs = [i["output"] for i in await hooks.chat(sid) if i["type"] == "function_call_output"]
    assert outputs and all(len(o) < 1000 for o in outputs)


async def test_an_answer_within_the_cap_is_cut_to_the_output_limit_with_a_marker(hooks: Hooks):
    hooks.backend.answers["lookup"] = [(200, {"output": "y" * 200_000})]
    sid = await hooks.session(call_turn("lookup"))
    call = await hooks.call(sid, "lookup", "completed")
    assert call["output"].startswith("y" * 16_000)
    assert call["output"].endswith("[output truncated: 184000 more characters not shown]")


async def test_cancel_notices_name_who_cancelled(
    tmp_path: Path, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With API keys, an operator's cancel names the key (never the key itself); a close says the session closed;
    the notice and the chat say the same thing."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    key = "ops-key-0123456789abcdef"
    settings = make_settings(
        tmp_path,
        agents_file=agents_file(tmp_path, backend),
        api_keys=[
            {
                "key": key,
                "name": "night-desk",
                "scopes": ["sessions:read", "sessions:write", "sessions:control", "tools:cancel"],
            }
        ],
    )
    app = create_app(settings, registry=AgentRegistry(TEST_AGENTS))
    async with app.router.lifespan_context(app):
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers
        ) as client:
            hooks = Hooks(client, backend)
            backend.answers["refund"] = [(202, None), (202, None)]
            sid = await hooks.session(call_turn("refund"), {"text": "Started."}, call_turn("refund"))
            call_id = (await backend.next("call"))["call_id"]
            await hooks.progress(sid, call_id, "working")
            r = await client.post(f"/v1/sessions/{sid}/tool-calls/{call_id}/cancel")
            assert r.status_code == 200, r.text
            assert r.json()["output"] == "The tool call was cancelled (cancelled by the operator night-desk)."
            assert (await backend.next("cancel"))["reason"] == "cancelled by the operator night-desk"
            assert key not in str(backend.cancels)

            await hooks.said(sid, "Started.")
            await client.post(f"/v1/sessions/{sid}/input", json={"text": "again"})
            second = (await backend.next("call"))["call_id"]
            await hooks.progress(sid, second, "working")
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
            assert (await backend.next("cancel"))["reason"] == "session closed"
