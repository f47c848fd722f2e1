"""Media edge benchmark: barge-in latency and heard-text accuracy with 200 sessions, each with an edge connected.

A real ``switchboard serve`` process (SQLite in a temp dir, loopback) hosts the sessions; this process runs the 200
edges (one WebSocket each, ``WS /v1/sessions/{sid}/media``). Each session's reply is a long preamble (300 words)
followed by a call of the ``heard_at`` tool, which awaits ``ctx.wait_for_playout()`` and, when that wait is released
by an interruption, returns the wall-clock time of its release.

Every edge plays like a real one: once its speech's text has arrived it sends ``playback.started`` and then a
``playback.progress`` every ``--progress-ms`` (one more word each time, so 200 edges send ~650 frames/s). Barge-ins
are issued open loop, one every ``--period-ms``, each on a session whose edge is mid-speech: the edge sends
``user.speech_started`` right after its last progress. Measured per barge-in:

* ``speech.stop``: from just before ``user.speech_started`` is written to the receipt of ``speech.stop``;
* ``wait released``: from the same instant to the wall-clock time the tool's ``wait_for_playout()`` was released
  (its output; the server and this process share the machine's clock);
* heard-text accuracy: the speech's committed ``played_text`` (``GET .../speeches/{id}``) must equal the text up to the
  last ``played_chars`` the edge reported before ``user.speech_started``, in every interrupted speech.

A round interrupts every session once (then each gets a new input, so the next round finds it speaking again);
``--rounds 5`` with 200 sessions is 1,000 interrupts. Prints p50/p90/p99/max per round and overall, the load average,
and exits non-zero if the p99 budget is missed or any heard text differs.

With ``--nodes N`` (2 or more) the sessions run on a cluster instead (``N`` nodes on a fresh PostgreSQL database and
a redis-server of the benchmark's own, as ``cluster_common.py`` starts them): half the edges connect to the node that
runs their session, the other half to another node, which relays them (``api/cluster/relay.py``), and both halves are
reported side by side, measured in the same rounds.

Run: ``.venv/bin/python bench/media_edge.py [--sessions 200] [--rounds 5] [--period-ms 20] [--progress-ms 300]
[--nodes N]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets
from websockets.asyncio.client import ClientConnection

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cluster_common import cluster  # noqa: E402
from tests.e2e.server import Server  # noqa: E402

from switchboard import Agent, RunContext, SpeechInterrupted, function_tool  # noqa: E402

BUDGET_P99_MS = 10.0
PREAMBLE = " ".join(f"word{i}" for i in range(300))
TURN = {"text": PREAMBLE, "tool_calls": [{"name": "heard_at"}]}
WAIT_S = 60.0


class EdgeBench(Agent):
    """The benchmark's agent (loaded by the server: ``SWITCHBOARD_AGENTS=bench.media_edge:AGENTS``)."""

    def __init__(self) -> None:
        super().__init__(instructions="Speak, and wait for the preamble to be heard.")

    @function_tool
    async def heard_at(self, ctx: RunContext) -> str:
        """Wait until the preamble was heard; say when the wait ended."""
        try:
            await ctx.wait_for_playout()
        except SpeechInterrupted:
            return f"released {time.time():.6f}"
        return "heard"


AGENTS = {"edge_bench": EdgeBench}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)  # nearest rank
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class Interrupt:
    sid: str
    relayed: bool
    speech_id: str
    text: str
    played_chars: int
    sent_perf: float
    sent_wall: float
    stop_ms: float | None = None
    released_ms: float | None = None
    committed: str | None = None


