"""``switchboard edge SID``: a reference media edge that speaks a session's speeches with espeak-ng.

It connects to ``WS /v1/sessions/{sid}/media``, synthesises each speech clause by clause as its text arrives,
plays it in real time (to the sound device, or into one WAV file per speech with ``--out DIR``) and reports
``playback.started``, ``playback.progress`` (the characters spoken to the end of a word, as the audio passes each
word) and ``playback.finished``. ``speech.stop`` silences it at once. Each line on stdin is a final user transcript,
sent again on each new connection until the session says it took it (:mod:`..client.edge_memory`); with
``--barge-in`` the edge first says the user started talking and, like a phone or a browser that hears its user, stops
its own audio there, so what it last reported is exactly what was played. At the end of stdin the edge exits
(status 0) once the session has taken every line and what it had sent to play has been played; it also exits when
the session closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client import AsyncClient, MediaConnection, MediaFrame, SwitchboardError, Unavailable
from ..client.edge_memory import DROP_CODES, RESEND_CODE, WAIT_CODE, EdgeIdentity, PendingTranscripts, Transcript
from .common import global_options, target
from .edge_audio import DeviceSink, Sink, SpeechRecord, WavSink, file_stem, find_player
from .espeak import Chunker, ClauseAudio, Espeak, SynthesisError, WordEnd
from .output import printable, short

FRAME_S = 0.02  # audio is played, written and measured in frames of this length
SESSION_CLOSED = 1000
SEGMENT_MEMORY = 256  # speeches whose segments are counted (for their file names)
RECONNECT_FIRST_S = 0.25
RECONNECT_MAX_S = 2.0
RESEND_AFTER_S = 1.0  # a transcript the service failed to apply (command_failed) is sent again after this pause
MAX_WAIT_S = 60.0  # the longest pause a rate_limited refusal's retry_after_s is taken at its word for
# a dropped connection, a restart, a stall (1011: missed keepalive; 4008: too slow), the database away for a moment
# (1013), a session being recovered or moved
RETRY_CODES = frozenset({1006, 1011, 1012, 1013, 4008, 4410})
CLOSE_NOTES = {
    4409: "Another edge connected to this session and replaced this one.",
    4410: "The session is not active.",
    4429: "The edge sent too many frames per second.",
}


class Playback:
    """One speech: its text as it arrives, its clauses being synthesised in order, what has been played."""

    def __init__(self, speech_id: str, allow_interruptions: bool, engine: Espeak, *, name: str) -> None:
        self.speech_id = speech_id
        self.allow_interruptions = allow_interruptions
        self.name = name  #: of its files: the speech id, and ``-2``, ``-3`` for the segments after a tool step
        self.record = SpeechRecord(speech_id)
        self.sinks: list[Sink] = []
        self.stopped = False
        self.finalised = False
        self._engine = engine
        self._chunker = Chunker()
        self._synthesis: list[asyncio.Task[ClauseAudio]] = []
        self.clauses: asyncio.Queue[asyncio.Task[ClauseAudio] | None] = asyncio.Queue()

    def add_text(self, delta: str) -> None:
        for clause in self._chunker.feed(delta):
            self._synthesise(self._engine.clause(clause))
        self.record.text = self._chunker.text

    def end(self) -> None:
        for clause in self._chunker.flush():
            self._synthesise(self._engine.clause(clause))
        self.clauses.put_nowait(None)

    def _synthesise(self, work: Coroutine[Any, Any, ClauseAudio]) -> None:
        task = asyncio.create_task(work)
        self._synthesis.append(task)
        self.clauses.put_nowait(task)

    async def cancel_synthesis(self) -> None:
        tasks: list[asyncio.Future[Any]] = []
        for task in self._synthesis:
            if task.done() and not task.cancelled() and task.exception() is None:
                tasks.append(task.result().words)  # synthesised, its words still being measured
            tasks.append(task)
        for future in tasks:
            future.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close_sinks(self, *, cut: bool) -> None:
        for sink in self.sinks:
            sink.close(cut=cut)
        self.sinks = []


@dataclass(frozen=True)
class EdgeOptions:
    engine: Espeak
    out: Path | None  #: the directory of the WAV files, if any
    player: str | None  #: the sound device's player (aplay, pw-play), if any
    barge_in: bool  #: each user line first says the user started talking
    transcripts: PendingTranscripts = field(default_factory=PendingTranscripts)  #: across connections
    identity: EdgeIdentity = field(default_factory=EdgeIdentity)  #: one per run of the edge


class Edge:
    """The edge of one media connection: a receiving pump, a player, and the user's lines."""

    def __init__(self, conn: MediaConnection, options: EdgeOptions, *, say: Callable[[str], None]) -> None:
        self.conn = conn
        self.engine = options.engine
        self.out = options.out
        self.player = options.player
        self.barge_in = options.barge_in
        self.options = options
        self.say = say
        self.speeches: dict[str, Playback] = {}  # the latest segment of each speech not yet finalised
        self._segments: dict[str, int] = {}
        self._queue: asyncio.Queue[Playback] = asyncio.Queue()
        self.current: Playback | None = None
        self._play_task: asyncio.Task[None] | None = None
        self._resends: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()  # a frame handled or a speech played: whether the edge is done may have changed

    async def run(self, lines: asyncio.Queue[str | None]) -> bool:
        """Until the service closes the connection, or the user's lines have ended and the edge is done with them
        (True), or the edge is cancelled."""
        user = asyncio.create_task(self._user(lines), name="edge-user")
        tasks = [
            asyncio.create_task(self._receive(), name="edge-receive"),
            asyncio.create_task(self._player(), name="edge-player"),
            user,
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure of any pump ends the edge with its error
            return user in done
        finally:
            if self._play_task is not None:
                tasks.append(self._play_task)
            tasks.extend(self._resends)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for playback in list(self.speeches.values()):
                await playback.cancel_synthesis()
                await self._finalise(playback, cut=True, report=False)

    # -- the service's frames --------------------------------------------------------------------------------------

    async def _receive(self) -> None:
        async for frame in self.conn:
            await self._on_frame(frame)
            self._changed.set()

    async def _on_frame(self, frame: MediaFrame) -> None:
        sid = frame.speech_id or ""
        if frame.type == "speech.start":
            # a speech with tool steps comes in segments, each opened by its own speech.start with the same id
            segment = self._segments[sid] = self._segments.pop(sid, 0) + 1
            if len(self._segments) > SEGMENT_MEMORY:
                del self._segments[next(iter(self._segments))]  # the speech least recently started
            name = file_stem(sid) + (f"-{segment}" if segment > 1 else "")
            playback = Playback(sid, frame.allow_interruptions is not False, self.engine, name=name)
            self.speeches[sid] = playback
            self._queue.put_nowait(playback)
        elif frame.type == "speech.text" and sid in self.speeches:
            self.speeches[sid].add_text(frame.delta or "")
        elif frame.type == "speech.end" and sid in self.speeches:
            self.speeches[sid].end()
        elif frame.type == "speech.stop":
            await self._stop(sid)
        elif frame.type == "transcript.taken" and frame.id:
            self.options.transcripts.discard(frame.id)
        elif frame.type == "error":
            self.say(f"the service reports an error: {frame.code}: {printable(frame.detail or '')}")
            if frame.id:
                self._refused(frame.id, frame.code or "", frame.retry_after_s)

    # -- playing ---------------------------------------------------------------------------------------------------

    async def _player(self) -> None:
        while True:
            playback = await self._queue.get()
            if playback.stopped:
                continue
            self.current = playback
            self._play_task = asyncio.create_task(self._play(playback), name=f"edge-play-{playback.speech_id}")
            # waited on, not awaited: a stop cancels the speech's playing, never the player
            await asyncio.wait([self._play_task])
            task, self._play_task, self.current = self._play_task, None, None
            failure = None if task.cancelled() else task.exception()
            if isinstance(failure, SynthesisError):
                # the engine failed on this speech: it ends where it was heard, and the next one is tried
                self.say(f"speech {playback.speech_id} could not be synthesised: {failure}")
                await playback.cancel_synthesis()
                await self._finalise(playback, cut=True, report=True)
            elif failure is not None:
                raise failure
            self._changed.set()

    async def _play(self, playback: Playback) -> None:
        clock: float | None = None
        while (clause := await playback.clauses.get()) is not None:
            audio = await clause
            if not playback.sinks:
                await self._open(playback, audio.rate)
            clock = await self._pace(playback, audio, clock)
        if not playback.sinks:
            await self.conn.send_started(playback.speech_id)  # a speech without a word to say
        await self._report(playback, len(playback.record.text))
        await self._finalise(playback, cut=False, report=True)

    async def _open(self, playback: Playback, rate: int) -> None:
        playback.record.rate = rate
        if self.out is not None:
            playback.sinks.append(WavSink(self.out / f"{playback.name}.wav", rate))
        if self.player is not None:
            playback.sinks.append(DeviceSink(self.player, rate))
        if not playback.sinks:
            playback.sinks.append(_Silent())
        await self.conn.send_started(playback.speech_id)
        # it reports positions: a speech cut before its first word is heard as nothing, not as all it was sent
        await self.conn.send_progress(playback.speech_id, 0)
        self.say(f"speech {playback.speech_id} playing")

    async def _pace(self, playback: Playback, audio: ClauseAudio, clock: float | None) -> float:
        """Play one clause in real time; ``clock`` is the loop time at which the speech's first sample played."""
        loop = asyncio.get_running_loop()
        record, rate = playback.record, audio.rate
        base = record.played_samples
        taken = 0  # of the clause's words, measured while it plays: a word is reported once its end is known
        if clock is None or clock + base / rate < loop.time():
            clock = loop.time() - base / rate  # the first clause, or synthesis fell behind: play on from now
        frame, pos = max(1, int(rate * FRAME_S)), 0
        while pos < audio.samples:
            end = min(pos + frame, audio.samples)
            pcm = audio.pcm[pos * 2 : end * 2]
            for sink in playback.sinks:
                sink.ahead(pcm)
            delay = clock + (base + end) / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            for sink in playback.sinks:
                sink.played(pcm)
            pos, record.played_samples = end, base + end
            taken = self._take_words(record, audio.known, taken, base)
            await self._report(playback, record.heard_chars())
        await audio.words  # every word of this clause before any of the next
        if self._take_words(record, audio.known, taken, base) > taken:
            await self._report(playback, record.heard_chars())
        return clock

    @staticmethod
    def _take_words(record: SpeechRecord, known: list[WordEnd], taken: int, base: int) -> int:
        record.words.extend((base + w.sample, w.chars) for w in known[taken:])
        return len(known)

    async def _report(self, playback: Playback, chars: int) -> None:
        if chars > playback.record.reported_chars:
            playback.record.reported_chars = chars
            # shielded: a stop arriving now must not leave the service unsure of what was reported
            await asyncio.shield(self.conn.send_progress(playback.speech_id, chars))

    # -- stopping --------------------------------------------------------------------------------------------------

    async def _halt(self, playback: Playback) -> None:
        """Silence the speech now: no frame after this one is played."""
        playback.stopped = True
        if self.current is playback and self._play_task is not None:
            self._play_task.cancel()
            await asyncio.wait([self._play_task])
        await playback.cancel_synthesis()

    async def _stop(self, speech_id: str) -> None:
        # the segment playing first (its audio stops now), then a later segment of the same speech still queued
        for playback in (self.current, self.speeches.get(speech_id)):
            if playback is not None and playback.speech_id == speech_id and not playback.finalised:
                await self._halt(playback)
                await self._finalise(playback, cut=True, report=True)

    async def _finalise(self, playback: Playback, *, cut: bool, report: bool) -> None:
        if playback.finalised:
            return
        playback.finalised = True
        if self.speeches.get(playback.speech_id) is playback:
            del self.speeches[playback.speech_id]
        record = playback.record
        record.interrupted = cut
        playback.close_sinks(cut=cut)
        if self.out is not None:
            record.write(self.out / f"{playback.name}.json")
        heard = printable(record.text[: record.reported_chars])
        if cut:
            seconds = record.played_samples / record.rate if record.rate else 0.0
            self.say(f"speech {playback.speech_id} stopped after {seconds:.2f} s; heard: {short(heard, 120)!r}")
        else:
            self.say(f"speech {playback.speech_id} finished: {short(heard, 120)!r}")
        if report:
            await self.conn.send_finished(playback.speech_id, interrupted=cut)

    # -- the user --------------------------------------------------------------------------------------------------

    async def _user(self, lines: asyncio.Queue[str | None]) -> None:
        said = self.options.transcripts
        for kept in said.pending():  # no answer on an earlier connection: taken or not, the session takes it once
            await self.conn.send_transcript(kept.text, id=kept.id)
        while (line := await lines.get()) is not None:
            text = line.strip()
            if not text:
                continue
            # kept before anything can fail or be cancelled: a line read is never lost with the connection
            kept, dropped = said.add(text)
            if dropped is not None:
                self.say(f"transcript {dropped.id} dropped: {said.limit} transcripts were waiting for an answer")
            if self.barge_in:
                await self._barge_in()
            await self.conn.send_transcript(text, id=kept.id)
        lines.put_nowait(None)  # the end stays for the next connection, if this one is lost before the edge is done
        await self._settled()

    async def _settled(self) -> None:
        """Until the session has answered every line sent and every speech it sent has been played."""
        while True:
            self._changed.clear()
            playing = self.speeches or self.current is not None or not self._queue.empty()
            if not playing and not self.options.transcripts.pending():
                return
            await self._changed.wait()

    def _refused(self, transcript_id: str, code: str, retry_after_s: float | None = None) -> None:
        """The service did not take a final transcript: send it again in a moment (after the wait it named, when
        over the credential's budget), or give it up."""
        kept = self.options.transcripts.get(transcript_id)
        if kept is None:
            return
        if code in (RESEND_CODE, WAIT_CODE):
            wait_s = RESEND_AFTER_S
            if code == WAIT_CODE and retry_after_s is not None:
                wait_s = min(max(retry_after_s, 0.0), MAX_WAIT_S)
            task = asyncio.create_task(self._send_again(kept, wait_s), name=f"edge-resend-{kept.id}")
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)
        elif code in DROP_CODES:
            self.options.transcripts.discard(transcript_id)
            self.say(f"transcript {transcript_id} dropped ({code}): {short(printable(kept.text), 80)!r}")

    async def _send_again(self, kept: Transcript, wait_s: float) -> None:
        await asyncio.sleep(wait_s)
        if self.options.transcripts.get(kept.id) is not None:  # neither taken nor given up meanwhile
            await self.conn.send_transcript(kept.text, id=kept.id)

    async def _barge_in(self) -> None:
        playback = self.current
        if playback is not None and playback.allow_interruptions:
            await self._halt(playback)
        await self.conn.send_user_started()
        if playback is not None and playback.stopped:
            await self._finalise(playback, cut=True, report=True)


