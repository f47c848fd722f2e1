"""Traffic against a real server, and the invariants every session must hold afterwards.

Shared by the load and soak tests (small, bounded, for CI) and by ``bench/load.py`` and ``bench/soak.py`` (the same
workloads, bigger, for figures). Loopback only: the server is a ``tests.e2e.server.Server``.

``check_session`` is the post-condition of every workload, on a closed session:
- the chat is valid: each ``function_call`` is followed by its output, no output without its call (I1, I2);
- every tool call ended in exactly one terminal status, with exactly one ``tool.ended`` event and one output item
  (two for a call moved to the background: its placeholder pair and its ``/final`` pair) (I5);
- the event log, replayed over a WebSocket from ``since=0``, is gap-free from seq 1 and ends with
  ``session.closed`` (I6); and what a live subscriber received is exactly that log (no loss, no duplicate).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets

from tests.waiting import WAIT_S

from .server import EventStream, Server

Frame = dict[str, Any]
TERMINAL = frozenset({"completed", "failed", "cancelled", "rejected", "interrupted"})
LONG = " ".join(f"w{i}" for i in range(60))  # ~1.2 s of speech at 50 words/s: something to interrupt


# -- small helpers -------------------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``nan`` for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(seconds, value)`` samples, per minute (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    cov = sum((t - mean_t) * (v - mean_v) for t, v in samples)
    return cov / var * 60.0


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample ``name`` in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


GAUGES = {
    "rss_bytes": "process_resident_memory_bytes",
    "tasks": "switchboard_asyncio_tasks",
    "subscribers": "switchboard_event_subscribers",
    "ws_connections": "switchboard_ws_connections",
    "sessions_live": "switchboard_sessions_live",
    "open_fds": "process_open_fds",
}


async def gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {key: metric(text, name) for key, name in GAUGES.items()}


def assert_valid_chat(items: list[Frame]) -> None:
    """No call without its output right after it; no output without its call (I1, I2)."""
    for i, it in enumerate(items):
        if it["type"] == "function_call":
            nxt = items[i + 1] if i + 1 < len(items) else None
            assert nxt and nxt["type"] == "function_call_output" and nxt["call_id"] == it["call_id"], (i, items)
        if it["type"] == "function_call_output":
            prev = items[i - 1] if i > 0 else None
            assert prev and prev["type"] == "function_call" and prev["call_id"] == it["call_id"], (i, items)


def assert_gap_free(frames: list[Frame], start: int = 1) -> None:
    seqs = [f["seq"] for f in frames]
    assert seqs == list(range(start, start + len(seqs))), seqs


async def replay(ws_url: str, sid: str, *, since: int = 0, timeout_s: float = WAIT_S) -> list[Frame]:
    """A closed session's event log over the WebSocket: every frame after ``since``, until the 1000 close."""
    frames: list[Frame] = []
    async with asyncio.timeout(timeout_s):
        async with websockets.connect(f"{ws_url}/v1/sessions/{sid}/events?since={since}", max_size=None) as ws:
            try:
                async for raw in ws:
                    frames.append(json.loads(raw))
            except websockets.ConnectionClosed:
                pass
            assert ws.close_code == 1000, (sid, ws.close_code, ws.close_reason)
    return frames


@dataclass
class SessionCheck:
    events: int
    tool_calls: Counter[str]  # by terminal status
    chat_items: int


