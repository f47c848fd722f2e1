"""Cross-node event delivery: tool progress of one session to 1,000 subscribers spread over the nodes of a cluster.

    .venv/bin/python bench/cluster_fanout.py [--nodes 3] [--subscribers 1000] [--events 100] [--rate 10] [--runs 3]

``--nodes`` ``switchboard serve`` nodes (real processes on loopback) on a fresh PostgreSQL database and a
redis-server of the benchmark's own. One session on node-1 runs the ``ticker`` tool of ``ws_fanout.py`` (progress
``--events`` times at ``--rate`` per second, each update stamped with ``time.time()`` just before ``ctx.update()``);
``--subscribers`` WebSockets stream the session's ``tool.progress`` events, spread evenly over the nodes, from one
client process per node (``ws_fanout.py --role client``). A subscriber on node-1 gets each event from node-1's hub; one
on another node gets it through Redis (published by node-1 once durable, handed to that node's hub). Latency =
receipt time - the stamp (same machine clock), per event per subscriber. A subscriber whose stream closes (other than
normally) resumes after the last seq it received, as a dashboard does; frames received twice are counted. Reported per
run and over all runs: p50/p99 for the owner's subscribers and for the other nodes', missing frames, resumes and
duplicates; the medians of the per-run p99. Load average stated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from typing import Any

import httpx

from cluster_common import Node, cluster, loadavg, pct
from ws_fanout import Proc, raise_nofile

SESSION = "cluster-fanout"


async def subscribed(client: httpx.AsyncClient, node: Node, want: int) -> None:
    async with asyncio.timeout(120):
        while True:
            text = (await client.get(f"{node.url}/metrics")).text
            line = next(ln for ln in text.splitlines() if ln.startswith("switchboard_event_subscribers "))
            if float(line.split()[1]) >= want:
                return
            await asyncio.sleep(0.2)


async def one_run(nodes: list[Node], args: argparse.Namespace, run: int) -> dict[str, dict[str, Any]]:
    sid = f"{SESSION}-{run}"
    call = {"name": "ticker", "arguments": {"events": args.events, "rate": args.rate}}
    body = {
        "id": sid,
        "agent": "ticker",
        "llm": {"provider": "scripted", "turns": [{"text": "", "tool_calls": [call]}]},
    }
    per = [args.subscribers // len(nodes) + (1 if k < args.subscribers % len(nodes) else 0) for k in range(len(nodes))]
    timeout_s = args.events / args.rate + 60
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{nodes[0].url}/v1/sessions", json=body)
        if r.status_code != 201 or r.json()["owner_node"] != nodes[0].node_id:
            raise RuntimeError(f"the session is not on {nodes[0].node_id}: {r.status_code} {r.text}")
        clients = []
        try:
            for node, conns in zip(nodes, per, strict=True):
                url = f"{node.ws_url}/v1/sessions/{sid}/events?types=tool.progress"
                clients.append(
                    await Proc.start(
                        node.node_id, "--role", "client", "--url", url, "--conns", str(conns),
                        "--events", str(args.events), "--timeout-s", str(timeout_s),
                    )
                )  # fmt: skip
            for c in clients:
                await c.expect("READY", 180)
            await asyncio.gather(*(subscribed(client, node, n) for node, n in zip(nodes, per, strict=True)))
            await asyncio.sleep(1.0)
            (await client.post(f"{nodes[0].url}/v1/sessions/{sid}/input", json={"text": "go"})).raise_for_status()
            results = [json.loads(await c.expect("RESULT", timeout_s + 30)) for c in clients]
        finally:
            for c in clients:
                await c.stop()
        await client.delete(f"{nodes[0].url}/v1/sessions/{sid}")
    owner, others = results[0], results[1:]
    return {"owner": merged([owner]), "other nodes": merged(others)}


def merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    closes: dict[str, int] = {}
    for r in results:
        for k, v in r["closes"].items():
            closes[k] = closes.get(k, 0) + v
    return {
        "latencies": [v for r in results for v in r["latencies"]],
        "missing": sum(r["missing"] for r in results),
        "closes": closes,
        "resumes": sum(r.get("resumes", 0) for r in results),
        "duplicates": sum(r.get("duplicates", 0) for r in results),
    }


async def main(args: argparse.Namespace) -> int:
    raise_nofile(args.subscribers * 2 + 1024)
    print(f"load average at start: {loadavg()}")
    env = {
        "SWITCHBOARD_AGENTS": "bench.ws_fanout:AGENTS",
        # every subscriber is the same (anonymous) credential: the per-credential cap would refuse most of them
        "SWITCHBOARD_WS_MAX_STREAMS": str(args.subscribers + 100),
        "SWITCHBOARD_WS_MAX_STREAMS_PER_CREDENTIAL": str(args.subscribers + 100),
        "SWITCHBOARD_MAX_CONNECTIONS_PER_CLIENT": "0",  # every subscriber (and every node) comes from 127.0.0.1
    }
    runs: list[dict[str, dict[str, Any]]] = []
    async with cluster(args.nodes, **env) as nodes:
        for run in range(args.runs):
            result = await one_run(nodes, args, run)
            runs.append(result)
            line = ", ".join(
                f"{where}: p50 {pct(r['latencies'], 50):.1f} ms p99 {pct(r['latencies'], 99):.1f} ms "
                f"missing {r['missing']} closed {r['closes'] or '-'} resumed {r['resumes']} twice {r['duplicates']}"
                for where, r in result.items()
            )
            print(f"run {run + 1}: {line} (load {loadavg()})", flush=True)
    print(f"\n{args.subscribers} subscribers over {args.nodes} nodes, {args.events} updates at {args.rate:g}/s, ms")
    print("| subscribers on | frames | missing |   p50 |   p99 |   max | median of run p99 |")
    print("|----------------|-------:|--------:|------:|------:|------:|------------------:|")
    for where in ("owner", "other nodes"):
        every = [v for r in runs for v in r[where]["latencies"]]
        missing = sum(r[where]["missing"] for r in runs)
        run_p99 = statistics.median(pct(r[where]["latencies"], 99) for r in runs)
        print(
            f"| {where:<14} | {len(every):>6} | {missing:>7} | {pct(every, 50):5.1f} | {pct(every, 99):5.1f} "
            f"| {max(every):5.1f} | {run_p99:17.1f} |"
        )
    print(f"load average at end: {loadavg()}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    sys.exit(asyncio.run(main(parser.parse_args())))
