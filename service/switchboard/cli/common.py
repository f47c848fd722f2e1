"""What the client commands share: the global options, the service they talk to, and how a refusal reads.

Imports nothing of the server (nor of the client): ``switchboard --help`` and every client command start without it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..client import ScheduledCommand, SwitchboardError

DEFAULT_URL = "http://127.0.0.1:8080"
# a shell's status for a command that wrote to a pipe whose reader had gone (killed by SIGPIPE)
EXIT_STDOUT_CLOSED = 128 + signal.SIGPIPE
KEY_HELP = "with --key KEY or set SWITCHBOARD_KEY"
_SCOPE = re.compile(r"'([^']+)' scope")


def add_global_options(parser: argparse.ArgumentParser, *, default: object) -> None:
    """``--url``, ``--key`` and ``--json``: on the ``switchboard`` parser (``default`` None) and on each client
    command's (``argparse.SUPPRESS``, so an option given before the command is not reset after it)."""
    parser.add_argument("--url", default=default, help=f"service URL (default: $SWITCHBOARD_URL or {DEFAULT_URL})")
    parser.add_argument("--key", default=default, help="API key (default: $SWITCHBOARD_KEY)")
    parser.add_argument("--json", action="store_true", default=default, help="print the API's JSON (listings)")


def global_options() -> argparse.ArgumentParser:
    """The parent parser of every client command: the global options, also accepted after the command."""
    parent = argparse.ArgumentParser(add_help=False)
    add_global_options(parent, default=argparse.SUPPRESS)
    return parent


def target(args: argparse.Namespace) -> tuple[str, str | None]:
    """The service URL and the API key the command uses."""
    url = args.url or os.environ.get("SWITCHBOARD_URL") or DEFAULT_URL
    return url, args.key or os.environ.get("SWITCHBOARD_KEY") or None


def _key_source(args: argparse.Namespace) -> str:
    return "--key" if args.key else "SWITCHBOARD_KEY" if os.environ.get("SWITCHBOARD_KEY") else ""


def refusal(err: SwitchboardError, args: argparse.Namespace) -> str | None:
    """A 401 or 403 told as what the operator can do about it, or None for another error."""
    source = _key_source(args)
    if err.status == 401:
        if not source:
            return f"the service needs an API key: pass one {KEY_HELP}"
        if err.code in ("invalid_token", "token_expired"):
            return f"the service did not accept the session token ({err.code}): mint a new one"
        return f"the service did not accept the API key from {source}: pass a valid one {KEY_HELP}"
    if err.status == 403:
        scope = _SCOPE.search(err.detail or "")
        lacks = f"the {scope.group(1)!r} scope" if scope else "the scope this needs"
        credential = f"the API key from {source}" if source else "this credential"
        return f"{credential} lacks {lacks} for this: use a key that has it (--key or SWITCHBOARD_KEY)"
    return None


def stdout_closed() -> int:
    """The reader of stdout went away (``switchboard agents | head``): what is still buffered goes nowhere, and the
    exit is quiet, with a shell's status for it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush writes there, not to the closed pipe
    os.close(devnull)
    return EXIT_STDOUT_CLOSED


WHEN_HELP = (
    "apply at a point of the conversation instead of now: idle (when the agent is next idle), after-speech (after the "
    "current speech), after-tool:CALL_ID (once that tool call has ended)"
)
_WHEN = re.compile(r"^(now|idle|after[-_]speech|after[-_]tool:.+)$")


def when_arg(value: str) -> str:
    """``--when``, checked before anything is sent (the client reads it: ``switchboard.client._ops.when_body``)."""
    if not _WHEN.match(value):
        raise argparse.ArgumentTypeError(f"{value!r}: use idle, after-speech or after-tool:CALL_ID")
    return value


def add_when(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--when", type=when_arg, metavar="POINT", help=WHEN_HELP)


def scheduled_line(sid: str, command: ScheduledCommand) -> str:
    """How a command that was scheduled (not applied now) is reported."""
    point = f"after_tool {command.call_id}" if command.call_id else command.at
    return f"{command.kind} scheduled on {sid} as {command.id} ({point}): {command.state}"
