"""Operator commands against a running service: ``switchboard sessions|tail|input|interrupt|tools|cancel``.

Pure clients of the public REST and WebSocket API, pointed at ``--url`` (or ``SWITCHBOARD_URL``) with ``--key``
(or ``SWITCHBOARD_KEY``), sent as ``Authorization: Bearer`` on every request and on the WebSocket handshake, never in
a URL. An API error is printed as one plain line on stderr and the command exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import quote, urlencode

import httpx

from .output import Style, age, choose_style, event_line, format_arguments, printable, short, table

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

DEFAULT_URL = "http://127.0.0.1:8080"
RETRIES = 2
RECONNECT_MIN_S = 0.25
RECONNECT_MAX_S = 2.0
FATAL_CLOSES = {
    4400: "the event stream rejected the request",
    4401: "the service needs a valid API key (--key or SWITCHBOARD_KEY)",
    4403: "this API key may not read this session's events",
}


class ClientError(Exception):
    """Something to tell the operator in one line."""


class Client:
    def __init__(self, url: str, key: str | None, timeout_s: float = 15.0) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.timeout_s = timeout_s

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def request(self, method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None) -> Any:
        """One call; commands carry an Idempotency-Key that retries reuse, so a retry never applies twice."""
        headers = self.headers()
        command = method != "GET"
        if command:
            headers["Idempotency-Key"] = str(uuid.uuid4())
        for attempt in range(RETRIES + 1):
            try:
                with httpx.Client(base_url=self.url, timeout=self.timeout_s) as http:
                    r = http.request(method, path, json=body, params=params, headers=headers)
            except httpx.TransportError as err:
                if attempt < RETRIES:
                    time.sleep(0.2 * 2**attempt)
                    continue
                raise ClientError(f"cannot reach {self.url}: {err or type(err).__name__}") from None
            if r.status_code == 503 and attempt < RETRIES:
                time.sleep(min(float(r.headers.get("Retry-After", "0.5") or 0.5), 5.0))
                continue
            if r.is_success:
                return r.json() if r.content else None
            raise ClientError(_problem_line(r))
        raise AssertionError("unreachable")


def _problem_line(r: httpx.Response) -> str:
    try:
        problem = r.json()
    except ValueError:
        problem = None
    if isinstance(problem, dict) and problem.get("detail"):
        return f"{problem['detail']} ({problem.get('code', 'error')}, HTTP {r.status_code})"
    if r.status_code == 401:
        return "the service needs a valid API key (--key or SWITCHBOARD_KEY)"
    return f"HTTP {r.status_code} from {r.request.method} {r.request.url.path}"


# -- commands ------------------------------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Client:
    url = args.url or os.environ.get("SWITCHBOARD_URL") or DEFAULT_URL
    key = args.key or os.environ.get("SWITCHBOARD_KEY") or None
    return Client(url, key)


def _sid(sid: str) -> str:
    return quote(sid, safe="")


def _printed_json_or_nothing(items: list[dict[str, Any]], as_json: bool, nothing: str) -> bool:
    """Print the API's JSON (``--json``) or that there is nothing to list; False when a table is still due."""
    if as_json:
        print(json.dumps(items, indent=2))
    elif not items:
        print(nothing)
    return as_json or not items


def cmd_sessions(args: argparse.Namespace) -> int:
    client = _client(args)
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 200}
        if not args.all:
            params["state"] = "active"
        if cursor:
            params["cursor"] = cursor
        page = client.request("GET", "/v1/sessions", params=params)
        items += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    running = client.request("GET", "/v1/tool-calls", params={"status": "running"})["items"]
    if _printed_json_or_nothing(items, args.json, "no sessions" if args.all else "no live sessions"):
        return 0
    counts: dict[str, int] = {}
    for call in running:
        counts[call["session_id"]] = counts.get(call["session_id"], 0) + 1
    rows = [
        [
            it["id"],
            it["agent"],
            it["state"],
            it["agent_state"] if it["state"] == "active" else "-",
            str(counts.get(it["id"], 0)),
            age(it["created_at"]),
        ]
        for it in items
    ]
    table(rows, ["SESSION", "AGENT", "STATE", "AGENT STATE", "TOOLS", "AGE"], sys.stdout)
    return 0


def cmd_input(args: argparse.Namespace) -> int:
    body = {"text": args.text, "reply": not args.no_reply, "interrupt": not args.no_interrupt, "force": args.force}
    if args.role != "user":
        body["role"] = args.role
    res = _client(args).request("POST", f"/v1/sessions/{_sid(args.sid)}/input", body=body)
    reply = f"; reply in speech {res['speech_id']}" if res.get("speech_id") else ""
    print(f"input {res.get('item_id')} sent to {args.sid}{reply}")
    return 0


