"""`switchboard tail` never hands a terminal the controls found in session text: escape sequences, C1 controls and
bidi overrides from users, models or tool backends are printed as visible escapes."""

from __future__ import annotations

import argparse
import io
import json
import sys
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from switchboard.cli import main as cli_main
from switchboard.cli.operator import Style, printable, tail
from switchboard.client import AsyncClient

HOSTILE = "hi\x1b]0;owned\x07\x1b[2J\x1b[1A\u009b31m\u202etxt.exe\u2066x\u2069\r\nfake line\x00\x7f"


def frame(seq: int, type: str, **data: Any) -> str:
    return json.dumps({"seq": seq, "session_id": "s1", "type": type, "at": "2026-01-01T00:00:00+00:00", "data": data})


async def test_tail_prints_terminal_controls_as_escapes():
    async def handler(ws: ServerConnection) -> None:
        await ws.send(frame(1, "user.input", text=HOSTILE, final=True))
        await ws.send(frame(2, "tool.started", call_id="c1", name=f"t{HOSTILE}", arguments={HOSTILE: HOSTILE}))
        await ws.send(frame(3, "tool.progress", call_id="c1", message=HOSTILE, progress=0.5))
        await ws.send(frame(4, "generation.failed", error=HOSTILE))
        await ws.send(frame(5, "session.closed"))

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        out = io.StringIO()
        code = await tail(AsyncClient(f"http://127.0.0.1:{port}"), "s1", style=Style(True, True), out=out)
    assert code == 0
    lines = out.getvalue().split("\n")[:-1]
    assert len(lines) == 5, lines  # one line per event: no raw newline from the text
    printed = out.getvalue()
    for raw in ("\x1b]", "\x07", "\x1b[2J", "\x1b[1A", "\u009b", "\u202e", "\u2066", "\u2069", "\r", "\x00", "\x7f"):
        assert raw not in printed, repr(raw)
    assert "\\x1b]0;owned\\x07" in printed and "\\u202etxt.exe" in printed and "\\x9b31m" in printed
    assert "\x1b[" in printed  # tail's own colours still go through (Style(colour=True))


def test_printable_keeps_text_and_tabs():
    assert printable({"k": ["héllo\tworld ✓", 1, None, True]}) == {"k": ["héllo\tworld ✓", 1, None, True]}
    assert printable({"a\x1bb": "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"}) == {
        "a\\x1bb": "\\u202a\\u202b\\u202c\\u202d\\u202e\\u2066\\u2067\\u2068\\u2069"
    }


def test_a_new_command_cannot_print_terminal_controls(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """Every command's stdout and stderr go through the output layer: one that prints server text raw (like
    `attention` did) still shows its controls as escapes; only Style's colours and line breaks pass."""

    def hostile(args: argparse.Namespace) -> int:
        print(HOSTILE + Style(True, True)("ok", "bold", "red"))
        print(HOSTILE, file=sys.stderr)
        return 0

    def with_a_new_command(sub: Any) -> None:
        sub.add_parser("hostile").set_defaults(func=hostile)

    monkeypatch.setattr(cli_main, "add_edge_command", with_a_new_command)
    assert cli_main.main(["hostile"]) == 0
    out, err = capsys.readouterr()
    for printed in (out, err):
        for raw in ("\x1b]", "\x07", "\x1b[2J", "\x1b[1A", "\u009b", "\u202e", "\u2066", "\r", "\x00", "\x7f"):
            assert raw not in printed, repr(raw)
        assert "hi\\x1b]0;owned\\x07\\x1b[2J\\x1b[1A\\x9b31m\\u202etxt.exe" in printed
    assert out.endswith("\x1b[1;31mok\x1b[0m\n")  # Style's own sequences are not escaped
    assert err.count("\n") == 2  # line breaks stay: the stream carries lines
