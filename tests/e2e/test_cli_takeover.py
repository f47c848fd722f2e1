"""`switchboard takeover|say --operator|handback` as subprocesses against a real server (with auth on)."""

from __future__ import annotations

import httpx
import pytest

from tests.waiting import WAIT_S

from .console_support import server_events, wait_until
from .server import Server
from .test_cli import KEY, run, srv

__all__ = ["srv"]  # the same kind of server as the other CLI tests (module-scoped fixture)

pytestmark = pytest.mark.e2e


def test_take_over_speak_and_hand_back(srv: Server) -> None:
    assert run(srv, "create", "tester", "--id", "cli-hold").returncode == 0
    r = run(srv, "takeover", "cli-hold")
    assert r.returncode == 0 and r.stdout.startswith("cli-hold is held by "), r.stderr
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S) as client:
        assert client.get("/v1/sessions/cli-hold").json()["takeover"]["operator"]
    r = run(srv, "say", "cli-hold", "A human here.", "--operator")
    assert r.returncode == 0 and r.stdout.startswith("cli-hold will say it in speech "), r.stderr
    wait_until(lambda: any(e["type"] == "operator.spoke" for e in server_events(srv, "cli-hold", key=KEY)))
    assert run(srv, "input", "cli-hold", "thanks!").returncode == 0
    r = run(srv, "handback", "cli-hold")
    assert r.returncode == 0 and r.stdout.startswith("cli-hold handed back to the agent; the agent replies in speech ")
    again = run(srv, "handback", "cli-hold")
    assert again.returncode == 1 and "no operator holds session 'cli-hold'" in again.stderr
