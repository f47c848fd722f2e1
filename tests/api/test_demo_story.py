"""The built-in demo agent tells a coherent story through each step of the quickstart (docs/http-api.md), without a
model: an order lookup the operator interrupts (its result still comes), a flight search cancelled over REST, a booking,
and a transfer to billing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from switchboard.integrations import demo
from tests.waiting import WAIT_S

from .conftest import Api


async def said(api: Api, sid: str) -> list[str]:
    items = (await api.client.get(f"/v1/sessions/{sid}/chat", params={"limit": 1000})).json()["items"]
    return [i["text"] for i in items if i["type"] == "message" and i["role"] == "assistant"]


async def until_said(api: Api, sid: str, words: str, timeout: float = WAIT_S) -> list[str]:
    texts: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                texts = await said(api, sid)
                if any(words in text for text in texts):
                    return texts
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"{words!r} was not said; the agent said {texts}") from None


async def running(api: Api, sid: str) -> list[dict[str, Any]]:
    r = await api.client.get(f"/v1/sessions/{sid}/tool-calls", params={"status": "running"})
    return list(r.json()["items"])


async def test_the_quickstart_story(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "WORK_S", 0.5)  # the demo's own pace: progress reports come while replies are spoken
    await api.create(id="s1", agent="demo")
    r = await api.client.post("/v1/sessions/s1/input", json={"text": "Where is my order A-1042?"})
    assert r.status_code == 202
    await until_said(api, "s1", "Let me look up")  # (or part of it, once interrupted)
    assert (await api.client.post("/v1/sessions/s1/interrupt", json={"force": True})).status_code == 200
    # the lookup was not cancellable: it runs on, and its result is told when it comes
    texts = await until_said(api, "s1", "Here is what I found: Order A-1042: shipped yesterday")
    assert not any(
        "I'll tell you as soon as I know" in t for t in texts[texts.index(next(t for t in texts if "Here is" in t)) :]
    )

    await api.client.post("/v1/sessions/s1/input", json={"text": "Can you find me a flight to Rome?"})
    async with asyncio.timeout(WAIT_S):
        while not (calls := [c for c in await running(api, "s1") if c["name"] == "search_flights"]):
            await asyncio.sleep(0.02)
    call = calls[0]
    assert call["cancellable"] is True
    cancelled = await api.client.post(f"/v1/sessions/s1/tool-calls/{call['call_id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"

    await api.client.post("/v1/sessions/s1/input", json={"text": "Book a table for dinner, please."})
    await until_said(api, "s1", "Booked a table for 2 at 19:30 under Ada")

    await api.client.post("/v1/sessions/s1/input", json={"text": "I have a question about my bill."})
    texts = await until_said(api, "s1", "Billing desk here")
    assert (await api.client.get("/v1/sessions/s1")).json()["agent"] == "billing"
    # what the user heard, in order: never the executor's own wording of a progress report (the script used to take
    # each progress report for the result: "Here is what I found: Progress of the call running in the background...")
    internal = ("in the background", "Still running", "Progress of", "<none>")
    assert not [t for t in texts if any(words in t for words in internal)], texts
    found = [t for t in texts if t.startswith("Here is what I found")]
    assert len(found) == 1 and "Order A-1042: shipped yesterday" in found[0], texts
    order = ["Let me look up", "Here is what I found", "Booked a table", "I'll transfer you", "Billing desk here"]
    at = [next(i for i, t in enumerate(texts) if t.startswith(words[:4]) and words[:8] in t) for words in order]
    assert at == sorted(at), texts


async def test_the_first_step_tells_the_order_once_and_no_progress_report_as_its_result(api: Api) -> None:
    """The README's first step, left to run: the demo used to take each of the lookup's progress reports for its
    result and said "Here is what I found: Progress of the call running in the background: ..." before the answer."""
    # spoken at the default voice's pace (3 words a second), so that the lookup's progress reports come while the
    # agent still speaks, as they do for someone trying the demo
    await api.create(id="first", agent="demo", playout={"words_per_second": 3.0})
    assert (await api.client.post("/v1/sessions/first/input", json={"text": "Where is my order A-1042?"})).is_success
    texts = await until_said(api, "first", "shipped yesterday")
    assert texts[0] == "Let me look up your order.", texts
    assert not [t for t in texts if "in the background" in t or "Still running" in t], texts
    assert [t for t in texts if t.startswith("Here is what I found")] == [texts[-1]], texts