def cmd_interrupt(args: argparse.Namespace) -> int:
    res = _client(args).request("POST", f"/v1/sessions/{_sid(args.sid)}/interrupt", body={"force": args.force})
    if res.get("interrupted"):
        print(f"interrupted speech {res['speech_id']}")
    else:
        print("nothing to interrupt: the agent is not speaking")
    return 0


def cmd_tools(args: argparse.Namespace) -> int:
    client = _client(args)
    params = {} if args.all else {"status": "running"}
    if args.sid:
        calls = client.request("GET", f"/v1/sessions/{_sid(args.sid)}/tool-calls", params=params)["items"]
    else:
        calls = client.request("GET", "/v1/tool-calls", params={"status": "running"})["items"]
    if _printed_json_or_nothing(calls, args.json, "no tool calls" if args.all else "no running tool calls"):
        return 0
    s = choose_style("never", sys.stdout)
    rows = [_call_row(c, s) for c in calls]
    table(rows, ["CALL ID", "SESSION", "NAME", "STATUS", "CANCELLABLE", "PROGRESS", "ARGUMENTS"], sys.stdout)
    return 0


def _call_row(call: dict[str, Any], s: Style) -> list[str]:
    last = call["progress"][-1] if call["progress"] else None
    progress = ""
    if last is not None:
        bar = s.bar(last["progress"], width=10) if last["progress"] is not None else ""
        progress = f"{bar} {last['message']}".strip()
    flag = "yes" if call["cancellable"] else "no"
    arguments = short(format_arguments(call["arguments"]), 40)
    return [call["call_id"], call["session_id"], call["name"], call["status"], flag, progress, arguments]


def cmd_cancel(args: argparse.Namespace) -> int:
    path = f"/v1/sessions/{_sid(args.sid)}/tool-calls/{quote(args.call_id, safe='')}/cancel"
    res = _client(args).request("POST", path, body={})
    print(f"cancelled {res['name']} ({res['call_id']}): {short(res.get('output') or '')}")
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    return asyncio.run(
        tail(
            _client(args),
            args.sid,
            since=args.since,
            types=args.types,
            style=choose_style(args.color, sys.stdout),
            retry_for_s=args.retry_for,
        )
    )


async def tail(
    client: Client,
    sid: str,
    *,
    since: int = 0,
    types: str | None = None,
    style: Style,
    retry_for_s: float = 30.0,
    out: TextIO = sys.stdout,
    note: Callable[[str], None] | None = None,
) -> int:
    """Print a session's events as they happen; after a drop (or a 4008 "too slow") resume from the last seq shown,
    so no event is printed twice or skipped. Ends when the session closes."""

    def to_stderr(text: str) -> None:
        print(style(text, "dim"), file=sys.stderr, flush=True)

    return await _Tail(client, sid, types, style, retry_for_s, out, note or to_stderr, last=since).run()


class _Read(enum.Enum):
    """How reading one connection's frames ended."""

    SESSION_CLOSED = enum.auto()  # the session.closed event was printed
    GAP = enum.auto()  # a frame is missing: read again from the last one shown
    DROPPED = enum.auto()  # the connection ended; its close code says why


