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
#: Units of work of a flight search: long enough to cancel it by hand (the quickstart in docs/http-api.md does).
FLIGHT_LEGS = 40


class BillingAgent(Agent):
    """The demo's billing desk: explains charges and refunds delivered orders (the demo agent transfers to it)."""

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
    """The demo shop's assistant: looks up orders, books tables, searches flights in the background, and transfers
    billing questions to the billing desk. Runs without a model (a script answers each step of the quickstart)."""

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
            # the first update is answered ("I'm checking it now"); the later ones are for dashboards only
            await ctx.update(f"{message} for {order_id}", progress=round(step / 3, 2), silent=step > 0)
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
        for leg in range(FLIGHT_LEGS):
            if ctx.cancelled:
                return f"Search stopped early; {found} flights found so far."
            await ctx.update(f"Searching {origin} to {destination}: {found} flights so far", progress=leg / FLIGHT_LEGS)
            await ctx.sleep(WORK_S)
            found += leg % 2 + 1
        return f"Found {found} flights from {origin} to {destination}; the cheapest is 89 EUR."

    @function_tool()
    async def transfer_to_billing(self, ctx: RunContext) -> tuple[Agent, str]:
        """Transfer the customer to the billing desk."""
        await ctx.wait_for_playout()  # let the customer hear "I'll transfer you" before switching
        return BillingAgent(), "Transferred to the billing desk."


AGENTS = {"demo": DemoAgent, "billing": BillingAgent}


def _say(text: str, *calls: dict[str, Any]) -> dict[str, Any]:
    return {"text": text, "tool_calls": list(calls), "ttft_ms": 200, "word_ms": 120}


def _call(tool: str, /, **arguments: Any) -> dict[str, Any]:
    return {"name": tool, "arguments": arguments}


#: The demo's model without a model: it answers what the user asks and what each tool returns, in whatever order
#: the conversation takes (interruptions, cancellations, background results), so each step of the
#: quickstart (README, docs/http-api.md) gets a fitting answer.
DEMO_SCRIPT: dict[str, Any] = {
    "provider": "scripted",
    "on_user": [
        {
            "match": r"\border\b|A-\d+",
            "turn": _say("Let me look up your order.", _call("lookup_order", order_id="A-1042")),
        },
        {
            "match": r"fl(y|ight)",
            "turn": _say(
                "I'll search flights from Paris to Rome; it takes a few seconds.",
                _call("search_flights", origin="Paris", destination="Rome"),
            ),
        },
        {
            "match": r"table|book|dinner",
            "turn": _say("Let me book that table.", _call("book_table", name="Ada", time="19:30", party=2)),
        },
        {
            "match": r"bill|invoice|refund|charge",
            "turn": _say("I'll transfer you to billing.", _call("transfer_to_billing")),
        },
        {"match": r"cancel|stop|never ?mind", "turn": _say("Understood, I've stopped.")},
    ],
    "on_started": {
        "lookup_order": _say("I'm checking it now; I'll tell you as soon as I know."),
        "search_flights": _say("The search is running; you can keep talking to me meanwhile."),
    },
    "on_output": {
        "lookup_order": _say("Here is what I found: {{tool_output:lookup_order}}"),
        "search_flights": _say("{{tool_output:search_flights}}"),
        "book_table": _say("{{tool_output:book_table}}"),
        "transfer_to_billing": _say("Billing desk here. How can I help with your invoice?"),
        "refund": _say("{{tool_output:refund}}"),
    },
    "fallback": _say("I'm here. Ask me about an order, a table, a flight, or your bill."),
}

#: The model config each built-in agent uses when a session gives none (as an agents file's ``llm`` does).
DEFAULT_LLMS: dict[str, dict[str, Any]] = {"demo": DEMO_SCRIPT}
