"""Operator commands against a running service: ``switchboard sessions|tail|input|interrupt|tools|cancel``.

Built on the typed client (``switchboard.client``), with no HTTP of their own: pointed at ``--url`` (or
``SWITCHBOARD_URL``) with ``--key`` (or ``SWITCHBOARD_KEY``), before or after the command, sent as
``Authorization: Bearer`` on every request and on the WebSocket handshake, never in a URL. An API error is printed as
one plain line on stderr (a missing or refused key as how to give one) and the command exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TextIO

from pydantic import BaseModel

from ..client import (
    AsyncClient,
    BadRequest,
    Client,
    NotFound,
    Resume,
    SwitchboardError,
    ToolCall,
    ToolStatus,
    Unavailable,
)
from .common import add_when, global_options, refusal, scheduled_line, target
from .output import Style, age, choose_style, event_line, format_arguments, printable, short, table
from .runner import run_bounded

TIMEOUT_S = 15.0
STOP_GRACE_S = 2.0  # what a command that runs until ^C gives its stream to close once it is stopped


class ClientError(Exception):
    """Something to tell the operator in one line."""


def _one_line(err: SwitchboardError) -> str:
    if err.code == "unreachable" and err.detail:  # "Cannot reach <url>: <why>"
        return err.detail[:1].lower() + err.detail[1:]
    return str(err)


# -- commands ------------------------------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Client:
    url, key = target(args)
    return Client(url, api_key=key, timeout_s=TIMEOUT_S)


def _printed_json_or_nothing(items: Sequence[BaseModel], as_json: bool, nothing: str) -> bool:
    """Print the items as JSON (``--json``) or that there is nothing to list; False when a table is still due."""
    if as_json:
        print(json.dumps([it.model_dump(mode="json") for it in items], indent=2))
    elif not items:
        print(nothing)
    return as_json or not items


def cmd_sessions(args: argparse.Namespace) -> int:
    with _client(args) as client:
        items = list(client.iter_sessions(state=None if args.all else "active", page_size=200))
        running = client.list_running_tool_calls()
    if _printed_json_or_nothing(items, args.json, "no sessions" if args.all else "no live sessions"):
        return 0
    counts: dict[str, int] = {}
    for call in running:
        counts[call.session_id] = counts.get(call.session_id, 0) + 1
    rows = [
        [
            it.id,
            it.agent,
            it.state,
            it.agent_state if it.state == "active" else "-",
            str(counts.get(it.id, 0)),
            age(it.created_at.isoformat()),
        ]
        for it in items
    ]
    table(rows, ["SESSION", "AGENT", "STATE", "AGENT STATE", "TOOLS", "AGE"], sys.stdout)
    return 0


def cmd_input(args: argparse.Namespace) -> int:
    with _client(args) as client:
        res = client.input(
            args.sid,
            args.text,
            reply=not args.no_reply,
            interrupt=not args.no_interrupt,
            force=args.force,
            role=args.role,
            when=args.when,
        )
    if res.scheduled is not None:
        print(scheduled_line(args.sid, res.scheduled))
        return 0
    reply = f"; reply in speech {res.speech_id}" if res.speech_id else ""
    print(f"input {res.item_id} sent to {args.sid}{reply}")
    return 0


def cmd_interrupt(args: argparse.Namespace) -> int:
    with _client(args) as client:
        res = client.interrupt(args.sid, force=args.force, when=args.when)
    if res.scheduled is not None:
        print(scheduled_line(args.sid, res.scheduled))
    elif res.interrupted:
        print(f"interrupted speech {res.speech_id}")
    else:
        print("nothing to interrupt: the agent is not speaking")
    return 0


def cmd_tools(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.sid:
            calls = client.list_tool_calls(args.sid, status=None if args.all else "running")
        else:
            calls = client.list_running_tool_calls()
    if _printed_json_or_nothing(calls, args.json, "no tool calls" if args.all else "no running tool calls"):
        return 0
    s = choose_style("never", sys.stdout)
    rows = [_call_row(c, s) for c in calls]
    table(rows, ["CALL ID", "SESSION", "NAME", "STATUS", "CANCELLABLE", "PROGRESS", "ARGUMENTS"], sys.stdout)
    return 0


def _call_row(call: ToolCall, s: Style) -> list[str]:
    last = call.progress[-1] if call.progress else None
    progress = ""
    if last is not None:
        # a completed call is done, whatever its last report said; one that reported no fraction is indeterminate
        done = 1.0 if call.status == ToolStatus.COMPLETED else last.progress
        progress = f"{s.bar(done, width=10)} {last.message}".strip()
    flag = "yes" if call.cancellable else "no"
    arguments = short(format_arguments(call.arguments), 40)
    return [call.call_id, call.session_id, call.name, str(call.status), flag, progress, arguments]


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        res = client.cancel_tool_call(args.sid, args.call_id)
    print(f"cancelled {printable(res.name)} ({res.call_id}): {short(printable(res.output or ''))}")
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    url, key = target(args)

    async def run() -> int:
        async with AsyncClient(url, api_key=key, timeout_s=TIMEOUT_S, reconnect_for_s=args.retry_for) as client:
            following = tail(
                client, args.sid, since=args.since, types=args.types, style=choose_style(args.color, sys.stdout)
            )
            return await until_signalled(following)

    return run_bounded(run(), grace_s=STOP_GRACE_S, what="tail")


async def until_signalled(work: Coroutine[Any, Any, int]) -> int:
    """``work``'s exit status, or 130 once SIGINT (^C) or SIGTERM arrives: ``work`` is then cancelled and given
    ``STOP_GRACE_S`` to end, and the command ends even if it does not (a cancellation that a stream's own timeout
    swallowed once kept ``tail`` running after ^C, its reconnects and all)."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled.set)
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(signalled.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        stop.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task}, timeout=STOP_GRACE_S)
    return 130


