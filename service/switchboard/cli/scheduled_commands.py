"""Commands that apply at a point of the conversation, and coaching: ``--when`` on ``input`` (alias ``inject``),
``say`` and ``interrupt``; ``switchboard coach SID NOTE``; ``switchboard scheduled SID`` (the list) and
``switchboard unschedule SID ID`` (cancel one)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..client import Client, ScheduledCommand
from .common import global_options, target
from .operator import TIMEOUT_S, _guarded
from .output import age, short, table


def _client(args: argparse.Namespace) -> Client:
    url, key = target(args)
    return Client(url, api_key=key, timeout_s=TIMEOUT_S)


def cmd_coach(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        res = sb.coach(args.sid, args.note)
    print(f"note {res.id} left for the next reply of {args.sid}")
    return 0


def cmd_scheduled(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        items = sb.list_scheduled(args.sid, pending_only=not args.all)
    if args.json:
        print(json.dumps([it.model_dump(mode="json") for it in items], indent=2))
        return 0
    if not items:
        print("nothing scheduled" if args.all else "nothing pending")
        return 0
    rows = [_row(it) for it in items]
    table(rows, ["ID", "KIND", "AT", "STATE", "AGE", "WHAT"], sys.stdout)
    return 0


def _row(it: ScheduledCommand) -> list[str]:
    what = str(it.args.get("text") or it.args.get("note") or ("force" if it.args.get("force") else ""))
    point = f"after_tool:{it.call_id}" if it.call_id else it.at
    state = f"{it.state} ({it.reason})" if it.reason else it.state
    return [it.id, it.kind, point, state, age(it.created_at.isoformat()), short(what, 60)]


def cmd_unschedule(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        res = sb.cancel_scheduled(args.sid, args.scheduled_id)
    print(f"{res.id} cancelled")
    return 0


def add_scheduled_commands(sub: Any) -> None:
    common = global_options()

    p = sub.add_parser("coach", parents=[common], help="leave a note for the agent's next reply only")
    p.add_argument("sid")
    p.add_argument("note")
    p.set_defaults(func=_guarded(cmd_coach))

    p = sub.add_parser("scheduled", parents=[common], help="a session's pending scheduled commands and notes")
    p.add_argument("sid")
    p.add_argument("--all", action="store_true", help="also those applied or cancelled")
    p.set_defaults(func=_guarded(cmd_scheduled))

    p = sub.add_parser("unschedule", parents=[common], help="cancel a pending scheduled command or note")
    p.add_argument("sid")
    p.add_argument("scheduled_id")
    p.set_defaults(func=_guarded(cmd_unschedule))
