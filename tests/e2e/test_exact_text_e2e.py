"""Text keeps every character exactly through the whole service, on SQLite and PostgreSQL: an input, an interim
input, a say, a tool's output and the model's reply holding NUL and other control characters are answered, read back
from the chat, replayed over the event stream without a gap, and recovered after a restart. A lone surrogate in a
request body becomes U+FFFD (the one rule for text that has no UTF-8 form)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.waiting import WAIT_S

from .server import EventStream, Server
from .test_faults import PG_URL, pg_database
from .traffic import assert_gap_free, replay

ODD = "a\x00b\x01\x1b[31m\x7f\ue000c"  # NUL, controls, an escape sequence, DEL, the store's escape character


@contextlib.asynccontextmanager
async def database(kind: str, tmp_path: Path) -> AsyncIterator[str]:
    if kind == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/exact.db"
        return
    async with pg_database() as name:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)


async def _until(check: Any, timeout_s: float = WAIT_S) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def test_nul_and_control_characters_survive_input_tool_say_replay_and_restart(kind: str, tmp_path: Path):
    turns = [
        {"text": f"On it {ODD}.", "tool_calls": [{"name": "book", "arguments": {"what": ODD}}]},
        {"text": "Done: {{tool_output:book}}"},
    ]
    async with database(kind, tmp_path) as url:
        server = Server(tmp_path, database_url=url)
        await asyncio.to_thread(server.start)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                r = await client.post(
                    "/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}}
                )
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                stream = await EventStream.open(server, sid)
                r = await client.post(f"/v1/sessions/{sid}/input", json={"text": ODD, "final": False})
                assert r.status_code == 202, r.text
                r = await client.post(f"/v1/sessions/{sid}/input", json={"text": f"book {ODD}"})
                assert r.status_code == 202, r.text
                speech_id = r.json()["speech_id"]

                async def replied() -> bool:
                    sp = (await client.get(f"/v1/sessions/{sid}/speeches/{speech_id}")).json()
                    return bool(sp["state"] == "done")

                await _until(replied)
                r = await client.post(f"/v1/sessions/{sid}/say", json={"text": f"say {ODD}"})
                assert r.status_code == 202, r.text
                await stream.wait_for("chat.item", lambda d: d["item"].get("text") == f"say {ODD}")
                await stream.wait_for("speech.done", lambda d: d["speech_id"] == r.json()["speech_id"])
                chat = (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
                expected = _expected_chat()
                assert [(i["type"], i.get("text", i.get("output"))) for i in chat] == expected
                (call,) = (await client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
                assert call["arguments"] == {"what": ODD} and call["output"] == f"booked {ODD}"
                live = [f for f in stream.frames]
                await stream.close()
        finally:
            server.stop()

        # A new process on the same database: recovery and the replay give back the same characters.
        server = Server(tmp_path, database_url=url)
        await asyncio.to_thread(server.start)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                chat = (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
                assert [(i["type"], i.get("text", i.get("output"))) for i in chat] == expected
                assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
            frames = await replay(server.ws_url, sid)
        finally:
            server.stop()
    assert_gap_free(frames)
    assert frames[: len(live)] == live
    interim = [f["data"] for f in frames if f["type"] == "user.input"]
    assert [(d["text"], d["final"]) for d in interim] == [(ODD, False), (f"book {ODD}", True)]
    item_events = [f["data"]["item"] for f in frames if f["type"] == "chat.item"]
    # each durable item has its event (events follow commit order, the chat view puts each output after its call)
    assert sorted((i["type"], str(i.get("text", i.get("output")))) for i in item_events) == sorted(
        (kind, str(text)) for kind, text in expected
    )


def _expected_chat() -> list[tuple[str, Any]]:
    return [
        ("message", f"book {ODD}"),
        ("message", f"On it {ODD}."),
        ("function_call", None),
        ("function_call_output", f"booked {ODD}"),
        ("message", f"Done: booked {ODD}"),
        ("message", f"say {ODD}"),
    ]


async def test_lone_surrogates_in_request_bodies_become_the_replacement_character(tmp_path: Path):
    server = Server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            r = await client.post("/v1/sessions", json={"agent": "tester", "metadata": {"k": "v"}})
            sid = r.json()["id"]
            headers = {"content-type": "application/json"}
            body = b'{"text": "a\\ud800b\\udfff \\ud83d\\ude00", "final": true}'
            r = await client.post(f"/v1/sessions/{sid}/input", content=body, headers=headers)
            assert r.status_code == 202, r.text
            r = await client.post(f"/v1/sessions/{sid}/say", content=b'{"text": "x\\udc00"}', headers=headers)
            assert r.status_code == 202, r.text
            stream = await EventStream.open(server, sid)
            await stream.wait_for("chat.item", lambda d: d["item"].get("text") == "x\ufffd")
            chat = (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
            assert chat[0]["text"] == "a\ufffdb\ufffd 😀"
            await stream.close()
    finally:
        server.stop()
