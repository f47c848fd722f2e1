"""The chaos load: sessions of four roles driven through the balancer, every operation recorded in the history.

- ``chat``: inputs (some interrupting, some sent twice at once like a balancer's retry), `say`, interrupts, and an
  operator's takeover round trip (take over, the user's input while held, the operator's words, hand back).
- ``media``: the same with a media edge attached, whose barge-ins interrupt, and which says final transcripts (each
  with an id, sent again on each new connection until taken) every ``TRANSCRIPT_EVERY_S``.
- ``tools``: scripted turns calling Python tools (a slow one, a cancellable search, one re-run after a crash, one
  that reports progress in the background), inputs that never interrupt, and cancels of running searches. Nothing a
  client does interrupts these sessions, so every completed result must be replied to.
- ``webhook``: scripted turns calling webhook tools; the backend answers the long one 202 and the load reports its
  progress and result (or cancels it) later, through the balancer, so the report reaches any node.

A command is retried after a transport error or a 503, with the same Idempotency-Key, for up to ``RETRY_FOR_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from typing import Any

import httpx

from switchboard.integrations.webhooks import REPORT_TOKEN_HEADER

from .history import History, Record, now
from .streams import MediaEdge, MultiStream, SessionStream

RETRY_FOR_S = 90.0
REQUEST_TIMEOUT_S = 20.0
ROLES = ("chat", "tools", "webhook", "media")
TRANSCRIPT_EVERY_S = (1.5, 4.0)
LONG = " ".join(f"w{i}" for i in range(40))  # two seconds of speech at 20 words per second
TOOL_TURNS: list[dict[str, Any]] = [
    {"text": "Checking.", "tool_calls": [{"name": "slow", "arguments": {"seconds": 1.5}}]},
    {"text": "Slow said {{tool_output:slow}}."},
    {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "q", "seconds": 4}}]},
    {"text": "Search said {{tool_output:search}}."},
    {"text": "Again.", "tool_calls": [{"name": "rerun", "arguments": {"seconds": 2}}]},
    {"text": "Rerun said {{tool_output:rerun}}."},
    {"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 8, "step_s": 0.4}}]},
    {"text": "Counted {{tool_output:progress}}."},
]
HOOK_TURNS: list[dict[str, Any]] = [
    {"text": "Looking.", "tool_calls": [{"name": "lookup", "arguments": {"what": "order"}}]},
    {"text": "Lookup said {{tool_output:lookup}}."},
    {"text": "Refunding.", "tool_calls": [{"name": "refund", "arguments": {"order": "A-1"}}]},
    {"text": "Refund started."},
]


def _problem_code(r: httpx.Response) -> str | None:
    with contextlib.suppress(ValueError, AttributeError):
        body = r.json()
        if isinstance(body, dict):
            return body.get("code")
    return None


class Api:
    """HTTP through the balancer, one new connection per request (so each may reach another node)."""

    def __init__(self, base_url: str, key: str, history: History) -> None:
        self.history = history
        self.http = httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=REQUEST_TIMEOUT_S,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def call(
        self,
        op: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        sid: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        retry_codes: frozenset[str] = frozenset(),
        method: str = "POST",
        **fields: Any,
    ) -> Record:
        """POST (or ``method``) with the retry rule; ``retry_codes`` adds 4xx problem codes to retry (a webhook
        backend's)."""
        record = self.history.add("op", op=op, sid=sid, key=key, t0=now(), attempts=[], **fields)
        sent = {**(headers or {}), **({"Idempotency-Key": key} if key else {})}
        deadline = time.monotonic() + RETRY_FOR_S
        while True:
            try:
                if method == "POST":
                    r = await self.http.post(path, json=body or {}, headers=sent)
                else:
                    r = await self.http.request(method, path, headers=sent)
            except httpx.TransportError as err:
                record["attempts"].append([now(), "transport", type(err).__name__])
                record.update(status="transport", code=type(err).__name__)
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.3)
                continue
            code = _problem_code(r)
            record["attempts"].append([now(), r.status_code, code])
            record.update(status=r.status_code, code=code, body=r.json() if _is_json(r) else None)
            retry = r.status_code == 503 or (r.status_code < 500 and code in retry_codes)
            if not retry or time.monotonic() > deadline:
                break
            await asyncio.sleep(float(r.headers.get("retry-after", "1")) / 2)
        record["t1"] = now()
        return record

    async def get(self, path: str) -> Any:
        """A read; None when it did not answer 200 (reads are not part of the history)."""
        try:
            r = await self.http.get(path)
        except httpx.TransportError:
            return None
        return r.json() if r.status_code == 200 else None


def _ok(record: Record) -> bool:
    status = record.get("status")
    return isinstance(status, int) and 200 <= status < 300


def _is_json(r: httpx.Response) -> bool:
    return r.headers.get("content-type", "").endswith("json") and bool(r.content)


