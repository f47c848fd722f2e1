"""Export load: another session's ``POST /interrupt`` latency while one read-only token exports a large session many
times at once, against the same interrupts with no export running, in one run.

    .venv/bin/python bench/export_load.py [--runs 3] [--exports 30] [--log-mb 20] [--interrupts 300]
        [--env SWITCHBOARD_EXPORT_MAX=100 ...] [--source OTHER_TREE/service]

A real ``switchboard serve`` process (SQLite in a temp dir, loopback) with two API keys: an operator's and a viewer's
(``sessions:read`` only). The operator fills one session's log with inputs of 60,000 characters until its export is
``--log-mb`` MB, and opens another, idle session. The viewer mints one session token for the large session.

Each run has two phases of ``--interrupts`` interrupts of the idle session, one every ``--period-ms``, each awaited
and timed from just before its request (over a keep-alive connection of its own):

- ``baseline``: nothing else runs;
- ``exports``: ``--exports`` clients export the large session at once with the viewer's token, each reading the
  whole document as it comes and starting again as soon as it ends; an export refused (429) starts again after its
  ``Retry-After``, as a polite client does. Counted: exports completed, refused, and the bytes received.

Reported per phase: p50, p99 and max of the interrupt latency per run, and their medians over the runs. The
server's settings can be changed with ``--env`` (e.g. the export budgets lifted); ``--source`` runs the server from
another source tree (``PYTHONPATH``), e.g. the code before a change, with the same benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.server import Server  # noqa: E402

from cluster_common import loadavg, pct  # noqa: E402

OPERATOR = "bench-operator-key-0123456789"
VIEWER = "bench-viewer-key-0123456789"
KEYS = [
    {"key": OPERATOR, "scopes": ["sessions:read", "sessions:write", "sessions:control"]},
    {"key": VIEWER, "scopes": ["sessions:read"]},
]
INPUT_CHARS = 60_000


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Exported:
    completed: int = 0
    refused: int = 0
    failed: int = 0
    bytes: int = 0


async def fill(client: httpx.AsyncClient, sid: str, log_mb: float) -> int:
    """Inputs into ``sid`` until its export is ``log_mb`` MB: the export's size."""
    text = "lorem ipsum " * (INPUT_CHARS // 12)
    while True:
        for _ in range(20):
            r = await client.post(f"/v1/sessions/{sid}/input", json={"text": text})
            r.raise_for_status()
        await asyncio.sleep(1.0)  # the inputs' events committed
        size = len((await client.get(f"/v1/sessions/{sid}/export")).content)
        if size >= log_mb * 1e6:
            return size


async def interrupts(client: httpx.AsyncClient, sid: str, count: int, period_s: float) -> list[float]:
    times: list[float] = []
    for _ in range(count):
        started = time.perf_counter()
        r = await client.post(f"/v1/sessions/{sid}/interrupt", json={})
        times.append(time.perf_counter() - started)
        if r.status_code >= 500 or r.status_code == 429:
            raise RuntimeError(f"interrupt: {r.status_code} {r.text}")
        await asyncio.sleep(max(0.0, period_s - times[-1]))
    return times


async def exporter(client: httpx.AsyncClient, url: str, token: str, stop: asyncio.Event, out: Exported) -> None:
    while not stop.is_set():
        try:
            async with client.stream("GET", url, headers=bearer(token)) as r:
                if r.status_code == 429:
                    out.refused += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), float(r.headers.get("retry-after", "1")))
                    continue
                r.raise_for_status()
                async for chunk in r.aiter_raw():
                    out.bytes += len(chunk)
                    if stop.is_set():
                        break
                else:
                    out.completed += 1
        except httpx.HTTPError:
            out.failed += 1


