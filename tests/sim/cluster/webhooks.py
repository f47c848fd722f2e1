"""Webhook tools in the cluster: the desk agent has ``ticket``, a tool whose body runs on a backend (the product's
``WebhookTool``, delivering through ``Webhooks`` on a mock transport). The backend answers 202 and reports later,
through the load balancer, to any node: progress, then the result, each under an idempotency key of its own and
retried like any client's command. The node that receives a report routes it to the call's owner, where the product's
``WebhookBroker`` applies it (as the report routes do)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from switchboard.integrations.webhooks import WebhookEndpoint, Webhooks, WebhookTool
from switchboard.runtime.agent import Agent, AgentRegistry
from switchboard.runtime.tools import ToolPolicy

from ..workload import Billing, Desk

TICKET = "ticket"
ENDPOINT = WebhookEndpoint(
    url="http://backend.sim/ticket", cancel_url="http://backend.sim/ticket/cancel", timeout_s=60.0, secret="sim"
)
PARAMETERS = {"type": "object", "properties": {"ms": {"type": "integer"}, "out": {"type": "string"}}}

# (session id, call id, arguments): what the backend does with a delivery (the world schedules its reports)
Delivered = Callable[[str, str, dict[str, Any]], None]


def backend(delivered: Delivered) -> httpx.MockTransport:
    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/cancel"):
            return httpx.Response(200)
        body = json.loads(request.content)
        delivered(body["session_id"], body["call_id"], body.get("arguments") or {})
        return httpx.Response(202)

    return httpx.MockTransport(handle)


def registry(webhooks: Webhooks, *, resume: bool = True) -> AgentRegistry:
    """The workload's agents, the desk with a webhook tool delivering through this node's ``webhooks`` (its calls
    resume where their session runs next, as webhook tools' do; ``resume=False``: they end interrupted, as before)."""

    def desk() -> Agent:
        agent = Desk()
        tool = WebhookTool(
            name=TICKET,
            description="Opens a ticket on the backend.",
            parameters=PARAMETERS,
            endpoint=ENDPOINT,
            webhooks=webhooks,
            **({} if resume else {"policy": ToolPolicy(on_restart="fail")}),
        )
        agent._extra_tools.append(tool)
        return agent

    return AgentRegistry({"desk": desk, "billing": Billing})
