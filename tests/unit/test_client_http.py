"""The Python client's HTTP layer against httpx's MockTransport: retries, the Idempotency-Key, problem mapping."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from switchboard.client import (
    AsyncClient,
    Client,
    Conflict,
    Forbidden,
    FunctionCall,
    NotFound,
    OtherChatItem,
    RetryPolicy,
    ServerError,
    SwitchboardError,
    Unauthorized,
    Unavailable,
    ValidationFailed,
)

FAST = RetryPolicy(retries=3, backoff_s=0.0)
ACCEPTED = {"item_id": "item_1", "speech_id": "speech_1"}


def problem(status: int, code: str, detail: str = "no", **extra: Any) -> httpx.Response:
    body = {"type": f"https://switchboard.dev/problems/{code}", "title": "T", "status": status, "code": code}
    body.update(detail=detail, **extra)
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})


def scripted(*answers: httpx.Response | Exception) -> tuple[list[httpx.Request], Callable[[httpx.Request], Any]]:
    """A handler answering each request with the next answer (an exception is raised, as a transport failure)."""
    seen: list[httpx.Request] = []
    queue = list(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return seen, handler


def test_a_command_sends_one_idempotency_key_on_every_retry():
    seen, handler = scripted(
        httpx.ConnectError("refused"),
        httpx.ReadError("connection reset"),  # sent, maybe applied, answer lost
        httpx.Response(503, headers={"Retry-After": "0"}),
        httpx.Response(202, json=ACCEPTED),
        httpx.Response(202, json=ACCEPTED),
    )
    with Client("http://sb", transport=httpx.MockTransport(handler), retry=FAST) as sb:
        accepted = sb.input("s1", "hello")
        assert accepted.item_id == "item_1" and accepted.speech_id == "speech_1"
        assert len(seen) == 4
        keys = {r.headers["Idempotency-Key"] for r in seen}
        assert len(keys) == 1 and all(keys)
        assert [json.loads(r.content) for r in seen] == [json.loads(seen[0].content)] * 4
        sb.input("s1", "hello")  # another call: another key
    assert seen[4].headers["Idempotency-Key"] not in keys


async def test_the_async_client_reuses_the_key_too():
    seen, handler = scripted(httpx.ReadTimeout("slow"), httpx.Response(200, json=tool_call("cancelled")))
    async with AsyncClient("http://sb", transport=httpx.MockTransport(handler), retry=FAST) as sb:
        call = await sb.cancel_tool_call("s1", "call/1")
    assert call.status == "cancelled" and call.ended
    assert seen[0].headers["Idempotency-Key"] == seen[1].headers["Idempotency-Key"]
    assert seen[0].url.raw_path == b"/v1/sessions/s1/tool-calls/call%2F1/cancel"  # an id never reaches another route


def test_a_given_idempotency_key_is_sent_as_is_and_reads_carry_none():
    seen, handler = scripted(httpx.Response(202, json={"speech_id": "sp"}), httpx.Response(200, json={"items": []}))
    with Client("http://sb", api_key="k1", transport=httpx.MockTransport(handler)) as sb:
        assert sb.say("s1", "hi", idempotency_key="order-42-greeting").speech_id == "sp"
        assert sb.list_tool_calls("s1", status="running") == []
    assert seen[0].headers["Idempotency-Key"] == "order-42-greeting"
    assert "Idempotency-Key" not in seen[1].headers
    assert seen[1].url.params["status"] == "running"
    assert all(r.headers["Authorization"] == "Bearer k1" for r in seen)


def test_retries_are_bounded():
    seen, handler = scripted(*[httpx.ConnectError("refused")] * 4)
    with (
        Client("http://sb", transport=httpx.MockTransport(handler), retry=FAST) as sb,
        pytest.raises(Unavailable) as err,
    ):
        sb.get_session("s1")
    assert len(seen) == 4  # the first attempt and three retries
    assert err.value.code == "unreachable" and err.value.status == 0


def test_a_503_is_retried_only_as_long_as_retry_after_asks():
    seen, handler = scripted(problem(503, "unavailable"))  # no Retry-After: not retried
    with Client("http://sb", transport=httpx.MockTransport(handler), retry=FAST) as sb, pytest.raises(Unavailable):
        sb.get_session("s1")
    assert len(seen) == 1

    long_wait = problem(503, "database_unavailable")
    long_wait.headers["Retry-After"] = "120"
    seen, handler = scripted(long_wait)
    with (
        Client("http://sb", transport=httpx.MockTransport(handler), retry=FAST) as sb,
        pytest.raises(Unavailable) as err,
    ):
        sb.get_session("s1")
    assert len(seen) == 1 and err.value.retry_after == 120 and err.value.code == "database_unavailable"


@pytest.mark.parametrize(
    ("answer", "error", "code"),
    [
        (problem(401, "invalid_key"), Unauthorized, "invalid_key"),
        (problem(403, "forbidden"), Forbidden, "forbidden"),
        (problem(404, "session_not_found"), NotFound, "session_not_found"),
        (problem(409, "not_cancellable"), Conflict, "not_cancellable"),
        (problem(500, "internal_error"), ServerError, "internal_error"),
        (httpx.Response(502, text="bad gateway"), ServerError, "http_error"),
        (httpx.Response(418, text="teapot"), SwitchboardError, "http_error"),
    ],
)
def test_problems_become_typed_errors(answer: httpx.Response, error: type[SwitchboardError], code: str):
    _, handler = scripted(answer)
    with Client("http://sb", transport=httpx.MockTransport(handler), retry=FAST) as sb, pytest.raises(error) as err:
        sb.cancel_tool_call("s1", "c1")
    assert type(err.value) is error
    assert err.value.status == answer.status_code and err.value.code == code


def test_a_422_carries_each_field_error():
    errors = [{"loc": ["body", "max_tool_steps"], "msg": "too big", "type": "less_than_equal"}]
    _, handler = scripted(problem(422, "invalid_request", "body.max_tool_steps: too big", errors=errors))
    with Client("http://sb", transport=httpx.MockTransport(handler)) as sb, pytest.raises(ValidationFailed) as err:
        sb.create_session("tester", max_tool_steps=99)
    assert err.value.errors == errors and err.value.detail == "body.max_tool_steps: too big"


def test_readiness_reports_an_unreachable_database_without_raising():
    _, handler = scripted(httpx.Response(503, json={"status": "unavailable", "detail": "database unreachable"}))
    with Client("http://sb", transport=httpx.MockTransport(handler), retry=FAST) as sb:
        health = sb.ready()
    assert health.status == "unavailable" and health.detail == "database unreachable"


def test_a_chat_item_of_an_unknown_type_is_kept():
    at = "2026-01-01T00:00:00+00:00"
    items = [
        {"id": "i1", "type": "function_call", "created_at": at, "call_id": "c", "name": "n", "arguments": {}},
        {"id": "i2", "type": "reasoning", "created_at": at, "summary": "thought"},
    ]
    _, handler = scripted(httpx.Response(200, json={"items": items}))
    with Client("http://sb", transport=httpx.MockTransport(handler)) as sb:
        call, other = sb.get_chat("s1")
    assert isinstance(call, FunctionCall) and call.call_id == "c"
    assert isinstance(other, OtherChatItem) and other.type == "reasoning"
    assert other.model_extra == {"summary": "thought"}


def tool_call(status: str) -> dict[str, Any]:
    return {
        "session_id": "s1",
        "call_id": "call/1",
        "name": "search",
        "arguments": {"query": "x"},
        "status": status,
        "cancellable": True,
        "scope": "agent",
        "background": True,
        "progress": [{"message": "searching", "progress": 0.5, "at": "2026-01-01T00:00:00+00:00"}],
        "output": None,
        "is_error": False,
        "speech_id": None,
        "started_at": "2026-01-01T00:00:00+00:00",
        "ended_at": None,
        "a_field_from_a_newer_service": 1,
    }


async def test_a_token_for_a_media_edge_asks_for_its_scope():
    token = {"token": "sbt_x", "session_id": "s1", "scopes": ["media:connect"], "expires_at": "2030-01-01T00:00:00Z"}
    seen, handler = scripted(httpx.Response(201, json=token), httpx.Response(201, json=token))
    async with AsyncClient("http://sb", transport=httpx.MockTransport(handler), retry=FAST) as sb:
        minted = await sb.create_token("s1", scopes=["media:connect"])
    with Client("http://sb", transport=httpx.MockTransport(handler), retry=FAST) as sync:
        sync.create_token("s1", ttl_s=60, scopes=["media:connect"])
    assert minted.scopes == ["media:connect"]
    assert json.loads(seen[0].content) == {"scopes": ["media:connect"]}
    assert json.loads(seen[1].content) == {"ttl_s": 60, "scopes": ["media:connect"]}


def _call_page(call_ids: list[str], next_cursor: str | None) -> httpx.Response:
    items = [{**tool_call("running"), "call_id": call_id} for call_id in call_ids]
    return httpx.Response(200, json={"items": items, "next_cursor": next_cursor})


def test_a_sessions_tool_calls_are_read_page_after_page():
    seen, handler = scripted(_call_page(["a", "b"], "b"), _call_page(["c"], None), _call_page(["a"], "a"))
    with Client("http://sb", transport=httpx.MockTransport(handler)) as sb:
        calls = sb.list_tool_calls("s1", status="running", page_size=2)
        page = sb.tool_calls_page("s1", cursor="z", limit=1)
    assert [c.call_id for c in calls] == ["a", "b", "c"]
    assert [dict(r.url.params) for r in seen[:2]] == [
        {"status": "running", "limit": "2"},
        {"status": "running", "limit": "2", "cursor": "b"},
    ]
    assert [c.call_id for c in page.items] == ["a"] and page.next_cursor == "a"
    assert dict(seen[2].url.params) == {"cursor": "z", "limit": "1"}


async def test_running_tool_calls_are_read_page_after_page_up_to_the_limit():
    pages = (_call_page(["a", "b"], "p1"), _call_page(["c"], None), _call_page(["a", "b"], "p1"))
    seen, handler = scripted(*pages, _call_page(["c"], "p2"), _call_page(["d"], "d"), _call_page(["e"], None))
    async with AsyncClient("http://sb", transport=httpx.MockTransport(handler)) as sb:
        assert [c.call_id for c in await sb.list_running_tool_calls()] == ["a", "b", "c"]
        assert [c.call_id for c in await sb.list_running_tool_calls(limit=3)] == ["a", "b", "c"]
        assert [c.call_id for c in await sb.list_tool_calls("s1")] == ["d", "e"]
    assert [dict(r.url.params) for r in seen] == [
        {"status": "running"},
        {"status": "running", "cursor": "p1"},
        {"status": "running", "limit": "3"},
        {"status": "running", "limit": "1", "cursor": "p1"},  # only what the limit still allows
        {},
        {"cursor": "d"},
    ]