async def run_once(
    server: Server, token: str, big: str, idle: str, args: argparse.Namespace
) -> tuple[list[float], list[float], Exported]:
    period_s = args.period_ms / 1000
    limits = httpx.Limits(max_connections=args.exports + 1, max_keepalive_connections=args.exports + 1)
    async with (
        httpx.AsyncClient(base_url=server.url, headers=bearer(OPERATOR), timeout=60) as ops,
        httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as viewers,
    ):
        await interrupts(ops, idle, 10, period_s)  # warm-up: the connection
        baseline = await interrupts(ops, idle, args.interrupts, period_s)
        stop, out = asyncio.Event(), Exported()
        url = f"/v1/sessions/{big}/export"
        tasks = [asyncio.create_task(exporter(viewers, url, token, stop, out)) for _ in range(args.exports)]
        await asyncio.sleep(1.0)  # the exports under way
        loaded = await interrupts(ops, idle, args.interrupts, period_s)
        stop.set()
        await asyncio.gather(*tasks)
    return baseline, loaded, out


def row(name: str, values: list[list[float]]) -> str:
    figures = [
        statistics.median(f(v) * 1000 for v in values) for f in (lambda v: pct(v, 50), lambda v: pct(v, 99), max)
    ]
    return f"| {name:<8} | " + " | ".join(f"{x:8.1f}" for x in figures) + " |"


def server_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(item.split("=", 1) for item in args.env)
    if args.source:
        env["PYTHONPATH"] = f"{Path(args.source).resolve()}:{ROOT}"
    return env


async def main(args: argparse.Namespace) -> int:
    env = server_env(args)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(
            Path(tmp),
            SWITCHBOARD_API_KEYS=json.dumps(KEYS),
            SWITCHBOARD_MAX_TEXT_CHARS=str(INPUT_CHARS),
            SWITCHBOARD_WRITE_RATE_PER_S="0",  # the filling's inputs; the interrupts are few anyway
            SWITCHBOARD_REQUEST_TIMEOUT_S="60",
            **env,
        ).start()
        try:
            async with httpx.AsyncClient(base_url=server.url, headers=bearer(OPERATOR), timeout=120) as ops:
                body = {"agent": "tester", "llm": {"provider": "scripted", "turns": []}}
                big = (await ops.post("/v1/sessions", json=body)).json()["id"]
                idle = (await ops.post("/v1/sessions", json=body)).json()["id"]
                size = await fill(ops, big, args.log_mb)
                r = await ops.post(f"/v1/sessions/{big}/tokens", json={}, headers=bearer(VIEWER))
                token = r.raise_for_status().json()["token"]
            settings = {k: v for k, v in env.items() if k != "PYTHONPATH"} or "defaults"
            code = "from --source" if args.source else "this tree's"
            print(f"export of the large session: {size / 1e6:.1f} MB; server code: {code}; settings: {settings}")
            print(f"load average at start: {loadavg()}", flush=True)
            baselines, loads = [], []
            for run in range(args.runs):
                baseline, loaded, out = await run_once(server, token, big, idle, args)
                baselines.append(baseline)
                loads.append(loaded)
                print(
                    f"run {run + 1}: baseline p50 {pct(baseline, 50) * 1000:.1f} max {max(baseline) * 1000:.1f} ms;"
                    f" exports p50 {pct(loaded, 50) * 1000:.1f} p99 {pct(loaded, 99) * 1000:.1f}"
                    f" max {max(loaded) * 1000:.1f} ms; exports completed {out.completed}, refused {out.refused},"
                    f" failed {out.failed}, {out.bytes / 1e6:.0f} MB received; load {loadavg()}",
                    flush=True,
                )
        finally:
            server.stop()
    print(f"\n{args.runs} runs x {args.interrupts} interrupts; {args.exports} exports at once; latency in ms,")
    print("medians over the runs of each run's figure")
    print("| phase    |      p50 |      p99 |      max |")
    print("|----------|---------:|---------:|---------:|")
    print(row("baseline", baselines))
    print(row("exports", loads))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--exports", type=int, default=30)
    parser.add_argument("--log-mb", type=float, default=20.0)
    parser.add_argument("--interrupts", type=int, default=300)
    parser.add_argument("--period-ms", type=float, default=20.0)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server (repeatable)")
    parser.add_argument("--source", help="run the server from this source tree (its service/ directory)")
    sys.exit(asyncio.run(main(parser.parse_args())))
