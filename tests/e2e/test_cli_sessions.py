"""`switchboard create|say|close|agents|attention` as subprocesses against a real server (with auth on)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.waiting import WAIT_S

from .console_support import server_events, wait_until
from .server import Server
from .test_cli import KEY, run, srv

__all__ = ["srv"]  # the same kind of server as the other CLI tests (module-scoped fixture)

pytestmark = pytest.mark.e2e


def test_create_say_and_close_a_session(srv: Server) -> None:
    r = run(srv, "create", "tester", "--id", "cli-1", "--meta", "caller=+41 79 000 00 00", "--meta", "desk=2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "session cli-1 (tester) is active"
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S) as client:
        assert client.get("/v1/sessions/cli-1").json()["metadata"] == {"caller": "+41 79 000 00 00", "desk": "2"}
    r = run(srv, "say", "cli-1", "Your taxi is on its way.")
    assert r.returncode == 0 and r.stdout.startswith("cli-1 will say it in speech "), r.stderr
    wait_until(lambda: any(e["type"] == "speech.done" for e in server_events(srv, "cli-1", key=KEY)))
    said = [e for e in server_events(srv, "cli-1", key=KEY) if e["type"] == "chat.item"]
    assert said[-1]["data"]["item"]["text"] == "Your taxi is on its way."
    assert run(srv, "close", "cli-1").stdout.strip() == "closed cli-1"
    again = run(srv, "say", "cli-1", "hello?")
    assert again.returncode == 1 and again.stderr.strip() == "switchboard: Session 'cli-1' is closed."
    quiet = run(srv, "create", "tester", "-q")
    assert quiet.returncode == 0 and quiet.stdout.strip().startswith("sess")


def test_create_refuses_bad_input_in_one_line(srv: Server) -> None:
    r = run(srv, "create", "nobody")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "unknown agent 'nobody'" in r.stderr
    r = run(srv, "create", "tester", "--metadata", "[1]")
    assert r.returncode == 2 and r.stderr.strip() == "switchboard: --metadata must be a JSON object"
    r = run(srv, "create", "tester", key="wrong-key-0123456789")
    assert r.returncode == 1 and r.stderr.strip() == (
        "switchboard: the service did not accept the API key from SWITCHBOARD_KEY: pass a valid one with --key KEY or "
        "set SWITCHBOARD_KEY"
    )


def test_agents_lists_tools_and_models(srv: Server) -> None:
    r = run(srv, "agents")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split()[:3] == ["AGENT", "MODEL", "TOOLS"]
    tester = next(row for row in rows if row.startswith("tester "))
    assert "book" in tester and "search" in tester
    as_json = json.loads(run(srv, "agents", "--json").stdout)
    assert {"demo", "tester"} <= {a["name"] for a in as_json}


def test_attention_lists_what_needs_an_operator(srv: Server) -> None:
    turns = json.dumps({"provider": "scripted", "turns": [{"error": "model unreachable"}]})
    assert run(srv, "create", "tester", "--id", "cli-att", "--llm", turns).returncode == 0
    assert run(srv, "input", "cli-att", "hello?").returncode == 0

    def listed() -> str | None:
        # one line per reason: the session may be listed for its silence before the failed generation is
        out = run(srv, "attention").stdout
        lines = out.splitlines()
        return next((line for line in lines if line.startswith("cli-att ") and "generation_failed" in line), None)

    line = wait_until(listed)
    assert "model unreachable" in line


def test_attention_prints_a_model_error_without_its_terminal_controls(srv: Server) -> None:
    hostile = "down\x1b]0;owned\x07\x1b[2J\u009b31m\u202eexe"
    turns = json.dumps({"provider": "scripted", "turns": [{"error": hostile}]})
    assert run(srv, "create", "tester", "--id", "cli-att-esc", "--llm", turns).returncode == 0
    assert run(srv, "input", "cli-att-esc", "hello?").returncode == 0

    def listed() -> tuple[str, str] | None:
        out = run(srv, "attention").stdout
        lines = out.splitlines()
        line = next((line for line in lines if line.startswith("cli-att-esc") and "generation_failed" in line), None)
        return (out, line) if line else None

    out, line = wait_until(listed)
    for raw in ("\x1b", "\x07", "\u009b", "\u202e"):
        assert raw not in out, repr(raw)
    assert "down\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\u202eexe" in line
