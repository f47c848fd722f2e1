"""The operator CLI (`switchboard sessions|tail|input|interrupt|tools|cancel`) as a subprocess against a real server."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from switchboard.cli.operator import Style, tail
from switchboard.client import AsyncClient
from tests.client_only import WITHOUT_SERVER
from tests.waiting import WAIT_S

from .console_support import create_session, server_events, wait_until
from .server import Server

pytestmark = pytest.mark.e2e

KEY = "cli-operator-key-0123456789"
READER = "cli-reader-key-0123456789"
KEYS = json.dumps(
    [
        {"key": KEY, "scopes": ["sessions:read", "sessions:write", "sessions:control", "tools:cancel", "events:read"]},
        {"key": READER, "scopes": ["sessions:read"]},
    ]
)
LONG = " ".join(f"word{i}" for i in range(1500))  # 30 s at 50 words/s: still speaking after several CLI runs
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("cli"), SWITCHBOARD_API_KEYS=KEYS).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as c:
        yield c


def cli_env(server: Server, key: str | None = KEY) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    env["SWITCHBOARD_URL"] = server.url
    if key:
        env["SWITCHBOARD_KEY"] = key
    return env


def run(server: Server, *argv: str, key: str | None = KEY) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "switchboard.cli", *argv]
    return subprocess.run(cmd, env=cli_env(server, key), capture_output=True, text=True, timeout=WAIT_S)


class Tail:
    """`switchboard tail` in the background; started once it has printed the session's first event."""

    def __init__(self, sid: str, *extra: str, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "switchboard.cli", "tail", sid, *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.first_line = self.proc.stdout.readline()  # blocks until connected and replaying
        assert self.first_line, self.proc.stderr.read() if self.proc.stderr else ""
        # the rest is read through the same buffered reader: readline() may already hold the next lines, which
        # communicate() (it reads the raw pipe) would never see
        self._rest: list[str] = []
        self._reader = threading.Thread(target=lambda: self._rest.append(self.proc.stdout.read()), daemon=True)
        self._reader.start()

    def finish(self, timeout: float = WAIT_S) -> tuple[int, str, str]:
        assert self.proc.stderr is not None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._reader.join(WAIT_S)
            out, err = "".join(self._rest), self.proc.stderr.read()
            raise AssertionError(f"tail did not end\nstdout:\n{out}\nstderr:\n{err}") from None
        self._reader.join(WAIT_S)
        return self.proc.returncode, self.first_line + "".join(self._rest), self.proc.stderr.read()


def printed_seqs(out: str) -> list[int]:
    return [int(line.split()[0]) for line in ANSI.sub("", out).splitlines() if line.strip()]


def wait_for_event(server: Server, sid: str, kind: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((e for e in server_events(server, sid, key=KEY, idle_s=0.1) if e["type"] == kind), None)

    return wait_until(found, interval=0.05, what=kind)


def test_operator_commands(srv: Server, client: httpx.Client) -> None:
    turns = [
        # a search that runs until it is cancelled: the commands before the cancel, each a process of its own, took
        # over 30 s on a loaded machine
        {"text": LONG, "tool_calls": [{"name": "search", "arguments": {"query": "flights", "seconds": 3600}}]},
        {"text": "Searching."},
    ]
    sid = create_session(client, turns)
    listed = run(srv, "sessions")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["SESSION", "AGENT", "STATE", "AGENT", "STATE", "TOOLS", "AGE"]
    assert any(r.split()[:3] == [sid, "tester", "active"] for r in rows), listed.stdout

    sent = run(srv, "input", sid, "find me a flight")
    assert sent.returncode == 0, sent.stderr
    assert re.fullmatch(rf"input item_\S+ sent to {sid}; reply in speech \S+\n", sent.stdout), sent.stdout
    started = wait_for_event(srv, sid, "tool.started")
    call_id = started["data"]["call_id"]

    everywhere = run(srv, "tools")
    assert everywhere.returncode == 0, everywhere.stderr
    row = next(r for r in everywhere.stdout.splitlines() if r.startswith(call_id))
    assert row.split()[1:5] == [sid, "search", "running", "yes"] and "searching flights" in row
    here = run(srv, "tools", sid)
    assert call_id in here.stdout

    wait_for_event(srv, sid, "speech.started")
    cut = run(srv, "interrupt", sid)
    assert cut.returncode == 0 and cut.stdout.startswith("interrupted speech "), cut.stdout + cut.stderr
    again = run(srv, "interrupt", sid, "--force")
    assert again.stdout == "nothing to interrupt: the agent is not speaking\n"

    cancelled = run(srv, "cancel", sid, call_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.startswith(f"cancelled search ({call_id})")
    statuses = {c["call_id"]: c["status"] for c in client.get(f"/v1/sessions/{sid}/tool-calls").json()["items"]}
    assert statuses[call_id] == "cancelled"

    twice = run(srv, "cancel", sid, call_id)
    assert twice.returncode == 1 and twice.stdout == ""
    assert twice.stderr == f"switchboard: Tool call '{call_id}' already ended (cancelled). (already_ended, HTTP 409)\n"
    missing = run(srv, "interrupt", "no-such-session")
    assert missing.returncode == 1
    assert missing.stderr == "switchboard: No session 'no-such-session'. (session_not_found, HTTP 404)\n"


def test_errors_are_one_plain_line(srv: Server, tmp_path: Path) -> None:
    no_key = run(srv, "sessions", key=None)
    assert no_key.returncode == 1 and no_key.stdout == ""
    assert (
        no_key.stderr == "switchboard: the service needs an API key: pass one with --key KEY or set SWITCHBOARD_KEY\n"
    )
    wrong = run(srv, "tools", "--key", "not-the-right-key-at-all", key=None)
    assert wrong.returncode == 1
    assert wrong.stderr == (
        "switchboard: the service did not accept the API key from --key: pass a valid one with --key KEY or set "
        "SWITCHBOARD_KEY\n"
    )
    down = run(srv, "sessions", "--url", "http://127.0.0.1:9")
    assert down.returncode == 1 and down.stderr.startswith("switchboard: cannot reach http://127.0.0.1:9")
    tail_missing = run(srv, "tail", "no-such-session")
    assert tail_missing.returncode == 1 and tail_missing.stderr == "switchboard: No session 'no-such-session'.\n"


def test_tail_shows_live_events_with_colours_and_progress_bars(srv: Server, client: httpx.Client) -> None:
    turns = [
        {"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 4, "step_s": 0.1}}]},
        {"text": "In the background."},
        {"text": "Result: {{tool_output:progress}}"},
    ]
    sid = create_session(client, turns)
    proc = Tail(sid, "--color", "always", env=cli_env(srv))
    client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})
    wait_for_event(srv, sid, "tool.ended")
    wait_until(
        lambda: any(
            e["type"] == "chat.item" and e["data"]["item"].get("text") == "Result: all 4 steps done"
            for e in server_events(srv, sid, key=KEY, idle_s=0.1)
        ),
    )
    assert client.delete(f"/v1/sessions/{sid}").status_code == 204
    code, out, err = proc.finish()
    assert code == 0, err
    assert "\x1b[" in out, "colours when asked"
    plain = ANSI.sub("", out)
    progress = [line for line in plain.splitlines() if " tool.progress " in line]
    assert len(progress) == 4
    assert progress[0].endswith("tool.progress       progress [█████░░░░░░░░░░░░░░░]  25% step 1/4")
    assert progress[-1].endswith("progress [████████████████████] 100% step 4/4")
    assert "user: count" in plain and "assistant: Result: all 4 steps done" in plain
    assert plain.splitlines()[-1].endswith("session closed")
    seqs = printed_seqs(out)
    assert seqs == list(range(1, len(seqs) + 1)) == [e["seq"] for e in server_events(srv, sid, key=KEY)]


async def test_tail_honours_4008_and_resumes_without_gaps(srv: Server) -> None:
    """A proxy in front of the real server plays a service that finds the tail too slow: it closes the first stream
    with 4008 after a few events. The tail resumes from its last seq and prints every event exactly once."""
    requested: list[str] = []

    async def proxy(down: ServerConnection) -> None:
        assert down.request is not None
        requested.append(down.request.path)
        headers = {"Authorization": down.request.headers["Authorization"]}
        async with connect(srv.ws_url + down.request.path, additional_headers=headers) as up:
            async for frame in up:
                await down.send(frame)
                seq = json.loads(frame)["seq"]
                if len(requested) == 1 and seq == 8:
                    await down.close(4008, f"too slow; resume with since={seq}")
                    return

    turns = [
        {"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 6, "step_s": 0.05}}]},
        {"text": "In the background."},
    ]
    async with httpx.AsyncClient(
        base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S
    ) as client:
        r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}})
        sid = r.json()["id"]
        out, notes = io.StringIO(), []
        async with serve(proxy, "127.0.0.1", 0) as proxy_server:
            port = proxy_server.sockets[0].getsockname()[1]
            api = AsyncClient(f"http://127.0.0.1:{port}", api_key=KEY)
            tail_task = asyncio.create_task(tail(api, sid, style=Style(False, True), out=out, note=notes.append))
            await client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})
            async with asyncio.timeout(WAIT_S):
                while " tool.ended " not in out.getvalue():
                    await asyncio.sleep(0.02)
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
            assert await asyncio.wait_for(tail_task, WAIT_S) == 0
            await api.aclose()
    assert notes == ["fell behind the live stream; resuming from seq 8"]
    assert [p.rsplit("since=", 1)[1] for p in requested] == ["0", "8"]
    seqs = printed_seqs(out.getvalue())
    assert seqs == list(range(1, len(seqs) + 1)) == [e["seq"] for e in server_events(srv, sid, key=KEY)]
    assert "session closed" in out.getvalue().splitlines()[-1]


