"""An AG-UI run's input is held to the rules of every other body: its text is cleaned as REST text is (a lone
surrogate stored as U+FFFD: it broke the session's chat and export for good), and its runId, the run's idempotency
key, has the bounds of an ``Idempotency-Key`` (an 8,000-character one failed PostgreSQL's key index with a 500)."""

from __future__ import annotations

import json

import pytest

from .conftest import Api


def run(sid: str, run_id: str, text: str) -> bytes:
    # json.dumps writes a lone surrogate as the escape \ud800, which a client may send
    message = {"id": "m1", "role": "user", "content": text}
    body = {"threadId": sid, "runId": run_id, "messages": [message], "state": {}, "tools": [], "context": []}
    return json.dumps({**body, "forwardedProps": {}}).encode()


async def post(api: Api, sid: str, body: bytes) -> tuple[int, str]:
    async with api.client.stream(
        "POST", f"/v1/sessions/{sid}/ag-ui", content=body, headers={"content-type": "application/json"}
    ) as resp:
        return resp.status_code, (await resp.aread()).decode()


async def test_a_lone_surrogate_is_stored_as_a_replacement_character(api: Api) -> None:
    sid = (await api.create(agent="tester", llm={"provider": "scripted", "turns": [{"text": "Fine."}]}))["id"]
    status, text = await post(api, sid, run(sid, "r1", "bad \ud800 text"))
    assert status == 200, text
    chat = await api.client.get(f"/v1/sessions/{sid}/chat")
    assert chat.status_code == 200, chat.text
    assert [i["text"] for i in chat.json()["items"] if i.get("role") == "user"] == ["bad \ufffd text"]
    assert (await api.client.get(f"/v1/sessions/{sid}/export")).status_code == 200


@pytest.mark.parametrize("run_id", ["", "r" * 201])
async def test_a_run_id_outside_the_bounds_of_a_key_is_refused(api: Api, run_id: str) -> None:
    sid = (await api.create(agent="tester"))["id"]
    status, text = await post(api, sid, run(sid, run_id, "hello"))
    assert status == 422 and json.loads(text)["code"] == "invalid_run_id", text