def resume_note(resume: Resume) -> str:
    """What ``tail`` tells the operator when its stream reconnects."""
    if resume.reason == "too_slow":
        return f"fell behind the live stream; resuming from seq {resume.position}"
    if resume.reason == "gap":
        return f"missed events after seq {resume.position}; re-reading them"
    detail = f": {resume.detail}" if resume.detail else ""
    return f"connection lost ({resume.code}{detail}); reconnecting from seq {resume.position}"


async def tail(
    client: AsyncClient,
    sid: str,
    *,
    since: int = 0,
    types: str | None = None,
    style: Style,
    out: TextIO = sys.stdout,
    note: Callable[[str], None] | None = None,
) -> int:
    """Print a session's events as they happen; after a drop (or a 4008 "too slow") the client resumes from the last
    seq shown, so no event is printed twice or skipped (each resume is a note on stderr). Ends when the session
    closes."""

    def to_stderr(text: str) -> None:
        print(style(text, "dim"), file=sys.stderr, flush=True)

    say = note or to_stderr
    globs = [t for t in (types or "").split(",") if t.strip()] or None
    names: dict[str, str] = {}  # tool names by call id, for progress lines
    stream = client.events(sid, since=since, types=globs, on_resume=lambda r: say(resume_note(r)))
    try:
        async with stream:
            async for event in stream:
                shown = printable(event.model_dump(mode="json", exclude={"cursor"}))
                if shown["type"] == "tool.started":
                    names[str(shown["data"].get("call_id"))] = str(shown["data"].get("name"))
                out.write(event_line(shown, style, names) + "\n")
                out.flush()
    except NotFound:
        raise ClientError(f"No session {sid!r}.") from None
    except BadRequest:
        raise ClientError("the event stream rejected the request") from None
    except Unavailable as err:
        if err.code != "stream_lost":
            raise
        raise ClientError(
            f"lost the event stream of {sid!r} and could not reconnect for {client.reconnect_for_s:.0f} s"
        ) from None
    return 0


# -- wiring --------------------------------------------------------------------------------------------------------


def _guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ClientError as err:
            print(f"switchboard: {err}", file=sys.stderr)
            return 1
        except SwitchboardError as err:
            print(f"switchboard: {refusal(err, args) or _one_line(err)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130

    return run


def add_client_commands(sub: Any) -> None:
    """Register the operator commands on the ``switchboard`` parser's subcommands."""
    common = global_options()

    p = sub.add_parser("sessions", parents=[common], help="list live sessions")
    p.add_argument("--all", action="store_true", help="include closed sessions")
    p.set_defaults(func=_guarded(cmd_sessions))

    p = sub.add_parser("tail", parents=[common], help="follow a session's events live")
    p.add_argument("sid")
    p.add_argument("--since", type=int, default=0, help="start after this seq (default: from the beginning)")
    p.add_argument("--types", help="only these event types, e.g. 'tool.*,speech.*'")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--retry-for", type=float, default=120.0, help="seconds to keep reconnecting after a drop")
    p.set_defaults(func=_guarded(cmd_tail))

    p = sub.add_parser("input", aliases=["inject"], parents=[common], help="inject user input into a session")
    p.add_argument("sid")
    p.add_argument("text")
    p.add_argument("--no-reply", action="store_true", help="commit the input without asking for a reply")
    p.add_argument("--no-interrupt", action="store_true", help="do not interrupt the current speech")
    p.add_argument("--force", action="store_true", help="interrupt even a speech that does not allow it")
    p.add_argument("--role", choices=("user", "system", "developer"), default="user")
    add_when(p)
    p.set_defaults(func=_guarded(cmd_input))

    p = sub.add_parser("interrupt", parents=[common], help="interrupt the agent's current speech")
    p.add_argument("sid")
    p.add_argument("--force", action="store_true", help="even if the speech does not allow interruptions")
    add_when(p)
    p.set_defaults(func=_guarded(cmd_interrupt))

    p = sub.add_parser("tools", parents=[common], help="running tool calls (of every session, or of one)")
    p.add_argument("sid", nargs="?")
    p.add_argument("--all", action="store_true", help="with a session: every call, not only running ones")
    p.set_defaults(func=_guarded(cmd_tools))

    p = sub.add_parser("cancel", parents=[common], help="cancel a running, cancellable tool call")
    p.add_argument("sid")
    p.add_argument("call_id")
    p.set_defaults(func=_guarded(cmd_cancel))
