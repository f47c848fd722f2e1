"""The runtime's field scenarios replayed over the wire: a real uvicorn server, real HTTP and WebSocket clients."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.waiting import WAIT_S

from .server import EventStream, Server

pytestmark = pytest.mark.e2e

LONG = " ".join(f"w{i}" for i in range(200))


async def create(client: httpx.AsyncClient, turns: list[dict[str, Any]], **kw: Any) -> str:
    body = {"agent": "tester", "llm": {"provider": "scripted", "turns": turns, **kw.pop("llm_extra", {})}, **kw}
    r = await client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def chat(client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/sessions/{sid}/chat")
    assert r.status_code == 200
    return list(r.json()["items"])


def assert_valid_chat(items: list[dict[str, Any]]) -> None:
    """No call without its output right after it; no output without its call (I2, I5)."""
    for i, it in enumerate(items):
        if it["type"] == "function_call":
            nxt = items[i + 1] if i + 1 < len(items) else None
            assert nxt and nxt["type"] == "function_call_output" and nxt["call_id"] == it["call_id"], items
        if it["type"] == "function_call_output":
            assert i > 0 and items[i - 1]["type"] == "function_call" and items[i - 1]["call_id"] == it["call_id"]


def assert_gap_free(frames: list[dict[str, Any]], start: int = 1) -> None:
    seqs = [f["seq"] for f in frames]
    assert seqs == list(range(start, start + len(seqs))), seqs


async def test_interrupt_keeps_completed_tool_result(server: Server):
    turns = [{"text": LONG, "tool_calls": [{"name": "book", "arguments": {"what": "table 7"}}]}]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, turns, llm_extra={"fallback": {"text": "You have {{tool_output:book}}"}})
        events = await EventStream.open(server, sid)
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "book table 7"})
        await events.wait_for("tool.ended")
        r = await client.post(f"/v1/sessions/{sid}/interrupt")
        assert r.json()["interrupted"] is True
        await events.wait_for("speech.interrupted")
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "what do I have?"})
        await events.wait_for("chat.item", lambda d: d["item"].get("text") == "You have booked table 7")
        items = await chat(client, sid)
        assert [i["name"] for i in items if i["type"] == "function_call"] == ["book"]
        assert_valid_chat(items)
        await events.close()
        assert_gap_free(events.frames)


async def test_interrupt_unblocks_wait_for_playout_and_answers_input(server: Server):
    turns = [
        {"text": LONG, "tool_calls": [{"name": "heard", "arguments": {}}]},
        {"text": "Stopping now."},
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, turns)
        events = await EventStream.open(server, sid)
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
        await events.wait_for("tool.started")
        await asyncio.sleep(0.15)  # a few words of the preamble are heard
        r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "stop", "interrupt": True})
        assert r.status_code == 202
        ended = await events.wait_for("tool.ended", timeout=2.0)  # bound: far below the 5 s forced-cancel net
        assert ended["data"]["status"] == "interrupted"
        await events.wait_for(
            "chat.item", lambda d: d["item"].get("text") == "Stopping now.", timeout=2.0
        )  # bound: far below the 5 s forced-cancel net
        items = await chat(client, sid)
        roles = [(i.get("role"), i.get("interrupted")) for i in items if i["type"] == "message"]
        assert roles == [("user", False), ("assistant", True), ("user", False), ("assistant", False)]
        assert_valid_chat(items)
        await events.close()
    assert "did not stop within" not in server.logs()


async def test_preemptive_generation_never_runs_during_a_tool(server: Server):
    turns = [{"text": "Working on it.", "tool_calls": [{"name": "slow", "arguments": {"seconds": 0.5}}]}]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, turns, preemptive_generation=True)
        events = await EventStream.open(server, sid)
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "do it"})
        await events.wait_for("tool.started")
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "and then", "final": False})
        await events.wait_for("tool.ended")
        await events.wait_for("generation.speculative", lambda d: d["state"] == "started")
        order = [f["type"] for f in events.frames if f["type"] in ("tool.ended", "generation.speculative")]
        assert order[0] == "tool.ended", order  # nothing speculative before the tool ended
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "and then"})
        await events.wait_for("generation.speculative", lambda d: d["state"] in ("used", "discarded"))
        await events.close()


async def test_async_tool_progress_streamed_in_order(server: Server):
    turns = [
        {"text": "Starting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 5, "step_s": 0.03}}]},
        {"text": "It runs in the background."},
        {"text": "Result: {{tool_output:progress}}"},
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, turns)
        events = await EventStream.open(server, sid, types="tool.*")
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
        await events.wait_for("tool.ended")
        progress = [f["data"]["message"] for f in events.frames if f["type"] == "tool.progress"]
        assert progress == [f"step {i}/5" for i in range(1, 6)]
        assert set(events.types()) == {"tool.started", "tool.progress", "tool.ended"}
        await events.close()
        all_events = await EventStream.open(server, sid)
        await all_events.wait_for("chat.item", lambda d: d["item"].get("text") == "Result: all 5 steps done")
        await all_events.close()
        assert_valid_chat(await chat(client, sid))


async def test_cancel_via_rest(server: Server):
    turns = [
        {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "flights", "seconds": 10}}]},
        {"text": "On it."},
        {"text": "Search ended: {{tool_output:search}}"},
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, turns)
        events = await EventStream.open(server, sid)
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "search"})
        started = await events.wait_for("tool.started")
        call_id = started["data"]["call_id"]
        running = (await client.get("/v1/tool-calls", params={"status": "running"})).json()["items"]
        assert [c["call_id"] for c in running] == [call_id]
        r = await client.post(f"/v1/sessions/{sid}/tool-calls/{call_id}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        ended = await events.wait_for("tool.ended")
        assert ended["data"]["status"] == "cancelled"
        await events.close()


async def test_resume_after_disconnect_loses_nothing(server: Server):
    turns = [{"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 20, "step_s": 0.02}}]}]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, turns)
        first = await EventStream.open(server, sid)
        await client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})
        await first.wait_for("tool.progress", lambda d: d["message"] == "step 5/20")
        await first.close()
        last = first.frames[-1]["seq"]
        await asyncio.sleep(0.2)  # events keep coming while nobody listens
        second = await EventStream.open(server, sid, since=last)
        await second.wait_for("tool.ended")
        await second.close()
        frames = first.frames + second.frames
        assert_gap_free(frames)
        steps = [f["data"]["message"] for f in frames if f["type"] == "tool.progress"]
        assert steps == [f"step {i}/20" for i in range(1, 21)]


async def test_restart_keeps_chat_tool_calls_and_event_log(tmp_path):
    server = Server(tmp_path).start()
    turns = [
        {"text": "Booking.", "tool_calls": [{"name": "book", "arguments": {"what": "room"}}]},
        {"text": "Booked. Now the long one.", "tool_calls": [{"name": "slow", "arguments": {"seconds": 30}}]},
    ]
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
            sid = await create(
                client, turns, llm_extra={"fallback": {"text": "Before the restart you had {{tool_output:book}}"}}
            )
            events = await EventStream.open(server, sid)
            await client.post(f"/v1/sessions/{sid}/input", json={"text": "book"})
            await events.wait_for("tool.started", lambda d: d["name"] == "slow")
            await asyncio.sleep(0.2)
            before_chat = await chat(client, sid)
            before_frames = list(events.frames)
            server.kill()  # SIGKILL mid-tool
            await events.close()
    except BaseException:
        server.kill()
        raise

    restarted = Server(tmp_path, database_url=server.database_url).start()
    try:
        async with httpx.AsyncClient(base_url=restarted.url, timeout=WAIT_S) as client:
            items = await chat(client, sid)
            completed = [i for i in items if i["type"] == "function_call_output" and i["name"] == "book"]
            assert [c["output"] for c in completed] == ["booked room"]
            for item in before_chat:
                assert item in items  # nothing committed before the crash is lost
            slow = [i for i in items if i["type"] == "function_call_output" and i["name"] == "slow"]
            assert len(slow) == 1 and slow[0]["is_error"] is True
            calls = (await client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
            assert sorted((c["name"], c["status"]) for c in calls) == [("book", "completed"), ("slow", "interrupted")]
            assert_valid_chat(items)

            last = before_frames[-1]["seq"]
            resumed = await EventStream.open(restarted, sid, since=last)
            await resumed.wait_for("session.recovered")
            await client.post(f"/v1/sessions/{sid}/input", json={"text": "what did I book?"})
            await resumed.wait_for(
                "chat.item", lambda d: d["item"].get("text") == "Before the restart you had booked room"
            )
            await resumed.close()
            full = await EventStream.open(restarted, sid)
            await full.wait_for("chat.item", lambda d: "Before the restart" in d["item"].get("text", ""))
            await full.close()
            assert_gap_free(full.frames)
            assert full.frames[: len(before_frames)] == before_frames
    finally:
        restarted.stop()


async def test_flood_of_inputs_and_interrupts_leaves_valid_chat(server: Server):
    turns = [{"text": LONG, "tool_calls": [{"name": "book", "arguments": {"what": f"t{i}"}}]} for i in range(20)]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, turns, llm_extra={"fallback": {"text": "ok " * 30}})

        async def poke(i: int) -> int:
            if i % 3 == 0:
                r = await client.post(f"/v1/sessions/{sid}/interrupt", json={"force": i % 2 == 0})
            else:
                r = await client.post(f"/v1/sessions/{sid}/input", json={"text": f"input {i}"})
            return r.status_code

        statuses = await asyncio.gather(*(poke(i) for i in range(60)))
        assert all(s < 500 for s in statuses), statuses
        await asyncio.sleep(0.5)
        await client.delete(f"/v1/sessions/{sid}")
        items = await chat(client, sid)
        assert_valid_chat(items)
        users = [i for i in items if i["type"] == "message" and i["role"] == "user"]
        assert len(users) == 40  # no input dropped
        calls = (await client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
        assert all(c["status"] != "running" for c in calls)