@dataclass(eq=False)
class EdgeConn:
    """One session's edge: reads what the server sends, reports progress while a speech plays."""

    sid: str
    ws: ClientConnection
    progress_s: float
    relayed: bool = False  # connected to a node that does not run the session (cluster mode)
    speech_id: str | None = None
    text: str = ""
    ended: bool = False
    played_chars: int = 0
    playing_ev: asyncio.Event = field(default_factory=asyncio.Event)
    stop_waiters: dict[str, asyncio.Future[float]] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # progress and barge-in frames go out in order
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._play())]

    async def _read(self) -> None:
        async for raw in self.ws:
            frame = json.loads(raw)
            kind = frame["type"]
            if kind == "speech.stop":
                waiter = self.stop_waiters.get(frame["speech_id"])
                if waiter is not None and not waiter.done():
                    waiter.set_result(time.perf_counter())
            elif kind == "speech.start":
                self.speech_id, self.text, self.ended, self.played_chars = frame["speech_id"], "", False, 0
                self.playing_ev.clear()
            elif kind == "speech.text" and frame["speech_id"] == self.speech_id:
                self.text += frame["delta"]
            elif kind == "speech.end" and frame["speech_id"] == self.speech_id:
                self.ended = True
                self.playing_ev.set()
            elif kind == "error":
                self.errors.append(frame)

    async def _play(self) -> None:
        """While a speech plays, report one more word every ``progress_s`` (with a random phase)."""
        await asyncio.sleep(random.uniform(0, self.progress_s))
        while True:
            await self.playing_ev.wait()
            async with self.lock:
                speech_id = self.speech_id
                if self.playing_ev.is_set() and speech_id is not None:
                    if self.played_chars == 0:
                        await self.ws.send(json.dumps({"type": "playback.started", "speech_id": speech_id}))
                    nxt = self.text.find(" ", self.played_chars + 1)
                    if nxt > 0:
                        self.played_chars = nxt
                        frame = {"type": "playback.progress", "speech_id": speech_id, "played_chars": nxt}
                        await self.ws.send(json.dumps(frame))
            await asyncio.sleep(self.progress_s)

    async def barge_in(self) -> Interrupt:
        async with self.lock:
            assert self.speech_id is not None
            self.playing_ev.clear()  # no progress after the barge-in
            waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            self.stop_waiters[self.speech_id] = waiter
            it = Interrupt(
                self.sid, self.relayed, self.speech_id, self.text, self.played_chars, time.perf_counter(), time.time()
            )
            await self.ws.send('{"type": "user.speech_started"}')
        async with asyncio.timeout(WAIT_S):
            stopped = await waiter
        it.stop_ms = (stopped - it.sent_perf) * 1000
        return it

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.ws.close()


async def _request(client: httpx.AsyncClient, method: str, url: str, **kw: Any) -> httpx.Response:
    """One request, sent again if the server had just closed the idle keep-alive connection it went on, or answered
    503 (POSTs carry an Idempotency-Key, so a second send is applied once)."""
    for attempt in range(1, 6):
        try:
            r = await client.request(method, url, **kw)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            if attempt == 5:
                raise
            continue
        if r.status_code != 503 or attempt == 5:  # 503: the server's deadline passed (a loaded machine): again
            r.raise_for_status()
            return r
        await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def _speaking(client: httpx.AsyncClient, edge: EdgeConn, gate: asyncio.Semaphore) -> None:
    """Give the session input and wait until its edge has the whole preamble (and the tool is waiting)."""
    key = {"Idempotency-Key": f"go-{edge.sid}-{time.time_ns()}"}
    async with gate:
        r = await _request(client, "POST", f"/v1/sessions/{edge.sid}/input", json={"text": "go"}, headers=key)
    speech_id = r.json()["speech_id"]
    async with asyncio.timeout(WAIT_S):
        while not (edge.speech_id == speech_id and edge.ended and edge.played_chars > 0):
            await asyncio.sleep(0.01)


async def _settle(client: httpx.AsyncClient, it: Interrupt) -> None:
    """Read the committed heard text and the tool's release time."""
    async with asyncio.timeout(WAIT_S):
        while True:
            speech = (await _request(client, "GET", f"/v1/sessions/{it.sid}/speeches/{it.speech_id}")).json()
            calls = (await _request(client, "GET", f"/v1/sessions/{it.sid}/tool-calls")).json()["items"]
            mine = [c for c in calls if c["speech_id"] == it.speech_id and c["status"] != "running"]
            if speech["state"] == "done" and mine:
                it.committed = speech["played_text"]
                output = str(mine[0]["output"])
                if output.startswith("released "):
                    it.released_ms = (float(output.split()[1]) - it.sent_wall) * 1000
                return
            await asyncio.sleep(0.05)


def _server_histogram(metrics: str) -> str:
    """The server's own ``switchboard_media_barge_in_seconds`` as "<= bound: share" (cumulative)."""
    name = "switchboard_media_barge_in_seconds"
    buckets: list[tuple[str, float]] = []
    for line in metrics.splitlines():
        if line.startswith(name + "_bucket{"):
            bound = line.split('le="')[1].split('"')[0]
            buckets.append((bound, float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return "no samples"
    shown = [f"<= {float(b) * 1000:g} ms: {n / total:.1%}" for b, n in buckets if b != "+Inf"]
    return f"n={total:.0f}, " + ", ".join(shown)


def _line(name: str, values: list[float]) -> str:
    return (
        f"  {name:<15} n={len(values):4d}  p50={pct(values, 50):6.2f} ms  p90={pct(values, 90):6.2f}  "
        f"p99={pct(values, 99):6.2f}  max={max(values):6.2f}"
    )


async def _round(client: httpx.AsyncClient, edges: list[EdgeConn], period_s: float) -> list[Interrupt]:
    order = random.sample(edges, len(edges))
    tasks: list[asyncio.Task[Interrupt]] = []
    for edge in order:  # open loop: a barge-in every period, whether or not the previous one was answered
        tasks.append(asyncio.create_task(edge.barge_in()))
        await asyncio.sleep(period_s)
    done = await asyncio.gather(*tasks)
    await asyncio.gather(*(_settle(client, it) for it in done))
    return list(done)


async def run(args: argparse.Namespace) -> int:
    random.seed(args.seed)
    env = {
        "SWITCHBOARD_AGENTS": "bench.media_edge:AGENTS",
        "SWITCHBOARD_MAX_SESSIONS": str(args.sessions + 10),
        "SWITCHBOARD_IDLE_TIMEOUT_S": "0",
        "SWITCHBOARD_MAX_CONNECTIONS_PER_CLIENT": "0",  # every edge (and, in a cluster, every relay) from 127.0.0.1
    }
    if args.nodes >= 2:
        async with cluster(args.nodes, **env) as nodes:
            return await _bench(list(nodes), args)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp), **env).start()
        try:
            return await _bench([server], args)
        finally:
            server.stop()


