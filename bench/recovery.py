"""Recovery benchmark: how long a restarted service takes to recover 1,000 live sessions of 100 chat items each.

    .venv/bin/python bench/recovery.py                          # SQLite (temp file) and PostgreSQL if reachable
    .venv/bin/python bench/recovery.py --only sqlite --runs 5
    .venv/bin/python bench/recovery.py --only sqlite --profile recovery.prof     # cProfile of one more run
    .venv/bin/python bench/recovery.py --source OTHER_CHECKOUT --db FILE --runs 4   # this code against another

The database is filled through the store (``create_session``, ``ChatStore.commit``, ``EventSink.publish``): per
session 100 chat items (20 exchanges of user message, assistant message, tool call, tool output, assistant message),
20 completed tool calls, one finished speech and their events (a user.input per user message, a chat.item per item,
a tool.ended per call, a speech.created and a speech.done) plus 9 more, 151 in all; one session in 20 also has a
tool call left ``running`` (a crash in the middle of a tool). Each run then starts a fresh store and
``SessionHost`` on a fresh copy of that database (as ``app.py`` does on start) and times
``SessionHost.recover_all()``: every session rebuilt with its chat context, ``seq`` continued, the running calls
ended ``interrupted`` with their output, ``session.recovered`` emitted.
"recover_all" is the call itself; "+ durable" adds the wait until every write it queued is committed. Its CPU time is
split into the bulk load (``Store.load_sessions_bulk``) and the rest (the rebuild of the sessions).

``--source DIR`` compares this code with another checkout's (DIR/service, e.g. the code before a change) on the same
SQLite data: each run is a fresh process on a fresh copy of one filled file, the two codes alternately (ABBA), and
their medians are printed side by side. ``--db FILE`` keeps the filled file (and reuses it when it exists).

Budget (DESIGN.md): < 3 s for 1,000 sessions x 100 items. The script exits non-zero if the SQLite median is over.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from switchboard import Agent, RunContext, function_tool
from switchboard.control.host import SessionHost
from switchboard.control.hub import EventHub
from switchboard.control.settings import Settings
from switchboard.runtime import event_types as ev
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.chat import ChatItem, ChatMessage, FunctionCall, FunctionCallOutput, utcnow
from switchboard.runtime.events import Event
from switchboard.runtime.llm import build_llm
from switchboard.runtime.ports import Commit
from switchboard.runtime.speech import SpeechInfo, SpeechState
from switchboard.runtime.status import SessionStatus
from switchboard.runtime.tools import ToolCallInfo, ToolStatus
from switchboard.store import SessionRecord, Store

ROOT = Path(__file__).resolve().parent.parent
PG_URL = os.environ.get("SWITCHBOARD_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
BUDGET_S = 3.0
EVENTS_PER_SESSION = 9  # with the ones above, 151 events per session
RUNNING_EVERY = 20  # one session in RUNNING_EVERY has a tool call left running
FILL_CONCURRENCY = 50


class Concierge(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You look things up.")

    @function_tool
    async def lookup(self, ctx: RunContext, query: str) -> str:
        """Look something up."""
        return f"found {query}"


AGENTS = {"concierge": Concierge}


@dataclass
class Target:
    name: str
    url: str
    schema: str | None = None


def session_content(sid: str, items: int) -> tuple[list[ChatItem], list[ToolCallInfo], list[SpeechInfo]]:
    """``items`` chat items in exchanges of five, a completed tool call per exchange, one finished speech."""
    chat: list[ChatItem] = []
    calls: list[ToolCallInfo] = []
    t0 = utcnow() - timedelta(hours=1)
    for n in range(items // 5):
        at = t0 + timedelta(seconds=n)
        call_id = f"call_{sid}_{n}"
        args = {"query": f"question {n}"}
        chat += [
            ChatMessage(id=f"u_{sid}_{n}", role="user", text=f"Please look up question {n} for me.", created_at=at),
            ChatMessage(id=f"a_{sid}_{n}", role="assistant", text="Let me look that up.", created_at=at),
            FunctionCall(id=f"c_{sid}_{n}", call_id=call_id, name="lookup", arguments=args, created_at=at),
            FunctionCallOutput(id=f"o_{sid}_{n}", call_id=call_id, name="lookup", output="found it", created_at=at),
            ChatMessage(id=f"r_{sid}_{n}", role="assistant", text=f"Here is the answer to {n}.", created_at=at),
        ]
        calls.append(
            ToolCallInfo(
                call_id=call_id,
                name="lookup",
                arguments=args,
                status=ToolStatus.COMPLETED,
                output="found it",
                agent="concierge",
                started_at=at,
                ended_at=at,
            )
        )
    speech = SpeechInfo(
        id=f"speech_{sid}",
        source="reply",
        state=SpeechState.DONE,
        interrupted=False,
        allow_interruptions=True,
        text="Here is the answer.",
        played_text="Here is the answer.",
        created_at=t0,
    )
    return chat, calls, [speech]


async def fill(url: str, schema: str | None, sessions: int, items: int) -> None:
    """Create the sessions a crash left live, through the store's own API."""
    store = Store.from_url(url, schema=schema)
    await store.migrate()
    await store.start()
    chat = store.chat_store()
    sink = store.event_sink()
    sem = asyncio.Semaphore(FILL_CONCURRENCY)
    llm = {"provider": "scripted", "turns": [{"text": "Hello."}] * 30}

    sids = [f"sess_{i:05d}" for i in range(sessions)]
    for sid in sids:  # one at a time: each is a transaction of its own, beside the group-commit writer
        config = {"id": sid, "agent": "concierge", "llm": llm}
        await store.create_session(
            SessionRecord(id=sid, agent="concierge", state="active", config=config, llm_state={"position": 20})
        )

    async def one(i: int) -> None:
        sid = sids[i]
        async with sem:
            content, calls, speeches = session_content(sid, items)
            if i % RUNNING_EVERY == 0:
                running = ToolCallInfo(
                    call_id=f"call_{sid}_running", name="lookup", agent="concierge", started_at=utcnow()
                )
                calls.append(running)
            await chat.commit(sid, Commit(items=content, tool_calls=calls, speeches=speeches))
            # what was committed is reported (recovery would emit any event that is missing), then some more
            payloads: list[ev.EventPayload] = [
                ev.UserInput(item_id=it.id, text=it.text, final=True, role="user")
                for it in content
                if isinstance(it, ChatMessage) and it.role == "user"
            ]
            payloads += [ev.SpeechCreated(speech_id=sp.id, source="reply") for sp in speeches]
            payloads += [ev.ChatItemAdded(item=it) for it in content]
            payloads += [
                ev.ToolEnded(call_id=c.call_id, name=c.name, status=c.status, output=c.output or "", is_error=False)
                for c in calls
                if c.ended
            ]
            payloads += [ev.SpeechDone(speech_id=sp.id, interrupted=False) for sp in speeches]
            payloads += [ev.AgentStateChanged(state="listening")] * EVENTS_PER_SESSION
            for seq, payload in enumerate(payloads, start=1):
                done = sink.publish(Event(seq=seq, session_id=sid, type=payload.type, data=payload.data()))
            await done

    await asyncio.gather(*(one(i) for i in range(sessions)))
    await store.aclose()


