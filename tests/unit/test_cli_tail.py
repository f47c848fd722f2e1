"""How `switchboard tail` ends and reconnects, against a small WebSocket server playing the service."""

from __future__ import annotations

import io
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from switchboard.cli.operator import ClientError, Style, tail
from switchboard.client import AsyncClient, Forbidden, SwitchboardError, Unauthorized

Handler = Callable[[ServerConnection], Awaitable[None]]


def frame(seq: int, type: str = "agent.state", **data: Any) -> str:
    return json.dumps({"seq": seq, "session_id": "s1", "type": type, "at": "2026-01-01T00:00:00+00:00", "data": data})


async def run_tail(
    handler: Handler, *, refuse_after: int | None = None, **kwargs: Any
) -> tuple[int | Exception, list[str], list[str], list[str]]:
    """Tail session s1 on a server running ``handler``; the handshakes after ``refuse_after`` answer 503."""
    requested: list[str] = []

    def process_request(ws: ServerConnection, request: Request) -> Response | None:
        requested.append(request.path)
        if refuse_after is not None and len(requested) > refuse_after:
            return ws.respond(503, "down for maintenance\n")
        return None

    out, notes = io.StringIO(), []
    async with serve(handler, "127.0.0.1", 0, process_request=process_request) as server:
        port = server.sockets[0].getsockname()[1]
        client = AsyncClient(f"http://127.0.0.1:{port}", reconnect_for_s=kwargs.pop("retry_for_s", 30.0))
        try:
            result: int | Exception = await tail(
                client, "s1", style=Style(False, False), out=out, note=notes.append, **kwargs
            )
        except (ClientError, SwitchboardError) as err:
            result = err
        finally:
            await client.aclose()
    seqs = [line.split()[0] for line in out.getvalue().splitlines()]
    return result, seqs, notes, [p.rsplit("since=", 1)[1] for p in requested]


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (4400, "the event stream rejected the request"),
        (4404, "No session 's1'."),
    ],
)
async def test_a_refusal_ends_the_tail_with_one_line(code: int, message: str) -> None:
    async def handler(ws: ServerConnection) -> None:
        await ws.close(code, "refused")

    result, seqs, notes, requested = await run_tail(handler)
    assert isinstance(result, ClientError) and str(result) == message
    assert seqs == [] and notes == [] and requested == ["0"]


@pytest.mark.parametrize(("code", "error"), [(4401, Unauthorized), (4403, Forbidden)])
async def test_a_refused_credential_ends_the_tail_with_its_error(code: int, error: type[SwitchboardError]) -> None:
    """Told by the command as how to give a key that the service takes (tests/e2e/test_cli.py)."""

    async def handler(ws: ServerConnection) -> None:
        await ws.close(code, "refused")

    result, seqs, notes, requested = await run_tail(handler)
    assert type(result) is error
    assert seqs == [] and notes == [] and requested == ["0"]


async def test_a_normal_close_for_a_closed_session_ends_the_tail() -> None:
    async def handler(ws: ServerConnection) -> None:
        await ws.send(frame(1))
        await ws.close(1000, "session closed")

    assert await run_tail(handler) == (0, ["1"], [], ["0"])


async def test_a_filtered_tail_does_not_take_skipped_seqs_for_a_gap() -> None:
    async def handler(ws: ServerConnection) -> None:
        await ws.send(json.dumps({"type": "pong"}))
        for seq in (2, 5, 5, 3):  # 5 again and 3 (older): already shown, not printed twice
            await ws.send(frame(seq, "tool.progress", call_id="c1"))
        await ws.send(frame(9, "session.closed"))

    result, seqs, notes, requested = await run_tail(handler, since=1, types="tool.*,session.*")
    assert (result, seqs, notes) == (0, ["2", "5", "9"], [])
    assert requested == ["1&types=tool.%2A%2Csession.%2A"]


async def test_a_dropped_stream_resumes_and_gives_up_after_retry_for() -> None:
    async def handler(ws: ServerConnection) -> None:
        await ws.send(frame(1))
        await ws.close(1011, "internal error")

    result, seqs, notes, requested = await run_tail(handler, refuse_after=2, retry_for_s=0.3)
    assert isinstance(result, ClientError)
    assert str(result) == "lost the event stream of 's1' and could not reconnect for 0 s"
    assert seqs == ["1"]
    assert notes[0] == "connection lost (1011: internal error); reconnecting from seq 1"
    # then every reconnect (answered 503 after the second handshake) is a note too, until retry_for runs out
    assert len(notes) >= 2 and all(n.startswith("connection lost (") and n.endswith("from seq 1") for n in notes)
    assert requested[:2] == ["0", "1"] and set(requested[2:]) <= {"1"}


async def test_a_tail_that_never_connects_retries_then_gives_up() -> None:
    async def handler(ws: ServerConnection) -> None:
        raise AssertionError("never reached")

    result, seqs, notes, requested = await run_tail(handler, refuse_after=0, retry_for_s=0.3)
    assert isinstance(result, ClientError)
    assert str(result) == "lost the event stream of 's1' and could not reconnect for 0 s"
    assert seqs == [] and notes and all(n.startswith("connection lost (1006: ") and "503" in n for n in notes)
    assert set(requested) == {"0"}
