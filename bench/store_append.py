"""Store benchmark: chat append cost vs context size, and event throughput with group commit.

    .venv/bin/python bench/store_append.py                      # SQLite (temp file) and PostgreSQL if reachable
    .venv/bin/python bench/store_append.py --only sqlite --appends 5000
    SWITCHBOARD_TEST_PG_URL=postgresql+asyncpg://... .venv/bin/python bench/store_append.py --only postgresql

Append cost: the latency of ``ChatStore.commit`` with one chat item, into 10-item contexts (200 sessions that
stay between 10 and ~20 items) vs a 10,000-item context, interleaved in random order in the same database.
Budget (DESIGN.md): the 10,000-item append costs no more than 1.2x the 10-item one.

Throughput: N concurrent publishers (one session each) each publish events and await each one's durability,
with group commit (batch_max=256) and, for comparison, with one transaction per event (batch_max=1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from sqlalchemy.engine import make_url

from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.events import Event
from switchboard.runtime.ports import Commit
from switchboard.store import SessionRecord, Store, make_engine

PG_URL = os.environ.get("SWITCHBOARD_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
BIG_CONTEXT = 10_000
SMALL_CONTEXT = 10
SMALL_SESSIONS = 200
FILL_CHUNK = 500


@dataclass
class Target:
    name: str
    url: str
    schema: str | None = None


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def item(n: int) -> ChatMessage:
    return ChatMessage(
        id=f"m{n}_{uuid.uuid4().hex[:8]}", role="user", text="a sentence of about ten words said by a user"
    )


async def new_store(t: Target, batch_max: int = 256) -> Store:
    store = Store(make_engine(t.url, schema=t.schema), batch_max=batch_max)
    await store.migrate()
    await store.start()
    return store


async def bench_append(t: Target, appends: int) -> dict[str, float]:
    store = await new_store(t)
    try:
        chat = store.chat_store()
        await store.create_session(SessionRecord(id="big", agent="bench", state="active"))
        for start in range(0, BIG_CONTEXT, FILL_CHUNK):
            await chat.commit("big", Commit(items=[item(n) for n in range(start, start + FILL_CHUNK)]))
        small = [f"small{i}" for i in range(SMALL_SESSIONS)]
        for sid in small:
            await store.create_session(SessionRecord(id=sid, agent="bench", state="active"))
            await chat.commit(sid, Commit(items=[item(n) for n in range(SMALL_CONTEXT)]))
        for sid in [*small, *["big"] * 50]:  # warm up: pools, caches, per-session counters
            await chat.commit(sid, Commit(items=[item(0)]))

        timings: dict[str, list[float]] = {"small": [], "big": []}
        rng = random.Random(1)
        for i in range(appends):
            order = [("small", small[i % SMALL_SESSIONS]), ("big", "big")]
            rng.shuffle(order)
            for kind, sid in order:
                one = Commit(items=[item(i)])
                t0 = time.perf_counter()
                await chat.commit(sid, one)
                timings[kind].append(time.perf_counter() - t0)
        big_items = len(await store.chat_items("big"))
        small_items = len(await store.chat_items(small[0]))
    finally:
        await store.aclose()
    med_s, med_b = statistics.median(timings["small"]), statistics.median(timings["big"])
    p99_s, p99_b = pct(timings["small"], 99), pct(timings["big"], 99)
    return {
        "small_median_ms": med_s * 1e3,
        "small_p99_ms": p99_s * 1e3,
        "big_median_ms": med_b * 1e3,
        "big_p99_ms": p99_b * 1e3,
        "median_ratio": med_b / med_s,
        "p99_ratio": p99_b / p99_s,
        "big_items_at_end": big_items,
        "small_items_at_end": small_items,
    }


async def bench_events(t: Target, publishers: int, per_publisher: int, batch_max: int) -> dict[str, float]:
    store = await new_store(t, batch_max=batch_max)
    tag = uuid.uuid4().hex[:6]
    try:
        sids = [f"pub{tag}_{i}" for i in range(publishers)]
        for sid in sids:
            await store.create_session(SessionRecord(id=sid, agent="bench", state="active"))
        delivered = 0

        def on_durable(events: list[Event]) -> None:
            nonlocal delivered
            delivered += len(events)

        sink = store.event_sink(on_durable)
        latencies: list[float] = []

        async def publisher(sid: str) -> None:
            for seq in range(1, per_publisher + 1):
                ev = Event(seq=seq, session_id=sid, type="tool.progress", data={"call_id": "c1", "progress": seq})
                t0 = time.perf_counter()
                await sink.publish(ev)
                latencies.append(time.perf_counter() - t0)

        batches0, ops0 = store.writer.batches, store.writer.ops_written
        t0 = time.perf_counter()
        await asyncio.gather(*(publisher(sid) for sid in sids))
        elapsed = time.perf_counter() - t0
        batches = store.writer.batches - batches0
        ops = store.writer.ops_written - ops0
        assert delivered == publishers * per_publisher
        for sid in sids[:3]:
            assert await store.last_seq(sid) == per_publisher
    finally:
        await store.aclose()
    return {
        "events": publishers * per_publisher,
        "seconds": elapsed,
        "events_per_s": publishers * per_publisher / elapsed,
        "mean_batch": ops / max(batches, 1),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": pct(latencies, 99) * 1e3,
    }


async def pg_target() -> tuple[Target | None, str]:
    dsn = make_url(PG_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        conn = await asyncpg.connect(dsn, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError) as err:
        return None, f"PostgreSQL unreachable ({err!r}); skipped"
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    await conn.execute(f'CREATE SCHEMA "{schema}"')
    version = await conn.fetchval("SHOW server_version")
    await conn.close()
    return Target("postgresql", PG_URL, schema), f"PostgreSQL {version}"


async def drop_schema(t: Target) -> None:
    dsn = make_url(t.url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{t.schema}" CASCADE')
    finally:
        await conn.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["sqlite", "postgresql"])
    parser.add_argument("--appends", type=int, default=2000, help="appends per context size")
    parser.add_argument("--publishers", type=int, default=200)
    parser.add_argument("--events", type=int, default=200, help="events per publisher (group commit)")
    parser.add_argument("--events-unbatched", type=int, default=20, help="events per publisher (batch_max=1)")
    args = parser.parse_args()

    targets: list[Target] = []
    notes: list[str] = []
    tmp = tempfile.TemporaryDirectory(prefix="sb-bench-")
    if args.only in (None, "sqlite"):
        import sqlite3

        targets.append(Target("sqlite", f"sqlite+aiosqlite:///{Path(tmp.name) / 'bench.db'}"))
        notes.append(f"SQLite {sqlite3.sqlite_version} (WAL, synchronous=NORMAL), file in {tempfile.gettempdir()}")
    if args.only in (None, "postgresql"):
        pg, note = await pg_target()
        notes.append(note)
        if pg is not None:
            targets.append(pg)

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; " + "; ".join(notes))
    ok = True
    try:
        for t in targets:
            a = await bench_append(t, args.appends)
            within = a["median_ratio"] <= 1.2
            ok = ok and within
            print(
                f"\n[{t.name}] append one item, {args.appends} appends each, interleaved:\n"
                f"  10-item contexts:     median {a['small_median_ms']:.3f} ms  p99 {a['small_p99_ms']:.3f} ms\n"
                f"  10,000-item context:  median {a['big_median_ms']:.3f} ms  p99 {a['big_p99_ms']:.3f} ms"
                f"  (ends at {a['big_items_at_end']} items)\n"
                f"  ratio: median {a['median_ratio']:.2f}x  p99 {a['p99_ratio']:.2f}x"
                f"  -> {'within' if within else 'OVER'} the 1.2x budget"
            )
            g = await bench_events(t, args.publishers, args.events, batch_max=256)
            u = await bench_events(t, args.publishers, args.events_unbatched, batch_max=1)
            for label, r in (("group commit (batch_max=256)", g), ("one transaction per event (batch_max=1)", u)):
                print(
                    f"[{t.name}] {args.publishers} publishers, {label}: {r['events']:.0f} events in "
                    f"{r['seconds']:.2f} s = {r['events_per_s']:,.0f} events/s; mean batch {r['mean_batch']:.1f}; "
                    f"publish->durable p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms"
                )
    finally:
        for t in targets:
            if t.schema:
                await drop_schema(t)
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
