"""HTTP benchmark: interrupt and input latency with 200 concurrently speaking sessions, over a real server.

A real ``switchboard serve`` process (SQLite in a temp dir, loopback) hosts the sessions; this process is the client.
Every session's scripted turn is a long preamble (300 words at 3 words/s) followed by a call of the ``heard`` test
tool, which awaits ``ctx.wait_for_playout()``. Each session's events are streamed over a WebSocket
(``types=speech.*,tool.*,generation.*``) and every frame is timestamped on receipt (``time.perf_counter``).

Each round has two phases, every command timed from just before its request is written:

* ``interrupt``, then ``input (idle)``: ``POST /interrupt`` on a speaking session (its tool waiting on the preamble).
  Measured: the response; the ``speech.interrupted`` frame; the ``tool.ended`` frame with status ``interrupted``,
  which is when the tool's ``wait_for_playout()`` was released and its call/output pair committed (the event's ``at``
  is server time, so only receipt times are compared). As soon as that session has settled, ``POST /input`` on it:
  the response and the ``generation.started`` frame of the new reply (again a preamble and a waiting tool). So an
  input reaches a listening session while every other session speaks.
* ``input (barge-in)``: ``POST /input`` (``interrupt=true``) on every session while it speaks: the response, the
  old speech's ``speech.interrupted`` and ``tool.ended``, and the new reply's ``generation.started``.

The budgeted figure "injected input -> ``generation.started``" is both inputs' last measurement. Beside each round the
server's CPU time per command is printed (it includes the 200 sessions' speaking): unlike latencies, the machine's
load does not inflate it.

Commands are issued open loop, ``--wave`` sessions at a time and a wave every ``--period-ms`` (default: one command
every 50 ms, 20 per second, a wave never waits for the previous one), while all the other sessions keep speaking.
``--modes waves,burst`` adds rounds where all 200 commands of a phase are issued at the same instant: that shows
throughput, not the latency of one command, and is not budgeted. Timed requests go over one keep-alive HTTP/1.1
connection per session, written by hand, so no client-library overhead sits in the timings.

Run: ``.venv/bin/python bench/http_interrupt.py [--sessions 200] [--rounds 5] [--wave 1] [--period-ms 50]``
The script stops by itself (``--timeout-s``), stops its server, and exits non-zero if a budget is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.server import Server  # noqa: E402

BUDGET_P99_MS = 25.0
PREAMBLE = " ".join(f"word{i}" for i in range(300))  # 100 s at 3 words/s: never finishes within a round
TURN = {"text": PREAMBLE, "tool_calls": [{"name": "heard"}]}
EVENT_TYPES = "speech.*,tool.*,generation.*"
WAIT_S = 60.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)  # nearest rank
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class Http:
    """One keep-alive HTTP/1.1 connection that posts JSON and reads a Content-Length response."""

    IDLE_S = 3.0  # uvicorn closes idle keep-alive connections after 5 s

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._used = 0.0

    async def open(self) -> None:
        await self.close()
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._used = time.monotonic()

    async def ready(self) -> None:
        """Reconnect, outside any timing, if the server may have closed the idle connection."""
        if self._reader is None or self._reader.at_eof() or time.monotonic() - self._used > self.IDLE_S:
            await self.open()

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert self._reader is not None and self._writer is not None
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        self._writer.write(head.encode() + data)
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"transfer-encoding":
                raise RuntimeError("chunked responses are not supported by this client")
        payload = await self._reader.readexactly(length) if length else b""
        self._used = time.monotonic()
        return status, (json.loads(payload) if payload else {})

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@dataclass(eq=False)
class Sess:
    """A session seen from the client: its HTTP connection, its event stream and when each frame arrived."""

    id: str
    http: Http
    ws: ClientConnection | None = None
    seen: dict[tuple[str, str], float] = field(default_factory=dict)  # (type, speech or call id) -> receipt
    call_of: dict[str, str] = field(default_factory=dict)  # speech id -> the call id of its tool
    status: dict[str, str] = field(default_factory=dict)  # call id -> terminal status
    speech: str | None = None  # the current reply
    closed: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set on every frame

    async def read(self) -> None:
        assert self.ws is not None
        try:
            async for raw in self.ws:
                now = time.perf_counter()
                frame = json.loads(raw)
                kind, data = frame["type"], frame["data"]
                key = data.get("call_id") if kind.startswith("tool.") else data.get("speech_id")
                self.seen[(kind, key)] = now
                if kind == "tool.started" and data.get("speech_id"):
                    self.call_of[data["speech_id"]] = data["call_id"]
                elif kind == "tool.ended":
                    self.status[data["call_id"]] = data["status"]
                self.changed.set()
        except Exception as err:  # recorded and reported; a round then fails its wait
            self.closed = repr(err)
        else:
            self.closed = f"closed {self.ws.close_code} {self.ws.close_reason}"
        self.changed.set()

    async def timed_post(self, path: str, body: dict[str, Any], ok: int, key: str) -> tuple[float, float, Any]:
        """POST on this session's connection: (start, response time, ``key`` of the answer), checked."""
        await self.http.ready()
        t0 = time.perf_counter()
        status, answer = await self.http.post(f"/v1/sessions/{self.id}/{path}", body)
        t1 = time.perf_counter()
        if status != ok or not answer.get(key):
            raise RuntimeError(f"{path} {self.id}: {status} {answer}")
        return t0, t1 - t0, answer[key]

    async def wait_for(self, what: str, pred: Callable[[Sess], bool], timeout: float = WAIT_S) -> None:
        async with asyncio.timeout(timeout):
            while not pred(self):
                if self.closed:
                    raise RuntimeError(f"{self.id} never reached '{what}': {self.closed}")
                self.changed.clear()
                await self.changed.wait()

    def waiting(self) -> bool:
        """Speaking its current reply, with that reply's tool started (it awaits the preamble at once)."""
        s = self.speech
        return s is not None and ("speech.started", s) in self.seen and s in self.call_of

    def settled(self, speech: str) -> bool:
        call = self.call_of.get(speech)
        return ("speech.done", speech) in self.seen and call is not None and call in self.status


async def wait_until(what: str, sessions: list[Sess], pred: Callable[[Sess], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        missing = [s for s in sessions if not pred(s)]
        if not missing:
            return
        broken = [s for s in missing if s.closed]
        if broken or time.monotonic() > deadline:
            detail = f"{broken[0].id}: {broken[0].closed}" if broken else f"e.g. {missing[0].id}"
            raise RuntimeError(f"{len(missing)} session(s) never reached '{what}' ({detail})")
        await asyncio.sleep(0.02)


Samples = dict[str, list[float]]


async def in_waves(
    sessions: list[Sess], wave: int, period_s: float, one: Callable[[Sess], Awaitable[dict[str, float]]]
) -> Samples:
    """Run ``one`` for every session: ``wave`` at a time, a wave every ``period_s`` (0: all at once)."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05

    async def scheduled(i: int, s: Sess) -> dict[str, float]:
        await asyncio.sleep(max(0.0, start + (i // wave) * period_s - loop.time()))
        return await one(s)

    rows = await asyncio.gather(*(scheduled(i, s) for i, s in enumerate(sessions)))
    out: Samples = {}
    for row in rows:
        for k, v in row.items():
            out.setdefault(k, []).append(v)
    return out


async def run_round(sessions: list[Sess], wave: int, period_s: float) -> Samples:
    samples: Samples = {}
    sent: dict[Sess, tuple[float, str, str, float]] = {}  # session -> (t0, old speech, old call, response)
    inputs: dict[Sess, tuple[float, float]] = {}  # session -> (t0, response) of its input

    # 1. POST /interrupt on a speaking session whose tool waits on the preamble; once it has settled (its tool
    #    ended, its speech done), POST /input on it: an input to a listening session while all others speak
    async def interrupt_then_input(s: Sess) -> dict[str, float]:
        speech = s.speech
        assert speech is not None
        t0, resp, _ = await s.timed_post("interrupt", {}, 200, "interrupted")
        sent[s] = (t0, speech, s.call_of[speech], resp)
        await s.wait_for("interrupted", lambda s: s.settled(speech))
        t0, resp, s.speech = await s.timed_post("input", {"text": "carry on"}, 202, "speech_id")
        inputs[s] = (t0, resp)
        return {}

    await in_waves(sessions, wave, period_s, interrupt_then_input)
    await wait_until("speaking again", sessions, Sess.waiting)
    for s, (t0, speech, call, resp) in sent.items():
        if s.status[call] != "interrupted":
            raise RuntimeError(f"{s.id}: tool ended {s.status[call]!r}, expected 'interrupted'")
        samples.setdefault("interrupt: response", []).append(resp * 1000)
        samples.setdefault("interrupt: speech.interrupted", []).append(
            (s.seen[("speech.interrupted", speech)] - t0) * 1000
        )
        samples.setdefault("interrupt: tool.ended (unblocked)", []).append((s.seen[("tool.ended", call)] - t0) * 1000)
    for s, (t0, resp) in inputs.items():
        assert s.speech is not None
        samples.setdefault("input (idle): response", []).append(resp * 1000)
        samples.setdefault("input (idle): generation.started", []).append(
            (s.seen[("generation.started", s.speech)] - t0) * 1000
        )
    await asyncio.sleep(0.3)  # every tool is inside wait_for_playout()

    # 2. POST /input (interrupt=true, the default) while speaking: barge-in
    async def barge_in(s: Sess) -> dict[str, float]:
        old = s.speech
        assert old is not None
        t0, resp, s.speech = await s.timed_post("input", {"text": "stop, other thing"}, 202, "speech_id")
        sent[s] = (t0, old, s.call_of[old], resp)
        return {}

    sent.clear()
    await in_waves(sessions, wave, period_s, barge_in)
    await wait_until("barged in", sessions, lambda s: s.waiting() and s.settled(sent[s][1]))
    for s, (t0, old, call, resp) in sent.items():
        if s.status[call] != "interrupted":
            raise RuntimeError(f"{s.id}: tool ended {s.status[call]!r}, expected 'interrupted'")
        assert s.speech is not None
        samples.setdefault("barge-in: response", []).append(resp * 1000)
        samples.setdefault("barge-in: speech.interrupted", []).append((s.seen[("speech.interrupted", old)] - t0) * 1000)
        samples.setdefault("barge-in: tool.ended (unblocked)", []).append((s.seen[("tool.ended", call)] - t0) * 1000)
        samples.setdefault("barge-in: generation.started", []).append(
            (s.seen[("generation.started", s.speech)] - t0) * 1000
        )
    await asyncio.sleep(0.3)
    return samples


BUDGETED = (
    "interrupt: speech.interrupted",
    "interrupt: tool.ended (unblocked)",
    "input (idle): generation.started",
    "barge-in: generation.started",
)


async def setup(server: Server, n: int) -> list[Sess]:
    sessions: list[Sess] = []
    sem = asyncio.Semaphore(20)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:

        async def one(i: int) -> Sess:
            async with sem:
                body = {
                    "id": f"bench-{i:04d}",
                    "agent": "tester",
                    "llm": {"provider": "scripted", "turns": [], "fallback": TURN},
                    "playout": {"words_per_second": 3},
                }
                r = await client.post("/v1/sessions", json=body)
                r.raise_for_status()
                s = Sess(id=r.json()["id"], http=Http("127.0.0.1", server.port))
                await s.http.open()
                s.ws = await connect(
                    f"{server.ws_url}/v1/sessions/{s.id}/events?types={EVENT_TYPES}", max_queue=None, ping_interval=None
                )
                asyncio.create_task(s.read(), name=f"read-{s.id}")  # noqa: RUF006 (ends with its connection)
                return s

        sessions = list(await asyncio.gather(*(one(i) for i in range(n))))
        await asyncio.sleep(0.2)  # subscriptions are registered before anything is said

        async def start(s: Sess) -> None:
            async with sem:
                r = await client.post(f"/v1/sessions/{s.id}/input", json={"text": "please confirm"})
                r.raise_for_status()
                s.speech = r.json()["speech_id"]

        await asyncio.gather(*(start(s) for s in sessions))
    await wait_until("speaking", sessions, Sess.waiting)
    await asyncio.sleep(0.5)
    return sessions


async def teardown(sessions: list[Sess]) -> None:
    for s in sessions:
        if s.ws is not None:
            with contextlib.suppress(Exception):
                await s.ws.close()
        await s.http.close()


def server_report(server: Server) -> list[str]:
    notes = []
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    for line in metrics.splitlines():
        if line.startswith(
            ("switchboard_ws_slow_consumers_dropped_total", "switchboard_interrupt_latency_seconds_count")
        ):
            notes.append(line)
    logs = server.logs()
    errors = [ln for ln in logs.splitlines() if "ERROR" in ln or "Traceback" in ln]
    forced = sum("did not stop within" in ln for ln in logs.splitlines())
    notes.append(f"server log: {len(errors)} error line(s); forced-interrupt safety net fired {forced} time(s)")
    notes.extend(f"  {ln[:200]}" for ln in errors[:10])
    return notes


def save(path: str, text: str) -> None:
    Path(path).write_text(text)


def cpu_s(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` so far: what the machine's load does not inflate."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}, {os.cpu_count()} cpus")
    print("load average at start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(
        f"{args.sessions} sessions speaking; waves of {args.wave} every {args.period_ms:g} ms; "
        f"{args.rounds} round(s) per mode; latencies in ms, measured on the client by receipt\n"
    )
    medians: dict[str, dict[str, dict[str, float]]] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sb-bench-") as tmp:
        server = Server(
            Path(tmp),
            SWITCHBOARD_WORDS_PER_SECOND="3",
            SWITCHBOARD_MAX_SESSIONS="1000",
            SWITCHBOARD_WS_MAX_STREAMS_PER_CREDENTIAL="1000",
            SWITCHBOARD_MAX_CONNECTIONS_PER_CLIENT="0",  # every connection comes from 127.0.0.1
            **({"PYTHONPATH": f"{args.source}/service:{ROOT}"} if args.source else {}),
        ).start(timeout=120)  # a busy machine starts it slowly
        sessions: list[Sess] = []
        try:
            async with asyncio.timeout(args.timeout_s):
                sessions = await setup(server, args.sessions)
                gc.collect()
                gc.freeze()
                for mode in modes:
                    wave, period = (args.wave, args.period_ms / 1000) if mode == "waves" else (len(sessions), 0.0)
                    per_round: list[dict[str, dict[str, float]]] = []
                    for r in range(args.rounds):
                        assert server.proc is not None
                        cpu0 = cpu_s(server.proc.pid)
                        samples = await run_round(sessions, wave, period)
                        commands = 3 * len(sessions)  # interrupt, input, barge-in
                        cpu_ms = (cpu_s(server.proc.pid) - cpu0) * 1000 / commands
                        stats = {k: {"p50": pct(v, 50), "p99": pct(v, 99), "max": max(v)} for k, v in samples.items()}
                        per_round.append(stats)
                        summary = ", ".join(f"{k} {stats[k]['p99']:.1f}" for k in BUDGETED)
                        load = os.getloadavg()[0]
                        print(
                            f"[{mode}] round {r + 1}, p99 (ms): {summary}; server CPU {cpu_ms:.2f} ms per command;"
                            f" load {load:.1f}",
                            flush=True,
                        )
                    medians[mode] = {
                        k: {q: statistics.median(st[k][q] for st in per_round) for q in ("p50", "p99", "max")}
                        for k in per_round[0]
                    }
                    medians[mode]["_rounds"] = {"n": len(per_round)}
        finally:
            await teardown(sessions)
            with contextlib.suppress(Exception):
                notes = server_report(server)
            server.stop()
            if args.server_log:
                save(args.server_log, server.logs())

    print(f"\nmedian over rounds (ms); {args.sessions} sessions")
    print(f"| mode  | {'measurement (from the POST)':<36} |    p50 |    p99 |    max |")
    print(f"|-------|{'-' * 38}|-------:|-------:|-------:|")
    for mode, table in medians.items():
        for k, v in table.items():
            if k.startswith("_"):
                continue
            print(f"| {mode:<5} | {k:<36} | {v['p50']:6.2f} | {v['p99']:6.2f} | {v['max']:6.2f} |")
    print()
    for n in notes:
        print(n)
    print("load average at end: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    ok = True
    if "waves" in medians:
        for k in BUDGETED:
            p99 = medians["waves"][k]["p99"]
            met = p99 <= BUDGET_P99_MS
            ok = ok and met
            print(f"budget {k}: p99 {p99:.2f} ms <= {BUDGET_P99_MS:g} ms -> {'PASS' if met else 'FAIL'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="waves", help="waves (budgeted) and/or burst")
    parser.add_argument("--wave", type=int, default=1, help="sessions per wave")
    parser.add_argument("--period-ms", type=float, default=50.0, help="time between waves")
    parser.add_argument("--source", help="run the server from this checkout's service/ (to compare versions)")
    parser.add_argument("--server-log", help="keep the server's log in this file")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="stop after this long, whatever happens")
    args = parser.parse_args()
    args.source = args.source and str(Path(args.source).resolve())
    try:
        import uvloop  # the server runs on uvloop too (uvicorn's default when installed)
    except ImportError:
        return asyncio.run(run(args))
    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
