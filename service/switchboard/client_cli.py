"""Operator commands against a running service: ``switchboard sessions|tail|input|interrupt|tools|cancel``.

Pure clients of the public REST and WebSocket API, pointed at ``--url`` (or ``SWITCHBOARD_URL``) with ``--key``
(or ``SWITCHBOARD_KEY``), sent as ``Authorization: Bearer`` on every request and on the WebSocket handshake, never in
a URL. An API error is printed as one plain line on stderr and the command exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TextIO
from urllib.parse import quote, urlencode

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"
RETRIES = 2
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


# -- output --------------------------------------------------------------------------------------------------------

ANSI = {
    "bold": "1",
    "dim": "2",
    "red": "31",
    "green": "32",
    "yellow": "33",
    "blue": "34",
    "magenta": "35",
    "cyan": "36",
}
STATUS_COLOURS = {"completed": "green", "cancelled": "magenta", "running": "yellow"}


class Style:
    def __init__(self, colour: bool, unicode: bool) -> None:
        self.colour = colour
        self.unicode = unicode

    def __call__(self, text: str, *names: str) -> str:
        if not self.colour or not names:
            return text
        codes = ";".join(ANSI[n] for n in names)
        return f"\033[{codes}m{text}\033[0m"

    def bar(self, progress: float | None, width: int = 20) -> str:
        if progress is None:
            return ""
        filled = max(0, min(width, round(progress * width)))
        full, empty = ("█", "░") if self.unicode else ("#", "-")
        return f"[{self(full * filled, 'green')}{empty * (width - filled)}] {round(progress * 100):3d}%"


def _style(choice: str, stream: TextIO) -> Style:
    if choice == "always":
        colour = True
    elif choice == "never":
        colour = False
    else:
        colour = stream.isatty() and not os.environ.get("NO_COLOR")
    unicode = "utf" in (getattr(stream, "encoding", "") or "").lower()
    return Style(colour, unicode)


# What a terminal would act on rather than show: C0 and C1 controls (escape sequences can retitle the window, move the
# cursor, rewrite earlier lines, or, with some terminals, inject input) and bidi overrides (text that reads differently
# from what it is). Session text comes from users, models and tool backends: tail shows these as escapes. Tab stays;
# a newline is escaped too, as tail prints one line per event and a raw one could forge a line.
_TERMINAL_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c != 0x09}
_TERMINAL_CONTROLS |= {c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}
_TERMINAL_CONTROLS |= {0x0A: "\\n", 0x0D: "\\r"}


def printable(value: Any) -> Any:
    """``value`` (decoded JSON) with terminal controls in every string, keys included, replaced by visible escapes."""
    if isinstance(value, str):
        return value.translate(_TERMINAL_CONTROLS)
    if isinstance(value, list):
        return [printable(v) for v in value]
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    return value


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _args(arguments: Any) -> str:
    if not isinstance(arguments, dict):
        return ""
    return ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())


def _age(created_at: str) -> str:
    try:
        seconds = int((datetime.now(UTC) - datetime.fromisoformat(created_at)).total_seconds())
    except ValueError:
        return "?"
    seconds = max(seconds, 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600}h"


def _table(rows: list[list[str]], header: list[str], out: TextIO) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        out.write("  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip() + "\n")


def describe(event: dict[str, Any], s: Style, names: dict[str, str] | None = None) -> str:
    """One readable line for an event (without seq and time); `names` maps call ids to tool names."""
    d: dict[str, Any] = event.get("data") or {}
    kind = str(event.get("type", ""))
    if kind == "session.started":
        return s(f"session started with agent {d.get('agent')}", "bold")
    if kind == "session.recovered":
        return s(f"──── session recovered after a restart (agent {d.get('agent')}) ────", "bold", "yellow")
    if kind == "session.closed":
        return s("session closed", "bold")
    if kind == "session.failed":
        return s(f"session failed: {d.get('error', '')}", "bold", "red")
    if kind == "agent.state":
        return s(f"agent is {d.get('state')}", "dim")
    if kind == "agent.handoff":
        return s(f"handoff {d.get('from_agent')} → {d.get('to_agent')}", "magenta")
    if kind == "user.input":
        who = d.get("role") or "user"
        label = f"{who} (interim)" if not d.get("final", True) else who
        return s(f"{label}: ", "green", "bold") + _short(d.get("text", ""), 200)
    if kind == "speech.created":
        return s(f"speech {d.get('speech_id')} queued ({d.get('source')})", "dim")
    if kind == "generation.started":
        return s(f"thinking (speech {d.get('speech_id')}, step {d.get('step')})", "dim")
    if kind == "speech.started":
        return s(f"speaking {d.get('speech_id')}", "cyan")
    if kind == "speech.interrupted":
        return s(f"interrupted {d.get('speech_id')}; heard: ", "yellow", "bold") + _short(d.get("played_text", ""), 200)
    if kind == "speech.done":
        return s(f"speech {d.get('speech_id')} done{' (interrupted)' if d.get('interrupted') else ''}", "dim")
    if kind == "chat.item":
        item = d.get("item") or {}
        if item.get("type") == "message":
            flag = " [interrupted]" if item.get("interrupted") else ""
            return s(f"{item.get('role')}: ", "cyan", "bold") + _short(item.get("text", ""), 200) + s(flag, "yellow")
        if item.get("type") == "function_call":
            return s(f"call {item.get('name')}({_args(item.get('arguments'))})", "dim")
        if item.get("type") == "function_call_output":
            return s(f"output of {item.get('name')}: {_short(item.get('output', ''))}", "dim")
        return s(f"chat item {item.get('type')}", "dim")
    if kind == "tool.started":
        flag = " [cancellable]" if d.get("cancellable") else ""
        return s(f"tool {d.get('name')}({_args(d.get('arguments'))}) started", "yellow") + s(
            f" {d.get('call_id')}{flag}", "dim"
        )
    if kind == "tool.progress":
        progress = d.get("progress")
        name = (names or {}).get(str(d.get("call_id")), str(d.get("call_id")))
        parts = [
            s(name, "yellow"),
            s.bar(float(progress)) if isinstance(progress, int | float) else "",
            d.get("message"),
        ]
        return " ".join(str(p) for p in parts if p)
    if kind == "tool.ended":
        status = str(d.get("status"))
        colour = STATUS_COLOURS.get(status, "red")
        return s(f"tool {d.get('name') or d.get('call_id')} {status}", colour, "bold") + f": {_short(d.get('output'))}"
    if kind == "generation.failed":
        return s(f"generation failed: {d.get('error')}", "red")
    return s(_short(d), "dim")


def event_line(event: dict[str, Any], s: Style, names: dict[str, str] | None = None) -> str:
    at = str(event.get("at", ""))
    try:
        clock = datetime.fromisoformat(at).astimezone().strftime("%H:%M:%S.%f")[:-3]
    except ValueError:
        clock = at
    kind = str(event.get("type", ""))
    return f"{s(str(event.get('seq')).rjust(5), 'dim')} {s(clock, 'dim')} {kind.ljust(19)} {describe(event, s, names)}"


# -- commands ------------------------------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Client:
    url = args.url or os.environ.get("SWITCHBOARD_URL") or DEFAULT_URL
    key = args.key or os.environ.get("SWITCHBOARD_KEY") or None
    return Client(url, key)


def _sid(sid: str) -> str:
    return quote(sid, safe="")


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
    if args.json:
        print(json.dumps(items, indent=2))
        return 0
    if not items:
        print("no live sessions" if not args.all else "no sessions")
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
            _age(it["created_at"]),
        ]
        for it in items
    ]
    _table(rows, ["SESSION", "AGENT", "STATE", "AGENT STATE", "TOOLS", "AGE"], sys.stdout)
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
    if args.json:
        print(json.dumps(calls, indent=2))
        return 0
    if not calls:
        print("no running tool calls" if not args.all else "no tool calls")
        return 0
    s = _style("never", sys.stdout)
    rows = []
    for c in calls:
        last = c["progress"][-1] if c["progress"] else None
        progress = ""
        if last is not None:
            bar = s.bar(last["progress"], width=10) if last["progress"] is not None else ""
            progress = f"{bar} {last['message']}".strip()
        flag = "yes" if c["cancellable"] else "no"
        rows.append(
            [c["call_id"], c["session_id"], c["name"], c["status"], flag, progress, _short(_args(c["arguments"]), 40)]
        )
    _table(rows, ["CALL ID", "SESSION", "NAME", "STATUS", "CANCELLABLE", "PROGRESS", "ARGUMENTS"], sys.stdout)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    path = f"/v1/sessions/{_sid(args.sid)}/tool-calls/{quote(args.call_id, safe='')}/cancel"
    res = _client(args).request("POST", path, body={})
    print(f"cancelled {res['name']} ({res['call_id']}): {_short(res.get('output') or '')}")
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    return asyncio.run(
        tail(
            _client(args),
            args.sid,
            since=args.since,
            types=args.types,
            style=_style(args.color, sys.stdout),
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
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    def say(text: str) -> None:
        (note or (lambda t: print(style(t, "dim"), file=sys.stderr, flush=True)))(text)

    base = "ws" + client.url[len("http") :] if client.url.startswith("http") else client.url
    last = since
    names: dict[str, str] = {}
    connected_once = False
    failing_since: float | None = None
    delay = 0.25
    while True:
        query = {"since": last, **({"types": types} if types else {})}
        url = f"{base}/v1/sessions/{_sid(sid)}/events?{urlencode(query)}"
        code, reason = 1006, ""
        try:
            async with connect(url, additional_headers=client.headers(), open_timeout=5, max_size=2**23) as ws:
                connected_once, failing_since, delay = True, None, 0.25
                try:
                    async for raw in ws:
                        event = printable(json.loads(raw))  # everything printed below comes from it
                        seq = event.get("seq")
                        if not isinstance(seq, int) or seq <= last:
                            continue  # a pong, or a frame already shown
                        if types is None and seq > last + 1:
                            # a frame is missing (seqs have no gaps): read again from the last one shown
                            say(f"missed events after seq {last}; re-reading them")
                            code, reason = 0, "gap"
                            break
                        last = seq
                        if event.get("type") == "tool.started":
                            names[str(event["data"].get("call_id"))] = str(event["data"].get("name"))
                        out.write(event_line(event, style, names) + "\n")
                        out.flush()
                        if event.get("type") == "session.closed":
                            return 0
                except ConnectionClosed:
                    pass
                if code == 0:
                    continue  # reconnect at once from `last`
                code, reason = ws.close_code or 1006, ws.close_reason or ""
        except (OSError, TimeoutError, InvalidHandshake) as err:
            if not connected_once:
                raise ClientError(f"cannot stream events from {client.url}: {err or type(err).__name__}") from None
            reason = str(err)
        if code in FATAL_CLOSES:
            raise ClientError(FATAL_CLOSES[code])
        if code == 4404:
            raise ClientError(f"no session {sid!r}")
        if code == 1000 and reason == "session closed":
            return 0
        if code == 4008:
            say(f"fell behind the live stream; resuming from seq {last}")
            continue
        now = time.monotonic()
        failing_since = failing_since or now
        if now - failing_since > retry_for_s:
            raise ClientError(f"lost the event stream of {sid!r} and could not reconnect for {retry_for_s:.0f} s")
        say(f"connection lost ({code}{': ' + reason if reason else ''}); reconnecting from seq {last}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, RECONNECT_MAX_S)


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
