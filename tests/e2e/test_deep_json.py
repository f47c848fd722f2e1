"""JSON nested too deeply to read (``[[[[...]]]]``) is bad input wherever a client sends it: an error frame
``bad_json`` on the media edge, a 4400 close on an event stream, a 4xx problem for a body; never a
``RecursionError`` with a traceback in the log. Against a real server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
import websockets

from tests.waiting import WAIT_S

from .edge_client import Edge
from .server import Server
from .test_media_edge import create

pytestmark = pytest.mark.e2e

DEPTH = 3000  # well past Python's recursion limit, well under a frame's size limit


def deep(opening: str, closing: str, inner: str = "1") -> str:
    return opening * DEPTH + inner + closing * DEPTH


DEEP_VALUES = [deep("[", "]"), deep('{"a":', "}"), deep("[", "]", "").replace("][", "],[")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("deep")).start()
    try:
        yield srv
    finally:
        srv.stop()


def _no_recursion_logged(server: Server) -> None:
    logs = server.logs()
    assert "RecursionError" not in logs and "Traceback" not in logs, logs[-3000:]


async def test_a_deeply_nested_media_frame_is_bad_json_and_the_edge_goes_on(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": "hello"}])
        edge = await Edge.connect(server.ws_url, sid)
        frames = [*DEEP_VALUES, '{"type": "ping", "x": ' + DEEP_VALUES[0] + "}", deep("[", "", "")]
        for frame in frames:
            await edge.send(frame)
        await edge.send({"type": "ping"})
        await edge.wait_for("pong", timeout=WAIT_S)
        assert [f["code"] for f in edge.of_type("error")] == ["bad_json"] * len(frames)
        await edge.close()
    _no_recursion_logged(server)


async def test_a_deeply_nested_event_stream_message_closes_it_4400(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await create(client, [{"text": "hello"}])
    async with websockets.connect(f"{server.ws_url}/v1/sessions/{sid}/events") as ws:
        await ws.send(json.dumps({"type": "ping"}))
        await ws.send(DEEP_VALUES[0])
        with pytest.raises(websockets.ConnectionClosed) as closed:
            async with asyncio.timeout(WAIT_S):
                while True:
                    await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4400
    _no_recursion_logged(server)


async def test_a_deeply_nested_body_is_a_client_error(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        for depth in (400, DEPTH):  # read by the parser, but too deep to walk; too deep to read at all
            nested = "[" * depth + "]" * depth
            body = '{"agent": "tester", "metadata": {"deep": ' + nested + "}}"
            r = await client.post("/v1/sessions", content=body, headers={"content-type": "application/json"})
            assert r.status_code in (400, 422), (depth, r.status_code, r.text[:300])
            assert r.headers["content-type"] == "application/problem+json"
    _no_recursion_logged(server)
