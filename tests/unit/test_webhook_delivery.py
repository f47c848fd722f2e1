"""Webhook deliveries that fail inside the HTTP stack: every failure of an attempt is a failed attempt, retried
until the call's timeout, never an internal error."""

from __future__ import annotations

import httpx

from switchboard import Agent
from switchboard.integrations.webhooks import WebhookEndpoint, Webhooks, WebhookTool
from tests.waiting import WAIT_S

from .harness import Harness

SECRET = "delivery-secret-0123456789abcdef"
PARAMS = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}


def agent_with(webhooks: Webhooks, timeout_s: float) -> Agent:
    url = "http://backend.invalid/tools/lookup"
    endpoint = WebhookEndpoint(url, url + "/cancel", timeout_s, SECRET)
    tool = WebhookTool(
        name="lookup", description="Look up an order.", parameters=PARAMS, endpoint=endpoint, webhooks=webhooks
    )
    return Agent(instructions="Use the tool.", tools=[tool])


TURNS = [
    {"text": "Looking.", "tool_calls": [{"id": "c1", "name": "lookup", "arguments": {"order_id": "A-1"}}]},
    {"text": "Done."},
]


async def test_an_os_error_let_through_by_the_http_stack_is_a_failed_attempt_that_is_retried():
    attempts = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        if request.url.path.endswith("/cancel"):
            return httpx.Response(204)
        if attempts <= 2:
            raise ConnectionResetError(104, "Connection reset by peer")
        return httpx.Response(200, json={"output": "shipped"})

    webhooks = Webhooks(transport=httpx.MockTransport(handler))
    try:
        async with Harness(agent_with(webhooks, 5.0), TURNS) as h:
            await h.session.input("where is my order")
            ended = await h.wait_for("tool.ended", timeout=WAIT_S)
            assert ended.data["status"] == "completed", ended.data
            assert ended.data["output"] == "shipped"
            assert attempts == 3
    finally:
        await webhooks.aclose()


async def test_a_backend_whose_every_attempt_fails_that_way_fails_the_call_with_the_reason():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/cancel"):
            return httpx.Response(204)
        raise ConnectionResetError(104, "Connection reset by peer")

    webhooks = Webhooks(transport=httpx.MockTransport(handler))
    try:
        async with Harness(agent_with(webhooks, 0.5), TURNS) as h:
            await h.session.input("where is my order")
            ended = await h.wait_for("tool.ended", timeout=WAIT_S)
            assert ended.data["status"] == "failed", ended.data
            assert ended.data["output"].startswith(
                "lookup failed: its backend could not be reached within 0.5 s (ConnectionResetError"
            ), ended.data
    finally:
        await webhooks.aclose()