def test_tail_resumes_across_a_server_restart(tmp_path: Path) -> None:
    first = Server(tmp_path).start()
    try:
        with httpx.Client(base_url=first.url, timeout=WAIT_S) as c:
            turns = [{"text": "Working.", "tool_calls": [{"name": "slow", "arguments": {"seconds": 30}}]}]
            sid = create_session(c, turns)
            proc = Tail(sid, "--url", first.url, "--color", "never", env=cli_env(first, key=None))
            c.post(f"/v1/sessions/{sid}/input", json={"text": "work"})
            wait_until(lambda: any(e["type"] == "tool.started" for e in server_events(first, sid, idle_s=0.1)))
    finally:
        first.kill()
    second = Server(tmp_path, database_url=first.database_url)
    second.port = first.port  # the same address: the tail reconnects to it
    second.start()
    try:
        with httpx.Client(base_url=second.url, timeout=WAIT_S) as c:
            wait_for_recovered = lambda: any(  # noqa: E731
                e["type"] == "session.recovered" for e in server_events(second, sid, idle_s=0.1)
            )
            wait_until(wait_for_recovered)
            assert c.delete(f"/v1/sessions/{sid}").status_code == 204
        code, out, err = proc.finish(timeout=WAIT_S)
        events = server_events(second, sid)
    finally:
        second.stop()
    assert code == 0, err
    assert "connection lost" in err and "reconnecting from seq" in err
    assert "session recovered after a restart" in out
    seqs = printed_seqs(out)
    assert seqs == list(range(1, len(seqs) + 1)) == [e["seq"] for e in events]


