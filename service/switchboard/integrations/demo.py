"""The built-in ``demo`` agent: a small shop's assistant with realistic tools, always available.

- ``lookup_order``: a slow lookup that reports progress (and so moves to the background).
- ``book_table``: a stateful booking that must not be cancelled half-way and is never run twice at once.
- ``search_flights``: a long, cancellable search that stops cooperatively.
- ``transfer_to_billing``: says its preamble, waits for it to be heard, then hands off to the billing agent.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..runtime.agent import Agent
from ..runtime.tools import RunContext, ToolError, function_tool

#: Seconds per simulated unit of backend work; tests shrink it.
WORK_S = 0.5


class BillingAgent(Agent):
    def __init__(self) -> None:
        super().__init__(
            instructions="You are the billing desk. You explain charges and issue refunds for delivered orders.",
        )

    @function_tool(on_duplicate="reject")
    async def refund(self, ctx: RunContext, order_id: str, amount_eur: float) -> str:
        """Refund part or all of an order."""
        if amount_eur <= 0:
            raise ToolError("The refund amount must be positive.")
        refunds: list[dict[str, Any]] = ctx.userdata.setdefault("refunds", [])
        refunds.append({"order_id": order_id, "amount_eur": amount_eur})
        await asyncio.sleep(WORK_S)
        return f"Refunded {amount_eur:.2f} EUR on order {order_id}."


class DemoAgent(Agent):
    def __init__(self) -> None:
        super().__init__(
            instructions=(
                "You are the assistant of a small shop and restaurant. Look up orders, book tables, search "
                "flights for customers, and transfer billing questions to the billing desk."
            ),
        )

    @function_tool(on_duplicate="reject", duplicate_scope="name_and_args")
    async def lookup_order(self, ctx: RunContext, order_id: str) -> str:
        """Look up an order's status by its id."""
        for step, message in enumerate(("Opening the order book", "Checking the warehouse", "Asking the carrier")):
            await ctx.update(f"{message} for {order_id}", progress=round(step / 3, 2))
            await asyncio.sleep(WORK_S)
        if not order_id.strip():
            raise ToolError("An order id is required.")
        return f"Order {order_id}: shipped yesterday, arriving tomorrow before noon."

    @function_tool(on_duplicate="confirm", allow_cancellation=False)
    async def book_table(self, ctx: RunContext, name: str, time: str, party: int) -> str:
        """Book a table at the restaurant. Bookings cannot be cancelled once started."""
        if not 1 <= party <= 12:
            raise ToolError("We take bookings for 1 to 12 people.")
        await asyncio.sleep(WORK_S)  # the reservation system is slow; the booking must complete once started
        bookings: list[dict[str, Any]] = ctx.userdata.setdefault("bookings", [])
        bookings.append({"name": name, "time": time, "party": party})
        return f"Booked a table for {party} at {time} under {name} (booking #{len(bookings)})."

    @function_tool(allow_cancellation=True, on_duplicate="replace")
    async def search_flights(self, ctx: RunContext, origin: str, destination: str) -> str:
        """Search flights between two cities. Slow; can be cancelled."""
        found = 0
        for leg in range(6):
            if ctx.cancelled:
                return f"Search stopped early; {found} flights found so far."
            await ctx.sleep(WORK_S)
            found += leg % 2 + 1
        return f"Found {found} flights from {origin} to {destination}; the cheapest is 89 EUR."

    @function_tool()
    async def transfer_to_billing(self, ctx: RunContext) -> tuple[Agent, str]:
        """Transfer the customer to the billing desk."""
        await ctx.wait_for_playout()  # let the customer hear "I'll transfer you" before switching
        return BillingAgent(), "Transferred to the billing desk."


AGENTS = {"demo": DemoAgent, "billing": BillingAgent}

#: A scripted conversation that shows the demo tools without any model.
DEMO_SCRIPT: dict[str, Any] = {
    "provider": "scripted",
    "turns": [
        {
            "text": "Let me look up your order.",
            "tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-1042"}}],
            "ttft_ms": 200,
            "word_ms": 120,
        },
        {"text": "I'm checking it now; I'll tell you as soon as I know.", "word_ms": 120},
        {"text": "Good news: {{tool_output:lookup_order}}", "word_ms": 120},
        {
            "text": "I'll search flights for you.",
            "tool_calls": [{"name": "search_flights", "arguments": {"origin": "Paris", "destination": "Rome"}}],
            "word_ms": 120,
        },
        {"text": "{{tool_output:search_flights}}", "word_ms": 120},
        {
            "text": "Let me book that table.",
            "tool_calls": [{"name": "book_table", "arguments": {"name": "Ada", "time": "19:30", "party": 2}}],
            "word_ms": 120,
        },
        {"text": "{{tool_output:book_table}}", "word_ms": 120},
        {
            "text": "I'll transfer you to billing.",
            "tool_calls": [{"name": "transfer_to_billing", "arguments": {}}],
            "word_ms": 120,
        },
        {"text": "Billing desk here. How can I help with your invoice?", "word_ms": 120},
    ],
    "fallback": {"text": "I'm here. Ask me about an order, a table, or a flight.", "word_ms": 120},
}

#: The model config each built-in agent uses when a session gives none (as an agents file's ``llm`` does).
DEFAULT_LLMS: dict[str, dict[str, Any]] = {"demo": DEMO_SCRIPT}
