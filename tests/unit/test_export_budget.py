"""Export slots: counted per caller and per process, each given back once however often its release is called, and
bytes a caller never sent (its export cancelled while it waited for them) not spent."""

from __future__ import annotations

import asyncio

import pytest

from switchboard.api.sessions.export_budget import ExportBudget, ExportsBusy
from tests.waiting import WAIT_S


def test_slots_per_caller_and_per_process_each_given_back_once() -> None:
    budget = ExportBudget(max_running=3, max_per_caller=2, bytes_per_s=0)
    first, _ = budget.enter("key:a"), budget.enter("key:a")
    with pytest.raises(ExportsBusy, match="credential"):
        budget.enter("key:a")
    budget.enter(None)  # auth off: only the process's cap
    with pytest.raises(ExportsBusy, match="server"):
        budget.enter("key:b")
    first()
    first()  # the response and the document both release it: once is what counts
    assert budget.running() == 2 and budget.running("key:a") == 1
    budget.enter("key:b")
    with pytest.raises(ExportsBusy, match="server"):
        budget.enter("key:a")


async def test_bytes_never_sent_are_not_spent() -> None:
    now = [100.0]
    budget = ExportBudget(max_running=2, max_per_caller=2, bytes_per_s=1000, clock=lambda: now[0])
    await budget.spend("key:a", 1000)  # a second's worth: at once
    waiting = asyncio.create_task(budget.spend("key:a", 50_000))  # 50 s of budget
    await asyncio.sleep(0)
    assert not waiting.done()
    waiting.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await waiting
    now[0] += 1.0
    await asyncio.wait_for(budget.spend("key:a", 1000), timeout=WAIT_S)  # paid for by the second gone by
    assert budget.running() == 0
