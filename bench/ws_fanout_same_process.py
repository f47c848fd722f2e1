"""WebSocket fan-out against a plain ``websockets`` broadcast of the same frames, in the same run, interleaved.

``ws_fanout.py`` runs Switchboard and its baseline one after the other, so a machine whose load changes between the
two phases (other work on a shared machine) moves the ratio as much as the code does. Here both serve at once: the
Switchboard app under uvicorn in this process (SQLite in a temp dir), and a ``websockets`` broadcast server. The
session's ``ticker`` tool reports progress ``--rate`` times per second. The baseline follows the session: half a
period after the session emitted an event (a progress update: after the tool reported it), it broadcasts the frames
the stream sends for it (translated as the stream translates it; a progress update as a frame of the same shape and
size, stamped with the time it was due: ``ws_fanout.Rhythm``), so the two servers send the same frames in the same
order and rhythm, alternating, and each one's latency includes its wait behind the frames before.
That matters for an AG-UI stream, which also carries the turn's other events (its runs, state, the reply around the
tool, the tool's end) in bursts; the ``ws`` stream reads ``types=tool.progress`` only.

``--baseline process`` (the default) runs the baseline in a process of its own (``ws_fanout.py --role relay``, fed
the frames through a pipe), so each server has an event loop to itself and they share only the machine;
``--baseline loop`` runs it on this process's event loop, where a burst of either server delays the other.

Subscribers (``--subscribers`` to each server) are ``ws_fanout.py`` client processes; latency = receipt time - the
time stamped in the frame just before ``ctx.update()`` (Switchboard: through the durable writes, the hub and the
sends) or just before the broadcast (baseline). Each table also names the updates with the slowest deliveries.

Run: ``.venv/bin/python bench/ws_fanout_same_process.py [--subscribers 1000] [--events 200] [--rate 10]
[--stream ws|ag-ui-ws|ag-ui-sse] [--baseline process|loop] [--runs 3]``; it stops by itself and stops every process
it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ws_fanout import (  # noqa: E402
    SESSION_ID,
    Proc,
    Rhythm,
    broadcast_server,
    pct,
    raise_nofile,
    run_loop,
    stream_url,
)
from tests.e2e.server import free_port  # noqa: E402

BUDGET_RATIO = 1.2


async def clients(url: str, n: int, procs: int, events: int, timeout_s: float) -> list[Proc]:
    per = [n // procs + (1 if k < n % procs else 0) for k in range(procs)]
    started = []
    for k, conns in enumerate(per):
        started.append(
            await Proc.start(
                f"client{k}", "--role", "client", "--url", url, "--conns", str(conns), "--events", str(events),
                "--timeout-s", str(timeout_s),
            )
        )  # fmt: skip
    return started


async def results(procs: list[Proc], timeout_s: float) -> dict[str, Any]:
    merged: dict[str, Any] = {
        "latencies": [], "updates": [], "missing": 0, "closes": {}, "worst": [], "resumes": 0, "duplicates": 0
    }  # fmt: skip
    for p in procs:
        r = json.loads(await p.expect("RESULT", timeout_s))
        merged["latencies"] += r["latencies"]
        merged["updates"] += r["updates"]
        worst = r.get("worst", [])
        merged["worst"] = [max(a, b) for a, b in zip(merged["worst"] or worst, worst, strict=True)]
        merged["missing"] += r["missing"]
        merged["resumes"] += r.get("resumes", 0)
        merged["duplicates"] += r.get("duplicates", 0)
        for k, v in r["closes"].items():
            merged["closes"][k] = merged["closes"].get(k, 0) + v
    return merged


async def one_run(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, Any]]:
    import httpx
    import uvicorn

    from switchboard.api.app import create_app
    from switchboard.api.streams.agui import AguiTranslator, encode_ws
    from switchboard.api.streams.ws_protocol import EventStreamProtocol
    from switchboard.cli.main import GC_YOUNG_THRESHOLD
    from switchboard.control.settings import Settings

    os.environ["SWITCHBOARD_AGENTS"] = "bench.ws_fanout:AGENTS"
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp}/same-process.db",
        scripted_model="allow",
        ws_max_streams=args.subscribers + 100,
        ws_max_streams_per_credential=args.subscribers + 100,
        log_level="WARNING",
    )
    port, base_port = free_port(), free_port()
    app = create_app(settings)
    # what `switchboard serve` does before serving (cli/main.py): the app out of every full collection, a larger
    # young generation
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    # the WebSocket protocol `switchboard serve` uses (cli/main.py)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws=EventStreamProtocol)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    shape = "ag-ui" if args.stream.startswith("ag-ui") else "ws"
    relay: Proc | None = None

    rhythm = Rhythm(set(), shape, args.events)  # its clients: the baseline's connections (``--baseline loop``)

    async def follow() -> None:
        """Hand the baseline each of the session's events as the stream's frames, due half a period after the
        session emitted it (a progress update: after the tool reported it)."""
        sub = app.state.services.host.hub.subscribe(session_ids=[SESSION_ID], maxsize=100_000)
        translator = AguiTranslator(SESSION_ID)
        with sub:
            while True:
                _, event, _ = await sub.get()
                frames = encode_ws(translator.translate(event), event.seq)
                message: dict[str, Any]
                if event.type == "tool.progress":
                    progress = json.loads(event.data["message"])
                    message = {"at": progress["t"] + 0.5 / args.rate, "progress": progress["i"]}
                elif shape == "ag-ui" and frames:
                    message = {"at": event.at.timestamp() + 0.5 / args.rate, "frames": frames}
                else:
                    continue  # the ``ws`` stream reads progress only
                if relay is not None:
                    relay.say(json.dumps(message))
                else:
                    rhythm.put(message)

    timeout_s = args.events / args.rate + 60
    procs: list[Proc] = []
    following: list[asyncio.Task[None]] = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            if args.baseline == "process":
                relay = await Proc.start(
                    "relay", "--role", "relay", "--port", str(base_port), "--events", str(args.events),
                    "--stream", args.stream,
                )  # fmt: skip
                procs.append(relay)
                await relay.expect("LISTENING", 60)
            else:
                rhythm.clients = await stack.enter_async_context(broadcast_server(base_port))
            while not server.started:
                await asyncio.sleep(0.05)
            following = [asyncio.create_task(follow())]
            if relay is None:
                following.append(asyncio.create_task(rhythm.run()))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                call = {"name": "ticker", "arguments": {"events": args.events, "rate": args.rate}}
                body = {
                    "id": SESSION_ID,
                    "agent": "ticker",
                    "llm": {"provider": "scripted", "turns": [{"text": "", "tool_calls": [call]}]},
                }
                (await http.post("/v1/sessions", json=body)).raise_for_status()
                url = stream_url(args.stream, f"http://127.0.0.1:{port}")
                sb_procs = await clients(url, args.subscribers, args.procs, args.events, timeout_s)
                base_procs = await clients(
                    f"ws://127.0.0.1:{base_port}/", args.subscribers, args.procs, args.events, timeout_s
                )
                procs += sb_procs + base_procs
                for p in sb_procs + base_procs:
                    await p.expect("READY", 180)
                await asyncio.sleep(1.0)
                (await http.post(f"/v1/sessions/{SESSION_ID}/input", json={"text": "go"})).raise_for_status()
                sb = await results(sb_procs, timeout_s + 30)
                base = await results(base_procs, timeout_s + 30)
    finally:
        for task in following:
            task.cancel()
        for p in procs:
            await p.stop()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 30)
    return {"switchboard": sb, "baseline": base}


STEADY_FROM = 20  # the updates after the turn's start (its burst of other events) and the tool's move to background


def line(name: str, r: dict[str, Any]) -> dict[str, float]:
    lat = r["latencies"]
    steady = [v for v, i in zip(lat, r["updates"], strict=True) if i >= STEADY_FROM]
    out = {
        "p50": pct(lat, 50) if lat else math.nan,
        "p99": pct(lat, 99) if lat else math.nan,
        "steady_p99": pct(steady, 99) if steady else math.nan,
    }
    print(
        f"| {name:<11} | {len(lat):>9,} | {r['missing']:>7} | {out['p50']:8.2f} | {out['p99']:8.2f} "
        f"| {max(lat) if lat else math.nan:8.2f} | {r['closes'] or '-'}"
    )
    slowest = sorted(range(len(r["worst"])), key=lambda i: -r["worst"][i])[:5]
    print("|             | slowest updates (number: ms): " + ", ".join(f"{i}: {r['worst'][i]:.0f}" for i in slowest))
    print(f"|             | p99 of updates {STEADY_FROM} and later: {out['steady_p99']:.2f}")
    if r["resumes"] or r["duplicates"]:
        print(f"|             | resumed {r['resumes']} time(s) after a close; {r['duplicates']} frame(s) twice")
    return out


async def main_async(args: argparse.Namespace) -> int:
    raise_nofile(args.subscribers * 4 + 1024)
    print(f"{os.cpu_count()} cpus; load average at start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(
        f"{args.subscribers} {args.stream} subscribers to each server, {args.procs} client process(es) each; "
        f"{args.events} updates at {args.rate:g}/s, interleaved; baseline on its own {args.baseline}; latencies in ms\n"
    )
    ratios, steady_ratios = [], []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="sb-fanout-same-") as tmp:
            async with asyncio.timeout(args.timeout_s):
                r = await one_run(args, Path(tmp))
        print(f"run {run + 1}")
        print("| server      |    frames | missing |      p50 |      p99 |      max | closed")
        print("|-------------|----------:|--------:|---------:|---------:|---------:|-------")
        sb, base = line("switchboard", r["switchboard"]), line("baseline", r["baseline"])
        ratio = sb["p99"] / base["p99"]
        ratios.append(ratio)
        steady_ratios.append(sb["steady_p99"] / base["steady_p99"])
        print(
            f"p99 ratio switchboard/baseline: {ratio:.2f}x "
            f"(updates {STEADY_FROM} and later: {steady_ratios[-1]:.2f}x); load average: {os.getloadavg()[0]:.2f}\n"
        )
    worst = max(ratios)
    verdict = "PASS" if worst <= BUDGET_RATIO else "FAIL"
    print(f"p99 ratios: {', '.join(f'{x:.2f}x' for x in ratios)}; median {statistics.median(ratios):.2f}x; ", end="")
    print(f"worst {worst:.2f}x <= {BUDGET_RATIO:g}x -> {verdict}")
    print(f"updates {STEADY_FROM} and later: {', '.join(f'{x:.2f}x' for x in steady_ratios)}")
    return 0 if worst <= BUDGET_RATIO else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--subscribers", type=int, default=1000, help="to each server")
    parser.add_argument("--procs", type=int, default=2, help="client processes per server")
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--stream", choices=("ws", "ag-ui-ws", "ag-ui-sse"), default="ws")
    parser.add_argument("--baseline", choices=("process", "loop"), default="process")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    return int(run_loop(main_async(parser.parse_args())))


if __name__ == "__main__":
    sys.exit(main())
