"""The ``switchboard`` command: serve, migrate, openapi, asyncapi, and the client commands.

The server's packages (``switchboard[server]``) are imported by the server's commands only, when they run: a client
command starts without them, and ``switchboard serve`` without them says how to install them."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import add_global_options, stdout_closed
from .edge import add_edge_command
from .operator import add_client_commands
from .output import terminal_output
from .runner import run_bounded
from .scheduled_commands import add_scheduled_commands
from .session_commands import add_session_commands
from .takeover_commands import add_takeover_commands

if TYPE_CHECKING:
    from ..control.settings import Settings

GC_YOUNG_THRESHOLD = 10_000  # CPython's default is 700 allocations
# `serve` exit statuses of a start given up (2: a setting is invalid)
EXIT_NOT_STARTED = 3  # another instance runs on the database (or the start failed otherwise)
EXIT_DATABASE_UNAVAILABLE = 4  # the database stayed unavailable for DATABASE_WAIT_S
# once a stopping server (after its drain) has closed its listeners: how long open requests get to finish
GRACEFUL_SHUTDOWN_S = 10
EXIT_USAGE = 2
NOT_INSTALLED = 'the server is not installed: pip install "switchboard[server]"'


def _server_command(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command of the server's: without the server's packages, one line that says how to install them."""

    def run(args: argparse.Namespace) -> int:
        try:
            from ..api import app  # noqa: F401  # every server package, before the command does anything
        except ModuleNotFoundError as err:
            if (err.name or "").partition(".")[0] == "switchboard":
                raise
            print(f"switchboard: {NOT_INSTALLED}", file=sys.stderr)
            return EXIT_USAGE
        return func(args)

    return run


def _settings(args: argparse.Namespace) -> Settings:
    from ..control.settings import Settings

    overrides = {}
    for name in ("host", "port", "database_url", "agents", "agents_file", "log_level"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)


def _ensure_sqlite_dir(url: str) -> None:
    prefix = "sqlite+aiosqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + ":memory:"):
        Path(url[len(prefix) :]).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)


def _draining_server_class() -> type[Any]:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """On SIGTERM a cluster node first hands its sessions to the other nodes (``control.cluster.drain``) while it
        still serves HTTP, then stops as usual."""

        async def shutdown(self, sockets: Any = None) -> None:
            app = self.config.app
            hand_over = getattr(getattr(app, "state", None), "drain", None)
            if hand_over is not None and not self.force_exit:
                try:
                    await hand_over()
                except Exception:
                    logging.getLogger("switchboard.cli").exception("drain failed; stopping anyway")
            await super().shutdown(sockets)

    return DrainingServer


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..api.app import create_app
    from ..api.http_protocol import gated_http_protocol
    from ..api.streams.ws_protocol import EventStreamProtocol
    from ..control import logs
    from ..integrations.agents_file import AgentsFileError
    from ..runtime.agent import AgentsImportError

    settings = _settings(args)
    try:
        settings.check_bind()
        settings.check_cluster()
    except ValueError as err:
        print(f"switchboard: {err}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.log_level, json_lines=settings.log_json, secrets=settings.secret_values())
    _ensure_sqlite_dir(settings.database_url)
    # like `python -m`, find agent modules in the working directory (SWITCHBOARD_AGENTS=myagents:AGENTS)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        app = create_app(settings)
    except (AgentsFileError, AgentsImportError) as err:
        print(f"switchboard: {err}", file=sys.stderr)
        return EXIT_USAGE
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,  # written by the app (api.request_metrics), with the time taken and a level by kind
        # uvicorn's own pick (httptools, else h11), with a header deadline and connection caps (api/connections.py)
        http=gated_http_protocol(app.state.connection_gate),
        ws=EventStreamProtocol,  # event frames encoded once for every subscriber
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_max_size=settings.ws_max_message_bytes,
        ws_ping_timeout=settings.ws_ping_interval_s,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="on",
    )
    # Garbage collection pauses are latency for every session and subscriber (bench/http_interrupt.py and
    # bench/ws_fanout.py measure it). What exists now (modules, the app) lives as long as the process: keep it out
    # of every later full collection. A larger young generation lets the many short-lived objects of a busy loop
    # (one task step per subscriber per event) die young instead of being promoted and forcing full collections.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    server = _draining_server_class()(config)
    try:
        run_bounded(server.serve(), loop_factory=config.get_loop_factory())
    except SystemExit:
        if server.started:
            raise
        # uvicorn's own exit when the lifespan failed to start (its status, 3, whatever the reason): ours says which
    if server.started:
        return 0
    # a lifespan that failed to start (another instance on the database, the database unavailable) has logged why
    wait = getattr(app.state, "database_wait", None)
    return EXIT_DATABASE_UNAVAILABLE if wait is not None and wait.gave_up is not None else EXIT_NOT_STARTED


