"""One chaos run: start the cluster, drive the load through the balancer while the seeded faults run, undo the
faults, let the cluster settle, then read the history and the durable state and check them.

    python -m tests.chaos --seed 1 --duration 300      (``make chaos``)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checker import Row, Violation, check
from .cluster import API_KEY, ChaosCluster
from .durable import read_durable
from .faults import FaultPlan, Injector, restore
from .history import History
from .load import Api, Load
from .proxy import Balancer
from .report import figures, render

LEASE_S = 4.0  # three nodes, PostgreSQL, Redis and the load share two cores: a 2 s lease would flap
SETTLE_S = 240.0  # longer than the webhook tool's own timeout (120 s): a call whose reports were lost ends by then
CATCH_UP_S = 30.0
TAKEN_S = 60.0
WARMUP_S = 60.0


@dataclass
class Outcome:
    violations: list[Violation]
    figures: dict[str, Any]
    text: str
    workdir: Path


async def _settle(cluster: ChaosCluster, history: History, bound_s: float) -> None:
    """Wait until every node is live, every session owned by one, no call runs and every speech is done."""
    started = time.monotonic()
    detail = ""
    last_restore = started
    while time.monotonic() - started < bound_s:
        conn = await cluster.connect()
        try:
            live = {
                r["id"] for r in await conn.fetch("SELECT id FROM nodes WHERE state = 'live' AND lease_until > now()")
            }
            unowned = await conn.fetchval(
                "SELECT count(*) FROM sessions WHERE state NOT IN ('closed', 'failed') "
                "AND (owner_node IS NULL OR NOT owner_node = ANY($1::text[]))",
                list(live),
            )
            running = await conn.fetchval("SELECT count(*) FROM tool_calls WHERE status = 'running'")
            speaking = await conn.fetchval("SELECT count(*) FROM speeches WHERE state <> 'done'")
        finally:
            await conn.close()
        detail = f"live nodes {sorted(live)}, unowned sessions {unowned}, calls running {running}, speeches {speaking}"
        if len(live) == len(cluster.nodes) and unowned == running == speaking == 0:
            history.add("settle", ok=True, seconds=time.monotonic() - started, detail=detail)
            return
        if time.monotonic() - last_restore > 10:  # a node that exited meanwhile is started again
            await restore(cluster)
            last_restore = time.monotonic()
        await asyncio.sleep(0.5)
    history.add("settle", ok=False, seconds=time.monotonic() - started, detail=detail)


async def _transcripts_taken(load: Load, bound_s: float) -> None:
    """Give the media edges the time to have every transcript they said taken, before the cluster settles (a reply
    to one taken later would start after the settling); the checker reports any never taken."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and any(edge.pending for edge in load.edges.values()):
        await asyncio.sleep(0.2)


async def _catch_up(load: Load, cluster: ChaosCluster) -> None:
    """Give the clients' streams the time to reach the end of the durable log (the checker reports any behind)."""
    deadline = time.monotonic() + CATCH_UP_S
    while time.monotonic() < deadline:
        conn = await cluster.connect()
        try:
            last = {
                r["session_id"]: r["n"]
                for r in await conn.fetch("SELECT session_id, max(seq) AS n FROM events GROUP BY session_id")
            }
            top = await conn.fetchval("SELECT coalesce(max(id), 0) FROM events")
        finally:
            await conn.close()
        if load.multi.cursor >= top and all(s.last_seq >= last.get(sid, 0) for sid, s in load.streams.items()):
            return
        await asyncio.sleep(0.5)


async def _warm_up(load: Load, want: int) -> None:
    deadline = time.monotonic() + WARMUP_S
    while len(load.sessions) < want and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


async def run(seed: int, duration_s: float, workdir: Path, max_sessions: int, lease_s: float = LEASE_S) -> Outcome:
    history = History()
    cluster = ChaosCluster(workdir, seed, lease_s)
    balancer = Balancer(cluster.routable_ports, random.Random(f"balancer-{seed}"))
    api: Api | None = None
    durable: dict[str, list[Row]] = {}
    try:
        await cluster.start(balancer)
        base = f"127.0.0.1:{balancer.port}"
        api = Api(f"http://{base}", API_KEY, history)
        load = Load(api, f"ws://{base}", API_KEY, history, seed, max_sessions, cluster.backend)
        await load.start()
        await _warm_up(load, min(4, max_sessions))
        injector = Injector(cluster, history, FaultPlan.seeded(seed, duration_s, lease_s))
        await injector.run()
        await restore(cluster)
        await load.stop()
        await _transcripts_taken(load, TAKEN_S)
        await _settle(cluster, history, SETTLE_S)
        await load.stop_reports()
        await _catch_up(load, cluster)
        await load.close_clients()
        await injector.wait_watchers()
        durable = await read_durable(cluster.dsn)
    finally:
        if api is not None:
            await api.aclose()
        (workdir / "nodes.log").write_text(cluster.logs())
        await cluster.aclose()
    for failure in cluster.start_failures:
        history.add("start_failed", detail=failure)
    history.save(workdir / "history.jsonl")
    (workdir / "durable.json").write_text(json.dumps(durable, default=str))
    violations = check(history, durable)
    figs = figures(history, durable)
    text = f"chaos run: seed {seed}, {duration_s:.0f} s of faults, lease {lease_s} s, in {workdir}" + render(
        violations, figs
    )
    return Outcome(violations, figs, text, workdir)


def recheck(workdir: Path) -> int:
    """Run the checker again on the history and durable state a run left (after a change to the checker)."""
    history = History.load(workdir / "history.jsonl")
    durable = json.loads((workdir / "durable.json").read_text())
    violations = check(history, durable)
    print(f"chaos run in {workdir}, checked again" + render(violations, figures(history, durable)))
    return 1 if violations else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of faults (the schedule's size)")
    parser.add_argument("--sessions", type=int, default=16, help="sessions the load creates")
    parser.add_argument("--lease", type=float, default=LEASE_S)
    parser.add_argument("--workdir", type=Path, default=None, help="where logs, history and durable state go")
    parser.add_argument("--check", type=Path, default=None, help="check a finished run's work directory again")
    args = parser.parse_args(argv)
    if args.check is not None:
        return recheck(args.check)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sbchaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    outcome = asyncio.run(run(args.seed, args.duration, workdir, args.sessions, args.lease))
    print(outcome.text)
    return 1 if outcome.violations else 0


if __name__ == "__main__":
    sys.exit(main())