def test_a_refused_key_says_how_to_give_another(srv: Server, client: httpx.Client) -> None:
    sid = create_session(client, [])
    wrong = run(srv, "agents", key="not-the-right-key-at-all")
    assert wrong.returncode == 1 and "the API key from SWITCHBOARD_KEY" in wrong.stderr, wrong.stderr
    lacking = run(srv, "interrupt", sid, key=READER)
    assert lacking.returncode == 1 and lacking.stdout == ""
    assert lacking.stderr == (
        "switchboard: the API key from SWITCHBOARD_KEY lacks the 'sessions:control' scope for this: use a key that "
        "has it (--key or SWITCHBOARD_KEY)\n"
    )
    stream = run(srv, "tail", sid, "--key", READER, key=None)
    assert stream.returncode == 1 and stream.stderr.count("\n") == 1
    assert stream.stderr.startswith("switchboard: the API key from --key lacks"), stream.stderr


def test_global_options_go_before_or_after_the_command(srv: Server, client: httpx.Client) -> None:
    sid = create_session(client, [])
    before = run(srv, "--url", srv.url, "--key", KEY, "--json", "sessions", key=None)
    after = run(srv, "sessions", "--url", srv.url, "--key", KEY, "--json", key=None)
    mixed = run(srv, "--key", KEY, "sessions", "--json", key=None)
    for done in (before, after, mixed):
        assert done.returncode == 0, done.stderr
        assert sid in {s["id"] for s in json.loads(done.stdout)}
    # given on both sides, the one after the command wins
    assert run(srv, "--key", "not-the-right-key-at-all", "agents", "--key", KEY, key=None).returncode == 0
    assert run(srv, "--json", "agents").stdout.startswith("[")


def closed_pipe_run(server: Server, *argv: str) -> subprocess.CompletedProcess[str]:
    """The command with its stdout a pipe whose reader has already gone (like `| head` that has read its fill)."""
    read, write = os.pipe()
    os.close(read)
    try:
        cmd = [sys.executable, "-m", "switchboard.cli", *argv]
        return subprocess.run(cmd, env=cli_env(server), stdout=write, stderr=subprocess.PIPE, text=True, timeout=WAIT_S)
    finally:
        os.close(write)


def test_a_closed_stdout_ends_the_command_quietly(srv: Server, client: httpx.Client) -> None:
    sid = create_session(client, [])
    for argv in (("agents", "--json"), ("agents",), ("sessions", "--all"), ("tail", sid)):
        done = closed_pipe_run(srv, *argv)
        assert (done.returncode, done.stderr) == (141, ""), (argv, done.stderr)
    # a real pipeline: `switchboard tail SID | head -n 1` ends with head, quietly, though the session goes on
    cmd = [sys.executable, "-m", "switchboard.cli", "tail", sid]
    tail = subprocess.Popen(cmd, env=cli_env(srv), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.run(["head", "-n", "1"], stdin=tail.stdout, capture_output=True, timeout=WAIT_S)
    assert tail.stdout is not None and tail.stderr is not None
    tail.stdout.close()
    client.post(f"/v1/sessions/{sid}/say", json={"text": "More events for a reader that has gone."})
    try:
        assert tail.wait(WAIT_S) == 141
    finally:
        tail.kill()
    assert head.stdout.decode().split()[0] == "1" and tail.stderr.read() == b""


def test_client_commands_run_without_the_server_packages(srv: Server) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_SERVER, "--json", "agents"],
        env=cli_env(srv),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 0, done.stderr
    assert "demo" in {a["name"] for a in json.loads(done.stdout)}
    helped = subprocess.run(
        [sys.executable, "-c", WITHOUT_SERVER, "--help"], capture_output=True, text=True, timeout=WAIT_S
    )
    assert helped.returncode == 0 and "serve" in helped.stdout, helped.stderr
