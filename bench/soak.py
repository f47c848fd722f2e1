"""Soak: minutes of steady traffic against a real ``switchboard serve`` on loopback, sampling the server's resident
memory and open asyncio tasks from /metrics; both must stay flat. Reports their slopes (least squares, per minute).

Traffic is ``tests.e2e.traffic.steady_traffic``: ``--lanes`` lanes, each opening a session, subscribing to its
events, running a background tool with progress, two inputs, an interrupt and a read, then closing it and waiting for
its stream to end, over and over. Every ``--sample-s`` the script reads ``process_resident_memory_bytes``,
``switchboard_asyncio_tasks``, ``switchboard_event_subscribers``, ``process_open_fds`` and the live sessions.

The slopes are fitted over the samples after ``--warmup-s`` (default: the first half of the run). The first minutes
are not flat, and are not a leak: the resident size climbs ~13 MiB and levels off after ~6 minutes, while the Python
heap (tracemalloc) stays flat; it is native memory filling up to its bounds (the database driver's page and
statement caches, the allocator's arenas). A flat run: RSS slope within ``--max-rss-mib-per-min`` and a task slope
within ``--max-tasks-per-min``; and once the traffic stops and every session is closed, tasks, subscribers and live
sessions are back at their baseline.

Run: ``.venv/bin/python bench/soak.py [--duration-s 480] [--lanes 3] [--sample-s 5]``  (exits non-zero if not flat)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.server import Server  # noqa: E402
from tests.e2e.traffic import gauges, quiesce, slope_per_min, steady_traffic  # noqa: E402

MIB = 1024 * 1024


async def main(args: argparse.Namespace) -> int:
    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}, {os.cpu_count()} cpus")
    with tempfile.TemporaryDirectory(prefix="sb-soak-") as tmp:
        server = Server(Path(tmp), database_url=args.database_url, SWITCHBOARD_LOG_LEVEL="WARNING")
        await asyncio.to_thread(server.start)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                await steady_traffic(server, duration_s=2.0, lanes=1)  # first use: imports, pools
                idle = {"subscribers": 0.0, "ws_connections": 0.0, "sessions_live": 0.0}
                baseline = await quiesce(client, idle, tuple(idle))
                samples: list[tuple[float, dict[str, float]]] = []
                started = time.monotonic()

                async def sampler() -> None:
                    while True:
                        samples.append((time.monotonic() - started, await gauges(client)))
                        await asyncio.sleep(args.sample_s)

                sampling = asyncio.create_task(sampler())
                try:
                    async with asyncio.timeout(args.duration_s + 120):
                        report = await steady_traffic(server, duration_s=args.duration_s, lanes=args.lanes)
                finally:
                    sampling.cancel()
                    await asyncio.gather(sampling, return_exceptions=True)
                after = await quiesce(client, baseline, ("tasks", "subscribers", "sessions_live"))
        finally:
            await asyncio.to_thread(server.stop)

    warmup_s = args.duration_s / 2 if args.warmup_s is None else args.warmup_s
    steady = [(t, s) for t, s in samples if t >= warmup_s] or samples
    rss_slope = slope_per_min([(t, s["rss_bytes"] / MIB) for t, s in steady])
    task_slope = slope_per_min([(t, s["tasks"]) for t, s in steady])
    fd_slope = slope_per_min([(t, s["open_fds"]) for t, s in steady])
    rss_whole = slope_per_min([(t, s["rss_bytes"] / MIB) for t, s in samples])
    rss = [s["rss_bytes"] / MIB for _, s in steady]
    tasks = [s["tasks"] for _, s in steady]
    print(f"\n{report.sessions} sessions over {args.duration_s:g} s in {args.lanes} lanes; {len(samples)} samples")
    print(report.recorder.table())
    print(f"\nRSS   : {min(rss):.1f}-{max(rss):.1f} MiB, slope {rss_slope:+.3f} MiB/min (after {warmup_s:g} s)")
    print(f"        whole run {rss_whole:+.3f} MiB/min, from {samples[0][1]['rss_bytes'] / MIB:.1f} MiB")
    print(f"tasks : {min(tasks):.0f}-{max(tasks):.0f} while busy, slope {task_slope:+.3f} /min")
    print(f"fds   : slope {fd_slope:+.3f} /min")
    print(f"idle  : before {baseline}\n        after  {after}")
    returned = all(after[k] <= baseline[k] for k in ("tasks", "subscribers", "sessions_live"))
    flat = abs(rss_slope) <= args.max_rss_mib_per_min and abs(task_slope) <= args.max_tasks_per_min
    errors = report.recorder.server_errors + report.recorder.transport_errors
    result = {
        "duration_s": args.duration_s,
        "fitted_after_s": warmup_s,
        "sessions": report.sessions,
        "requests": report.recorder.requests,
        "errors": errors,
        "rss_mib_per_min": round(rss_slope, 3),
        "rss_mib_per_min_whole_run": round(rss_whole, 3),
        "tasks_per_min": round(task_slope, 3),
        "fds_per_min": round(fd_slope, 3),
        "rss_mib": [round(min(rss), 1), round(max(rss), 1)],
        "back_to_baseline": returned,
        "samples": [{"t": round(t, 1), **s} for t, s in samples],
    }
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "samples"}))
    if args.samples_json:
        await asyncio.to_thread(Path(args.samples_json).write_text, json.dumps(result, indent=1))
    verdict = flat and returned and errors == 0
    print("flat: yes" if verdict else "flat: NO")
    return 0 if verdict else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=480.0)
    parser.add_argument("--lanes", type=int, default=3, help="sessions in flight at once")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=None, help="not fitted before this (default: half the run)")
    parser.add_argument("--max-rss-mib-per-min", type=float, default=1.0)
    parser.add_argument("--max-tasks-per-min", type=float, default=1.0)
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temp dir")
    parser.add_argument("--samples-json", default=None, help="write every sample to this file")
    sys.exit(asyncio.run(main(parser.parse_args())))