def cmd_migrate(args: argparse.Namespace) -> int:
    from ..control import logs
    from ..store import Store

    settings = _settings(args)
    logs.configure(settings.log_level, secrets=settings.secret_values())
    _ensure_sqlite_dir(settings.database_url)

    async def run() -> None:
        store = Store.from_url(settings.database_url)
        try:
            await store.migrate()
        finally:
            await store.aclose()

    asyncio.run(run())
    print("database is at the latest revision")
    return 0


def openapi_spec() -> dict[str, object]:
    from ..api.app import create_app
    from ..control.settings import Settings

    return create_app(Settings(api_keys=[])).openapi()


def asyncapi_spec() -> dict[str, object]:
    from ..api.asyncapi import asyncapi_spec

    return asyncapi_spec()


def cmd_openapi(args: argparse.Namespace) -> int:
    return _write_spec(openapi_spec(), args.output)


def cmd_asyncapi(args: argparse.Namespace) -> int:
    return _write_spec(asyncapi_spec(), args.output)


def _write_spec(spec: dict[str, object], output: str) -> int:
    text = json.dumps(spec, indent=2, sort_keys=True) + "\n"
    if output == "-":
        sys.stdout.write(text)
    else:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text)
        print(f"wrote {output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchboard", description="Control plane for live AI agent sessions.")
    add_global_options(parser, default=None)  # before the command, or after it (each client command's own)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP/WebSocket service")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--database-url", dest="database_url")
    serve.add_argument("--agents", help="pkg.module:AGENTS[,other.module:AGENTS]")
    serve.add_argument("--agents-file", dest="agents_file", help="YAML or JSON file of agents with webhook tools")
    serve.add_argument("--log-level", dest="log_level")
    serve.set_defaults(func=_server_command(cmd_serve))

    migrate = sub.add_parser("migrate", help="upgrade the database to the latest schema")
    migrate.add_argument("--database-url", dest="database_url")
    migrate.set_defaults(func=_server_command(cmd_migrate))

    spec = sub.add_parser("openapi", help="write the OpenAPI document")
    spec.add_argument("--output", "-o", default="openapi/openapi.json")
    spec.set_defaults(func=_server_command(cmd_openapi))

    events_spec = sub.add_parser("asyncapi", help="write the AsyncAPI document of the event streams")
    events_spec.add_argument("--output", "-o", default="openapi/asyncapi.json")
    events_spec.set_defaults(func=_server_command(cmd_asyncapi))

    add_client_commands(sub)  # sessions, tail, input, interrupt, tools, cancel
    add_session_commands(sub)  # create, say, close, agents, attention
    add_takeover_commands(sub)  # takeover, handback
    add_scheduled_commands(sub)  # coach, scheduled, unschedule
    add_edge_command(sub)  # a media edge that speaks with espeak-ng
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with terminal_output():  # whatever a command prints, no server text reaches the terminal as a control
            return int(args.func(args))
    except BrokenPipeError:
        return stdout_closed()


if __name__ == "__main__":
    raise SystemExit(main())
