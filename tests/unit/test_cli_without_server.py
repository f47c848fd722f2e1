"""`switchboard` installed without its server (`pip install switchboard`): the server's commands say how to get it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.client_only import WITHOUT_SERVER
from tests.waiting import WAIT_S


@pytest.mark.parametrize("argv", [["serve"], ["migrate"], ["openapi", "-o", "-"], ["asyncapi", "-o", "-"]])
def test_a_server_command_without_the_server_is_one_line_and_status_2(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_SERVER, *argv], capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == 'switchboard: the server is not installed: pip install "switchboard[server]"\n'