async def check_session(
    client: httpx.AsyncClient, ws_url: str, sid: str, live_frames: list[Frame] | None = None
) -> SessionCheck:
    """Assert the invariants of a closed session (see the module docstring); returns what was checked."""
    r = await client.get(f"/v1/sessions/{sid}/chat")
    assert r.status_code == 200, r.text
    items = r.json()["items"]
    assert_valid_chat(items)
    r = await client.get(f"/v1/sessions/{sid}/tool-calls")
    assert r.status_code == 200, r.text
    calls = r.json()["items"]
    frames = await replay(ws_url, sid)
    assert_gap_free(frames)
    assert frames and frames[-1]["type"] == "session.closed", [f["type"] for f in frames[-5:]]
    if live_frames is not None:
        assert live_frames == frames, (sid, len(live_frames), len(frames))
    ended = Counter(f["data"]["call_id"] for f in frames if f["type"] == "tool.ended")
    statuses = {f["data"]["call_id"]: f["data"]["status"] for f in frames if f["type"] == "tool.ended"}
    outputs = Counter(i["call_id"] for i in items if i["type"] == "function_call_output")
    expected_outputs: Counter[str] = Counter()
    for call in calls:
        cid = call["call_id"]
        assert call["status"] in TERMINAL, call
        assert ended[cid] == 1, (cid, ended[cid])
        assert statuses[cid] == call["status"], (cid, statuses[cid], call["status"])
        expected_outputs[cid] = 1
        if call["background"]:
            expected_outputs[f"{cid}/final"] = 1
    assert set(ended) == {c["call_id"] for c in calls}, "a tool.ended event for a call the API does not know"
    # every ctx.update() after the first is a pair of its own (`<call_id>/update/<n>`), each exactly once, of a call
    # that went to the background
    updates = Counter({cid: n for cid, n in outputs.items() if "/update/" in cid})
    assert all(n == 1 for n in updates.values()), (sid, updates)
    assert {cid.split("/update/")[0] for cid in updates} <= {c["call_id"] for c in calls if c["background"]}, updates
    assert outputs - updates == expected_outputs, (sid, outputs, expected_outputs)
    return SessionCheck(events=len(frames), tool_calls=Counter(c["status"] for c in calls), chat_items=len(items))


# -- timed requests ------------------------------------------------------------------------------------------------


