"""`switchboard tail` never skips a seq: a missing frame makes it read again from the last one shown."""

from __future__ import annotations

import io
import json
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

from switchboard.cli.operator import Style, tail
from switchboard.client import AsyncClient


def frame(seq: int, type: str = "agent.state", **data: Any) -> str:
    return json.dumps({"seq": seq, "session_id": "s1", "type": type, "at": "2026-01-01T00:00:00+00:00", "data": data})


async def test_tail_rereads_after_a_missing_frame():
    requested: list[str] = []

    async def handler(ws: ServerConnection) -> None:
        requested.append(ws.request.path if ws.request else "")
        if len(requested) == 1:
            for seq in (1, 3):  # seq 2 is missing on the first connection
                await ws.send(frame(seq, state="listening"))
            await ws.wait_closed()
        else:
            for seq in (2, 3):
                await ws.send(frame(seq, state="listening"))
            await ws.send(frame(4, "session.closed"))

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        out, notes = io.StringIO(), []
        code = await tail(
            AsyncClient(f"http://127.0.0.1:{port}"), "s1", style=Style(False, False), out=out, note=notes.append
        )
    assert code == 0
    assert [line.split()[0] for line in out.getvalue().splitlines()] == ["1", "2", "3", "4"]
    assert [p.rsplit("since=", 1)[1] for p in requested] == ["0", "1"]
    assert notes == ["missed events after seq 1; re-reading them"]