class _Silent:
    """No device and no ``--out``: the speech is timed and reported all the same."""

    def ahead(self, pcm: bytes) -> None:
        pass

    def played(self, pcm: bytes) -> None:
        pass

    def close(self, *, cut: bool) -> None:
        pass


def stdin_lines(loop: asyncio.AbstractEventLoop) -> asyncio.Queue[str | None]:
    """Lines of stdin as they come (None at its end), read by a daemon thread that never holds up the exit."""
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def put(line: str | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody reads any more
            loop.call_soon_threadsafe(lines.put_nowait, line)

    def read() -> None:
        for line in sys.stdin:
            put(line)
        put(None)

    threading.Thread(target=read, name="edge-stdin", daemon=True).start()
    return lines


def _say(text: str) -> None:
    print(text, flush=True)


async def run_edge(args: argparse.Namespace) -> int:
    url, key = target(args)
    key = None if args.token else key
    engine = Espeak(voice=args.voice, wpm=args.wpm)
    await engine.pcm("ready")  # a missing voice or a broken engine is one line now, not a silent session later
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    player = None if args.no_play else find_player()
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    lines = stdin_lines(loop)
    retry = _Retry(args.retry_for)
    options = EdgeOptions(engine, out, player, args.barge_in)
    async with AsyncClient(url, api_key=key) as sb:
        while True:
            try:
                closed = await _connection(sb, args, lines, options, retry)
            except asyncio.CancelledError:
                return 0  # a signal: what was played is written and reported
            except Unavailable as err:
                if not retry.connected_once:
                    raise  # a wrong URL or a service that is not there: say so now
                closed = 1006, err.detail or str(err)
            if closed is None:
                _say(f"input ended; left session {args.sid}")
                return 0
            code, reason = closed
            if code == SESSION_CLOSED:
                _say(f"session {args.sid} closed")
                return 0
            first = retry.failing_since is None
            delay = retry.after(code)
            if delay is None:
                note = CLOSE_NOTES.get(code, "")
                print(f"switchboard: the media connection closed ({code} {reason}). {note}".rstrip(), file=sys.stderr)
                return 1
            if first:  # once per outage, not once per attempt
                print(f"switchboard: the media connection closed ({code} {reason}); reconnecting", file=sys.stderr)
            await asyncio.sleep(delay)


async def _connection(
    sb: AsyncClient, args: argparse.Namespace, lines: asyncio.Queue[str | None], options: EdgeOptions, retry: _Retry
) -> tuple[int, str] | None:
    """One media connection, until the service closes it (its close code and reason) or the edge is done with the
    user's lines (None)."""
    ident = options.identity
    async with sb.media(args.sid, token=args.token, edge_id=ident.edge_id, connection=ident.next_attempt()) as conn:
        retry.connected()
        _say(f"connected to session {args.sid} as its media edge")
        ended = await Edge(conn, options, say=_say).run(lines)
    refusal = conn.refusal()  # once closed: a refusal sent as the connection opened is read even if stdin ended first
    if refusal is not None:
        raise refusal
    return None if ended else (conn.close_code or 1006, conn.close_reason)


class _Retry:
    """Reconnect after a drop, a restart or a stall, for up to ``for_s`` seconds in a row; never after a refusal
    or after another edge took the session over."""

    def __init__(self, for_s: float) -> None:
        self.for_s = for_s
        self.connected_once = False
        self.failing_since: float | None = None
        self.delay_s = RECONNECT_FIRST_S

    def connected(self) -> None:
        self.connected_once = True
        self.failing_since, self.delay_s = None, RECONNECT_FIRST_S

    def after(self, code: int) -> float | None:
        if code not in RETRY_CODES:
            return None
        now = time.monotonic()
        self.failing_since = self.failing_since or now
        if now - self.failing_since > self.for_s:
            return None
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, RECONNECT_MAX_S)
        return delay


def cmd_edge(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(run_edge(args))
    except SwitchboardError as err:
        print(f"switchboard: {err.detail or err}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # stdout's reader went away: main() ends quietly
    except (SynthesisError, OSError) as err:
        print(f"switchboard: {err}", file=sys.stderr)
        return 2


def add_edge_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "edge",
        parents=[global_options()],
        help="speak a session's speeches with espeak-ng and send stdin lines as the user",
    )
    p.add_argument("sid")
    p.add_argument("--token", help="a session token minted with the media:connect scope, instead of a key")
    p.add_argument("--out", metavar="DIR", help="write each speech to DIR/<speech_id>.wav (and .json: its timings)")
    p.add_argument("--no-play", action="store_true", help="never play to the sound device (aplay or pw-play)")
    p.add_argument("--barge-in", action="store_true", help="each stdin line first interrupts the agent")
    p.add_argument("--voice", help="espeak-ng voice, e.g. en-us")
    p.add_argument("--wpm", type=int, help="speaking rate in words per minute (espeak-ng's default: 175)")
    p.add_argument("--retry-for", type=float, default=120.0, help="seconds to keep reconnecting after a drop")
    p.set_defaults(func=cmd_edge)
