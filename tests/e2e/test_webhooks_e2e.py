"""The example agents file served by a real ``switchboard serve``, its webhook tools answered by a real backend."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from switchboard.integrations.webhooks import REPORT_TOKEN_HEADER
from tests.waiting import WAIT_S
from tests.webhook_backend import FakeBackend

from .server import EventStream, Server
from .test_field_scenarios import assert_valid_chat, chat

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents.yaml"
SECRET = "e2e-webhook-secret-0123456789abcdef"


async def said(client: httpx.AsyncClient, text: str, timeout: float = WAIT_S) -> None:
    """Wait until the agent said ``text`` (so the next input does not cut its reply short)."""
    try:
        async with asyncio.timeout(timeout):
            while not any(i.get("role") == "assistant" and i.get("text") == text for i in await chat(client, "w1")):
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"the agent never said {text!r}: {await chat(client, 'w1')}") from None


async def test_example_agents_file_sync_async_and_cancelled_webhook_calls(tmp_path: Path):
    async with FakeBackend(SECRET) as backend:
        agents = tmp_path / "agents.yaml"
        agents.write_text(EXAMPLE.read_text().replace("http://127.0.0.1:9000", backend.url()))
        server = Server(tmp_path, SWITCHBOARD_AGENTS_FILE=str(agents), ORDERS_WEBHOOK_SECRET=SECRET)
        await asyncio.to_thread(server.start)
        try:
            backend.answers["lookup_order"] = [(200, {"output": "A-1042 ships on Monday."})]
            backend.answers["refund_order"] = [(202, None)]
            refund = {"order_id": "A-1042", "amount": 12.5, "reason": "late"}
            turns = [
                {"text": "Let me look.", "tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-1042"}}]},
                {"text": "{{tool_output:lookup_order}}"},
                {"text": "Refunding.", "tool_calls": [{"name": "refund_order", "arguments": refund}]},
                {"text": "I started the refund."},
                {"text": "{{tool_output:refund_order}}"},
                {"text": "Again.", "tool_calls": [{"name": "refund_order", "arguments": refund}]},
            ]
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                body = {"id": "w1", "agent": "orders", "llm": {"provider": "scripted", "turns": turns}}
                assert (await client.post("/v1/sessions", json=body)).status_code == 201
                events = await EventStream.open(server, "w1", types="tool.*")
                try:
                    # a 200 answer is the result
                    await client.post("/v1/sessions/w1/input", json={"text": "Where is A-1042?"})
                    lookup = await events.wait_for("tool.ended", lambda d: d["name"] == "lookup_order")
                    assert lookup["data"]["status"] == "completed"
                    assert lookup["data"]["output"] == "A-1042 ships on Monday."
                    assert (await backend.next("call"))["arguments"] == {"order_id": "A-1042"}
                    await said(client, "A-1042 ships on Monday.")

                    # 202, then progress and the result reported over HTTP, streamed to subscribers
                    await client.post("/v1/sessions/w1/input", json={"text": "Refund it, it was late."})
                    call = await backend.next("call")
                    assert call["tool"] == "refund_order" and call["arguments"] == refund  # no confirm flag sent
                    base = f"/v1/sessions/w1/tool-calls/{call['call_id']}"
                    as_backend = {REPORT_TOKEN_HEADER: call["report_token"]}  # the call's own report credential
                    r = await client.post(
                        f"{base}/progress",
                        json={"message": "asking the bank", "progress": 0.5},
                        headers={"Idempotency-Key": "refund-p1", **as_backend},
                    )
                    assert r.status_code == 200, r.text
                    progress = await events.wait_for("tool.progress", lambda d: d["call_id"] == call["call_id"])
                    assert progress["data"]["message"] == "asking the bank"
                    # the first report moved the call to the background; the result comes after the tool reply (a
                    # result that lands before it is answered by that step, with no reply of its own)
                    await said(client, "I started the refund.")
                    r = await client.post(f"{base}/result", json={"output": "Refunded 12.50 EUR."}, headers=as_backend)
                    assert r.status_code == 200 and r.json()["status"] == "completed"
                    ended = await events.wait_for("tool.ended", lambda d: d["call_id"] == call["call_id"])
                    assert ended["data"]["output"] == "Refunded 12.50 EUR."
                    late = await client.post(f"{base}/result", json={"output": "Refunded twice."}, headers=as_backend)
                    assert late.status_code == 409 and late.json()["code"] == "already_ended"
                    await said(client, "Refunded 12.50 EUR.")

                    # cancelling a running webhook call tells its backend
                    await client.post("/v1/sessions/w1/input", json={"text": "Once more."})
                    again = await backend.next("call")
                    r = await client.post(f"/v1/sessions/w1/tool-calls/{again['call_id']}/cancel")
                    assert r.status_code == 200 and r.json()["status"] == "cancelled"
                    notice = await backend.next("cancel")
                    assert notice["call_id"] == again["call_id"] and notice["session_id"] == "w1"
                finally:
                    await events.close()

                items = await chat(client, "w1")
                assert_valid_chat(items)
                spoken = [i["text"] for i in items if i["type"] == "message" and i["role"] == "assistant"]
                assert "A-1042 ships on Monday." in spoken and "Refunded 12.50 EUR." in spoken
                assert backend.bad_signatures == 0
        finally:
            await asyncio.to_thread(server.stop)
