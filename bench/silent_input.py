"""Silent input vs context size on SQLite, through HTTP: does a ``reply=false`` input cost the same in a session of
~5,000 chat items as in one of ~500?

    .venv/bin/python bench/silent_input.py                        # 3 rounds of 300 inputs per session
    .venv/bin/python bench/silent_input.py --rounds 5 --inputs 500

A real ``switchboard serve`` process (uvicorn on loopback, SQLite in a temp dir) and this process as its client
(keep-alive connections). Two sessions are filled with silent inputs through the API (``--small`` and ``--big``
items), then each round sends ``--inputs`` silent inputs to each, interleaved in random order, and reports per
session the median and p90 latency and the ratio of medians (big / small). Alongside: the size of the WAL file, the
number of WAL checkpoints that happened in the round (the WAL header's checkpoint counter moving), and the latency of
the inputs that coincided with one, to tell a context-size cost from checkpoint noise. ``--source DIR`` runs the
server from another checkout (its ``service/``), to compare with an earlier version.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.server import Server  # noqa: E402


def wal_checkpoints(wal: Path) -> int:
    """The WAL header's checkpoint sequence number (it moves each time the WAL is reset after a checkpoint)."""
    try:
        with wal.open("rb") as f:
            header = f.read(32)
    except FileNotFoundError:
        return 0
    return struct.unpack(">I", header[12:16])[0] if len(header) == 32 else 0


def wal_mb(wal: Path) -> float:
    return wal.stat().st_size / 1e6 if wal.exists() else 0.0


async def silent(client: httpx.AsyncClient, sid: str, n: int) -> float:
    started = time.perf_counter()
    r = await client.post(f"/v1/sessions/{sid}/input", json={"text": f"note {n}", "reply": False})
    assert r.status_code == 202, r.text
    return time.perf_counter() - started


async def fill(client: httpx.AsyncClient, sid: str, size: int, lanes: int = 4) -> None:
    # a session runs one command at a time: several lanes only keep a request always waiting at the server
    async def lane(k: int) -> None:
        for n in range(k, size, lanes):
            await silent(client, sid, n)

    await asyncio.gather(*(lane(k) for k in range(lanes)))


async def run(args: argparse.Namespace) -> None:
    print("load average at start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    with tempfile.TemporaryDirectory(prefix="sb-silent-") as tmp:
        env = {"PYTHONPATH": f"{args.source}/service:{ROOT}"} if args.source else {}
        server = Server(Path(tmp), **env).start(timeout=120)  # a busy machine starts it slowly
        try:
            await measure(server, Path(tmp) / "e2e.db-wal", args)
        finally:
            server.stop()
    print("load average at end: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))


async def measure(server: Server, wal: Path, args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
        sids: dict[str, str] = {}
        for name, size in (("small", args.small), ("big", args.big)):
            r = await client.post("/v1/sessions", json={"agent": "tester"})
            assert r.status_code == 201, r.text
            sids[name] = r.json()["id"]
            await fill(client, sids[name], size)
        print(f"filled: small {args.small} items, big {args.big} items; WAL {wal_mb(wal):.1f} MB")
        ratios = []
        for round_no in range(1, args.rounds + 1):
            order = [name for name in sids for _ in range(args.inputs)]
            random.shuffle(order)
            times: dict[str, list[float]] = {name: [] for name in sids}
            near_checkpoint: list[float] = []
            checkpoints = 0
            for n, name in enumerate(order):
                before = wal_checkpoints(wal)
                elapsed = await silent(client, sids[name], n)
                if wal_checkpoints(wal) != before:
                    checkpoints += 1
                    near_checkpoint.append(elapsed)
                times[name].append(elapsed)
            med = {name: statistics.median(t) for name, t in times.items()}
            p90 = {name: statistics.quantiles(t, n=10)[-1] for name, t in times.items()}
            ratio = med["big"] / med["small"]
            ratios.append(ratio)
            cp = f", their median {statistics.median(near_checkpoint) * 1e3:.2f} ms" if near_checkpoint else ""
            print(
                f"round {round_no}: small median {med['small'] * 1e3:.2f} ms p90 {p90['small'] * 1e3:.2f} |"
                f" big median {med['big'] * 1e3:.2f} ms p90 {p90['big'] * 1e3:.2f} | ratio {ratio:.2f} |"
                f" WAL {wal_mb(wal):.1f} MB, {checkpoints} checkpoint(s){cp}"
            )
        print(f"ratio of medians: {', '.join(f'{r:.2f}' for r in ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=500)
    parser.add_argument("--big", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=300, help="silent inputs per session per round")
    parser.add_argument("--source", help="run the server from this checkout's service/ (default: this one)")
    args: Any = parser.parse_args()
    args.source = args.source and str(Path(args.source).resolve())
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