async def _edges(client: httpx.AsyncClient, servers: list[Server], args: argparse.Namespace) -> list[EdgeConn]:
    """The sessions and an edge for each: on a cluster, every other one connected through a node that does not run
    its session."""
    ws_url = {getattr(s, "node_id", None): s.ws_url for s in servers}
    edges = []
    for k in range(args.sessions):
        llm = {"provider": "scripted", "turns": [], "fallback": TURN}
        r = await client.post("/v1/sessions", json={"agent": "edge_bench", "llm": llm})
        r.raise_for_status()
        sid, owner = r.json()["id"], r.json().get("owner_node")
        relayed = len(servers) > 1 and k % 2 == 1
        target = next(u for node, u in ws_url.items() if node != owner) if relayed else ws_url.get(owner)
        ws = await websockets.connect(f"{target or servers[0].ws_url}/v1/sessions/{sid}/media", max_queue=None)
        edges.append(EdgeConn(sid, ws, args.progress_ms / 1000, relayed))
    return edges


def _lines(its: list[Interrupt], relayed_too: bool) -> None:
    groups = [("", its)]
    if relayed_too:
        groups += [(" (owner)", [it for it in its if not it.relayed]), (" (relayed)", [it for it in its if it.relayed])]
    for label, group in groups:
        print(_line(f"speech.stop{label}", [it.stop_ms or 0.0 for it in group]))
        print(_line(f"wait released{label}", [it.released_ms or 0.0 for it in group]))


async def _bench(servers: list[Server], args: argparse.Namespace) -> int:
    limits = httpx.Limits(max_connections=50)
    relayed_too = len(servers) > 1
    async with httpx.AsyncClient(base_url=servers[0].url, timeout=WAIT_S, limits=limits) as client:
        edges = await _edges(client, servers, args)
        for edge in edges:
            edge.start()
        where = f"on {len(servers)} nodes, half of the edges relayed" if relayed_too else "on one server"
        print(f"{args.sessions} sessions {where}, each with an edge connected; progress every {args.progress_ms} ms")
        all_its: list[Interrupt] = []
        gate = asyncio.Semaphore(20)  # inputs between rounds, not measured: no need to flood the server
        for n in range(args.rounds):
            await asyncio.gather(*(_speaking(client, edge, gate) for edge in edges))
            await asyncio.sleep(args.progress_ms / 1000 * 2)  # a few progress reports in
            load = os.getloadavg()
            its = await _round(client, edges, args.period_ms / 1000)
            all_its += its
            print(f"round {n + 1}  (load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
            _lines(its, relayed_too)
        server_side = _server_histogram((await _request(client, "GET", "/metrics")).text)
        for edge in edges:
            await edge.close()
    print(f"in the server, barge-in read -> speech.stop written: {server_side}")
    wrong = [it for it in all_its if it.committed != it.text[: it.played_chars].strip()]
    errors = [e for edge in edges for e in edge.errors]
    stops = [it.stop_ms or 0.0 for it in all_its]
    released = [it.released_ms or 0.0 for it in all_its]
    print(f"overall ({len(all_its)} interrupts)")
    _lines(all_its, relayed_too)
    print(f"heard-text accuracy: {len(all_its) - len(wrong)}/{len(all_its)} committed == last reported progress")
    print(f"error frames: {len(errors)}")
    for it in wrong[:5]:
        print(f"  MISMATCH {it.sid} {it.speech_id}: committed {it.committed!r}, reported {it.played_chars} chars")
    print(f"load average now: {os.getloadavg()}, cpus {os.cpu_count()}, python {platform.python_version()}")
    slow = max(pct(stops, 99), pct(released, 99)) > BUDGET_P99_MS
    if slow:
        print(f"BUDGET MISSED: p99 > {BUDGET_P99_MS} ms")
    return 1 if wrong or errors or slow else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--period-ms", type=float, default=20.0)
    parser.add_argument("--progress-ms", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=0, help="run on a cluster of this many nodes (2 or more)")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
