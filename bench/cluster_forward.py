"""Forwarding benchmark: what a command sent to a node that does not run its session adds, against the same command
sent to the node that runs it.

    .venv/bin/python bench/cluster_forward.py [--runs 5] [--requests 400] [--sessions 20]

Two ``switchboard serve`` nodes (real processes on loopback) on a fresh PostgreSQL database and a redis-server of
the benchmark's own. ``--sessions`` idle demo sessions run on node-1. Each run sends ``--requests`` commands one at a
time, alternating between the node that runs the session and the other one (which forwards it), to sessions taken in
turn (they are placed evenly on both nodes):

- ``interim``: ``POST /input`` with ``final=false`` (an interim transcript: nothing is committed, so what is measured
  is the request path itself);
- ``input``: ``POST /input`` with ``reply=false`` (a user message committed: one group commit on the owner).

Reported per kind and per target: p50/p99 latency (client-side, the whole request) over all runs, the medians of the
per-run p50 and p99, and the added latency (forwarded - owner) at p50 and p99. Load average stated.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import httpx

from cluster_common import cluster, create_sessions, loadavg, pct, retrying

KINDS = {
    "interim": {"text": "hello there", "final": False},
    "input": {"text": "hello there", "reply": False},
}


async def one_run(
    client: httpx.AsyncClient, sessions: list[tuple[str, str, str]], requests: int
) -> dict[str, list[float]]:
    """``sessions``: (session id, its owner's URL, the other node's URL)."""
    times: dict[str, list[float]] = {f"{kind}/{target}": [] for kind in KINDS for target in ("owner", "forwarded")}
    for k in range(requests):
        sid, owner, other = sessions[k % len(sessions)]
        for kind, body in KINDS.items():
            for target, url in (("owner", owner), ("forwarded", other)):
                started = time.perf_counter()
                r = await client.post(f"{url}/v1/sessions/{sid}/input", json=body)
                elapsed = time.perf_counter() - started
                if r.status_code == 503:  # moving (a node let go after a late renewal): retried, not timed
                    r = await retrying(client, "POST", f"{url}/v1/sessions/{sid}/input", json=body)
                    if r.status_code == 202:
                        continue
                if r.status_code != 202:
                    raise RuntimeError(f"{kind} via {target}: {r.status_code} {r.text}")
                times[f"{kind}/{target}"].append(elapsed)
    return times


async def main(args: argparse.Namespace) -> int:
    print(f"load average at start: {loadavg()}")
    runs: list[dict[str, list[float]]] = []
    async with cluster(2) as nodes, httpx.AsyncClient(timeout=30) as client:
        urls = {node.node_id: node.url for node in nodes}
        sessions = []
        for sid in await create_sessions(nodes, args.sessions):  # placed evenly by the service
            owner = (await client.get(f"{nodes[0].url}/v1/sessions/{sid}")).json()["owner_node"]
            if owner not in urls:
                raise RuntimeError(f"{sid} has no owner yet")
            other = next(url for node_id, url in urls.items() if node_id != owner)
            sessions.append((sid, urls[owner], other))
        await one_run(client, sessions, 20)  # warm-up: connections, caches
        for run in range(args.runs):
            runs.append(await one_run(client, sessions, args.requests))
            print(f"run {run + 1}: load {loadavg()}", flush=True)
        for node in nodes:
            text = (await client.get(f"{node.url}/metrics")).text
            print(
                node.node_id, next(ln for ln in text.splitlines() if ln.startswith("switchboard_node_forwards_total"))
            )
    print(f"\n{args.runs} runs x {args.requests} requests per kind and target, one at a time; latencies in ms")
    print("| command | target    |   p50 |   p99 | median of run p50 | median of run p99 |")
    print("|---------|-----------|------:|------:|------------------:|------------------:|")
    for kind in KINDS:
        for target in ("owner", "forwarded"):
            key = f"{kind}/{target}"
            every = [v for run in runs for v in run[key]]
            run_p50 = statistics.median(pct(run[key], 50) for run in runs)
            run_p99 = statistics.median(pct(run[key], 99) for run in runs)
            print(
                f"| {kind:<7} | {target:<9} | {pct(every, 50) * 1000:5.2f} | {pct(every, 99) * 1000:5.2f} "
                f"| {run_p50 * 1000:17.2f} | {run_p99 * 1000:17.2f} |"
            )
        owner = [v for run in runs for v in run[f"{kind}/owner"]]
        fwd = [v for run in runs for v in run[f"{kind}/forwarded"]]
        print(
            f"| {kind:<7} | added     | {(pct(fwd, 50) - pct(owner, 50)) * 1000:5.2f} "
            f"| {(pct(fwd, 99) - pct(owner, 99)) * 1000:5.2f} |                   |                   |"
        )
    print(f"load average at end: {loadavg()}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--sessions", type=int, default=20)
    sys.exit(asyncio.run(main(parser.parse_args())))
