"""Rolling deploy: how long each session cannot take a command while every node of the cluster is restarted in turn.

    .venv/bin/python bench/cluster_rolling.py [--nodes 3] [--per-node 20] [--runs 3] [--probe-s 0.25]

``--nodes`` ``switchboard serve`` nodes (real processes on loopback) on a fresh PostgreSQL database and a
redis-server of the benchmark's own, ``--per-node`` idle demo sessions on each. Every session is probed every
``--probe-s`` with a command (``POST /input``, ``final=false``: an interim transcript), sent to the nodes in turn as a
load balancer would: a node being restarted is taken out of the rotation before its SIGTERM and put back once it
answers ``/readyz``, and a request that cannot connect is sent to the next node (what nginx's ``proxy_next_upstream
error`` does). Meanwhile each node in turn gets SIGTERM, is waited for (its stop time is reported), started again
and waited for.

A session is unavailable from the first probe that does not answer 202 until the next one that does; reported:
each session's longest unavailability (p50/p99/max over sessions, and the medians of the per-run p99), the non-202
answers by status and problem code, and how long the stopping nodes took. Load average stated.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from cluster_common import Node, cluster, create_sessions, loadavg, pct


@dataclass
class Probe:
    sid: str
    down_since: float | None = None
    longest: float = 0.0
    failures: int = 0


@dataclass
class Balancer:
    """The nodes in rotation, like a load balancer's upstreams with health checks."""

    nodes: list[Node]
    out: set[str] = field(default_factory=set)
    turn: itertools.count[int] = field(default_factory=itertools.count)

    def order(self) -> list[Node]:
        up = [n for n in self.nodes if n.node_id not in self.out]
        start = next(self.turn) % max(1, len(up))
        return up[start:] + up[:start]


async def probe_forever(
    client: httpx.AsyncClient, lb: Balancer, probe: Probe, every_s: float, answers: Counter[str]
) -> None:
    while True:
        sent = time.monotonic()
        ok = False
        for node in lb.order():
            try:
                r = await client.post(f"{node.url}/v1/sessions/{probe.sid}/input", json={"text": "hm", "final": False})
            except httpx.TransportError:
                continue  # the next node, as the load balancer does
            ok = r.status_code == 202
            if not ok:
                code = r.json().get("code", "") if "json" in r.headers.get("content-type", "") else ""
                answers[f"{r.status_code} {code}".strip()] += 1
            break
        else:
            answers["no node answered"] += 1
        if ok and probe.down_since is not None:
            probe.longest = max(probe.longest, sent - probe.down_since)
            probe.down_since = None
        elif not ok:
            probe.failures += 1
            if probe.down_since is None:
                probe.down_since = sent
        await asyncio.sleep(max(0.0, every_s - (time.monotonic() - sent)))


async def roll(lb: Balancer, settle_s: float) -> list[float]:
    """Restart every node in turn; returns how long each took to stop after its SIGTERM."""
    stops = []
    for node in lb.nodes:
        lb.out.add(node.node_id)
        await asyncio.sleep(0.5)  # requests already sent to it finish
        sent = time.monotonic()
        node.signal(signal.SIGTERM)
        await node.stopped(60)
        stops.append(time.monotonic() - sent)
        await node.relaunch()
        lb.out.discard(node.node_id)
        await asyncio.sleep(settle_s)
    return stops


async def one_run(
    nodes: list[Node], sids: list[str], args: argparse.Namespace
) -> tuple[list[float], Counter[str], list[float]]:
    lb = Balancer(nodes)
    probes = [Probe(sid) for sid in sids]
    answers: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=len(sids) + 10)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        tasks = [asyncio.create_task(probe_forever(client, lb, p, args.probe_s, answers)) for p in probes]
        try:
            await asyncio.sleep(2.0)
            stops = await roll(lb, args.settle_s)
            await asyncio.sleep(5.0)  # every session answers again (or is counted down until the end)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    end = time.monotonic()
    longest = [max(p.longest, end - p.down_since if p.down_since is not None else 0.0) for p in probes]
    return longest, answers, stops


async def main(args: argparse.Namespace) -> int:
    print(f"load average at start: {loadavg()}")
    per_run: list[list[float]] = []
    all_answers: Counter[str] = Counter()
    all_stops: list[float] = []
    async with cluster(args.nodes) as nodes, httpx.AsyncClient(timeout=30) as client:
        sids = await create_sessions(nodes, args.nodes * args.per_node)
        for run in range(args.runs):
            longest, answers, stops = await one_run(nodes, sids, args)
            per_run.append(longest)
            all_answers.update(answers)
            all_stops.extend(stops)
            hit = sum(1 for v in longest if v > 0)
            print(
                f"run {run + 1}: {hit}/{len(sids)} sessions saw a failed command; longest per session p50 "
                f"{pct(longest, 50) * 1000:.0f} ms p99 {pct(longest, 99) * 1000:.0f} ms max {max(longest) * 1000:.0f} "
                f"ms; answers {dict(answers) or '-'}; stops {', '.join(f'{s:.1f}s' for s in stops)} (load {loadavg()})",
                flush=True,
            )
        states = Counter()
        for sid in sids:
            states[(await client.get(f"{nodes[0].url}/v1/sessions/{sid}")).json()["state"]] += 1
        print(f"sessions after the runs: {dict(states)}")
    every = [v for run in per_run for v in run]
    print(f"\n{args.runs} rolling restarts of {args.nodes} nodes, {len(sids)} sessions probed every {args.probe_s}s")
    print(
        f"longest unavailability per session (ms): p50 {pct(every, 50) * 1000:.0f}, p99 {pct(every, 99) * 1000:.0f}, "
        f"max {max(every) * 1000:.0f}; median of run p99 {statistics.median(pct(r, 99) for r in per_run) * 1000:.0f}"
    )
    print(f"non-202 answers: {dict(all_answers) or 'none'}")
    print(f"stop after SIGTERM (s): p50 {pct(all_stops, 50):.1f}, max {max(all_stops):.1f}")
    print(f"load average at end: {loadavg()}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--per-node", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--probe-s", type=float, default=0.25)
    parser.add_argument("--settle-s", type=float, default=3.0)
    sys.exit(asyncio.run(main(parser.parse_args())))
