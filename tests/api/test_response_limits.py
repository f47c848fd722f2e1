"""Answers of bounded size: a long chat comes in pages, a list of sessions is bounded in count and in item size.

The attacks: ``GET /chat`` of a long session returned every item in one answer (62 MB), and
``GET /v1/sessions?limit=500`` of sessions with large metadata 27 MB.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from switchboard.runtime.chat import ChatItem
from switchboard.store import store as store_module
from switchboard.store.rows import items_from_texts

from .conftest import Api
from .test_sessions_api import assert_problem, until


async def _long_chat(api: Api, says: int) -> str:
    s = await api.create(llm={"provider": "scripted", "turns": []})
    for i in range(says):
        r = await api.client.post(f"/v1/sessions/{s['id']}/say", json={"text": f"line {i}", "add_to_chat": True})
        assert r.status_code == 202, r.text

    async def all_said() -> bool:
        return (
            len((await api.client.get(f"/v1/sessions/{s['id']}/chat", params={"limit": 1000})).json()["items"]) == says
        )

    await until(all_said)
    return str(s["id"])


async def test_chat_comes_in_pages(api: Api) -> None:
    sid = await _long_chat(api, 250)
    first = (await api.client.get(f"/v1/sessions/{sid}/chat")).json()
    assert len(first["items"]) == 200 and first["next_cursor"] == first["items"][-1]["id"]  # the default page
    seen = list(first["items"])
    cursor = first["next_cursor"]
    while cursor is not None:
        page = (await api.client.get(f"/v1/sessions/{sid}/chat", params={"cursor": cursor, "limit": 30})).json()
        assert len(page["items"]) <= 30
        seen.extend(page["items"])
        cursor = page["next_cursor"]
    assert [i["text"] for i in seen] == [f"line {i}" for i in range(250)]  # each once, in order
    r = await api.client.get(f"/v1/sessions/{sid}/chat", params={"limit": 5000})
    assert r.status_code == 422
    assert_problem(await api.client.get(f"/v1/sessions/{sid}/chat", params={"cursor": "nope"}), 422, "invalid_cursor")


async def test_a_page_of_an_ended_sessions_chat_reads_that_page_only(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ended session's chat is read from the store: each page used to read and parse the whole chat (a 1-item
    page of a 24 MB chat: 0.13 s and 30 MB; eight at once took a server from 157 to 415 MB)."""
    sid = await _long_chat(api, 250)
    live = [(await api.client.get(f"/v1/sessions/{sid}/chat", params={"limit": 1000})).json()["items"]]
    assert (await api.client.delete(f"/v1/sessions/{sid}")).status_code == 204
    parsed: list[int] = []

    def counted(texts: Sequence[str]) -> list[ChatItem]:
        parsed.append(len(texts))
        return items_from_texts(texts)

    monkeypatch.setattr(store_module, "items_from_texts", counted)
    first = (await api.client.get(f"/v1/sessions/{sid}/chat", params={"limit": 1})).json()
    assert [i["id"] for i in first["items"]] == [live[0][0]["id"]] and first["next_cursor"] == live[0][0]["id"]
    assert sum(parsed) <= 1, parsed
    seen, cursor = list(first["items"]), first["next_cursor"]
    while cursor is not None:
        page = (await api.client.get(f"/v1/sessions/{sid}/chat", params={"cursor": cursor, "limit": 60})).json()
        seen.extend(page["items"])
        cursor = page["next_cursor"]
    assert seen == live[0]  # the same chat, each item once, in order
    assert sum(parsed) <= len(live[0]), parsed


async def test_a_short_chat_is_one_page_as_before(api: Api) -> None:
    s = await api.create(llm={"provider": "scripted", "turns": []})
    body = (await api.client.get(f"/v1/sessions/{s['id']}/chat")).json()
    assert body == {"items": [], "next_cursor": None}


async def test_session_lists_and_metadata_are_bounded(api: Api) -> None:
    r = await api.client.get("/v1/sessions", params={"limit": 500})
    assert r.status_code == 422
    assert (await api.client.get("/v1/sessions", params={"limit": 200})).status_code == 200
    r = await api.client.post("/v1/sessions", json={"agent": "tester", "metadata": {"blob": "x" * 5000}})
    assert r.status_code == 422 and "metadata" in r.text
    await api.create(metadata={"blob": "x" * 3000})
