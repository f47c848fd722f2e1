"""The built-in demo agent tells a coherent story through each step of the README's quickstart, without a model:
an order lookup the operator interrupts (its result still comes), a flight search cancelled over REST, a booking,
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
    monkeypatch.setattr(demo, "WORK_S", 0.1)
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
    async with asyncio.timeout(10):
        while not (calls := [c for c in await running(api, "s1") if c["name"] == "search_flights"]):
            await asyncio.sleep(0.02)
    call = calls[0]
    assert call["cancellable"] is True
    cancelled = await api.client.post(f"/v1/sessions/s1/tool-calls/{call['call_id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"

    await api.client.post("/v1/sessions/s1/input", json={"text": "Book a table for dinner, please."})
    await until_said(api, "s1", "Booked a table for 2 at 19:30 under Ada")

    await api.client.post("/v1/sessions/s1/input", json={"text": "I have a question about my bill."})
    await until_said(api, "s1", "Billing desk here")
    assert (await api.client.get("/v1/sessions/s1")).json()["agent"] == "billing"
