"""REST endpoints in-process (httpx ASGI transport): happy paths and every documented error."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from switchboard.api.app import create_app
from switchboard.runtime.status import SessionClosed
from tests.waiting import until

from .conftest import Api, make_settings

PROBLEM = "application/problem+json"
LONG = " ".join(f"w{i}" for i in range(300))


def assert_problem(r: Any, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    body = r.json()
    assert body["status"] == status and body["code"] == code and body["title"]
    return body


async def test_create_get_list_and_idempotent_create(api: Api):
    s = await api.create(id="alpha", metadata={"team": "a"})
    assert s["id"] == "alpha" and s["agent"] == "tester" and s["state"] == "active"
    assert s["metadata"] == {"team": "a"}
    again = await api.client.post("/v1/sessions", json={"id": "alpha", "agent": "tester", "metadata": {"team": "a"}})
    assert again.status_code == 200 and again.json()["id"] == "alpha"
    conflict = await api.client.post("/v1/sessions", json={"id": "alpha", "agent": "demo"})
    assert_problem(conflict, 409, "session_exists")
    got = await api.client.get("/v1/sessions/alpha")
    assert got.status_code == 200 and got.json()["agent_state"] in ("listening", "initializing")
    await api.create()
    listed = (await api.client.get("/v1/sessions")).json()
    assert len(listed["items"]) == 2 and "next_cursor" in listed


async def test_list_pagination(api: Api):
    for i in range(5):
        await api.create(id=f"p{i}")
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = (await api.client.get("/v1/sessions", params=params)).json()
        seen += [s["id"] for s in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == [f"p{i}" for i in reversed(range(5))]  # newest first, as documented


async def test_create_errors(api: Api):
    assert_problem(await api.client.post("/v1/sessions", json={"agent": "nobody"}), 422, "unknown_agent")
    assert_problem(await api.client.post("/v1/sessions", json={}), 422, "invalid_request")
    assert_problem(await api.client.post("/v1/sessions", json={"agent": "tester", "bogus": 1}), 422, "invalid_request")
    assert_problem(
        await api.client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "nope"}}),
        422,
        "invalid_session_config",
    )
    bad_llm = {"provider": "openai", "model": "m", "api_key": "sk-secret"}  # keys come from the environment only
    problem = assert_problem(
        await api.client.post("/v1/sessions", json={"agent": "tester", "llm": bad_llm}), 422, "invalid_session_config"
    )
    assert "server's configuration" in problem["detail"] and "sk-secret" not in problem["detail"]
    assert_problem(
        await api.client.post("/v1/sessions", json={"agent": "tester", "id": "bad id!"}), 422, "invalid_request"
    )
    bad_json = await api.client.post("/v1/sessions", content=b"{not json", headers={"content-type": "application/json"})
    assert_problem(bad_json, 422, "invalid_request")


async def test_unknown_session_is_404_everywhere(api: Api):
    for method, path in [
        ("GET", "/v1/sessions/nope"),
        ("DELETE", "/v1/sessions/nope"),
        ("GET", "/v1/sessions/nope/chat"),
        ("POST", "/v1/sessions/nope/input"),
        ("POST", "/v1/sessions/nope/say"),
        ("POST", "/v1/sessions/nope/interrupt"),
        ("GET", "/v1/sessions/nope/speeches/x"),
        ("GET", "/v1/sessions/nope/tool-calls"),
        ("GET", "/v1/sessions/nope/tool-calls/x"),
        ("POST", "/v1/sessions/nope/tool-calls/x/cancel"),
        ("POST", "/v1/sessions/nope/tokens"),
    ]:
        body = {"text": "hi"} if path.endswith(("input", "say")) else None
        r = await api.client.request(method, path, json=body)
        assert_problem(r, 404, "session_not_found")


async def test_input_reply_chat_and_speech(api: Api):
    turns = [
        {"text": "Booking.", "tool_calls": [{"name": "book", "arguments": {"what": "table"}}]},
        {"text": "Done: {{tool_output:book}}"},
    ]
    s = await api.create(llm={"provider": "scripted", "turns": turns})
    r = await api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": "book a table"})
    assert r.status_code == 202
    accepted = r.json()
    assert accepted["item_id"] and accepted["speech_id"]

    async def reply_done() -> bool:
        sp = (await api.client.get(f"/v1/sessions/{s['id']}/speeches/{accepted['speech_id']}")).json()
        return sp["state"] == "done"

    await until(reply_done)
    chat = (await api.client.get(f"/v1/sessions/{s['id']}/chat")).json()["items"]
    shape = [(i["type"], i.get("role")) for i in chat]
    assert shape == [
        ("message", "user"),
        ("message", "assistant"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "assistant"),
    ]
    assert chat[3]["output"] == "booked table" and chat[4]["text"] == "Done: booked table"
    speech = (await api.client.get(f"/v1/sessions/{s['id']}/speeches/{accepted['speech_id']}")).json()
    assert speech["interrupted"] is False and speech["played_text"].endswith("booked table")
    assert_problem(await api.client.get(f"/v1/sessions/{s['id']}/speeches/nope"), 404, "speech_not_found")
    calls = (await api.client.get(f"/v1/sessions/{s['id']}/tool-calls")).json()["items"]
    assert [(c["name"], c["status"]) for c in calls] == [("book", "completed")]
    one = await api.client.get(f"/v1/sessions/{s['id']}/tool-calls/{calls[0]['call_id']}")
    assert one.json()["output"] == "booked table"
    assert_problem(await api.client.get(f"/v1/sessions/{s['id']}/tool-calls/nope"), 404, "tool_call_not_found")


async def test_the_agent_speaks_only_once_audio_starts_after_the_playouts_first_audio_ms(api: Api):
    playout = {"words_per_second": 100, "first_audio_ms": 2000}
    s = await api.create(llm={"provider": "scripted", "turns": [{"text": "Hello there."}]}, playout=playout)
    await _thinking_until_audio(api, s)
    bad = await api.client.post("/v1/sessions", json={"agent": "tester", "playout": {"first_audio_ms": -1}})
    assert_problem(bad, 422, "invalid_request")


async def test_the_servers_first_audio_ms_is_the_default(tmp_path: Any, registry: Any):
    app = create_app(make_settings(tmp_path, first_audio_ms=2000), registry=registry)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            api = Api(client, app)
            s = await api.create(llm={"provider": "scripted", "turns": [{"text": "Hello there."}]})
            await _thinking_until_audio(api, s)


async def _thinking_until_audio(api: Api, s: dict[str, Any]) -> None:
    """The model is done but the voice has not started yet: the agent is thinking, the speech generating."""
    accepted = (await api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": "hi"})).json()
    url = f"/v1/sessions/{s['id']}/speeches/{accepted['speech_id']}"

    async def generated() -> dict[str, Any] | None:
        sp = (await api.client.get(url)).json()
        return sp if sp["text"] == "Hello there." else None

    speech = await until(generated)
    assert speech["state"] == "generating", "the model is done, the voice has not started yet"
    assert (await api.client.get(f"/v1/sessions/{s['id']}")).json()["agent_state"] == "thinking"
    r = await api.client.post(f"/v1/sessions/{s['id']}/interrupt", json={})
    assert r.status_code == 200 and r.json()["interrupted"] is True
    speech = (await api.client.get(url)).json()
    assert speech["interrupted"] and speech["played_text"] == ""
    assert (await api.client.get(f"/v1/sessions/{s['id']}")).json()["agent_state"] == "listening"


async def test_interim_input_commits_nothing(api: Api):
    s = await api.create()
    r = await api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": "hel", "final": False})
    assert r.status_code == 202 and r.json() == {"item_id": None, "speech_id": None}
    assert (await api.client.get(f"/v1/sessions/{s['id']}/chat")).json()["items"] == []


async def test_interrupt_returns_after_commit_and_409_when_not_interruptible(api: Api):
    s = await api.create(llm={"provider": "scripted", "turns": [{"text": LONG}]})
    await api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": "talk"})

    async def speaking() -> bool:
        return (await api.client.get(f"/v1/sessions/{s['id']}")).json()["agent_state"] == "speaking"

    await until(speaking)
    await asyncio.sleep(0.05)
    r = await api.client.post(f"/v1/sessions/{s['id']}/interrupt")
    assert r.status_code == 200 and r.json()["interrupted"] is True
    chat = (await api.client.get(f"/v1/sessions/{s['id']}/chat")).json()["items"]
    assert chat[-1]["role"] == "assistant" and chat[-1]["interrupted"] is True  # committed before the response
    nothing = await api.client.post(f"/v1/sessions/{s['id']}/interrupt", json={})
    assert nothing.json() == {"speech_id": None, "interrupted": False}

    say = await api.client.post(f"/v1/sessions/{s['id']}/say", json={"text": LONG, "allow_interruptions": False})
    assert say.status_code == 202

    async def playing() -> bool:
        sp = (await api.client.get(f"/v1/sessions/{s['id']}/speeches/{say.json()['speech_id']}")).json()
        return sp["state"] == "playing"

    await until(playing)
    assert_problem(await api.client.post(f"/v1/sessions/{s['id']}/interrupt"), 409, "not_interruptible")
    forced = await api.client.post(f"/v1/sessions/{s['id']}/interrupt", json={"force": True})
    assert forced.json()["interrupted"] is True


async def test_cancel_tool_call_rest(api: Api):
    turns = [
        {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "q", "seconds": 5}}]},
        {"text": "Started."},
        {"text": "The search was cancelled."},  # the deferred reply to the cancelled background call
        {"text": "Slow.", "tool_calls": [{"name": "slow", "arguments": {"seconds": 1.0}}]},
    ]
    s = await api.create(llm={"provider": "scripted", "turns": turns})
    sid = s["id"]
    await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "search"})

    async def running() -> list[dict[str, Any]]:
        return (await api.client.get(f"/v1/sessions/{sid}/tool-calls", params={"status": "running"})).json()["items"]

    call = (await until(running))[0]

    async def backgrounded() -> bool:  # the search reported progress: its body is running
        one = (await api.client.get(f"/v1/sessions/{sid}/tool-calls/{call['call_id']}")).json()
        return bool(one["progress"])

    await until(backgrounded)
    across = (await api.client.get("/v1/tool-calls", params={"status": "running"})).json()["items"]
    assert [(c["session_id"], c["call_id"]) for c in across] == [(sid, call["call_id"])]
    r = await api.client.post(f"/v1/sessions/{sid}/tool-calls/{call['call_id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    again = await api.client.post(f"/v1/sessions/{sid}/tool-calls/{call['call_id']}/cancel")
    assert_problem(again, 409, "already_ended")
    assert_problem(await api.client.post(f"/v1/sessions/{sid}/tool-calls/nope/cancel"), 404, "tool_call_not_found")

    async def told() -> bool:  # the deferred reply about the cancelled call is out (a new input would replace it)
        items = (await api.client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
        return any(i.get("text") == "The search was cancelled." for i in items)

    await until(told)
    await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "slow please"})
    slow = (await until(running))[0]
    assert slow["name"] == "slow" and slow["cancellable"] is False
    refused = await api.client.post(f"/v1/sessions/{sid}/tool-calls/{slow['call_id']}/cancel")
    assert_problem(refused, 409, "not_cancellable")


async def test_close_session_then_commands_conflict(api: Api):
    s = await api.create()
    assert (await api.client.delete(f"/v1/sessions/{s['id']}")).status_code == 204
    got = (await api.client.get(f"/v1/sessions/{s['id']}")).json()
    assert got["state"] == "closed"
    assert_problem(
        await api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": "hi"}), 409, "session_not_active"
    )
    assert (await api.client.delete(f"/v1/sessions/{s['id']}")).status_code == 204  # idempotent


async def test_limits_and_validation(api: Api):
    s = await api.create()
    too_long = await api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": "x" * 9000})
    assert_problem(too_long, 413, "text_too_long")
    huge = await api.client.post(f"/v1/sessions/{s['id']}/input", content=b"x" * 100_000)
    assert_problem(huge, 413, "body_too_large")
    assert_problem(await api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": ""}), 422, "invalid_request")
    assert_problem(
        await api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": "x", "role": "root"}),
        422,
        "invalid_request",
    )


async def test_idempotency_key(api: Api):
    s = await api.create()
    sid = s["id"]
    h = {"Idempotency-Key": "k-1"}
    first = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "once"}, headers=h)
    second = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "once"}, headers=h)
    assert first.status_code == second.status_code == 202
    assert first.json() == second.json()
    assert second.headers.get("idempotent-replayed") == "true"
    users = [i for i in (await api.client.get(f"/v1/sessions/{sid}/chat")).json()["items"] if i.get("role") == "user"]
    assert [u["text"] for u in users] == ["once"]
    reuse = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "different"}, headers=h)
    assert_problem(reuse, 409, "idempotency_key_reused")
    # concurrent retries with one key apply once
    h2 = {"Idempotency-Key": "k-2"}
    rs = await asyncio.gather(
        *(api.client.post(f"/v1/sessions/{sid}/input", json={"text": "burst"}, headers=h2) for _ in range(5))
    )
    assert len({r.json()["item_id"] for r in rs}) == 1
    users = [i for i in (await api.client.get(f"/v1/sessions/{sid}/chat")).json()["items"] if i.get("text") == "burst"]
    assert len(users) == 1


async def test_health_ready_and_metrics(api: Api):
    assert (await api.client.get("/healthz")).json() == {"status": "ok"}
    assert (await api.client.get("/readyz")).json() == {"status": "ok"}
    await api.create()
    text = (await api.client.get("/metrics")).text
    assert "switchboard_sessions_live 1.0" in text
    assert "switchboard_interrupt_latency_seconds_bucket" in text


async def test_list_filters_by_state_and_rejects_an_unknown_one(api: Api):
    open_ = await api.create()
    closed = await api.create()
    assert (await api.client.delete(f"/v1/sessions/{closed['id']}")).status_code == 204
    active = (await api.client.get("/v1/sessions", params={"state": "active"})).json()["items"]
    assert [s["id"] for s in active] == [open_["id"]]
    assert_problem(await api.client.get("/v1/sessions", params={"state": "bogus"}), 422, "invalid_request")
    assert_problem(await api.client.get("/v1/sessions", params={"cursor": "garbage!"}), 422, "invalid_cursor")


async def test_a_server_at_its_session_limit_answers_429_with_retry_after(tmp_path: Any, registry: Any):
    app = create_app(make_settings(tmp_path, max_sessions=1), registry=registry)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.post("/v1/sessions", json={"agent": "tester"})).status_code == 201
            full = await client.post("/v1/sessions", json={"agent": "tester"})
            assert_problem(full, 429, "too_many_sessions")
            assert full.headers["retry-after"] == "5"


async def test_a_session_that_closes_under_a_command_answers_409(api: Api, monkeypatch):
    sid = (await api.create())["id"]
    session = api.app.state.services.host.live(sid)

    async def closing(*args: Any, **kwargs: Any) -> Any:
        raise SessionClosed(f"session {sid} is closing")

    for command in ("input", "say", "interrupt"):
        monkeypatch.setattr(session, command, closing)
    for path, body in (("input", {"text": "hi"}), ("say", {"text": "hi"}), ("interrupt", {})):
        r = await api.client.post(f"/v1/sessions/{sid}/{path}", json=body)
        problem = assert_problem(r, 409, "session_not_active")
        assert problem["detail"] == f"session {sid} is closing"


async def test_the_demo_agent_runs_its_own_script_when_the_session_gives_no_model(api: Api):
    sid = (await api.create(agent="demo"))["id"]
    r = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "where is my order?"})
    assert r.status_code == 202

    async def first_reply() -> Any:
        items = (await api.client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
        return [i["text"] for i in items if i.get("role") == "assistant"]

    assert (await until(first_reply))[0] == "Let me look up your order."


async def test_cancel_is_refused_with_409_while_the_speech_disallows_interruptions_unless_force(api: Api):
    turns = [
        {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "q", "seconds": 30}}]},
        {"text": "It is running and I keep talking for a while.", "word_ms": 200},  # the speech goes on
    ]
    s = await api.create(llm={"provider": "scripted", "turns": turns}, allow_interruptions=False)
    sid = s["id"]
    await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "search"})

    async def background() -> list[dict[str, Any]]:
        calls = (await api.client.get(f"/v1/sessions/{sid}/tool-calls", params={"status": "running"})).json()
        return [c for c in calls["items"] if c["progress"]]

    call = (await until(background))[0]
    path = f"/v1/sessions/{sid}/tool-calls/{call['call_id']}/cancel"
    body = assert_problem(await api.client.post(path), 409, "not_interruptible")
    assert "does not allow interruptions" in body["detail"]
    assert_problem(await api.client.post(path, json={"force": False}), 409, "not_interruptible")
    forced = await api.client.post(path, json={"force": True})
    assert forced.status_code == 200 and forced.json()["status"] == "cancelled"


async def test_the_tool_call_resource_carries_the_redacted_exception_message(api: Api):
    turns = [{"text": "Trying.", "tool_calls": [{"name": "fail", "arguments": {"expected": False}}]}]
    s = await api.create(llm={"provider": "scripted", "turns": turns})
    await api.client.post(f"/v1/sessions/{s['id']}/input", json={"text": "go"})

    async def ended() -> dict[str, Any] | None:
        calls = (await api.client.get(f"/v1/sessions/{s['id']}/tool-calls")).json()["items"]
        return next((c for c in calls if c.get("status") == "failed"), None)

    call = await until(ended)
    assert call["error"] == "RuntimeError: secret internal detail"
    assert call["output"] == "An internal error occurred", "the model gets the generic text"
