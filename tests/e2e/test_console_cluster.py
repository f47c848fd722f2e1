"""The console's attention queue on a real three-node cluster, in Chromium: a node that does not answer in time (frozen
with SIGSTOP) is named above the queue, whose sessions it runs are missing from it, and the note goes once it answers
again."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from .cluster_support import RedisServer, start_all, until
from .console_support import CHROMIUM, CHROMIUM_ARGS, require_chromium
from .test_cluster_wide import SETUP, _attention, _auth, _ids, _nodes, _pinned

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.browser, pytest.mark.timeout(240)]

MISSING = "#attention-missing"


async def test_the_attention_queue_names_a_node_that_does_not_answer(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    require_chromium()
    from playwright.async_api import async_playwright

    nodes = _nodes(tmp_path, database_url, redis)
    a, b, c = nodes
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            on_a = await _pinned(http, a, "node-a", [{"error": "upstream 502"}])
            on_b = await _pinned(http, b, "node-b", [{"error": "upstream 502"}])
            for sid in (on_a, on_b):
                r = await http.post(f"{c.url}/v1/sessions/{sid}/input", json={"text": "hi"}, headers=_auth(SETUP))
                assert r.status_code == 202, r.text

            async def listed() -> bool:
                return set(_ids(await _attention(http, c))) == {on_a, on_b}

            await until(listed)
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                ctx = await browser.new_context()
                await ctx.add_init_script(f"sessionStorage.setItem('switchboard.apiKey', {json.dumps(SETUP)})")
                page = await ctx.new_page()
                errors: list[Any] = []
                page.on("pageerror", lambda err: errors.append(str(err)))
                page.set_default_timeout(15000)
                await page.goto(f"{c.url}/console/")
                await page.wait_for_selector(f'#attention li[data-session-id="{on_b}"]')
                assert await page.is_hidden(MISSING)

                assert b.proc is not None
                b.proc.send_signal(signal.SIGSTOP)
                try:
                    # within a poll or two, well inside the frozen node's lease (nothing fails over meanwhile)
                    note = await page.wait_for_selector(
                        f"{MISSING}:not([hidden])", timeout=6000
                    )  # bound: inside the frozen node's lease
                    assert await note.inner_text() == "Not answering: node-b — their sessions are not listed."
                    assert await note.get_attribute("data-nodes") == "node-b"
                    shown = await page.eval_on_selector_all(
                        "#attention > li", "els => els.map(e => e.dataset.sessionId)"
                    )
                    assert shown == [on_a]
                finally:
                    b.proc.send_signal(signal.SIGCONT)

                await page.wait_for_selector(MISSING, state="hidden")
                await page.wait_for_selector(f'#attention li[data-session-id="{on_b}"]')
                assert await page.inner_text(MISSING) == ""
                assert not errors, errors
            finally:
                await browser.close()
    finally:
        for node in nodes:
            node.stop()