@dataclass
class Recorder:
    """Latency (ms) and status of every request, by operation name."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))

    async def call(self, client: httpx.AsyncClient, op: str, method: str, url: str, **kw: Any) -> httpx.Response | None:
        started = time.perf_counter()
        try:
            r = await client.request(method, url, **kw)
        except httpx.HTTPError:
            self.statuses[op][0] += 1  # transport error: counted, never hidden
            return None
        self.latencies[op].append((time.perf_counter() - started) * 1000)
        self.statuses[op][r.status_code] += 1
        return r

    @property
    def server_errors(self) -> int:
        return sum(n for c in self.statuses.values() for s, n in c.items() if s >= 500)

    @property
    def transport_errors(self) -> int:
        return sum(c[0] for c in self.statuses.values())

    @property
    def requests(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for op in sorted(self.statuses):
            lat, st = self.latencies.get(op, []), self.statuses[op]
            out.append(
                {
                    "op": op,
                    "n": sum(st.values()),
                    "p50_ms": round(pct(lat, 50), 1),
                    "p99_ms": round(pct(lat, 99), 1),
                    "max_ms": round(max(lat), 1) if lat else math.nan,
                    "2xx": sum(n for s, n in st.items() if 200 <= s < 300),
                    "4xx": sum(n for s, n in st.items() if 400 <= s < 500),
                    "5xx": sum(n for s, n in st.items() if s >= 500),
                    "transport": st[0],
                }
            )
        return out

    def table(self) -> str:
        head = (
            f"{'operation':<12} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
            f"{'2xx':>6} {'4xx':>5} {'5xx':>4} {'conn':>4}"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows():
            lines.append(
                f"{r['op']:<12} {r['n']:>6} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['max_ms']:>8.1f} "
                f"{r['2xx']:>6} {r['4xx']:>5} {r['5xx']:>4} {r['transport']:>4}"
            )
        return "\n".join(lines)


# -- the load workload ---------------------------------------------------------------------------------------------


def load_turns(rng: random.Random, n: int = 30) -> list[dict[str, Any]]:
    """A script mixing speech (to interrupt), instant, slow, cancellable and background tools."""
    kinds = [
        lambda i: {"text": LONG, "tool_calls": [{"name": "book", "arguments": {"what": f"t{i}"}}]},
        lambda i: {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": f"q{i}"}}]},
        lambda i: {"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 8}}]},
        lambda i: {"text": "One moment.", "tool_calls": [{"name": "slow", "arguments": {"seconds": 0.3}}]},
        lambda i: {"text": LONG},
    ]
    return [rng.choice(kinds)(i) for i in range(n)]


@dataclass
class LoadConfig:
    sessions: int = 6
    ops_per_session: int = 25
    duration_s: float = 20.0  # the workers stop issuing commands after this, whatever is left
    think_s: tuple[float, float] = (0.01, 0.1)
    seed: int = 7


@dataclass
class LoadReport:
    config: LoadConfig
    recorder: Recorder
    checks: dict[str, SessionCheck]
    elapsed_s: float
    events: int = 0
    tool_calls: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        return {
            "sessions": self.config.sessions,
            "requests": self.recorder.requests,
            "server_errors": self.recorder.server_errors,
            "transport_errors": self.recorder.transport_errors,
            "events_checked": self.events,
            "tool_calls": dict(self.tool_calls),
            "elapsed_s": round(self.elapsed_s, 1),
            "operations": self.recorder.rows(),
        }


async def _worker(
    client: httpx.AsyncClient, rec: Recorder, sid: str, cfg: LoadConfig, rng: random.Random, stop_at: float
) -> None:
    base = f"/v1/sessions/{sid}"
    ops: list[tuple[float, Callable[[], Awaitable[Any]]]] = []

    async def inject() -> None:
        await rec.call(client, "input", "POST", f"{base}/input", json={"text": f"input {rng.random():.4f}"})

    async def interrupt() -> None:
        await rec.call(client, "interrupt", "POST", f"{base}/interrupt", json={"force": rng.random() < 0.3})

    async def say() -> None:
        await rec.call(client, "say", "POST", f"{base}/say", json={"text": "A word from the operator."})

    async def cancel() -> None:
        r = await rec.call(client, "list_tools", "GET", f"{base}/tool-calls", params={"status": "running"})
        running = [c for c in (r.json()["items"] if r is not None and r.status_code == 200 else []) if c["cancellable"]]
        if running:
            call_id = rng.choice(running)["call_id"]
            await rec.call(client, "cancel", "POST", f"{base}/tool-calls/{call_id}/cancel")

    async def read() -> None:
        await rec.call(client, "get_chat", "GET", f"{base}/chat")

    ops = [(0.4, inject), (0.2, interrupt), (0.15, cancel), (0.1, say), (0.15, read)]
    weights = [w for w, _ in ops]
    for _ in range(cfg.ops_per_session):
        if time.monotonic() >= stop_at:
            break
        await rng.choices([op for _, op in ops], weights)[0]()
        await asyncio.sleep(rng.uniform(*cfg.think_s))


async def wait_closed(stream: EventStream, timeout_s: float = WAIT_S) -> tuple[int, str] | None:
    """Wait until the server closed the stream (it does, with 1000, once the session is closed)."""
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(stream._task)
    except TimeoutError:
        await stream.close()
    return stream.closed


async def run_load(server: Server, cfg: LoadConfig) -> LoadReport:
    """N sessions, each driven by a worker issuing inputs, interrupts, cancels, says and reads concurrently while a
    subscriber per session and one multi-session subscriber stream everything; then every session is closed and
    checked (``check_session``), the live streams compared with the stored logs."""
    rec = Recorder()
    master = random.Random(cfg.seed)
    started = time.monotonic()
    limits = httpx.Limits(max_connections=max(10, cfg.sessions * 2))
    async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
        sids: list[str] = []
        for i in range(cfg.sessions):
            turns = load_turns(random.Random(master.random()))
            body = {
                "id": f"load-{cfg.seed}-{i}",
                "agent": "tester",
                "llm": {"provider": "scripted", "turns": turns, "fallback": {"text": "Okay then."}},
            }
            r = await rec.call(client, "create", "POST", "/v1/sessions", json=body)
            assert r is not None and r.status_code == 201, r and r.text
            sids.append(r.json()["id"])
        streams = {sid: await EventStream.open(server, sid, max_size=None) for sid in sids}
        multi = EventStream(
            await websockets.connect(f"{server.ws_url}/v1/events?session_ids={','.join(sids)}", max_size=None)
        )
        stop_at = time.monotonic() + cfg.duration_s
        try:
            await asyncio.gather(
                *(_worker(client, rec, sid, cfg, random.Random(master.random()), stop_at) for sid in sids)
            )
        finally:
            for sid in sids:
                await rec.call(client, "close", "DELETE", f"/v1/sessions/{sid}")
            for stream in streams.values():
                await wait_closed(stream)
            await multi.close()
        report = LoadReport(config=cfg, recorder=rec, checks={}, elapsed_s=time.monotonic() - started)
        for sid in sids:
            assert streams[sid].closed is not None and streams[sid].closed[0] == 1000, (sid, streams[sid].closed)
            check = await check_session(client, server.ws_url, sid, live_frames=streams[sid].frames)
            report.checks[sid] = check
            report.events += check.events
            report.tool_calls.update(check.tool_calls)
            mine = [{k: v for k, v in f.items() if k != "cursor"} for f in multi.frames if f["session_id"] == sid]
            assert mine == streams[sid].frames[: len(mine)], f"the multi-session stream differs for {sid}"
        cursors = [f["cursor"] for f in multi.frames]
        assert cursors == sorted(set(cursors)), "the multi-session stream repeated or reordered a cursor"
    return report


# -- steady traffic (soak) -----------------------------------------------------------------------------------------


@dataclass
class SteadyReport:
    sessions: int = 0
    recorder: Recorder = field(default_factory=Recorder)


async def steady_traffic(server: Server, *, duration_s: float, lanes: int = 3, seed: int = 11) -> SteadyReport:
    """Sessions opened and closed one after another in ``lanes`` parallel lanes for ``duration_s``: each gets a
    subscriber, a background tool with progress, inputs, an interrupt and a read, then is closed and its stream
    awaited. Steady load whose every session ends, so memory and tasks must come back to where they were."""
    out = SteadyReport()
    stop_at = time.monotonic() + duration_s

    async def lane(n: int) -> None:
        rng = random.Random(seed + n)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            k = 0
            while time.monotonic() < stop_at:
                k += 1
                turns = [
                    {"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 5}}]},
                    {"text": LONG},
                ]
                body = {"agent": "tester", "llm": {"provider": "scripted", "turns": turns}}
                r = await out.recorder.call(client, "create", "POST", "/v1/sessions", json=body)
                if r is None or r.status_code != 201:
                    await asyncio.sleep(0.2)
                    continue
                sid = r.json()["id"]
                out.sessions += 1
                stream = await EventStream.open(server, sid)
                try:
                    base = f"/v1/sessions/{sid}"
                    await out.recorder.call(client, "input", "POST", f"{base}/input", json={"text": "count"})
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                    await out.recorder.call(client, "input", "POST", f"{base}/input", json={"text": "talk"})
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                    await out.recorder.call(client, "interrupt", "POST", f"{base}/interrupt", json={})
                    await out.recorder.call(client, "get_chat", "GET", f"{base}/chat")
                finally:
                    await out.recorder.call(client, "close", "DELETE", f"/v1/sessions/{sid}")
                    await wait_closed(stream)

    await asyncio.gather(*(lane(n) for n in range(lanes)))
    return out


async def quiesce(
    client: httpx.AsyncClient, baseline: dict[str, float], keys: tuple[str, ...], timeout_s: float = 15.0
) -> dict[str, float]:
    """Poll /metrics until the ``keys`` gauges are back at ``baseline`` (or the timeout); returns the last sample."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = await gauges(client)
        if all(now[k] <= baseline[k] for k in keys) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)