@dataclass
class Run:
    recover_s: float  # recover_all(), wall clock
    durable_s: float  # ... until every write it queued is committed
    cpu_s: float  # CPU time of this process (all threads) during recover_all()
    load_cpu_s: float  # ... of it, in the bulk load (``Store.load_sessions_bulk``)
    load: float  # the machine's 1-minute load average afterwards (the machine may be shared)

    @property
    def rebuild_cpu_s(self) -> float:
        return self.cpu_s - self.load_cpu_s

    def __str__(self) -> str:
        return (
            f"recover_all {self.recover_s:.3f} s (cpu {self.cpu_s:.3f} s: load {self.load_cpu_s:.3f} s,"
            f" rebuild {self.rebuild_cpu_s:.3f} s), + durable {self.durable_s:.3f} s  [load {self.load:.1f}]"
        )


async def recover_once(url: str, schema: str | None, sessions: int) -> Run:
    """Start a store and a host as ``app.py`` does; time ``recover_all()`` and the flush of what it wrote."""
    store = Store.from_url(url, schema=schema)
    await store.migrate()
    await store.start()
    host = SessionHost(
        store=store,
        registry=AgentRegistry(AGENTS),
        hub=EventHub(),
        settings=Settings(database_url=url, max_sessions=sessions),
    )
    load_cpu = 0.0
    bulk_load = store.load_sessions_bulk

    async def timed_load(*args: Any, **kwargs: Any) -> Any:
        nonlocal load_cpu
        cpu = time.process_time()
        try:
            return await bulk_load(*args, **kwargs)
        finally:
            load_cpu += time.process_time() - cpu  # the load runs alone: nothing else is scheduled meanwhile

    store.load_sessions_bulk = timed_load  # type: ignore[method-assign]
    gc.collect()  # like a fresh process: no garbage left over from the previous runs for the GC to wade through
    try:
        t0, cpu0 = time.perf_counter(), time.process_time()
        await host.recover_all()
        t1, cpu1 = time.perf_counter(), time.process_time()
        await store.mark_session(host.recovered[0], SessionStatus.ACTIVE)  # queued after every write of the recovery
        t2 = time.perf_counter()
        assert len(host.recovered) == sessions and not host.failed, (len(host.recovered), host.failed)
        assert await store.running_tool_calls() == []
        sample = host.recovered[RUNNING_EVERY]
        assert len(await store.chat_items(sample)) >= 100 or sessions < 100
        assert await store.last_seq(sample) > EVENTS_PER_SESSION
    finally:
        await host.aclose()
        await store.aclose()
    return Run(t1 - t0, t2 - t0, cpu1 - cpu0, load_cpu, os.getloadavg()[0])


