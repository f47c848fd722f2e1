"""Screenshot of the operator console during a tool call, for the README: ``docs/console.png``.

Starts a real server (SQLite in a temporary directory) with the small shop agent below, runs a scripted
conversation — a completed stock check, a long answer the operator interrupts, a parcel tracking call still in
progress — next to two sessions that need an operator (a model that never answers, a tool whose backend fails),
opens the console in Debian's headless Chromium and saves the picture with the attention queue.

Run: ``.venv/bin/python bench/console_screenshot.py [--output docs/console.png]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from switchboard import Agent, RunContext, ToolError, function_tool

ROOT = Path(__file__).resolve().parents[1]
TRACKING_STEPS = ("Opening the order book", "Checking the warehouse", "Asking the carrier", "Reading the tracking")


class ShopAgent(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You help the customers of a small furniture shop.")

    @function_tool(on_duplicate="reject")
    async def check_stock(self, ctx: RunContext, product: str) -> str:
        """How many of a product are in stock."""
        return f"7 x {product} in stock, ships today"

    @function_tool(allow_cancellation=True)
    async def track_parcel(self, ctx: RunContext, order_id: str) -> str:
        """Track an order's parcel with the carrier (slow; reports progress)."""
        for i, step in enumerate(TRACKING_STEPS):
            await ctx.update(f"{step} for {order_id}", progress=round(i / len(TRACKING_STEPS), 2))
            await ctx.sleep(2.0)
        return f"Order {order_id} is in the carrier's van, arriving today before 18:00."

    @function_tool
    async def reserve_pickup(self, ctx: RunContext, order_id: str) -> str:
        """Reserve a pickup slot at the shop (its backend is down in this picture)."""
        raise ToolError("the store's booking system did not answer (HTTP 503)")


AGENTS = {"shop": ShopAgent}

SCRIPT: dict[str, Any] = {
    "provider": "scripted",
    "turns": [
        {"text": "Let me check.", "tool_calls": [{"name": "check_stock", "arguments": {"product": "oak desk lamp"}}]},
        {"text": "Good news: {{tool_output:check_stock}}."},
        {
            "text": "I'm sorry it hasn't arrived yet. I'm asking the warehouse and the carrier right now; it usually "
            "takes a few seconds, and while we wait I can tell you about our delivery guarantee, which refunds the "
            "shipping costs of any late parcel.",
            "tool_calls": [{"name": "track_parcel", "arguments": {"order_id": "A-1042"}}],
        },
        {"text": "Of course. I'm tracking it now and will tell you the moment the carrier answers."},
    ],
    "fallback": {"text": "I'm still on it."},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(ROOT / "docs" / "console.png"))
    args = parser.parse_args()

    import httpx
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(ROOT))
    from tests.e2e.console_support import CHROMIUM, CHROMIUM_ARGS
    from tests.e2e.server import Server

    if not CHROMIUM.exists():
        print(f"{CHROMIUM} is missing: apt-get install chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(
            Path(tmp),
            SWITCHBOARD_AGENTS="bench.console_screenshot:AGENTS",
            SWITCHBOARD_ATTENTION_STALL_S="3",
            SWITCHBOARD_ATTENTION_SILENCE_S="3",
        ).start(timeout=90)
        try:
            with httpx.Client(base_url=server.url, timeout=10) as api, sync_playwright() as pw:
                never = {"provider": "scripted", "turns": [{"text": "late", "ttft_ms": 600_000}]}
                failing = {
                    "provider": "scripted",
                    "turns": [{"tool_calls": [{"name": "reserve_pickup", "arguments": {"order_id": "B-2210"}}]}],
                    "fallback": {"text": "I'm sorry, I could not reserve a slot. Let me find someone to help."},
                }
                for other, llm, caller, said in (
                    ("billing-0412", never, "+41 44 555 01 12", "Why was I charged twice?"),
                    ("returns-0388", failing, "+41 31 555 09 77", "Can I pick up my order at the shop?"),
                    ("sales-0391", None, "+41 21 555 04 40", None),
                ):
                    body = {"id": other, "agent": "shop", "metadata": {"caller": caller}}
                    api.post("/v1/sessions", json={**body, **({"llm": llm} if llm else {})}).raise_for_status()
                    if said:
                        api.post(f"/v1/sessions/{other}/input", json={"text": said})
                sid = "support-7f3a"
                body = {
                    "id": sid,
                    "agent": "shop",
                    "llm": SCRIPT,
                    "playout": {"words_per_second": 6},
                    "metadata": {"caller": "+41 79 555 23 61"},
                }
                api.post("/v1/sessions", json=body).raise_for_status()

                browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1440, "height": 960})
                page.goto(f"{server.url}/console/#session={sid}")
                page.wait_for_selector('[data-type="session.started"]')

                api.post(f"/v1/sessions/{sid}/input", json={"text": "Hi! Is the oak desk lamp in stock?"})
                page.wait_for_selector('.row.speech[data-state="done"]:has-text("Good news")', timeout=15000)
                api.post(
                    f"/v1/sessions/{sid}/input",
                    json={"text": "Great. And where is my order A-1042? It should have arrived yesterday."},
                )
                page.wait_for_selector('.row.speech[data-state="speaking"]', timeout=15000)
                time.sleep(2.5)  # the customer hears the first sentence, then the operator cuts in
                page.click("#op-interrupt-now")
                page.wait_for_selector(".row.speech.interrupted[data-unheard='yes']")
                api.post(f"/v1/sessions/{sid}/input", json={"text": "Just tell me when you know."})
                page.wait_for_selector('.row.speech[data-state="done"]:has-text("tracking it now")', timeout=15000)
                page.wait_for_function(
                    "() => (document.querySelector('.row.tool[data-status=\"running\"] progress')?.value ?? 0) >= 0.5",
                    timeout=15000,
                )
                page.wait_for_function("() => document.querySelectorAll('#attention > li').length >= 2", timeout=15000)
                page.fill("#op-text", "Offer a 10% voucher for the delay")
                page.mouse.move(0, 0)
                Path(args.output).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=args.output)
                browser.close()
                api.delete(f"/v1/sessions/{sid}")
        finally:
            server.stop()
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
