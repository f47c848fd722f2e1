"""``switchboard takeover|handback``: an operator takes a session over and hands it back (``say --operator`` speaks
as the agent meanwhile), on the typed client. The operator is the caller, as the service names the API key."""

from __future__ import annotations

import argparse
from typing import Any

from .common import global_options
from .session_commands import _client, _guarded


def cmd_takeover(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        hold = sb.take_over(args.sid, force=args.force)
    displaced = f" (displacing {hold.displaced})" if hold.displaced else ""
    print(f"{args.sid} is held by {hold.operator} since {hold.since.isoformat()}{displaced}")
    return 0


def cmd_handback(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        back = sb.hand_back(args.sid, force=args.force)
    reply = f"; the agent replies in speech {back.speech_id}" if back.speech_id else ""
    print(f"{args.sid} handed back to the agent{reply}")
    return 0


def add_takeover_commands(sub: Any) -> None:
    common = global_options()

    p = sub.add_parser(
        "takeover", parents=[common], help="take a session over: the model is asked for nothing until handed back"
    )
    p.add_argument("sid")
    p.add_argument("--force", action="store_true", help="take it from another operator who holds it")
    p.set_defaults(func=_guarded(cmd_takeover))

    p = sub.add_parser("handback", parents=[common], help="hand a session you hold back to its agent")
    p.add_argument("sid")
    p.add_argument("--force", action="store_true", help="hand back a session another operator holds")
    p.set_defaults(func=_guarded(cmd_handback))
