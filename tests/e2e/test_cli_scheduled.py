"""`switchboard inject|say|interrupt --when`, `coach`, `scheduled` and `unschedule` as subprocesses against a real
server (with auth on), and the Python client's methods for them."""

from __future__ import annotations

import json

import pytest

from switchboard.client import Client, Conflict

from .console_support import server_events, wait_until
from .server import Server
from .test_cli import KEY, run, srv

__all__ = ["srv"]  # the same kind of server as the other CLI tests (module-scoped fixture)

pytestmark = pytest.mark.e2e

# a speech that outlasts the commands a test sends while it plays, however loaded the machine (60 s at the test
# server's 50 words a second); a test that needs it over interrupts it
LONG = " ".join(f"word{i}" for i in range(3000))


def _speaking(srv: Server, sid: str) -> bool:
    return any(e["type"] == "speech.started" for e in server_events(srv, sid, key=KEY))


def test_inject_when_idle_coach_list_and_unschedule(srv: Server) -> None:
    llm = json.dumps({"provider": "scripted", "turns": [{"text": LONG}, {"text": "Noted: {{coach}}"}]})
    assert run(srv, "create", "tester", "--id", "cli-when", "--llm", llm).returncode == 0
    assert run(srv, "input", "cli-when", "talk").returncode == 0
    wait_until(lambda: _speaking(srv, "cli-when"))
    r = run(srv, "inject", "cli-when", "are you there?", "--when", "idle")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("input scheduled on cli-when as sched_") and "(idle): pending" in r.stdout
    said = run(srv, "say", "cli-when", "One moment.", "--when", "after-speech")
    assert said.returncode == 0 and "(after_speech): pending" in said.stdout, said.stderr
    listed = run(srv, "scheduled", "cli-when")
    assert listed.returncode == 0 and listed.stdout.count("pending") == 2, listed.stdout
    say_id = said.stdout.split(" as ")[1].split()[0]
    assert run(srv, "unschedule", "cli-when", say_id).stdout.strip() == f"{say_id} cancelled"
    again = run(srv, "unschedule", "cli-when", say_id)
    assert again.returncode == 1 and "already cancelled" in again.stderr
    coached = run(srv, "coach", "cli-when", "offer the refund")
    assert coached.returncode == 0 and coached.stdout.startswith("note coach_"), coached.stderr
    bad = run(srv, "inject", "cli-when", "x", "--when", "later")
    assert bad.returncode == 2 and "after-tool:CALL_ID" in bad.stderr
    unknown = run(srv, "say", "cli-when", "x", "--when", "after-tool:call_nope")
    assert unknown.returncode == 1 and "no tool call" in unknown.stderr
    assert run(srv, "interrupt", "cli-when").returncode == 0  # the agent is idle: the input applies

    def answered() -> bool:
        events = server_events(srv, "cli-when", key=KEY)
        return sum(e["type"] == "scheduled.applied" for e in events) >= 2

    wait_until(answered)
    items = [e["data"]["item"] for e in server_events(srv, "cli-when", key=KEY) if e["type"] == "chat.item"]
    assert [it["text"] for it in items if it.get("role") == "user"] == ["talk", "are you there?"]
    assert any(it.get("text") == "Noted: offer the refund" for it in items)
    done = json.loads(run(srv, "scheduled", "cli-when", "--all", "--json").stdout)
    assert sorted(it["state"] for it in done) == ["applied", "applied", "cancelled"]


def test_the_client_schedules_coaches_and_cancels(srv: Server) -> None:
    with Client(srv.url, api_key=KEY) as sb:
        llm = {"provider": "scripted", "turns": [{"text": LONG}]}
        session = sb.create_session("tester", id="client-when", llm=llm)
        sb.input(session.id, "talk")
        wait_until(lambda: _speaking(srv, session.id))
        res = sb.interrupt(session.id, when="after-speech")
        assert res.scheduled is not None and res.scheduled.kind == "interrupt" and not res.interrupted
        note = sb.coach(session.id, "be brief")
        pending = sb.list_scheduled(session.id, pending_only=True)
        assert [c.id for c in pending] == [res.scheduled.id, note.id]
        cancelled = sb.cancel_scheduled(session.id, note.id)
        assert cancelled.state == "cancelled" and cancelled.reason == "cancelled_by_operator"
        with pytest.raises(Conflict):
            sb.cancel_scheduled(session.id, note.id)
        assert sb.get_scheduled(session.id, note.id).state == "cancelled"
        with pytest.raises(ValueError):
            sb.say(session.id, "x", when="after_tool")
        now = sb.say(session.id, "Right away.")
        assert now.speech_id and now.scheduled is None
