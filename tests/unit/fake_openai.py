"""A tiny OpenAI-compatible server on a loopback port: real HTTP/1.1 and server-sent events, written by hand.

Each request to ``POST /v1/chat/completions`` is recorded and answered with the next scripted ``Reply`` (a stream of
chunks, an error status, a stall); when the script runs out it answers "OK.".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tests.waiting import WAIT_S

# -- chunks -----------------------------------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, *, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "fake",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
    }


def role() -> dict[str, Any]:
    return chunk({"role": "assistant", "content": ""})


def text(content: str) -> dict[str, Any]:
    return chunk({"content": content})


def tool(index: int, *, id: str | None = None, name: str | None = None, args: str | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {}
    if name is not None:
        function["name"] = name
    if args is not None:
        function["arguments"] = args
    call: dict[str, Any] = {"index": index, "function": function}
    if id is not None:
        call.update(id=id, type="function")
    return chunk({"tool_calls": [call]})


def finish(reason: str = "stop") -> dict[str, Any]:
    return chunk(finish=reason)


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "fake",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


def text_reply(*words: str, prompt: int = 10, completion: int = 0) -> Reply:
    return Reply(events=[role(), *(text(w) for w in words), finish(), usage(prompt, completion or len(words))])


# -- the server -------------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """One answer. ``events`` are SSE data payloads (dict -> JSON, str sent raw) or float pauses in seconds.
    With ``status`` != 200, ``body`` is sent as JSON instead. ``stall`` keeps the response open without sending
    anything more (until the client goes away)."""

    events: list[dict[str, Any] | str | float] = field(default_factory=list)
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    stall: bool = False
    done: bool = True  # send "data: [DONE]" after the events
    abort: bool = False  # drop the connection after the events, mid-response


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 429: "Too Many Requests", 500: "Server Error"}


class FakeOpenAI:
    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.requests: list[Received] = []
        self.disconnects = 0  # responses the client walked away from before they ended
        self._disconnect_ev = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests]

    async def wait_disconnect(self, timeout: float = WAIT_S) -> None:
        async with asyncio.timeout(timeout):
            await self._disconnect_ev.wait()

    async def start(self) -> FakeOpenAI:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        # closing a connection ends its handler (EOF); a handler still pausing between events is cancelled
        for writer in list(self._writers):
            writer.close()
        if self._conns:
            _, pending = await asyncio.wait(
                self._conns, timeout=1.0
            )  # bound: then the handlers still pausing are cancelled
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        self._writers.add(writer)
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            self._lost()
        except asyncio.CancelledError:
            return  # torn down by aclose(); asyncio's server callback would log a cancelled handler as an error
        finally:
            self._conns.discard(task)
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _lost(self) -> None:
        self.disconnects += 1
        self._disconnect_ev.set()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False  # keep-alive connection closed between requests
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        raw = await reader.readexactly(int(headers.get("content-length", "0")))
        self.requests.append(Received(method, path, headers, json.loads(raw) if raw else None))
        reply = self.replies.popleft() if self.replies else text_reply("OK.")
        if reply.status != 200:
            payload = json.dumps(reply.body if reply.body is not None else {"error": {"message": "boom"}}).encode()
            extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
            writer.write(
                f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Error')}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n{extra}\r\n".encode()
                + payload
            )
            await writer.drain()
            return True
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"cache-control: no-cache\r\n\r\n"
        )
        await writer.drain()
        for event in reply.events:
            if isinstance(event, float | int):
                await asyncio.sleep(event)
                continue
            data = event if isinstance(event, str) else json.dumps(event)
            await self._send(writer, f"data: {data}\n\n".encode())
        if reply.abort:
            return False  # the connection closes with the chunked body unfinished
        if reply.stall:
            # hold the response open; the client leaving (timeout, cancellation) ends it
            await reader.read()
            self._lost()
            return False
        if reply.done:
            await self._send(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()
