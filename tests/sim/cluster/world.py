"""The simulated cluster under a schedule of client commands and faults, with the oracles across nodes.

Nodes (``node.Node``: the product's ``SessionHost`` and ``NodeLease``) share one simulated database
(``database.SimDatabase``) on one virtual clock (``loop.ClusterLoop``). Clients send commands through a load
balancer to any node and retry under the same idempotency key, at any node, until they get an answer; nodes are
paused, killed, drained and restarted; the database stalls, resets connections and loses one node; Redis (wake-ups
only) goes away. Media edges (``edges.py``) connect to any node, relayed to the owner (``links.py``).

The oracles (``check_step`` after every op, ``check_end`` once everything settled) are named after the chaos
checker's violation classes (tests/chaos/checker.py), plus those only a simulation can see at once: two running
nodes acting on one session (``split-brain``) and a write landing under an epoch that is no longer the session's
(``stale-epoch-write``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from switchboard.control.session_config import SessionConfig
from switchboard.control.settings import Settings
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.chat import ChatMessage, FunctionCall, FunctionCallOutput
from switchboard.runtime.speech import SpeechHandle
from switchboard.runtime.status import SessionStatus

from ..workload import AGENTS, EFFECTS
from ..world import held_by_the_open_turn
from .database import SimDatabase
from .edges import MEDIA_OPS, Media
from .loop import NODE, ClusterLoop, run_in_node
from .node import Answer, Command, Node
from .webhooks import ENDPOINT

Op = tuple[Any, ...]
LEASE_S = 2.0
WORDS_PER_SECOND = 20.0
REQUEST_TIMEOUT_S = 3.0  # the load balancer's (and a forwarding node's) timeout for one attempt
CLIENT_GIVE_UP_S = 90.0  # a client retries this long (a session moving takes a lease or so)
RETRY_S = 0.25
SETTLE_S = 60.0
SETTLE_MAX_S = 900.0
PROBE_S = 30.0
INTERRUPT_SLACK_S = 0.5
TICKET_TIMEOUT_S = ENDPOINT.timeout_s
WATCH_S = 0.1


class Violation(AssertionError):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"[{kind}] {detail}")
        self.kind = kind


def expect(cond: bool, kind: str, detail: str) -> None:
    if not cond:
        raise Violation(kind, detail)


@dataclass(frozen=True)
class Fixes:
    """The fixes a run has (all: "after"); ``--before`` switches one off by putting the old behaviour back from the
    test side."""

    db_clock: bool = True  # leases set and judged on the database's clock (else: each node's own)
    write_time_epochs: bool = True  # a write carries the epoch it was made under (else: the one held when queued)
    receipts_with_effect: bool = True  # an idempotency record commits with its effect (else: after it)
    hand_over: bool = True  # a move hands the speeches over (else: it interrupts them, and recovery owes none)
    resume_calls: bool = True  # a webhook call goes on where its session runs next (else: it ends interrupted)
    fenced_reports: bool = True  # a report whose effect the fence refused answers 503 (else: it is answered 200)
    live_when_moving: bool = True  # a session written during its hand-over stays live (else: stored `suspended`)
    leased_claims: bool = True  # only a node holding its lease claims orphans (else: a claim that ran late lands)
    # a media edge's final transcript carries an id and is taken once acknowledged (else: the edge holds it taken
    # unless a 4410 says it was not, the rule of edges that send no id)
    transcript_ids: bool = True
    # a media edge numbers its connections, and a late one does not replace its newer one (else: the last to arrive
    # replaces the edge's connection, 4409, on which an edge stops)
    edge_connections: bool = True

    @classmethod
    def without(cls, fix: str) -> Fixes:
        return cls(**{fix: False})


@dataclass
class Request:
    """One client command, sent until it is answered (retried under the same key at any node)."""

    cmd: Command
    sent_at: float
    answer: Answer | None = None
    answered_at: float | None = None
    attempts: list[tuple[float, str, int, str]] = field(default_factory=list)  # (at, node, status, code)


class ClusterWorld:
    def __init__(
        self,
        loop: ClusterLoop,
        *,
        nodes: int,
        sessions: list[dict[str, Any]],
        seed: int,
        fixes: Fixes = Fixes(),
    ) -> None:
        self.loop = loop
        self.fixes = fixes
        self.db = SimDatabase(loop.time, leased_claims=fixes.leased_claims)
        self.offsets: dict[str, float] = {f"n{i}": 0.0 for i in range(nodes)}
        if not fixes.db_clock:
            self.db.lease_clock = lambda node: loop.time() + self.offsets.get(node, 0.0)
        self.registry = AgentRegistry(AGENTS)
        self.node_ids = list(self.offsets)
        self.slots: dict[str, Node] = {}
        self.every_node: list[Node] = []  # every incarnation, the dead ones too
        self.incarnations: Counter[str] = Counter()
        self.session_specs = sessions
        self.sids = [f"s{i}" for i in range(len(sessions))]
        self.rng = random.Random(seed)
        self.requests: list[Request] = []
        self.clients: set[asyncio.Task[None]] = set()
        self.dead_tasks: set[asyncio.Task[Any]] = set()
        self.watcher: asyncio.Future[None] = loop.create_future()
        self.redis_down_until = -1.0
        self.redis_cut: dict[str, float] = {}
        self.keys = 0
        self.log: list[str] = []
        self.notes: list[str] = []
        self.broken_contexts: list[str] = []
        self.split: list[str] = []
        self.forced_before = SpeechHandle.forced_cancels
        self.forced_while_frozen = 0  # forced cancels whose process ran less than the net's time (``frozen_net``)
        self.paused_spans: dict[str, list[tuple[float, float]]] = {}  # node tag -> (paused at, resumed at)
        self.resumed_at: dict[str, float] = {}
        self.media = Media(self)
        EFFECTS.runs.clear()
        EFFECTS.completions.clear()
        EFFECTS.playout_waits.clear()

    def note(self, what: str) -> None:
        self.notes.append(f"t={self.loop.time():.3f} {what}")

    def settings(self, node_id: str) -> Settings:
        return Settings(
            database_url="postgresql+asyncpg://sim/sim",
            redis_url="redis://sim:6379/0",
            node_id=node_id,
            lease_s=LEASE_S,
            words_per_second=WORDS_PER_SECOND,
            request_timeout_s=REQUEST_TIMEOUT_S,
            advertise_url=f"http://{node_id}.sim:8000",
        )

    # -- nodes --------------------------------------------------------------------------------------------------

    async def start_node(self, node_id: str) -> Node:
        self.incarnations[node_id] += 1
        node = Node(self, node_id, self.incarnations[node_id], self.settings(node_id))
        self.watch_claims(node)
        self.media.watch(node)
        self.slots[node_id] = node
        self.every_node.append(node)
        await run_in_node(node.tag, asyncio.ensure_future, node.start())
        return node

    async def start(self) -> None:
        for node_id in self.node_ids:
            await self.start_node(node_id)
        self.watcher = asyncio.ensure_future(self.watch_owners())
        for i, spec in enumerate(self.session_specs):
            node = self.slots[self.node_ids[i % len(self.node_ids)]]
            config = SessionConfig(id=self.sids[i], agent="desk", **spec)
            await run_in_node(node.tag, asyncio.ensure_future, node.host.create(config, {}))

    def kill(self, node: Node) -> None:
        """The process dies: none of its tasks runs again, none of its statements returns."""
        node.gone = True
        self.loop.kill(node.tag)
        self.db.crashed.add(node.tag)
        self.media.process_died(node)
        # its tasks wait for what will never come; held here, they are not collected as "destroyed while pending"
        self.dead_tasks |= {t for t in asyncio.all_tasks(self.loop) if not t.done()}

    def redis_publish(self, sender: Node, what: str) -> None:
        """Redis carries wake-ups only: a lost one costs an adoption interval, never correctness."""
        now = self.loop.time()
        if now < self.redis_down_until or now < self.redis_cut.get(sender.id, -1.0):
            return
        for node in self.slots.values():
            if node is not sender and node.up and not node.gone and now >= self.redis_cut.get(node.id, -1.0):
                node.host.wake_adopt()

    async def forward(self, owner: str, cmd: Command) -> Answer:
        node = self.slots.get(owner)
        if node is None or node.gone:
            return Answer(503, "forward_failed")
        task = node.spawn(node.handle(cmd, forwarded=True), "forwarded")
        try:
            return await asyncio.wait_for(asyncio.shield(task), REQUEST_TIMEOUT_S)
        except TimeoutError:
            return Answer(503, "forward_timeout")

    # -- clients ------------------------------------------------------------------------------------------------

    def send(self, cmd: Command, first: str) -> Request:
        req = Request(cmd, self.loop.time())
        self.requests.append(req)
        task = asyncio.ensure_future(self._client(req, first, random.Random(self.rng.random())))
        self.clients.add(task)
        task.add_done_callback(self.clients.discard)
        return req

    async def _client(self, req: Request, first: str, rng: random.Random) -> None:
        target = first
        give_up_at = self.loop.time() + CLIENT_GIVE_UP_S
        while True:
            answer = await self._attempt(target, req.cmd)
            req.attempts.append((self.loop.time(), target, answer.status, answer.code))
            if answer.status != 503 or self.loop.time() >= give_up_at:
                req.answer, req.answered_at = answer, self.loop.time()
                return
            await asyncio.sleep(RETRY_S * rng.choice((1, 2, 4)))
            target = rng.choice(self.node_ids)

    async def _attempt(self, node_id: str, cmd: Command) -> Answer:
        node = self.slots.get(node_id)
        if node is None or node.gone or not node.up:
            return Answer(503, "connection_refused")
        task = node.spawn(node.handle(cmd), "request")
        try:
            return await asyncio.wait_for(asyncio.shield(task), REQUEST_TIMEOUT_S)
        except TimeoutError:
            return Answer(503, "timeout")

    def delivered(self, sid: str, call_id: str, arguments: dict[str, Any]) -> None:
        """The backend took a webhook call (202): it reports progress, then the result, to any node."""
        ctx = contextvars.copy_context()
        ctx.run(NODE.set, None)  # the backend is no node's: a pause of the node that delivered does not stop it
        task = self.loop.create_task(self._backend(sid, call_id, int(arguments.get("ms") or 0)), context=ctx)
        self.clients.add(task)
        task.add_done_callback(self.clients.discard)

    async def _backend(self, sid: str, call_id: str, ms: int) -> None:
        rng = random.Random(self.rng.random())
        await asyncio.sleep(ms / 2000)
        self.send(Command("progress", sid, self.new_key(), "half way", call_id=call_id), rng.choice(self.node_ids))
        await asyncio.sleep(ms / 2000)
        self.send(
            Command("result", sid, self.new_key(), f"ticket for {call_id}", call_id=call_id), rng.choice(self.node_ids)
        )

    def new_key(self) -> str:
        self.keys += 1
        return f"k{self.keys}"

    # -- ops ----------------------------------------------------------------------------------------------------

    async def apply(self, op: Op) -> None:
        self.log.append(repr(op))
        kind = op[0]
        now = self.loop.time()
        if kind == "advance":
            await asyncio.sleep(op[1] / 1000)
        elif kind in ("input", "say", "interrupt"):
            sid, first = self.sids[op[1] % len(self.sids)], self.node_ids[op[2] % len(self.node_ids)]
            if kind == "interrupt":
                self.send(Command("interrupt", sid), first)
            else:
                key = self.new_key()
                text = f"{kind} {key}"
                self.send(Command(kind, sid, key, text, interrupt=bool(op[3]) if kind == "input" else False), first)
        elif kind in MEDIA_OPS:
            await self.media.apply(op)
        elif kind == "pause":
            node = self.slots[self.node_ids[op[1] % len(self.node_ids)]]
            self.loop.pause(node.tag)
            await asyncio.sleep(op[2] / 1000)
            self.loop.resume(node.tag)
            self.resumed_at[node.tag] = self.loop.time()
            self.paused_spans.setdefault(node.tag, []).append((now, self.loop.time()))
            await asyncio.sleep(0.001)  # what was held runs (the lease watcher first: its timer is the earliest)
        elif kind == "kill":
            node = self.slots[self.node_ids[op[1] % len(self.node_ids)]]
            if not node.gone:
                self.kill(node)
        elif kind == "crash-owner":  # the node running a session dies a moment later (mid-command, mid-write)
            await asyncio.sleep(op[2] / 1000)
            owner = self.owner_of(self.sids[op[1] % len(self.sids)])
            if owner is not None:
                self.kill(owner)
        elif kind == "restart":
            node_id = self.node_ids[op[1] % len(self.node_ids)]
            if self.slots[node_id].gone:
                await self.start_node(node_id)
        elif kind == "drain":
            await self._drain_and_restart(self.node_ids[op[1] % len(self.node_ids)], restart=bool(op[2]))
        elif kind == "rolling":
            for node_id in self.node_ids:
                await self._drain_and_restart(node_id, restart=True)
        elif kind == "db-latency":
            self.db.latency_s = op[1] / 1000
        elif kind == "db-stall":
            self.db.stalled_until = max(self.db.stalled_until, now + op[1] / 1000)
        elif kind == "db-partition":
            node_id = self.node_ids[op[1] % len(self.node_ids)]
            self.db.partitioned[node_id] = max(self.db.partitioned.get(node_id, -1.0), now + op[2] / 1000)
        elif kind == "db-reset":
            target = None if op[1] is None else self.node_ids[op[1] % len(self.node_ids)]
            self.db.resets.append((target, bool(op[2])))
        elif kind == "redis-down":
            self.redis_down_until = max(self.redis_down_until, now + op[1] / 1000)
        elif kind == "redis-cut":
            node_id = self.node_ids[op[1] % len(self.node_ids)]
            self.redis_cut[node_id] = now + op[2] / 1000
        elif kind == "skew":
            self.offsets[self.node_ids[op[1] % len(self.node_ids)]] = op[2] / 1000
        else:
            raise ValueError(f"unknown op {op!r}")

    async def _drain_and_restart(self, node_id: str, *, restart: bool) -> None:
        node = self.slots[node_id]
        if node.gone or not node.up:
            return
        task = node.spawn(node.drain(), "drain")
        with contextlib.suppress(Exception):
            await asyncio.shield(task)
        self.kill(node)  # the process exits: whatever of it still runs writes nothing more
        if restart:
            await self.start_node(node_id)

    # -- oracles ------------------------------------------------------------------------------------------------

    def running(self) -> list[Node]:
        """Nodes that run: not paused, and not resumed this very instant (what they held has not run yet)."""
        now = self.loop.time()
        return [
            n
            for n in self.slots.values()
            if n.up and not n.gone and n.tag not in self.loop.paused and self.resumed_at.get(n.tag) != now
        ]

    def check_owners(self, claiming: Node | None = None, sid: str | None = None) -> None:
        """Two running nodes never act on one session at once. Checked as each claim is made (a claim made while the
        owner still runs the session lasts only until the owner hears of it, often before the next op), and every
        ``WATCH_S``."""
        for s in self.sids if sid is None else [sid]:
            acting = [n.tag for n in self.running() if n.host.live(s) is not None and n.lease.fence.owns(s)]
            if claiming is not None and claiming.tag not in acting:
                acting.append(claiming.tag)
            if len(acting) > 1:
                self.split.append(f"{s} is run by {acting} at once (t={self.loop.time():.3f})")

    async def watch_owners(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            self.check_owners()

    def watch_claims(self, node: Node) -> None:
        fence = node.lease.fence
        claim = fence.claim

        def claimed(sid: str, epoch: int) -> None:
            self.check_owners(node, sid)
            claim(sid, epoch)

        fence.claim = claimed  # type: ignore[method-assign]

    def frozen_net(self, speech: SpeechHandle, due_at: float) -> None:
        """The forced-cancel safety net of ``speech`` fires now, on the node of the running task: it counts as the
        process's, not the speech's, when the process ran for less than the net's time since the interruption (it was
        frozen, SIGSTOP, for the rest). Its timer came due while the node was paused and runs as it wakes, in the
        same instant as the work the speech was waiting for (seed 940: a 6 s pause 1 ms after an interrupt; the
        speech's task ends on its own in that instant). A monotonic clock goes on while a process is frozen, so a
        real process does the same."""
        tag, now = NODE.get(), self.loop.time()
        since = due_at - speech.force_timeout_s
        frozen = sum(max(0.0, min(end, now) - max(start, since)) for start, end in self.paused_spans.get(tag or "", []))
        if now - since - frozen < speech.force_timeout_s:
            self.forced_while_frozen += 1
            self.note(f"{tag}: the safety net of {speech.id} fired as the node woke ({frozen:.3f}s of it frozen)")

    def check_step(self) -> None:
        expect(not self.broken_contexts, "I2-broken-context", "; ".join(self.broken_contexts[:3]))
        forced = SpeechHandle.forced_cancels - self.forced_before - self.forced_while_frozen
        expect(forced == 0, "I3-safety-net-fired", "a forced cancel fired")
        expect(not self.db.stale_writes, "stale-epoch-write", "; ".join(self.db.stale_writes[:3]))
        expect(not self.split, "split-brain", "; ".join(self.split[:3]))
        for sid in self.sids:
            self._check_log(sid)
            self._check_calls(sid)
        self._check_effects()
        for kind, detail in self.media.check_step():
            expect(False, kind, detail)
        for req in self.requests:
            a = req.answer
            if a is not None:
                expect(a.status < 500 or a.status == 503, "answer-5xx", f"{req.cmd}: {a}")

    def _check_log(self, sid: str) -> None:
        d = self.db.session_rows(sid)
        seqs = sorted(d.events)
        expect(seqs == list(range(1, len(seqs) + 1)), "event-log", f"{sid}: seqs {seqs[-8:]} are not 1..N")
        seen: Counter[tuple[str, str]] = Counter()
        for e in d.events.values():
            if e.type == "chat.item":
                seen[(e.type, e.data["item"]["id"])] += 1
            elif e.type in ("tool.ended", "speech.done", "speech.created"):
                seen[(e.type, e.data.get("call_id") or e.data.get("speech_id"))] += 1
            elif e.type == "user.input" and e.data.get("item_id"):
                seen[(e.type, e.data["item_id"])] += 1
        twice = [k for k, n in seen.items() if n > 1]
        expect(not twice, "event-log", f"{sid}: reported twice: {twice[:3]}")

    def _check_calls(self, sid: str) -> None:
        d = self.db.session_rows(sid)
        calls = Counter(it.call_id for it in d.items.values() if isinstance(it, FunctionCall))
        outputs = Counter(it.call_id for it in d.items.values() if isinstance(it, FunctionCallOutput))
        for call_id, n in outputs.items():
            expect(n == 1, "call-ends", f"{sid}: call {call_id} has {n} outputs")
            expect(calls.get(call_id) == 1, "call-ends", f"{sid}: output of {call_id} without its call")
        for info in d.tool_calls.values():
            if info.speculative:  # of a speculative reply never confirmed: nothing of it may reach the chat
                expect(
                    info.call_id not in calls and info.call_id not in outputs,
                    "call-ends",
                    f"{sid}: {info.call_id}, of a speculative reply never confirmed, is in the chat",
                )
            elif info.ended:
                expect(outputs.get(info.call_id) == 1, "call-ends", f"{sid}: {info.call_id} ended without output")

    def _check_effects(self) -> None:
        """One effect per idempotency key (I7): each keyed command's text is its own, so two messages or two
        speeches with it are the command applied twice."""
        texts: Counter[tuple[str, str]] = Counter()
        for sid in self.sids:
            d = self.db.session_rows(sid)
            for it in d.items.values():
                if isinstance(it, ChatMessage) and it.role == "user" and it.text.startswith(("input k", "heard k")):
                    texts[(sid, it.text)] += 1
            for sp in d.speeches.values():
                if sp.source == "say" and (sp.text or "").startswith("say k"):
                    texts[(sid, sp.text or "")] += 1
        twice = [k for k, n in texts.items() if n > 1]
        expect(not twice, "duplicate-effect", f"applied twice: {twice[:3]}")

    # -- the end ------------------------------------------------------------------------------------------------

    async def settle(self) -> None:
        """Heal every fault, bring every node back, let the clients finish and the sessions settle."""
        self.db.stalled_until = -1.0
        self.db.partitioned.clear()
        self.db.resets.clear()
        self.db.latency_s = 0.0
        self.redis_down_until = -1.0
        self.redis_cut.clear()
        for node_id in self.node_ids:
            node = self.slots[node_id]
            self.loop.resume(node.tag)
            if node.gone:
                await self.start_node(node_id)
        if self.clients:
            await asyncio.wait(list(self.clients))
        waited = 0.0
        while waited < SETTLE_S or (self._busy() and waited < SETTLE_MAX_S):
            await asyncio.sleep(SETTLE_S / 4)
            waited += SETTLE_S / 4

    def owner_of(self, sid: str) -> Node | None:
        rec = self.db.sessions.get(sid)
        node = self.slots.get(rec.owner_node or "") if rec is not None else None
        return node if node is not None and not node.gone else None

    def _busy(self) -> bool:
        for sid in self.sids:
            rec = self.db.sessions[sid]
            if not SessionStatus(rec.state).live:
                continue
            node = self.owner_of(sid)
            session = node.live(sid) if node is not None else None
            if session is None:
                return True
            held = held_by_the_open_turn(session)
            running = any(not i.ended and i.call_id not in held for i in session.tool_calls())
            if not session.idle or session.pending_writes or running:
                return True
        return False

    def check_end(self) -> None:
        for sid in self.sids:
            rec = self.db.sessions[sid]
            # no client closes a session here: each one stays live (one stored otherwise is run by no node, ever)
            expect(SessionStatus(rec.state).live, "unowned-session", f"{sid} is stored {rec.state}, not live")
            node = self.owner_of(sid)
            session = node.live(sid) if node is not None else None
            expect(session is not None, "unowned-session", f"{sid} is owned by {rec.owner_node}, which does not run it")
            assert session is not None
            d = self.db.session_rows(sid)
            held = held_by_the_open_turn(session)
            for info in d.tool_calls.values():
                expect(
                    info.ended or info.call_id in held,
                    "call-ends",
                    f"{sid}: {info.call_id} still running in the store after settling",
                )
            live_ids = {it.id for it in session.chat.items}
            only_live, only_durable = sorted(live_ids - set(d.items))[:3], sorted(set(d.items) - live_ids)[:3]
            expect(not only_live and not only_durable, "live-vs-durable", f"{sid}: {only_live=} {only_durable=}")
            self._check_answered(sid)
            self._check_replied(sid)
        self._check_lost()
        for kind, detail in self.media.check_end():
            expect(False, kind, detail)

    def _interrupted_after(self, sid: str, at: float) -> bool:
        """A client interrupted ``sid`` since ``at`` (its media edge too: a barge-in, a final transcript, leaving a
        speech under way)."""
        since = at - INTERRUPT_SLACK_S
        return any(
            r.cmd.sid == sid
            and (r.cmd.kind == "interrupt" or r.cmd.interrupt)
            and (r.answered_at is None or r.answered_at >= since)  # sent before, it may be applied after (retried)
            for r in self.requests
        ) or any(t >= since for t in self.media.interrupts(sid))

    def _check_reports(self) -> None:
        """A backend's result is never lost (I1: the work a tool did is never lost), whatever node its report reached
        and wherever the session moved meanwhile: once everything settled, the call of every result a backend sent
        is stored ``completed`` with that result. The one other end allowed is the call's own deadline: ``failed``
        with the timeout's output, when the report could not land within the call's ``timeout_s`` and its backend was
        never told it had (no 2xx answer: it got a 503 until it gave up, or a 409 once the call had timed out). A
        result answered 2xx is the call's durable end, and one refused as not awaited while its call was waiting for
        it is a report lost (the chaos checker's ``report-refused``)."""
        for req in self.requests:
            a, cmd = req.answer, req.cmd
            if cmd.kind != "result":
                continue
            info = self.db.session_rows(cmd.sid).tool_calls.get(cmd.call_id)
            stored = f"{info.status.value}: {info.output!r}" if info is not None else "no call"
            completed = info is not None and info.status.value == "completed" and info.output == cmd.text
            taken = a is not None and a.status < 300
            timed_out = info is not None and info.status.value == "failed" and _timed_out(info.output) and not taken
            expect(
                completed or timed_out,
                "report-lost",
                f"{cmd.sid}: result of {cmd.call_id} sent, call stored {stored} (attempts {req.attempts[-4:]}, "
                f"answered {a})",
            )
            if a is not None:
                expect(
                    a.code != "not_awaiting_report", "report-refused", f"{cmd.sid}: {cmd.call_id}: {req.attempts[-3:]}"
                )

    def _check_lost(self) -> None:
        self._check_reports()
        for req in self.requests:
            a = req.answer
            if a is None or a.status != 202 or not isinstance(a.body, dict):
                continue
            d = self.db.session_rows(req.cmd.sid)
            if req.cmd.kind == "input":
                expect(a.body.get("item_id") in d.items, "lost-input", f"{req.cmd} answered {a.body}, not durable")
            elif req.cmd.kind == "say":
                expect(a.body.get("speech_id") in d.speeches, "lost-input", f"{req.cmd} answered {a.body}, no speech")

    def _check_answered(self, sid: str) -> None:
        """Every accepted input is answered: a generation started after its ``user.input`` (unless a client
        interrupted it before it could start)."""
        log = self.db.session_rows(sid).event_log()
        for req in self.requests:
            a = req.answer
            if req.cmd.sid != sid or req.cmd.kind != "input" or a is None or a.status != 202:
                continue
            item_id = a.body.get("item_id") if isinstance(a.body, dict) else None
            seq = next((e.seq for e in log if e.type == "user.input" and e.data.get("item_id") == item_id), None)
            if seq is None:
                expect(False, "event-log", f"{sid}: accepted input {item_id} has no user.input event")
            answered = any(e.seq > seq and e.type == "generation.started" for e in log)
            if not answered and not self._interrupted_after(sid, req.sent_at):
                expect(False, "unanswered-input", f"{sid}: input {req.cmd.key} ({item_id}) never answered")

    def _check_replied(self, sid: str) -> None:
        """Every completed tool result is replied to, in a session no client interrupts (a tool that returns nothing
        asks the model for nothing: no reply is owed for it, by design)."""
        if any(r.cmd.sid == sid and (r.cmd.kind == "interrupt" or r.cmd.interrupt) for r in self.requests):
            return
        if self.media.interrupts(sid):
            return
        log = self.db.session_rows(sid).event_log()
        for e in log:
            if e.type == "tool.ended" and e.data.get("status") == "completed" and e.data.get("output"):
                replied = any(later.seq > e.seq and later.type == "generation.started" for later in log)
                expect(replied, "unreplied-result", f"{sid}: result of {e.data.get('call_id')} never replied to")

    async def probe(self) -> None:
        """Every live session still answers: a new input (sent to any node) gets a reply."""
        probes = []
        for i, sid in enumerate(self.sids):
            if SessionStatus(self.db.sessions[sid].state).live:
                key = self.new_key()
                probes.append((sid, self.send(Command("input", sid, key, f"probe {key}"), self.node_ids[i % 2])))
        await asyncio.sleep(PROBE_S)
        if self.clients:
            await asyncio.wait(list(self.clients))
        for sid, req in probes:
            a = req.answer
            expect(a is not None and a.status == 202, "no-answer", f"{sid}: probe answered {a}, {req.attempts[-3:]}")
            assert a is not None
            log = self.db.session_rows(sid).event_log()
            seq = next(e.seq for e in log if e.type == "user.input" and e.data.get("item_id") == a.body["item_id"])
            expect(
                any(e.seq > seq and e.type == "generation.started" for e in log),
                "unanswered-input",
                f"{sid}: the probe got no reply",
            )

    async def shutdown(self) -> None:
        """Stop everything: the dead processes' tasks too (they are released only to be cancelled)."""
        for task in [*self.clients, self.watcher]:
            task.cancel()
        self.loop.killed.clear()
        for tag in list(self.loop.paused):
            self.loop.resume(tag)
        for node in self.slots.values():
            if not node.gone:
                self.db.crashed.add(node.tag)  # nothing more is written: the run is over
        for node in self.every_node:
            # what a process still had in its writer when it died (or when the run ends) fails as it is torn down:
            # nobody is left to hear it
            for fut in list(node.store.writer.made):
                fut.add_done_callback(_forget)
        current = asyncio.current_task()
        for _ in range(6):
            pending = [t for t in asyncio.all_tasks(self.loop) if t is not current and not t.done()]
            if not pending:
                break
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=1.0)  # bound: then the tasks still running are cancelled again


def _timed_out(output: str | None) -> bool:
    """The output a webhook call ends with when its deadline passes without a result."""
    return output is not None and f"no result from its backend within {TICKET_TIMEOUT_S:g} s" in output


def _forget(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()