@dataclass(eq=False)
class _Tail:
    """One ``tail``: the last seq shown, the tool names seen, and the reconnect back-off."""

    client: Client
    sid: str
    types: str | None
    style: Style
    retry_for_s: float
    out: TextIO
    say: Callable[[str], None]
    last: int  # the seq of the last event printed
    names: dict[str, str] = field(default_factory=dict)  # tool names by call id, for progress lines
    connected_once: bool = False
    failing_since: float | None = None
    delay_s: float = RECONNECT_MIN_S

    async def run(self) -> int:
        while True:
            read = await self._connect_and_print()
            if isinstance(read, _Read):
                if read is _Read.SESSION_CLOSED:
                    return 0
                continue  # a gap: reconnect at once from `last`
            code, reason = read
            if code in FATAL_CLOSES:
                raise ClientError(FATAL_CLOSES[code])
            if code == 4404:
                raise ClientError(f"no session {self.sid!r}")
            if code == 1000 and reason == "session closed":
                return 0
            if code == 4008:
                self.say(f"fell behind the live stream; resuming from seq {self.last}")
                continue
            await self._back_off(code, reason)

    def _url(self) -> str:
        url = self.client.url
        base = "ws" + url[len("http") :] if url.startswith("http") else url
        query = {"since": self.last, **({"types": self.types} if self.types else {})}
        return f"{base}/v1/sessions/{_sid(self.sid)}/events?{urlencode(query)}"

    async def _connect_and_print(self) -> _Read | tuple[int, str]:
        """One connection: how reading ended (the session closed, a gap), or the code and reason it was closed with."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidHandshake

        try:
            async with connect(
                self._url(), additional_headers=self.client.headers(), open_timeout=5, max_size=2**23
            ) as ws:
                self.connected_once, self.failing_since, self.delay_s = True, None, RECONNECT_MIN_S
                read = await self._print_frames(ws)
                if read is not _Read.DROPPED:
                    return read
                return ws.close_code or 1006, ws.close_reason or ""
        except (OSError, TimeoutError, InvalidHandshake) as err:
            if not self.connected_once:
                raise ClientError(f"cannot stream events from {self.client.url}: {err or type(err).__name__}") from None
            return 1006, str(err)

    async def _print_frames(self, ws: ClientConnection) -> _Read:
        from websockets.exceptions import ConnectionClosed

        try:
            async for raw in ws:
                event = printable(json.loads(raw))  # everything printed below comes from it
                seq = event.get("seq")
                if not isinstance(seq, int) or seq <= self.last:
                    continue  # a pong, or a frame already shown
                if self.types is None and seq > self.last + 1:
                    # a frame is missing (seqs have no gaps): read again from the last one shown
                    self.say(f"missed events after seq {self.last}; re-reading them")
                    return _Read.GAP
                self._print(event, seq)
                if event.get("type") == "session.closed":
                    return _Read.SESSION_CLOSED
        except ConnectionClosed:
            pass
        return _Read.DROPPED

    def _print(self, event: dict[str, Any], seq: int) -> None:
        self.last = seq
        if event.get("type") == "tool.started":
            self.names[str(event["data"].get("call_id"))] = str(event["data"].get("name"))
        self.out.write(event_line(event, self.style, self.names) + "\n")
        self.out.flush()

    async def _back_off(self, code: int, reason: str) -> None:
        """Wait before reconnecting; give up once the stream has been lost for ``retry_for_s``."""
        now = time.monotonic()
        self.failing_since = self.failing_since or now
        if now - self.failing_since > self.retry_for_s:
            raise ClientError(
                f"lost the event stream of {self.sid!r} and could not reconnect for {self.retry_for_s:.0f} s"
            )
        self.say(f"connection lost ({code}{': ' + reason if reason else ''}); reconnecting from seq {self.last}")
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, RECONNECT_MAX_S)


# -- wiring --------------------------------------------------------------------------------------------------------


def _guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ClientError as err:
            print(f"switchboard: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130

    return run


def add_client_commands(sub: Any) -> None:
    """Register the operator commands on the ``switchboard`` parser's subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"service URL (default: $SWITCHBOARD_URL or {DEFAULT_URL})")
    common.add_argument("--key", help="API key (default: $SWITCHBOARD_KEY)")

    p = sub.add_parser("sessions", parents=[common], help="list live sessions")
    p.add_argument("--all", action="store_true", help="include closed sessions")
    p.add_argument("--json", action="store_true", help="print the API's JSON")
    p.set_defaults(func=_guarded(cmd_sessions))

    p = sub.add_parser("tail", parents=[common], help="follow a session's events live")
    p.add_argument("sid")
    p.add_argument("--since", type=int, default=0, help="start after this seq (default: from the beginning)")
    p.add_argument("--types", help="only these event types, e.g. 'tool.*,speech.*'")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--retry-for", type=float, default=30.0, help="seconds to keep reconnecting after a drop")
    p.set_defaults(func=_guarded(cmd_tail))

    p = sub.add_parser("input", parents=[common], help="inject user input into a session")
    p.add_argument("sid")
    p.add_argument("text")
    p.add_argument("--no-reply", action="store_true", help="commit the input without asking for a reply")
    p.add_argument("--no-interrupt", action="store_true", help="do not interrupt the current speech")
    p.add_argument("--force", action="store_true", help="interrupt even a speech that does not allow it")
    p.add_argument("--role", choices=("user", "system", "developer"), default="user")
    p.set_defaults(func=_guarded(cmd_input))

    p = sub.add_parser("interrupt", parents=[common], help="interrupt the agent's current speech")
    p.add_argument("sid")
    p.add_argument("--force", action="store_true", help="even if the speech does not allow interruptions")
    p.set_defaults(func=_guarded(cmd_interrupt))

    p = sub.add_parser("tools", parents=[common], help="running tool calls (of every session, or of one)")
    p.add_argument("sid", nargs="?")
    p.add_argument("--all", action="store_true", help="with a session: every call, not only running ones")
    p.add_argument("--json", action="store_true", help="print the API's JSON")
    p.set_defaults(func=_guarded(cmd_tools))

    p = sub.add_parser("cancel", parents=[common], help="cancel a running, cancellable tool call")
    p.add_argument("sid")
    p.add_argument("call_id")
    p.set_defaults(func=_guarded(cmd_cancel))