class Load:
    def __init__(
        self, api: Api, ws_url: str, key: str, history: History, seed: int, max_sessions: int, backend: Any
    ) -> None:
        self.api = api
        self.ws_url = ws_url
        self.key = key
        self.history = history
        self.rng = random.Random(f"load-{seed}")
        self.seed = seed
        self.max_sessions = max_sessions
        self.backend = backend
        self.stop_ev = asyncio.Event()
        self.sessions: dict[str, str] = {}  # sid -> role
        self.streams: dict[str, SessionStream] = {}
        self.edges: dict[str, MediaEdge] = {}
        self.multi = MultiStream(ws_url, key)
        self.reports: list[asyncio.Task[None]] = []
        self._reporting = True
        self._reporter: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._counter = 0

    def _key(self, op: str) -> str:
        self._counter += 1
        return f"{op}-{self._counter}-{uuid.UUID(int=self.rng.getrandbits(128)).hex[:12]}"

    async def start(self) -> None:
        self.multi.start()
        self._tasks.append(asyncio.create_task(self._create_all()))
        self._reporter = asyncio.create_task(self._report_all())

    async def stop(self) -> None:
        """No new operation; those under way finish (bounded by their retry time)."""
        self.stop_ev.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop_reports(self) -> None:
        """The backend stops reporting (once the cluster settled: every call it was asked for has ended)."""
        self._reporting = False
        if self._reporter is not None:
            await self._reporter
        await asyncio.gather(*self.reports, return_exceptions=True)

    async def close_clients(self) -> None:
        clients = [self.multi, *self.streams.values(), *self.edges.values()]
        await asyncio.gather(*(c.aclose() for c in clients))
        self.multi.record(self.history)
        for stream in self.streams.values():
            stream.record(self.history)
        for edge in self.edges.values():
            edge.record(self.history)

    async def _pause(self, low: float, high: float) -> bool:
        """Wait a random while; True once the load is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop_ev.wait(), self.rng.uniform(low, high))
        return self.stop_ev.is_set()

    # -- sessions -----------------------------------------------------------------------------------------------

    async def _create_all(self) -> None:
        for n in range(self.max_sessions):
            if n and await self._pause(1.0, 3.0):
                return
            role = ROLES[n % len(ROLES)]
            sid = await self._create(role)
            if sid is None:
                continue
            self.sessions[sid] = role
            self.history.add("session", sid=sid, role=role)
            stream = SessionStream(self.ws_url, self.key, sid)
            stream.start()
            self.streams[sid] = stream
            if role == "media":
                self.edges[sid] = MediaEdge(self.ws_url, self.key, sid)
                self.edges[sid].start()
                self._tasks.append(asyncio.create_task(self._speak(sid)))
            rng = random.Random(f"{self.seed}-{n}")
            self._tasks.append(asyncio.create_task(self._drive(sid, role, rng)))

    async def _create(self, role: str) -> str | None:
        key = self._key("create")
        turns = {"tools": TOOL_TURNS, "webhook": HOOK_TURNS}.get(role, [])
        fallback = {"text": "Noted." if role in ("tools", "webhook") else LONG}
        body = {
            "agent": "hooks" if role == "webhook" else "tester",
            "llm": {"provider": "scripted", "turns": turns * 6, "fallback": fallback},
            "metadata": {"chaos_key": key, "role": role},
        }
        twice = self.rng.random() < 0.3  # a balancer that retried a request it thought lost
        calls = [self.api.call("create", "/v1/sessions", body, key=key, role=role, twice=twice)]
        if twice:
            calls.append(self.api.call("create", "/v1/sessions", body, key=key, role=role, twice=twice))
        records = await asyncio.gather(*calls)
        for record in records:
            if record.get("status") in (200, 201) and record.get("body"):
                return str(record["body"]["id"])
        return None

    async def _drive(self, sid: str, role: str, rng: random.Random) -> None:
        n = 0
        while not await self._pause(0.8, 2.5):
            n += 1
            roll = rng.random()
            if role in ("tools", "webhook"):
                if roll < 0.7:
                    await self._input(sid, n, interrupt=False, twice=rng.random() < 0.15)
                else:
                    await self._cancel_running(sid, "search" if role == "tools" else "refund")
                continue
            if roll < 0.45:
                await self._input(sid, n, interrupt=rng.random() < 0.5, twice=rng.random() < 0.15)
            elif roll < 0.65:
                await self._say(sid, n)
            elif role == "media" and roll < 0.85:
                await self._barge_in(sid)
            elif role == "chat" and roll < 0.8:
                await self._takeover(sid, n, rng)
            else:
                await self._interrupt(sid)

    async def _input(self, sid: str, n: int, *, interrupt: bool, twice: bool) -> None:
        key = self._key("input")
        text = f"input {key}"  # the key in the text: the checker counts its chat messages
        body = {"text": text, "interrupt": interrupt}
        path = f"/v1/sessions/{sid}/input"
        calls = [self.api.call("input", path, body, sid=sid, key=key, text=text, interrupt=interrupt, twice=twice)]
        if twice:
            calls.append(
                self.api.call("input", path, body, sid=sid, key=key, text=text, interrupt=interrupt, twice=twice)
            )
        await asyncio.gather(*calls)

    async def _say(self, sid: str, n: int) -> None:
        key = self._key("say")
        text = f"say {key}"
        await self.api.call("say", f"/v1/sessions/{sid}/say", {"text": text}, sid=sid, key=key, text=text)

    async def _interrupt(self, sid: str) -> None:
        key = self._key("interrupt")
        await self.api.call("interrupt", f"/v1/sessions/{sid}/interrupt", {}, sid=sid, key=key)

    async def _takeover(self, sid: str, n: int, rng: random.Random) -> None:
        """An operator takes the session over, the user talks meanwhile, the operator answers, and hands it back: no
        generation may start while it is held (the checker's ``held-generation``)."""
        base = f"/v1/sessions/{sid}/takeover"
        taken = await self.api.call("takeover", base, {}, sid=sid, key=self._key("takeover"))
        if not _ok(taken):
            return
        if rng.random() < 0.7:
            await self._input(sid, n, interrupt=rng.random() < 0.5, twice=False)
        key = self._key("takeover_say")
        text = f"operator {key}"
        await self.api.call("takeover_say", f"{base}/say", {"text": text}, sid=sid, key=key, text=text)
        if rng.random() < 0.5:
            await self._input(sid, n, interrupt=False, twice=False)  # the last word is the user's: the agent replies
        await self._pause(0.2, 1.0)
        # a hand-back has no Idempotency-Key: one retried after its answer was lost finds nothing held (409 not_held)
        await self.api.call("handback", base, sid=sid, method="DELETE")

    async def _barge_in(self, sid: str) -> None:
        edge = self.edges.get(sid)
        if edge is not None and await edge.barge_in():
            self.history.add("op", op="barge_in", sid=sid, key=None, t0=now(), t1=now(), attempts=[], status="sent")

    async def _speak(self, sid: str) -> None:
        """The user of a media session talks: final transcripts through its edge, each text unique in the run."""
        n = 0
        while not await self._pause(*TRANSCRIPT_EVERY_S):
            n += 1
            await self.edges[sid].say(f"heard {n} in {sid}")

    async def _cancel_running(self, sid: str, name: str) -> None:
        listed = await self.api.get(f"/v1/sessions/{sid}/tool-calls?status=running")
        for call in (listed or {}).get("items", []):
            if call.get("name") == name and call.get("cancellable"):
                path = f"/v1/sessions/{sid}/tool-calls/{call['call_id']}/cancel"
                await self.api.call("cancel", path, sid=sid, key=self._key("cancel"), call_id=call["call_id"])
                return

    # -- the webhook backend's reports --------------------------------------------------------------------------

    async def _report_all(self) -> None:
        """Each delivery of the long webhook tool gets its reports later, through the balancer (any node)."""
        while self._reporting:
            try:
                got, payload = await asyncio.wait_for(
                    self.backend.received.get(), 0.5
                )  # bound: a poll of the queue, expected to run out
            except TimeoutError:
                continue
            if got == "call" and payload.get("tool") == "refund":
                rng = random.Random(f"{self.seed}-{payload['call_id']}")
                self.reports.append(asyncio.create_task(self._report(payload, rng)))

    async def _report(self, call: dict[str, Any], rng: random.Random) -> None:
        sid, call_id = call["session_id"], call["call_id"]
        base = f"/v1/sessions/{sid}/tool-calls/{call_id}"
        headers = {REPORT_TOKEN_HEADER: call["report_token"]}
        # a report the node is not ready for (or that reached a node that cannot take it) is sent again
        again = frozenset({"not_awaiting_report"})
        await asyncio.sleep(rng.uniform(0.5, 2.0))
        roll = rng.random()
        if roll < 0.15:
            key = self._key("cancel")
            await self.api.call("cancel", f"{base}/cancel", sid=sid, key=key, call_id=call_id)
            return
        if roll < 0.85:
            body = {"message": "half way", "progress": 0.5}
            key = self._key("progress")
            await self.api.call(
                "progress",
                f"{base}/progress",
                body,
                sid=sid,
                key=key,
                headers=headers,
                retry_codes=again,
                call_id=call_id,
            )
            await asyncio.sleep(rng.uniform(0.5, 2.0))
        body = {"output": f"refunded {call_id}"}
        key = self._key("result")
        await self.api.call(
            "result", f"{base}/result", body, sid=sid, key=key, headers=headers, retry_codes=again, call_id=call_id
        )
