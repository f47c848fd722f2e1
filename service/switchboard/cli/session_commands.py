"""``switchboard create|say|chat|close|agents|attention|alerts``: session life cycle and discovery, on the typed client.

Same options as the other operator commands (``--url``/``SWITCHBOARD_URL``, ``--key``/``SWITCHBOARD_KEY``, before or
after the command); an API error is one plain line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ..client import Client, SwitchboardError
from .common import add_when, global_options, refusal, scheduled_line, target
from .output import CHAT_ITEM_FORMATTERS, age, choose_style, other_item, short, table


def _client(args: argparse.Namespace) -> Client:
    url, key = target(args)
    return Client(url, api_key=key)


def _json_object(text: str | None, what: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} is not JSON: {err.msg}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object")
    return value


def cmd_create(args: argparse.Namespace) -> int:
    metadata = dict(_json_object(args.metadata, "--metadata") or {})
    for pair in args.meta or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--meta {pair!r}: use KEY=VALUE")
        metadata[key] = value
    llm = {"profile": args.profile} if args.profile else _json_object(args.llm, "--llm")
    with _client(args) as sb:
        session = sb.create_session(args.agent, id=args.id, llm=llm, metadata=metadata or None)
    print(session.id if args.quiet else f"session {session.id} ({session.agent}) is {session.state}")
    return 0


def cmd_say(args: argparse.Namespace) -> int:
    if args.operator and args.when is not None:
        print("switchboard: an operator's words (--operator) are spoken now: no --when", file=sys.stderr)
        return 2
    with _client(args) as sb:
        if args.operator:  # the operator who holds the session speaks as the agent, now
            res = sb.takeover_say(args.sid, args.text)
        else:
            res = sb.say(args.sid, args.text, allow_interruptions=not args.no_interruptions, when=args.when)
    if res.scheduled is not None:
        print(scheduled_line(args.sid, res.scheduled))
        return 0
    print(f"{args.sid} will say it in speech {res.speech_id}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        items = sb.get_chat(args.sid)
    if args.json:
        print(json.dumps([item.model_dump(mode="json") for item in items], indent=2))
        return 0
    style = choose_style("auto", sys.stdout)
    for item in items:
        data = item.model_dump(mode="json")
        print(CHAT_ITEM_FORMATTERS.get(str(data.get("type")), other_item)(data, style))
    return 0


def cmd_close(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        sb.close_session(args.sid)
    print(f"closed {args.sid}")
    return 0


def _model(summary: Any) -> str:
    if summary is None:
        return "-"
    name = f"{summary.provider}/{summary.model}" if summary.model else summary.provider
    return f"{name} (profile {summary.profile})" if summary.profile else name


def cmd_agents(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        agents = sb.list_agents()
    if args.json:
        print(json.dumps([a.model_dump(mode="json") for a in agents], indent=2))
        return 0
    rows = [
        [a.name, _model(a.model), ", ".join(t.name for t in a.tools) or "-", short(a.description or "", 60)]
        for a in agents
    ]
    table(rows, ["AGENT", "MODEL", "TOOLS", "DESCRIPTION"], sys.stdout)
    return 0


def cmd_attention(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        page = sb.list_sessions(attention=True, agent=args.agent, limit=200)
    sessions = page.items
    if page.missing_nodes:
        missing = ", ".join(page.missing_nodes)
        print(f"switchboard: not answering: {missing} — their sessions are not listed", file=sys.stderr)
    if args.json:
        print(json.dumps([s.model_dump(mode="json") for s in sessions], indent=2))
        return 0
    if not sessions:
        print("nothing needs an operator")
        return 0
    rows = [
        [s.id, s.agent, r.code, age(r.since.isoformat()), short(r.message, 80)] for s in sessions for r in s.attention
    ]
    table(rows, ["SESSION", "AGENT", "REASON", "FOR", "DETAIL"], sys.stdout)
    return 0


def cmd_alerts(args: argparse.Namespace) -> int:
    with _client(args) as sb:
        alerts = sb.list_alerts(include_cleared=args.all, session_id=args.session)
    if args.json:
        print(json.dumps([a.model_dump(mode="json") for a in alerts], indent=2))
        return 0
    if not alerts:
        print("no alert open" if not args.all else "no alert")
        return 0
    rows = []
    for a in alerts:
        sent = ", ".join(
            f"{d.sink}: {d.state}" + (" (cleared)" if d.transition == "cleared" else "") for d in a.deliveries
        )
        state = "open" if a.cleared_at is None else "cleared"
        rows.append([a.id, a.session_id, a.reason, state, age(a.opened_at.isoformat()), sent or "-"])
    table(rows, ["ALERT", "SESSION", "REASON", "STATE", "OPENED", "SINKS"], sys.stdout)
    return 0


def _guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except SwitchboardError as err:
            print(f"switchboard: {refusal(err, args) or err.detail or err}", file=sys.stderr)
            return 1
        except BrokenPipeError:
            raise  # stdout's reader went away: main() ends quietly
        except (ValueError, OSError) as err:
            print(f"switchboard: {err}", file=sys.stderr)
            return 2

    return run


def add_session_commands(sub: Any) -> None:
    common = global_options()

    p = sub.add_parser("create", parents=[common], help="create a session")
    p.add_argument("agent")
    p.add_argument("--id", help="the session id (creating it again with the same options is a no-op)")
    p.add_argument("--profile", help="a model profile of the server")
    p.add_argument("--llm", help='the model as JSON, e.g. \'{"provider": "scripted", "turns": [...]}\'')
    p.add_argument("--meta", action="append", metavar="KEY=VALUE", help="a metadata value (repeatable)")
    p.add_argument("--metadata", help="metadata as a JSON object")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the session id")
    p.set_defaults(func=_guarded(cmd_create))

    p = sub.add_parser("say", parents=[common], help="have the agent say something verbatim")
    p.add_argument("sid")
    p.add_argument("text")
    p.add_argument("--no-interruptions", action="store_true", help="the speech cannot be interrupted")
    p.add_argument(
        "--operator", action="store_true", help="your own words, as the operator holding the session (`takeover`)"
    )
    add_when(p)
    p.set_defaults(func=_guarded(cmd_say))

    p = sub.add_parser("chat", parents=[common], help="the conversation as the model sees it")
    p.add_argument("sid")
    p.set_defaults(func=_guarded(cmd_chat))

    p = sub.add_parser("close", parents=[common], help="close a session")
    p.add_argument("sid")
    p.set_defaults(func=_guarded(cmd_close))

    p = sub.add_parser("agents", parents=[common], help="the agents the service runs, their tools and models")
    p.set_defaults(func=_guarded(cmd_agents))

    p = sub.add_parser("attention", parents=[common], help="sessions that need an operator, and why")
    p.add_argument("--agent", help="only sessions of this agent")
    p.set_defaults(func=_guarded(cmd_attention))

    p = sub.add_parser("alerts", parents=[common], help="alerts sent to the webhook sinks, and how each delivery went")
    p.add_argument("--all", action="store_true", help="cleared alerts too")
    p.add_argument("--session", help="only this session's alerts")
    p.set_defaults(func=_guarded(cmd_alerts))
