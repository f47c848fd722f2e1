"""docs/deploy.md, "Quickstart with auth on", as a reader runs it: the key its `export` lines make, a real server with
those keys, and the documented `switchboard` and curl commands, which succeed with the key and answer 401 without."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.test_compose_file import QUICKSTART, exported, shell_blocks
from tests.waiting import WAIT_S

from .server import Server

pytestmark = [pytest.mark.e2e]


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=WAIT_S)


def test_the_documented_commands_work_with_the_quickstart_key(tmp_path: Path) -> None:
    given = exported(shell_blocks(QUICKSTART)[0])
    cli_block, curl_block = shell_blocks(QUICKSTART)[1:3]
    server = Server(tmp_path, SWITCHBOARD_API_KEYS=given["SWITCHBOARD_API_KEYS"]).start()
    try:
        env = {**os.environ, "SWITCHBOARD_URL": server.url, "SWITCHBOARD_KEY": given["SWITCHBOARD_KEY"]}
        keyless = {k: v for k, v in env.items() if k != "SWITCHBOARD_KEY"}
        refused = run([sys.executable, "-m", "switchboard.cli", "sessions"], keyless)
        assert refused.returncode != 0 and "the service needs an API key: pass one with --key" in refused.stderr
        for line in cli_block.splitlines():
            words = shlex.split(line)
            if words[:2] == ["switchboard", "tail"]:  # follows the session until it closes
                continue
            done = run([sys.executable, "-m", "switchboard.cli", *words[1:]], env)
            assert done.returncode == 0, (line, done.stdout, done.stderr)
        if shutil.which("curl") is None:
            return
        for command in curl_block.replace("\\\n", " ").splitlines():
            command = command.replace("localhost:8080", server.url).replace("curl -s", "curl -s --fail-with-body", 1)
            done = run(["bash", "-c", command], env)
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            done = run(["bash", "-c", command], keyless)
            assert done.returncode != 0 and '"status":401' in done.stdout, (command, done.stdout)
    finally:
        server.kill()
