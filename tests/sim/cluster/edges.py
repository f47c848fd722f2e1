"""Media edges in the simulated cluster: one per session that has one, connected through the load balancer to any
node, and the oracles of what they saw.

An edge plays the speeches it is sent (``speech.*``) at its own pace, reporting ``playback.started``, a
``playback.progress`` at the end of each word and ``playback.finished`` once a segment ended and was played whole;
a ``speech.stop`` silences it at once. From the schedule it sends barge-ins (``user.speech_started``, after cutting
its own audio, as a phone or a browser that hears its user does) and transcripts, interim and final (each final one
with an ``id``, kept until ``transcript.taken`` names it); its connection may drop just after a final transcript.
After any close but 1000, 4404 and 4409 (a 4410, a dropped connection), a keepalive that went unanswered or a
connection that did not open, it connects again, after a retry delay, to any node, and first sends again each final
transcript not yet taken. Without ids (``Fixes.transcript_ids`` off) it follows the reference edge's rule: a
transcript sent is taken unless the connection closes 4410 ``TRANSCRIPT_NOT_TAKEN``. It numbers its connections
(``edge_id``, ``connection``; not with ``Fixes.edge_connections`` off). It stops when told the session ended (1000,
4404), or that another edge replaced it (4409), as the reference edges do.

The oracles (``Media.check_step`` after every op, ``Media.check_end`` once settled), named as the world's classes:
- ``edge-close``: the edge is never told the session ended (1000, 4404) while it lives on, nor that another edge
  replaced it (4409: each session has one edge; a connection it gave up on, delivered late, must not replace it);
- ``lost-input``: a final transcript the edge holds as taken is durable as the user's input;
- ``unanswered-input``: and answered (a generation after it), unless something interrupted it since;
- ``duplicate-effect``: no transcript is applied twice (its text is its own: two messages with it are two effects);
- ``heard-lost``: a segment the edge played whole, whose ``playback.finished`` the owner took, is committed as heard
  (an assistant message with all of its text), unless that owner died or lost the session before it could land.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from switchboard.api.media.codes import (
    CLOSE_NORMAL,
    CLOSE_NOT_ACTIVE,
    CLOSE_NOT_FOUND,
    CLOSE_REPLACED,
    TRANSCRIPT_NOT_TAKEN,
)
from switchboard.runtime.aio import cancel_and_wait
from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.media import EdgeStream, MediaEdge
from switchboard.runtime.status import SessionStatus

from .links import ABNORMAL, Link, frame, open_link
from .loop import NODE

if TYPE_CHECKING:
    from .node import Node
    from .world import ClusterWorld

OPEN_TIMEOUT_S = 3.0  # the edge's WebSocket handshake
PING_S = 5.0  # the edge's keepalive: a node silent for this long after a ping is given up
RECONNECT_S = 0.25  # times 1, 2 or 4
FIRST_AUDIO_S = 0.02
CHARS_PER_S = 60.0  # about the simulated playout's 20 words per second
ENDED = (CLOSE_NORMAL, CLOSE_NOT_FOUND)
FINAL = (*ENDED, CLOSE_REPLACED)  # the closes after which an edge does not connect again


@dataclass
class Transcript:
    key: str
    text: str
    at: float  # when the user said it
    taken: bool = False  # the edge holds it as taken
    sends: int = 0
    item_id: str | None = None  # as its transcript.taken said
    acks: int = 0  # transcript.taken frames for it (more than one: a copy sent again was answered, not applied)


@dataclass
class Segment:
    speech_id: str
    allow: bool
    text: str = ""
    ended: bool = False  # speech.end came
    stopped: bool = False
    played: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def poke(self) -> None:
        self.changed.set()


@dataclass
class Heard:
    """A segment the edge played to its end and reported finished (``n`` marks its frame)."""

    n: int
    speech_id: str
    text: str
    at: float


class SimEdge:
    def __init__(self, media: Media, sid: str, first: str, rng: random.Random) -> None:
        self.media = media
        self.world = media.world
        self.sid = sid
        self.first = first
        self.rng = rng
        self.transcripts: list[Transcript] = []
        self.last_sent: Transcript | None = None
        self.heard: list[Heard] = []
        self.closes: list[tuple[float, int, str, str]] = []  # (at, code, reason, node the edge reached)
        self.interrupts: list[float] = []  # barge-ins, final transcripts, and leaving a speech under way
        self.link: Link | None = None
        self.current: Segment | None = None
        self.segments: dict[str, Segment] = {}
        self.told_ended = False
        self.task: asyncio.Task[None] | None = None
        self.ids = self.world.fixes.transcript_ids  # final transcripts carry an id, and are taken once acknowledged
        self.numbered = self.world.fixes.edge_connections  # each connection says which edge it is, and its number
        self.connections = 0

    def start(self) -> None:
        ctx = contextvars.copy_context()
        ctx.run(NODE.set, None)  # the edge is no node's: no pause of a node stops it
        self.task = asyncio.get_running_loop().create_task(self.run(), context=ctx)

    def now(self) -> float:
        return self.world.loop.time()

    # -- the connection -----------------------------------------------------------------------------------------

    async def run(self) -> None:
        target = self.first
        while not self.told_ended:
            self.connections += 1
            query = f"edge_id=edge-{self.sid}&connection={self.connections}" if self.numbered else ""
            link = open_link(self.world, None, self.world.slots.get(target), self.sid, forwarded=False, query=query)
            if link is not None:
                code, reason = await self._connected(link)
                self._closed(link, code, reason)
            if self.told_ended:
                return
            await asyncio.sleep(RECONNECT_S * self.rng.choice((1, 2, 4)))
            target = self.rng.choice(self.world.node_ids)

    async def _connected(self, link: Link) -> tuple[int, str]:
        if not await link.opened(OPEN_TIMEOUT_S):
            return link.server_closed or (ABNORMAL, "did not open")
        self.link = link
        playlist: asyncio.Queue[Segment] = asyncio.Queue()
        player = asyncio.ensure_future(self._player(link, playlist))
        try:
            for t in self.transcripts:
                if not t.taken:
                    self._send_transcript(t)
            while True:
                code, text = await self._next(link)
                if code is not None:
                    return code, text
                self._on_frame(json.loads(text), playlist)
        finally:
            self.link = None
            await cancel_and_wait(player)
            if self.current is not None and not self.current.stopped:
                self.interrupts.append(self.now())  # the speech under way ends interrupted where it was reported
            self.current = None
            link.close()

    async def _next(self, link: Link) -> tuple[int | None, str]:
        while True:
            try:
                async with asyncio.timeout(PING_S):
                    return await link.recv()
            except TimeoutError:
                if not await link.ping(PING_S):
                    return ABNORMAL, "keepalive unanswered"

    def _closed(self, link: Link, code: int, reason: str) -> None:
        self.closes.append((self.now(), code, reason, link.server.tag))
        if code == CLOSE_NOT_ACTIVE and reason.startswith(TRANSCRIPT_NOT_TAKEN) and self.last_sent is not None:
            self.last_sent.taken = False  # sent again first on the next connection
        if code in FINAL:
            self.told_ended = True
            state = self.world.db.sessions[self.sid].state
            if SessionStatus(state).live or code == CLOSE_REPLACED:
                self.media.violations.append(
                    ("edge-close", f"{self.sid}: edge closed {code} {reason!r} at t={self.now():.3f}, session {state}")
                )

    def _on_frame(self, data: dict[str, Any], playlist: asyncio.Queue[Segment]) -> None:
        kind = data.get("type")
        if kind == "speech.start":
            seg = Segment(data["speech_id"], data["allow_interruptions"])
            self.segments[seg.speech_id] = seg
            playlist.put_nowait(seg)
            return
        if kind == "error":
            self.media.errors.append(f"{self.sid}: {data.get('code')} ({data.get('frame_type')})")
            if data.get("code") == "command_failed" and data.get("id") is not None:
                self._retry_later(data["id"])  # not taken: sent again in a moment
            return
        if kind == "transcript.taken":
            for t in self.transcripts:
                if t.key == data["id"]:
                    t.taken, t.item_id, t.acks = True, data["item_id"], t.acks + 1
            return
        seg = self.segments.get(data.get("speech_id", ""))
        if seg is None:
            return
        if kind == "speech.text":
            seg.text += data["delta"]
        elif kind == "speech.end":
            seg.ended = True
        elif kind == "speech.stop":
            seg.stopped = True
        seg.poke()

    # -- playing ------------------------------------------------------------------------------------------------

    async def _player(self, link: Link, playlist: asyncio.Queue[Segment]) -> None:
        while True:
            seg = await playlist.get()
            self.current = seg
            await asyncio.sleep(FIRST_AUDIO_S)
            if not seg.stopped:
                link.send_text(frame("playback.started", speech_id=seg.speech_id))
                await self._play(link, seg)
            self.current = None

    async def _play(self, link: Link, seg: Segment) -> None:
        while not seg.stopped:
            if seg.played < len(seg.text):
                word_end = seg.text.find(" ", seg.played + 1)
                upto = len(seg.text) if word_end < 0 else word_end
                await asyncio.sleep((upto - seg.played) / CHARS_PER_S)
                if seg.stopped:
                    return
                seg.played = upto
                link.send_text(frame("playback.progress", speech_id=seg.speech_id, played_chars=upto))
            elif seg.ended:
                n = self.media.mark()
                link.send_text(frame("playback.finished", speech_id=seg.speech_id, interrupted=False, n=n))
                self.heard.append(Heard(n, seg.speech_id, seg.text, self.now()))
                return
            else:
                seg.changed.clear()
                await seg.changed.wait()

    # -- the user -----------------------------------------------------------------------------------------------

    def barge_in(self) -> None:
        link = self.link
        if link is None:
            return  # the user spoke while the edge was away: nobody heard it
        self.interrupts.append(self.now())
        seg = self.current
        cut = seg is not None and seg.allow and not seg.stopped
        if cut:
            assert seg is not None
            seg.stopped = True
            seg.poke()
        link.send_text(frame("user.speech_started"))
        if cut:
            assert seg is not None
            link.send_text(frame("playback.finished", speech_id=seg.speech_id, interrupted=True))

    def say(self, key: str, *, final: bool) -> None:
        if not final:
            if self.link is not None:
                self.link.send_text(frame("user.transcript", text=f"hmm {key}", final=False))
            return
        self.interrupts.append(self.now())
        t = Transcript(key, f"heard {key}", self.now())
        self.transcripts.append(t)
        if self.link is not None:
            self._send_transcript(t)

    def _retry_later(self, key: str) -> None:
        link = self.link

        def again() -> None:
            t = next((t for t in self.transcripts if t.key == key), None)
            if t is not None and not t.taken and self.link is link and link is not None:
                self._send_transcript(t)

        self.world.loop.call_later(RECONNECT_S * self.rng.choice((1, 2, 4)), again)

    def _send_transcript(self, t: Transcript) -> None:
        assert self.link is not None
        t.sends += 1
        if self.ids:  # taken once its transcript.taken comes; until then sent again on each new connection
            self.link.send_text(frame("user.transcript", text=t.text, final=True, id=t.key))
            return
        t.taken = True  # unless the connection's close says it was not (the reference edge's rule)
        self.last_sent = t
        self.link.send_text(frame("user.transcript", text=t.text, final=True))


MEDIA_OPS = ("edge", "barge-in", "transcript", "edge-drop")


class Media:
    """Every edge and connection of one run, and what the oracles need to know about them."""

    def __init__(self, world: ClusterWorld) -> None:
        self.world = world
        self.links: list[Link] = []  # in the order they were opened (a set's order would change from run to run)
        self.edges: dict[str, SimEdge] = {}
        self.marks = 0
        self.finishes: dict[int, tuple[float, str]] = {}  # a finish frame the owner took: (when, node incarnation)
        self.crashed_at: dict[str, float] = {}  # node incarnation -> when it died without a clean exit
        self.lost_at: dict[tuple[str, str], float] = {}  # (node incarnation, session) -> when it was fenced
        self.violations: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.cuts: dict[str, list[float]] = {}  # session -> when a speech ended interrupted as its edge left

    def mark(self) -> int:
        self.marks += 1
        return self.marks

    def connect(self, sid: str, first: str) -> None:
        if sid not in self.edges:
            edge = SimEdge(self, sid, first, random.Random(self.world.rng.random()))
            self.edges[sid] = edge
            edge.start()

    async def apply(self, op: tuple[Any, ...]) -> None:
        """A media op of the schedule: ``("edge", s, n)`` connects session ``s``'s edge, first to node ``n``; then its
        ``("barge-in", s)``, ``("transcript", s, final)``, and ``("edge-drop", s, ms)``: a final transcript, and the
        edge's connection dropped ``ms`` later."""
        world = self.world
        sid = world.sids[op[1] % len(world.sids)]
        if op[0] == "edge":
            self.connect(sid, world.node_ids[op[2] % len(world.node_ids)])
            return
        edge = self.edges.get(sid)
        if edge is None:
            return
        if op[0] == "barge-in":
            edge.barge_in()
        elif op[0] == "transcript":
            edge.say(world.new_key(), final=bool(op[2]))
        else:
            edge.say(world.new_key(), final=True)
            await asyncio.sleep(op[2] / 1000)
            if edge.link is not None:
                edge.link.drop()

    def watch(self, node: Node) -> None:
        fence = node.lease.fence
        lose = fence.lose

        def lost(sid: str, why: str, *, epoch: int | None = None) -> None:
            self.lost_at.setdefault((node.tag, sid), self.world.loop.time())
            lose(sid, why, epoch=epoch)

        fence.lose = lost  # type: ignore[method-assign]

    def process_died(self, node: Node) -> None:
        if not node.drained:
            self.crashed_at.setdefault(node.tag, self.world.loop.time())
        for link in self.links:
            link.process_died(node.tag)
        self.links = [link for link in self.links if link.up]

    def read(self, link: Link, text: str) -> None:
        """The route on ``link.server`` read ``text``: a segment's finish taken while its stream was still open (so
        the whole segment is heard) is noted."""
        try:
            data = json.loads(text)
        except ValueError:
            return
        if data.get("type") != "playback.finished" or data.get("interrupted") or "n" not in data:
            return
        session = link.server.host.live(link.sid)
        edge = getattr(session.playout, "edge", None) if session is not None else None
        stream = edge._streams.get(data["speech_id"]) if edge is not None else None
        if stream is not None and not stream.ended and stream.input_ended and stream.played_chars == len(stream.text):
            self.finishes[data["n"]] = (self.world.loop.time(), link.server.tag)

    def interrupts(self, sid: str) -> list[float]:
        """When the session's edge interrupted it: its barge-ins and final transcripts, and each speech its owner
        ended interrupted because the edge left (or cut the audio) mid-speech, by design."""
        edge = self.edges.get(sid)
        return [*(edge.interrupts if edge is not None else []), *self.cuts.get(sid, [])]

    # -- oracles (each returns what it found: (class, detail)) --------------------------------------------------

    def check_step(self) -> list[tuple[str, str]]:
        return self.violations[:1]

    def check_end(self) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        for sid, edge in self.edges.items():
            if not SessionStatus(self.world.db.sessions[sid].state).ended:
                found += self._check_transcripts(sid, edge)
                found += self._check_heard(sid, edge)
        return found

    def _check_transcripts(self, sid: str, edge: SimEdge) -> list[tuple[str, str]]:
        d = self.world.db.session_rows(sid)
        log = d.event_log()
        found = []
        for t in edge.transcripts:
            items = [it for it in d.items.values() if isinstance(it, ChatMessage) and it.text == t.text]
            if len(items) > 1:
                found.append(("duplicate-effect", f"{sid}: transcript {t.key} applied {len(items)} times"))
            if not t.taken:
                if not edge.told_ended:
                    found.append(("lost-input", f"{sid}: transcript {t.key} never taken (sent {t.sends}x)"))
                continue
            if t.item_id is not None and items and items[0].id != t.item_id:
                found.append(("lost-input", f"{sid}: transcript {t.key} taken as {t.item_id}, stored as {items[0].id}"))
            if not items:
                found.append(("lost-input", f"{sid}: transcript {t.key} taken (sent {t.sends}x), not durable"))
                continue
            seq = next((e.seq for e in log if e.type == "user.input" and e.data.get("item_id") == items[0].id), None)
            if seq is None:
                found.append(("event-log", f"{sid}: transcript {t.key} has no user.input event"))
                continue
            answered = any(e.seq > seq and e.type == "generation.started" for e in log)
            if not answered and not self.world._interrupted_after(sid, t.at):
                found.append(("unanswered-input", f"{sid}: transcript {t.key} never answered"))
        return found

    def _check_heard(self, sid: str, edge: SimEdge) -> list[tuple[str, str]]:
        d = self.world.db.session_rows(sid)
        messages = sorted(
            (d.landed.get(it.id, 0.0), it.id, it.text.strip())
            for it in d.items.values()
            if isinstance(it, ChatMessage) and it.role == "assistant"
        )
        used: set[str] = set()
        found = []
        for h in sorted(edge.heard, key=lambda h: h.at):
            taken = self.finishes.get(h.n)
            if taken is None or not h.text.strip():
                continue
            at, tag = taken
            # its owner died, or lost the session, after the finish: the message had until then to land
            stops = [t for t in (self.crashed_at.get(tag), self.lost_at.get((tag, sid))) if t is not None and t >= at]
            until = min(stops, default=math.inf)
            match = next(
                (m for m in messages if m[2] == h.text.strip() and at <= m[0] <= until and m[1] not in used), None
            )
            if match is not None:
                used.add(match[1])
                continue
            if stops:
                continue  # excused: no message of its is durable (and none of another segment is taken for it)
            found.append(("heard-lost", f"{sid}: speech {h.speech_id} heard whole on {tag} at t={at:.3f}: {h.text!r}"))
        return found


@contextlib.contextmanager
def cuts_noted(world_of: list[ClusterWorld]) -> Iterator[None]:
    """A speech that ends interrupted because its edge left (or cut its audio) is an interruption by the edge, also
    when the edge never heard of it (its ``speech.start`` was lost with a relay): noted for the oracles."""
    real = MediaEdge._cut

    def cut(self: MediaEdge, stream: EdgeStream) -> None:
        speech = self.session.speech(stream.speech_id)
        if world_of and speech is not None and not speech.done:
            world = world_of[0]
            world.media.cuts.setdefault(self.session.id, []).append(world.loop.time())
        real(self, stream)

    MediaEdge._cut = cut  # type: ignore[method-assign]
    try:
        yield
    finally:
        MediaEdge._cut = real  # type: ignore[method-assign]
