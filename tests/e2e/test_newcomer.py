"""A newcomer's first hour, as the README tells it: the installed `switchboard` command, run in a folder that holds
their own agent module and their own agents file, serves both; a module that is not there is one clear line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.waiting import WAIT_S

from .server import ROOT, Server

pytestmark = pytest.mark.e2e

SWITCHBOARD = str(Path(sys.executable).parent / "switchboard")
MODULE = textwrap.dedent(
    '''
    from switchboard import Agent, RunContext, function_tool


    class Greeter(Agent):
        def __init__(self) -> None:
            super().__init__(instructions="You greet people.")

        @function_tool
        async def greet(self, ctx: RunContext, name: str) -> str:
            """Greet someone."""
            return f"Hello, {name}!"


    AGENTS = {"greeter": Greeter}
    '''
)
AGENTS_FILE = textwrap.dedent(
    """
    - name: desk
      instructions: You answer questions at the front desk.
    """
)


def test_the_switchboard_command_finds_agents_in_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "myagents.py").write_text(MODULE)
    (tmp_path / "agents.yaml").write_text(AGENTS_FILE)
    server = Server(
        tmp_path,
        command=[SWITCHBOARD],
        PYTHONPATH="",  # nothing but the working directory makes `myagents` importable
        SWITCHBOARD_AGENTS="myagents:AGENTS",
        SWITCHBOARD_AGENTS_FILE="agents.yaml",
    ).start()
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            turns = [
                {"text": "Let me.", "tool_calls": [{"name": "greet", "arguments": {"name": "Ada"}}]},
                {"text": "{{tool_output:greet}}"},
            ]
            r = client.post("/v1/sessions", json={"id": "mine", "agent": "greeter", "llm": {"turns": turns}})
            assert r.status_code == 201, r.text
            assert client.post("/v1/sessions", json={"id": "declared", "agent": "desk"}).status_code == 201
            assert client.post("/v1/sessions/mine/input", json={"text": "hi"}).status_code == 202
            deadline = time.monotonic() + WAIT_S
            texts: list[str] = []
            while time.monotonic() < deadline and "Hello, Ada!" not in texts:
                items = client.get("/v1/sessions/mine/chat").json()["items"]
                texts = [it.get("text") or it.get("output") for it in items]
                time.sleep(0.05)
            assert "Hello, Ada!" in texts, texts
    finally:
        server.kill()


def test_a_missing_agents_module_is_one_clear_line(tmp_path: Path) -> None:
    env = {
        "PATH": str(Path(sys.executable).parent),
        "PYTHONPATH": str(ROOT),
        "SWITCHBOARD_AGENTS": "nosuchmod:AGENTS",
        "SWITCHBOARD_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/n.db",
    }
    done = subprocess.run(
        [SWITCHBOARD, "serve", "--port", "0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "switchboard: nosuchmod:AGENTS: no module named 'nosuchmod' (looked in the working directory and on the "
        "Python path)\n"
    )


def test_python_dash_m_switchboard_is_the_command(tmp_path: Path) -> None:
    """Where the environment's scripts are not on the PATH, ``python -m switchboard`` is the same command (it failed:
    the package had no ``__main__``)."""
    done = subprocess.run(
        [sys.executable, "-m", "switchboard", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout
