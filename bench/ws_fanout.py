"""WebSocket benchmark: tool progress fanned out to 1,000 subscribers, against a plain ``websockets`` broadcast server.

Two phases in one run, measured the same way by the same client processes (asyncio, many connections each, separate
from the server process):

1. **Switchboard**: a real ``switchboard serve`` process (SQLite in a temp dir, loopback). One session runs the
   ``ticker`` tool below, which calls ``ctx.update()`` ``--events`` times at ``--rate`` per second on a fixed schedule;
   each progress message carries ``time.time()`` taken just before ``ctx.update()``. ``--subscribers`` WebSockets
   stream the session's events with ``types=tool.progress``. Delivery latency = receipt time (``time.time()`` in the
   client, same machine clock) - that timestamp, per event per subscriber: it covers the durable writes of the update
   and of its event, the hub, the per-subscriber send and the client's own loop.
2. **Baseline**: a minimal server of our own built on the ``websockets`` library (``websockets.broadcast``), sending a
   frame of the same shape and size at the same rate to the same number of clients, timestamped just before the
   broadcast.

Reported: latency p50/p99/max per phase, events/s delivered, missing frames, closed connections, and the ratio of
Switchboard's p99 to the baseline's. Budget: Switchboard p99 <= 100 ms and ratio <= 1.2x.

Run: ``.venv/bin/python bench/ws_fanout.py [--subscribers 1000] [--events 200] [--rate 10] [--procs 2]
[--stream ws|ag-ui-ws|ag-ui-sse]``
The script stops by itself (every wait is bounded), stops every process it started, and exits non-zero if a budget is
missed. The other roles (``--role client|baseline|relay``) are started by the script itself (``relay``: a baseline fed
its frames on stdin, for ``ws_fanout_same_process.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import resource
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from switchboard import Agent, RunContext, function_tool

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
BUDGET_P99_MS = 100.0
BUDGET_RATIO = 1.2
SESSION_ID = "fanout-bench"
CONNECT_CONCURRENCY = 50
MAX_RESUMES = 5  # per subscriber


class Ticker(Agent):
    """The benchmark agent, loaded by the server with ``SWITCHBOARD_AGENTS=bench.ws_fanout:AGENTS``."""

    def __init__(self) -> None:
        super().__init__(instructions="benchmark agent", name="ticker")

    @function_tool
    async def ticker(self, ctx: RunContext, events: int, rate: float) -> str:
        """Report progress ``events`` times, ``rate`` times per second, each update stamped with the time."""
        start = time.time()
        for i in range(events):
            delay = start + i / rate - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await ctx.update(json.dumps({"i": i, "t": time.time()}), progress=round((i + 1) / events, 4))
        return f"{events} updates sent"


AGENTS = {"ticker": Ticker}


def stream_url(stream: str, base_url: str) -> str:
    """Where a subscriber of ``stream`` (ws, ag-ui-ws, ag-ui-sse) reads the benchmark session's progress."""
    ws_url = "ws" + base_url[len("http") :]
    return {
        "ws": f"{ws_url}/v1/sessions/{SESSION_ID}/events?types=tool.progress",
        "ag-ui-ws": f"{ws_url}/v1/sessions/{SESSION_ID}/events?format=ag-ui",
        "ag-ui-sse": f"{base_url}/v1/sessions/{SESSION_ID}/ag-ui",
    }[stream]


def raise_nofile(want: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, want), hard)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def run_loop(coro: Any) -> Any:
    try:
        import uvloop  # the server runs on uvloop too (uvicorn's default when installed)
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)  # nearest rank
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# -- role: client ----------------------------------------------------------------------------------------------------


def position(frame: dict[str, Any], stream: Any) -> int:
    """The seq a frame completes (0 if none): a Switchboard frame's ``seq``, an AG-UI frame's ``rawEvent.seq``, the
    SSE ``id:`` before it."""
    if isinstance(frame.get("seq"), int):
        return int(frame["seq"])
    raw = frame.get("rawEvent")
    if isinstance(raw, dict) and isinstance(raw.get("seq"), int):
        return int(raw["seq"])
    return int(getattr(stream, "last_id", 0) or 0)


def stamp(frame: dict[str, Any]) -> tuple[int, float] | None:
    """The update number and send timestamp a progress frame carries (Switchboard or AG-UI shape), None for any
    other frame."""
    if frame.get("type") == "tool.progress":
        message = json.loads(frame["data"]["message"])
    elif frame.get("type") == "ACTIVITY_SNAPSHOT":
        message = json.loads(frame["content"]["message"])
    else:
        return None
    return int(message["i"]), float(message["t"])


class SseConnection:
    """A minimal SSE reader on a raw socket (one per subscriber: an HTTP client library would cost more per frame
    than the server's work being measured). Iterates the JSON of each ``data:`` line."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.close_code: int | None = None
        self.last_id = 0  # the last ``id:`` read

    @classmethod
    async def open(cls, url: str) -> SseConnection:
        rest = url.split("://", 1)[1]
        hostport, _, path = rest.partition("/")
        host, _, port = hostport.partition(":")
        reader, writer = await asyncio.open_connection(host, int(port), limit=2**22)
        writer.write(f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nAccept: text/event-stream\r\n\r\n".encode())
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"SSE refused: {status!r}")
        while (await reader.readline()).strip():
            pass  # headers
        return cls(reader, writer)

    def __aiter__(self) -> SseConnection:
        return self

    async def __anext__(self) -> str:
        while True:
            line = await self.reader.readline()
            if not line:
                raise StopAsyncIteration
            if line.startswith(b"id: "):
                self.last_id = int(line[4:])
            elif line.startswith(b"data: "):  # chunk-size lines and the rest of the framing are skipped
                return line[6:].decode()

    async def close(self) -> None:
        self.writer.close()


async def client_main(url: str, conns: int, expect: int, timeout_s: float) -> None:
    """Open ``conns`` WebSockets (or SSE streams, for an ``/ag-ui`` URL), print READY, collect ``expect`` progress
    frames on each (or time out), print RESULT."""
    from websockets.asyncio.client import connect

    sse = "/ag-ui" in url

    latencies: list[float] = []
    updates: list[int] = []  # the update each latency is of
    worst = [0.0] * expect  # per update: its slowest delivery (which updates make the tail)
    counts = [0] * conns
    closes: dict[str, int] = {}
    first_last = [math.inf, 0.0]
    all_done = asyncio.Event()
    finished = [0]
    resumes, duplicates = [0], [0]
    sem = asyncio.Semaphore(CONNECT_CONCURRENCY)

    resumable = "/v1/sessions/" in url  # a Switchboard session stream; the baseline's cannot resume

    async def open_stream(since: int) -> Any:
        at = url if not since else f"{url}{'&' if '?' in url else '?'}since={since}"
        if sse:
            return await SseConnection.open(at)
        return await connect(at, ping_interval=None, max_queue=None, open_timeout=60)

    async def one(k: int, ready: asyncio.Future[Any]) -> None:
        try:
            async with sem:
                ws: Any = await open_stream(0)
        except Exception as err:
            ready.set_exception(err)
            return
        ready.set_result(None)
        seen: set[int] = set()
        last_seq = 0
        for attempt in range(MAX_RESUMES + 1):
            if attempt:  # as a dashboard does after any close but a normal one: resume after the last seq
                resumes[0] += 1
                try:
                    ws = await open_stream(last_seq)
                except Exception as err:
                    key = f"resume failed: {type(err).__name__}"
                    closes[key] = closes.get(key, 0) + 1
                    return
            try:
                async for raw in ws:
                    now = time.time()
                    frame = json.loads(raw)
                    last_seq = max(last_seq, position(frame, ws))
                    stamped = stamp(frame)
                    if stamped is None:
                        continue  # an AG-UI stream's other frames (runs, tool call start and end)
                    i, sent = stamped
                    if i in seen:
                        duplicates[0] += 1
                        continue
                    seen.add(i)
                    latency = (now - sent) * 1000
                    latencies.append(latency)
                    updates.append(i)
                    if 0 <= i < expect:
                        worst[i] = max(worst[i], latency)
                    first_last[0] = min(first_last[0], now)
                    first_last[1] = max(first_last[1], now)
                    counts[k] += 1
                    if counts[k] == expect:
                        finished[0] += 1
                        if finished[0] == conns:
                            all_done.set()
                        return
            except Exception as err:
                closes[type(err).__name__] = closes.get(type(err).__name__, 0) + 1
            finally:
                if getattr(ws, "close_code", None) not in (None, 1000):
                    closes[f"code {ws.close_code}"] = closes.get(f"code {ws.close_code}", 0) + 1
                with contextlib.suppress(Exception):
                    await ws.close()
            if not resumable:
                return

    loop = asyncio.get_running_loop()
    readies = [loop.create_future() for _ in range(conns)]
    tasks = [asyncio.create_task(one(k, readies[k])) for k in range(conns)]
    async with asyncio.timeout(120):
        await asyncio.gather(*readies)
    print("READY", flush=True)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await all_done.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    result = {
        "latencies": [round(v, 3) for v in latencies],
        "updates": updates,
        "worst": [round(v, 1) for v in worst],
        "received": sum(counts),
        "missing": sum(max(0, expect - c) for c in counts),
        "closes": closes,
        "resumes": resumes[0],
        "duplicates": duplicates[0],
        "first": first_last[0],
        "last": first_last[1],
    }
    print("RESULT " + json.dumps(result), flush=True)


# -- role: baseline server -------------------------------------------------------------------------------------------


def baseline_frame(shape: str, i: int, events: int, at: float | None = None) -> str:
    """A frame of the shape and size the Switchboard stream sends for progress update ``i``, stamped ``at`` (now)."""
    message = json.dumps({"i": i, "t": time.time() if at is None else at})
    if shape == "ag-ui":
        frame: dict[str, Any] = {
            "type": "ACTIVITY_SNAPSHOT",
            "timestamp": int(time.time() * 1000),
            "rawEvent": {"seq": i + 10},
            "messageId": "call_0123456789abcdef.progress",
            "activityType": "switchboard.tool_progress",
            "content": {"call_id": "call_0123456789abcdef", "message": message, "progress": round((i + 1) / events, 4)},
        }
    else:
        frame = {
            "seq": i + 10,
            "session_id": SESSION_ID,
            "type": "tool.progress",
            "at": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()),
            "data": {
                "call_id": "call_0123456789abcdef",
                "message": message,
                "progress": round((i + 1) / events, 4),
            },
        }
    return json.dumps(frame)


@contextlib.asynccontextmanager
async def broadcast_server(port: int) -> AsyncIterator[set[Any]]:
    """A plain ``websockets`` server on ``port`` that only keeps its connections: the set it yields."""
    from websockets.asyncio.server import ServerConnection, serve

    clients: set[ServerConnection] = set()

    async def handler(ws: ServerConnection) -> None:
        clients.add(ws)
        try:
            await ws.wait_closed()
        finally:
            clients.discard(ws)

    async with serve(handler, "127.0.0.1", port, ping_interval=None):
        yield clients


async def baseline_main(port: int, events: int, rate: float, shape: str) -> None:
    """A plain ``websockets`` broadcast server: waits for GO on stdin, then broadcasts ``events`` frames at ``rate``."""
    from websockets.asyncio.server import broadcast

    loop = asyncio.get_running_loop()
    async with broadcast_server(port) as clients:
        print("LISTENING", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # GO
        start = time.time()
        for i in range(events):
            delay = start + i / rate - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            broadcast(clients, baseline_frame(shape, i, events))
        print("SENT", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # STOP


class Rhythm:
    """Broadcasts the frames of a session's events at their times, in order. Each message is ``{"at": <wall time>,
    "frames": [...]}`` or ``{"at": ..., "progress": i}``. A progress frame is stamped with its due time, or with the
    time its message arrived if that was later: its latency includes any wait behind earlier frames, as a Switchboard
    update's includes its wait behind earlier events, but not a late message."""

    def __init__(self, clients: Any, shape: str, events: int) -> None:
        self.clients, self.shape, self.events = clients, shape, events
        self.queue: asyncio.Queue[tuple[float, dict[str, Any]]] = asyncio.Queue()

    def put(self, message: dict[str, Any]) -> None:
        self.queue.put_nowait((time.time(), message))

    async def run(self) -> None:
        from websockets.asyncio.server import broadcast

        while True:
            arrived, message = await self.queue.get()
            if (delay := message["at"] - time.time()) > 0:
                await asyncio.sleep(delay)
            if "progress" in message:
                at = max(message["at"], arrived)
                frames = [baseline_frame(self.shape, message["progress"], self.events, at)]
            else:
                frames = message["frames"]
            for frame in frames:
                broadcast(self.clients, frame)


async def relay_main(port: int, events: int, shape: str) -> None:
    """A plain ``websockets`` broadcast server fed by stdin: each line is a ``Rhythm`` message; STOP ends it."""
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader(limit=2**24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    async with broadcast_server(port) as clients:
        rhythm = Rhythm(clients, shape, events)
        sending = asyncio.create_task(rhythm.run())
        print("LISTENING", flush=True)
        while (line := await stdin.readline()) and line.strip() != b"STOP":
            rhythm.put(json.loads(line))
        sending.cancel()


# -- role: orchestrator ----------------------------------------------------------------------------------------------


class Proc:
    """A child process of this script that speaks in lines on stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc, self.name = proc, name

    @classmethod
    async def start(cls, name: str, *args: str) -> Proc:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SCRIPT),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=64 * 1024 * 1024,
        )
        return cls(proc, name)

    async def expect(self, word: str, timeout: float) -> str:
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = (await self.proc.stdout.readline()).decode()
                if not line:
                    raise RuntimeError(f"{self.name} exited ({await self.proc.wait()}) before {word}")
                if line.startswith(word):
                    return line[len(word) :].strip()

    def say(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word.encode() + b"\n")

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


async def run_clients(url: str, args: argparse.Namespace, go: Any) -> dict[str, Any]:
    """Start the client processes, call ``go()`` once all are connected, and merge their results."""
    per = [args.subscribers // args.procs + (1 if k < args.subscribers % args.procs else 0) for k in range(args.procs)]
    timeout = args.events / args.rate + 30
    clients = [
        await Proc.start(
            f"client{k}", "--role", "client", "--url", url, "--conns", str(n), "--events", str(args.events),
            "--timeout-s", str(timeout),
        )
        for k, n in enumerate(per)
    ]  # fmt: skip
    try:
        for c in clients:
            await c.expect("READY", 180)
        await go()
        results = [json.loads(await c.expect("RESULT", timeout + 30)) for c in clients]
    finally:
        for c in clients:
            await c.stop()
    merged: dict[str, Any] = {"latencies": [], "received": 0, "missing": 0, "closes": {}}
    for r in results:
        merged["latencies"].extend(r["latencies"])
        merged["received"] += r["received"]
        merged["missing"] += r["missing"]
        for k, v in r["closes"].items():
            merged["closes"][k] = merged["closes"].get(k, 0) + v
    merged["span_s"] = max(r["last"] for r in results) - min(r["first"] for r in results)
    return merged


async def phase_switchboard(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import httpx

    sys.path.insert(0, str(ROOT))
    from tests.e2e.server import Server

    server = Server(
        tmp,
        SWITCHBOARD_AGENTS="bench.ws_fanout:AGENTS",
        SWITCHBOARD_MAX_SESSIONS="10",
        # every subscriber is the same (anonymous) credential: the per-credential cap would refuse most of them
        SWITCHBOARD_WS_MAX_STREAMS=str(args.subscribers + 100),
        SWITCHBOARD_WS_MAX_STREAMS_PER_CREDENTIAL=str(args.subscribers + 100),
        SWITCHBOARD_MAX_CONNECTIONS_PER_CLIENT="0",  # every subscriber comes from 127.0.0.1
    ).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            call = {"name": "ticker", "arguments": {"events": args.events, "rate": args.rate}}
            turn = {"text": "", "tool_calls": [call]}
            body = {"id": SESSION_ID, "agent": "ticker", "llm": {"provider": "scripted", "turns": [turn]}}
            (await http.post("/v1/sessions", json=body)).raise_for_status()

            async def go() -> None:
                async with asyncio.timeout(60):  # every subscription is registered in the hub
                    while True:
                        text = (await http.get("/metrics")).text
                        line = next(ln for ln in text.splitlines() if ln.startswith("switchboard_event_subscribers "))
                        if float(line.split()[1]) >= args.subscribers:
                            break
                        await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)
                (await http.post(f"/v1/sessions/{SESSION_ID}/input", json={"text": "go"})).raise_for_status()

            url = stream_url(args.stream, server.url)
            result = await run_clients(url, args, go)
            text = (await http.get("/metrics")).text
            result["server"] = [
                ln
                for ln in text.splitlines()
                if ln.startswith(("switchboard_ws_slow_consumers_dropped_total", "process_cpu_seconds_total"))
            ]
        logs = server.logs()
        result["server_errors"] = [ln[:200] for ln in logs.splitlines() if "ERROR" in ln or "Traceback" in ln][:10]
        return result
    finally:
        server.stop()


async def phase_baseline(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.e2e.server import free_port

    port = free_port()
    server = await Proc.start(
        "baseline", "--role", "baseline", "--port", str(port), "--events", str(args.events), "--rate", str(args.rate),
        "--stream", args.stream,
    )  # fmt: skip
    try:
        await server.expect("LISTENING", 30)

        async def go() -> None:
            await asyncio.sleep(1.0)
            server.say("GO")

        result = await run_clients(f"ws://127.0.0.1:{port}/", args, go)
        server.say("STOP")
        return result
    finally:
        await server.stop()


def summarise(name: str, r: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    lat = r["latencies"]
    out = {
        "p50": pct(lat, 50) if lat else math.nan,
        "p99": pct(lat, 99) if lat else math.nan,
        "max": max(lat) if lat else math.nan,
        "delivered_per_s": r["received"] / r["span_s"] if r["span_s"] > 0 else math.nan,
        "updates_per_s": (args.events - 1) / r["span_s"] if r["span_s"] > 0 else math.nan,
    }
    print(
        f"| {name:<11} | {len(lat):>9,} | {r['missing']:>7} | {out['p50']:8.2f} | {out['p99']:8.2f} "
        f"| {out['max']:8.2f} | {out['delivered_per_s']:>10,.0f} | {out['updates_per_s']:7.2f} | {r['closes'] or '-'}"
    )
    return out


async def orchestrate(args: argparse.Namespace) -> int:
    nofile = raise_nofile(args.subscribers * 2 + 1024)
    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}, {os.cpu_count()} cpus")
    print("load average at start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(
        f"{args.subscribers} {args.stream} subscribers in {args.procs} client process(es); {args.events} updates at "
        f"{args.rate:g}/s; "
        f"open-file limit {nofile}; latencies in ms, receipt time - send time (same clock)\n"
    )
    results: dict[str, dict[str, Any]] = {}
    async with asyncio.timeout(args.timeout_s):
        with tempfile.TemporaryDirectory(prefix="sb-fanout-") as tmp:
            for phase in args.order.split(","):
                print(f"running {phase} ...", flush=True)
                if phase == "switchboard":
                    results[phase] = await phase_switchboard(args, Path(tmp))
                else:
                    results[phase] = await phase_baseline(args)

    print("\n| server      |    frames | missing |      p50 |      p99 |      max | frames/s   | upd/s   | closed")
    print("|-------------|----------:|--------:|---------:|---------:|---------:|-----------:|--------:|-------")
    stats = {name: summarise(name, r, args) for name, r in results.items()}
    sb = results.get("switchboard", {})
    for line in sb.get("server", []):
        print(f"switchboard {line}")
    for line in sb.get("server_errors", []):
        print(f"switchboard log: {line}")
    print("load average at end: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    ok = True
    if "switchboard" in stats:
        p99 = stats["switchboard"]["p99"]
        met = p99 <= BUDGET_P99_MS and sb["missing"] == 0
        ok = ok and met
        verdict = "PASS" if met else "FAIL"
        print(f"\nbudget: switchboard p99 {p99:.2f} ms <= {BUDGET_P99_MS:g} ms, nothing missing -> {verdict}")
    if "switchboard" in stats and "baseline" in stats:
        ratio = stats["switchboard"]["p99"] / stats["baseline"]["p99"]
        met = ratio <= BUDGET_RATIO
        ok = ok and met
        verdict = "PASS" if met else "FAIL"
        print(f"budget: p99 ratio switchboard/baseline {ratio:.2f}x <= {BUDGET_RATIO:g}x -> {verdict}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--role", choices=("main", "client", "baseline", "relay"), default="main")
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--events", type=int, default=200, help="progress updates (20 s at 10/s)")
    parser.add_argument("--rate", type=float, default=10.0, help="updates per second")
    parser.add_argument("--order", default="switchboard,baseline")
    parser.add_argument(
        "--stream",
        choices=("ws", "ag-ui-ws", "ag-ui-sse"),
        default="ws",
        help="what the subscribers read: the event WebSocket, or AG-UI on the WebSocket or over SSE (the baseline "
        "then broadcasts AG-UI-shaped frames)",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="stop after this long, whatever happens")
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--conns", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "client":
        raise_nofile(args.conns + 256)
        run_loop(client_main(args.url, args.conns, args.events, args.timeout_s))
        return 0
    if args.role == "relay":
        raise_nofile(2 * 4096)
        run_loop(relay_main(args.port, args.events, "ag-ui" if args.stream.startswith("ag-ui") else "ws"))
        return 0
    if args.role == "baseline":
        raise_nofile(2 * 4096)
        run_loop(baseline_main(args.port, args.events, args.rate, "ag-ui" if args.stream.startswith("ag-ui") else "ws"))
        return 0
    return int(run_loop(orchestrate(args)))


if __name__ == "__main__":
    sys.exit(main())