async def pg_admin(sql: str) -> None:
    dsn = make_url(PG_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn, timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def pg_version() -> str | None:
    dsn = make_url(PG_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        conn = await asyncpg.connect(dsn, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return None
    try:
        return str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()


def copy_sqlite(src: Path, dst: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{src}{suffix}").exists():
            shutil.copyfile(f"{src}{suffix}", f"{dst}{suffix}")


async def sqlite_template(tmp: Path, db: str | None, sessions: int, items: int) -> Path:
    """The filled SQLite file each run copies: ``db`` if given (filled first if it does not exist yet)."""
    template = Path(db) if db else tmp / "template.db"
    if template.exists():
        print(f"[sqlite] reusing {template} (filled by an earlier run: its --sessions and --items)")
        return template
    t0 = time.perf_counter()
    await fill(f"sqlite+aiosqlite:///{template}", None, sessions, items)
    print(f"[sqlite] filled {sessions} sessions x {items} items in {time.perf_counter() - t0:.1f} s")
    return template


async def bench_sqlite(template: Path, tmp: Path, sessions: int, runs: int, profile: str | None) -> list[Run]:
    results = []
    for run in range(runs + (1 if profile else 0)):
        db = tmp / f"run{run}.db"
        copy_sqlite(template, db)
        url = f"sqlite+aiosqlite:///{db}"
        if run == runs:
            assert profile is not None
            await profiled(profile, recover_once(url, None, sessions))
            continue
        results.append(await recover_once(url, None, sessions))
        print(f"[sqlite] run {run + 1}: {results[-1]}")
    return results


def recover_in_process(source: Path, db: Path, sessions: int) -> Run:
    """One run in a fresh process, with the code of ``source`` (a checkout's ``service/`` directory)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), str(ROOT)])}
    args = [sys.executable, __file__, "--recover-once", str(db), "--sessions", str(sessions)]
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    return Run(**json.loads(out.strip().splitlines()[-1]))


def bench_compare(template: Path, tmp: Path, other: Path, sessions: int, runs: int) -> dict[str, list[Run]]:
    """``runs`` runs of each code on copies of ``template``, alternately (ABBA: neither always goes first)."""
    codes = {"this": ROOT / "service", "other": other / "service"}
    results: dict[str, list[Run]] = {name: [] for name in codes}
    for run in range(runs):
        order = list(codes) if run % 2 == 0 else list(reversed(codes))
        for name in order:
            db = tmp / f"run{run}-{name}.db"
            copy_sqlite(template, db)
            results[name].append(recover_in_process(codes[name], db, sessions))
            print(f"[sqlite] run {run + 1}, {name} code: {results[name][-1]}", flush=True)
            for suffix in ("", "-wal", "-shm"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)
    return results


def compare_summary(results: dict[str, list[Run]], other: Path) -> str:
    lines = [f"{'code':<6} {'runs':>4} {'cpu median':>10} {'load cpu':>9} {'rebuild cpu':>11} {'wall median':>11}"]
    for name, runs in results.items():
        label = "this" if name == "this" else "other"
        lines.append(
            f"{label:<6} {len(runs):>4} {statistics.median(r.cpu_s for r in runs):>9.3f}s"
            f" {statistics.median(r.load_cpu_s for r in runs):>8.3f}s"
            f" {statistics.median(r.rebuild_cpu_s for r in runs):>10.3f}s"
            f" {statistics.median(r.recover_s for r in runs):>10.3f}s"
        )
        lines.append("       cpu per run: " + ", ".join(f"{r.cpu_s:.2f}" for r in runs))
    return f"this code against {other}:\n" + "\n".join(lines)


async def bench_pg(sessions: int, items: int, runs: int) -> list[Run]:
    results = []
    for run in range(runs):
        schema = f"bench_recovery_{uuid.uuid4().hex[:8]}"
        await pg_admin(f'CREATE SCHEMA "{schema}"')
        try:
            t0 = time.perf_counter()
            await fill(PG_URL, schema, sessions, items)
            filled = time.perf_counter() - t0
            results.append(await recover_once(PG_URL, schema, sessions))
        finally:
            await pg_admin(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        print(f"[postgresql] run {run + 1} (filled in {filled:.1f} s): {results[-1]}")
    return results


async def profiled(path: str, run: Awaitable[object]) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    await run
    profiler.disable()
    profiler.dump_stats(path)
    print(f"profile of one more run written to {path}")


def summary(name: str, results: list[Run]) -> str:
    def fig(values: list[float]) -> str:
        return f"median {statistics.median(values):.3f} s  max {max(values):.3f} s"

    return (
        f"{name:<11} runs {len(results)}  recover_all {fig([r.recover_s for r in results])}"
        f"  | + durable {fig([r.durable_s for r in results])}  | cpu {fig([r.cpu_s for r in results])}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["sqlite", "postgresql"])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--items", type=int, default=100, help="chat items per session (a multiple of 5)")
    parser.add_argument("--runs", type=int, default=5, help="SQLite runs (PostgreSQL: --pg-runs)")
    parser.add_argument("--pg-runs", type=int, default=3, help="PostgreSQL runs (each refills a fresh schema)")
    parser.add_argument("--profile", metavar="FILE", help="cProfile one extra SQLite run into FILE")
    parser.add_argument("--db", metavar="FILE", help="the filled SQLite file: kept, and reused if it exists")
    parser.add_argument("--source", metavar="DIR", help="compare with the code of this checkout (SQLite only)")
    parser.add_argument("--recover-once", metavar="FILE", help=argparse.SUPPRESS)  # one run (--source), as JSON
    return parser.parse_args()


def compare(args: argparse.Namespace) -> int:
    """``--source``: this code and the other alternately, each run a process of its own."""
    other = Path(args.source).resolve()
    with tempfile.TemporaryDirectory(prefix="sb-bench-recovery-") as tmp:
        template = asyncio.run(sqlite_template(Path(tmp), args.db, args.sessions, args.items))
        results = bench_compare(template, Path(tmp), other, args.sessions, args.runs)
    print("\n" + compare_summary(results, other))
    return 0


async def recover_one(args: argparse.Namespace) -> int:
    """``--recover-once``: one run, printed as JSON (for ``compare``)."""
    build_llm({"provider": "scripted"})
    run = await recover_once(f"sqlite+aiosqlite:///{args.recover_once}", None, args.sessions)
    print(json.dumps(asdict(run)))
    return 0


async def main(args: argparse.Namespace) -> int:
    import sqlite3

    version = await pg_version() if args.only in (None, "postgresql") else None
    notes = [f"SQLite {sqlite3.sqlite_version}"]
    if args.only in (None, "postgresql"):
        notes.append(f"PostgreSQL {version}" if version else "PostgreSQL unreachable: skipped")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; " + "; ".join(notes))
    build_llm({"provider": "scripted"})  # the providers' modules are imported once per process: not in run 1's time
    lines = []
    ok = True
    if args.only in (None, "sqlite"):
        with tempfile.TemporaryDirectory(prefix="sb-bench-recovery-") as tmp:
            template = await sqlite_template(Path(tmp), args.db, args.sessions, args.items)
            results = await bench_sqlite(template, Path(tmp), args.sessions, args.runs, args.profile)
        ok = statistics.median(r.recover_s for r in results) < BUDGET_S
        lines.append(summary("sqlite", results) + ("" if ok else "  OVER BUDGET"))
    if version is not None:
        lines.append(summary("postgresql", await bench_pg(args.sessions, args.items, args.pg_runs)))
    print(f"\n{args.sessions} sessions x {args.items} items (budget < {BUDGET_S:.0f} s on SQLite):")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.source:
        sys.exit(compare(arguments))
    sys.exit(asyncio.run(recover_one(arguments) if arguments.recover_once else main(arguments)))
