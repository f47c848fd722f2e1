"""The reference edge's player against a protocol peer in this process: what it reports when the engine fails on a
speech, when the service stops one, and in what order."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from switchboard.cli.edge import Edge, EdgeOptions
from switchboard.cli.espeak import Espeak
from switchboard.client import AsyncClient

from .test_edge_espeak import require_espeak

TIMEOUT_S = 20.0


class Peer:
    """The service's side of one media connection: frames to send, frames received."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.ws: ServerConnection | None = None
        self.connected = asyncio.Event()

    async def handler(self, ws: ServerConnection) -> None:
        self.ws = ws
        self.connected.set()
        async for raw in ws:
            await self.received.put(json.loads(raw))

    async def send(self, **frame: Any) -> None:
        assert self.ws is not None
        await self.ws.send(json.dumps(frame))

    async def speak(self, speech_id: str, text: str) -> None:
        await self.send(type="speech.start", speech_id=speech_id, allow_interruptions=True)
        await self.send(type="speech.text", speech_id=speech_id, delta=text)
        await self.send(type="speech.end", speech_id=speech_id)

    async def until(self, type: str, speech_id: str) -> list[dict[str, Any]]:
        """Every frame up to and including the first `type` for `speech_id`."""
        seen = []
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                frame = await self.received.get()
                seen.append(frame)
                if frame["type"] == type and frame.get("speech_id") == speech_id:
                    return seen


@pytest.fixture
def flaky_espeak(tmp_path: Path) -> Espeak:
    """The real espeak-ng behind a wrapper that fails on any text holding the word BREAK."""
    require_espeak()
    wrapper = tmp_path / "espeak-ng"
    # one process, never a child: the text is read, then handed to espeak-ng through a pipe it replaces itself with
    wrapper.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            import os, sys
            text = sys.stdin.buffer.read()
            if b"BREAK" in text:
                sys.exit("engine broke")
            r, w = os.pipe()
            os.write(w, text)
            os.close(w)
            os.dup2(r, 0)
            os.execv("/usr/bin/espeak-ng", ["espeak-ng", *sys.argv[1:]])
            """
        )
    )
    wrapper.chmod(0o755)
    return Espeak(binary=str(wrapper))


async def test_a_speech_the_engine_fails_on_ends_interrupted_and_the_next_one_plays(
    flaky_espeak: Espeak, tmp_path: Path
) -> None:
    peer = Peer()
    notes: list[str] = []
    async with serve(peer.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with AsyncClient(f"http://127.0.0.1:{port}") as sb, sb.media("s1") as conn:
            lines: asyncio.Queue[str | None] = asyncio.Queue()
            edge = Edge(conn, EdgeOptions(flaky_espeak, tmp_path, None, False), say=notes.append)
            running = asyncio.create_task(edge.run(lines))
            try:
                await peer.connected.wait()
                await peer.speak("sp1", "This will BREAK the engine.")
                await peer.speak("sp2", "Fine.")
                broken = await peer.until("playback.finished", "sp1")
                assert broken[-1] == {"type": "playback.finished", "speech_id": "sp1", "interrupted": True}
                assert not [f for f in broken if f["type"] == "playback.progress"]  # nothing was heard
                fine = await peer.until("playback.finished", "sp2")
                types = ["playback.started", "playback.progress", "playback.progress", "playback.finished"]
                assert [f["type"] for f in fine] == types
                # at 0 first: the edge reports positions, so a cut before the first word is heard as nothing
                assert [f["played_chars"] for f in fine[1:3]] == [0, len("Fine.")]
                assert fine[-1]["interrupted"] is False
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
    assert any("sp1 could not be synthesised" in n and "exited with 1: engine broke" in n for n in notes), notes
    assert (tmp_path / "sp2.wav").exists() and not (tmp_path / "sp1.wav").exists()


async def test_a_stop_silences_the_speech_at_once_and_reports_it_cut_after_its_last_progress(tmp_path: Path) -> None:
    require_espeak()
    peer = Peer()
    async with serve(peer.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with AsyncClient(f"http://127.0.0.1:{port}") as sb, sb.media("s1") as conn:
            edge = Edge(conn, EdgeOptions(Espeak(), tmp_path, None, False), say=lambda _: None)
            running = asyncio.create_task(edge.run(asyncio.Queue()))
            try:
                await peer.connected.wait()
                await peer.speak("sp1", "One two three four five six seven eight nine ten eleven twelve.")
                await peer.until("playback.progress", "sp1")  # at 0: it reports positions
                await peer.until("playback.progress", "sp1")  # a word was heard
                await peer.send(type="speech.stop", speech_id="sp1")
                frames = await peer.until("playback.finished", "sp1")
                assert frames[-1]["interrupted"] is True
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
    record = json.loads((tmp_path / "sp1.json").read_text())
    assert record["interrupted"] is True and 0 < record["reported_chars"] < len(record["text"])
    assert (tmp_path / "sp1.wav").stat().st_size == 44 + 2 * record["played_samples"]
