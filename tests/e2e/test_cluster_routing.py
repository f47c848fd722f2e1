"""One routing seam (api/cluster/routing.py): behind a non-sticky load balancer every request about a session reaches
the node that runs it, whichever node it arrived at. Real nodes on PostgreSQL and a Redis of the test's own; webhook
tools answered by a real backend, which reports its results to whichever node it reaches."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchboard.integrations.webhooks import REPORT_TOKEN_HEADER
from tests.waiting import WAIT_S
from tests.webhook_backend import FakeBackend

from .cluster_support import FORWARDED, SECRET, RedisServer, cluster_node, start_all
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents.yaml"
HOOK_SECRET = "e2e-webhook-secret-0123456789abcdef"


async def _said(http: httpx.AsyncClient, node: Server, sid: str, text: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while True:
            r = await http.get(f"{node.url}/v1/sessions/{sid}/chat", params={"limit": 1000})
            if any(i.get("role") == "assistant" and i.get("text") == text for i in r.json()["items"]):
                return
            await asyncio.sleep(0.05)


async def test_a_webhook_backends_report_to_any_node_reaches_the_call_on_its_owner(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    async with FakeBackend(HOOK_SECRET) as backend:
        agents = tmp_path / "agents.yaml"
        agents.write_text(EXAMPLE.read_text().replace("http://127.0.0.1:9000", backend.url()))
        env = {"SWITCHBOARD_AGENTS_FILE": str(agents), "ORDERS_WEBHOOK_SECRET": HOOK_SECRET}
        env["SWITCHBOARD_CLUSTER_SECRET"] = SECRET
        owner, other = (cluster_node(tmp_path, database_url, f"node-{x}", redis.url, **env) for x in "ab")
        await start_all([owner, other])
        try:
            backend.answers["refund_order"] = [(202, None)]
            refund = {"order_id": "A-1042", "amount": 12.5, "reason": "late"}
            turns = [
                {"text": "Refunding.", "tool_calls": [{"name": "refund_order", "arguments": refund}]},
                {"text": "I started the refund."},
                {"text": "{{tool_output:refund_order}}"},
            ]
            async with httpx.AsyncClient(timeout=30) as http:
                body = {"id": "r1", "agent": "orders", "llm": {"provider": "scripted", "turns": turns}}
                # placed where it arrives (a request another node forwarded): node-a runs it
                created = await http.post(f"{owner.url}/v1/sessions", json=body, headers={FORWARDED: SECRET})
                assert created.status_code == 201 and created.json()["owner_node"] == "node-a", created.text

                # the input reaches node-b, which forwards it to node-a
                r = await http.post(f"{other.url}/v1/sessions/r1/input", json={"text": "Refund it."})
                assert r.status_code == 202, r.text
                call = await backend.next("call")
                base = f"/v1/sessions/r1/tool-calls/{call['call_id']}"
                as_backend = {REPORT_TOKEN_HEADER: call["report_token"]}

                # the backend's reports reach node-b too, behind the load balancer: forwarded to the call's node
                r = await http.post(
                    f"{other.url}{base}/progress", json={"message": "asking the bank"}, headers=as_backend
                )
                assert r.status_code == 200, r.text
                await _said(http, other, "r1", "I started the refund.")
                r = await http.post(
                    f"{other.url}{base}/result", json={"output": "Refunded 12.50 EUR."}, headers=as_backend
                )
                assert r.status_code == 200 and r.json()["status"] == "completed", r.text
                await _said(http, other, "r1", "Refunded 12.50 EUR.")
                late = await http.post(f"{other.url}{base}/result", json={"output": "twice"}, headers=as_backend)
                assert late.status_code == 409 and late.json()["code"] == "already_ended"
        finally:
            await asyncio.gather(*(asyncio.to_thread(node.stop) for node in (owner, other)))


async def _reported(http: httpx.AsyncClient, nodes: list[Server], url: str, body: dict[str, Any], headers: Any) -> Any:
    """A backend's report, sent behind the load balancer until it is taken: a 503 (the session is moving) is sent
    again, to any node, with the same key."""
    async with asyncio.timeout(4 * WAIT_S):
        for attempt in itertools.count():
            node = nodes[attempt % len(nodes)]
            try:
                r = await http.post(f"{node.url}{url}", json=body, headers=headers)
            except httpx.TransportError:  # the killed node
                continue
            if r.status_code != 503:
                return r
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def test_a_webhook_call_whose_node_is_killed_goes_on_and_its_result_lands_on_the_new_owner(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    """SIGKILL the node running a refund while its backend works: the node that adopts the session resumes the call
    without delivering it again, and the backend's result, reported through the balancer, completes it there."""
    async with FakeBackend(HOOK_SECRET) as backend:
        agents = tmp_path / "agents.yaml"
        agents.write_text(EXAMPLE.read_text().replace("http://127.0.0.1:9000", backend.url()))
        env = {"SWITCHBOARD_AGENTS_FILE": str(agents), "ORDERS_WEBHOOK_SECRET": HOOK_SECRET}
        env["SWITCHBOARD_CLUSTER_SECRET"] = SECRET
        owner, other = (cluster_node(tmp_path, database_url, f"node-{x}", redis.url, **env) for x in "ab")
        await start_all([owner, other])
        try:
            backend.answers["refund_order"] = [(202, None)]
            refund = {"order_id": "A-1042", "amount": 12.5, "reason": "late"}
            turns = [
                {"text": "Refunding.", "tool_calls": [{"name": "refund_order", "arguments": refund}]},
                {"text": "I started the refund."},
                {"text": "{{tool_output:refund_order}}"},
            ]
            async with httpx.AsyncClient(timeout=WAIT_S) as http:
                body = {"id": "r2", "agent": "orders", "llm": {"provider": "scripted", "turns": turns}}
                created = await http.post(f"{owner.url}/v1/sessions", json=body, headers={FORWARDED: SECRET})
                assert created.status_code == 201 and created.json()["owner_node"] == "node-a", created.text
                r = await http.post(f"{owner.url}/v1/sessions/r2/input", json={"text": "Refund it."})
                assert r.status_code == 202, r.text
                call = await backend.next("call")
                base = f"/v1/sessions/r2/tool-calls/{call['call_id']}"
                as_backend = {REPORT_TOKEN_HEADER: call["report_token"], "Idempotency-Key": "refund-result"}
                r = await http.post(
                    f"{owner.url}{base}/progress",
                    json={"message": "asking the bank"},
                    headers={REPORT_TOKEN_HEADER: call["report_token"]},
                )
                assert r.status_code == 200, r.text
                await _said(http, owner, "r2", "I started the refund.")

                owner.kill()  # the backend still works on the refund
                r = await _reported(
                    http, [owner, other], f"{base}/result", {"output": "Refunded 12.50 EUR."}, as_backend
                )
                assert r.status_code == 200 and r.json()["status"] == "completed", r.text
                await _said(http, other, "r2", "Refunded 12.50 EUR.")
                got = (await http.get(f"{other.url}{base}")).json()
                assert (got["status"], got["output"]) == ("completed", "Refunded 12.50 EUR.")
                assert len(backend.calls) == 1 and backend.cancels == []  # never delivered again, never cancelled
        finally:
            await asyncio.gather(*(asyncio.to_thread(node.stop) for node in (owner, other)))
