"""The FastAPI application: ``create_app(settings)`` with a lifespan that builds and tears down in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from .. import __version__
from ..control.host import SessionHost
from ..control.hub import EventHub
from ..control.metrics import Metrics
from ..control.settings import Settings
from ..integrations.agents_file import load_agents_file
from ..integrations.demo import AGENTS as DEMO_AGENTS
from ..integrations.demo import DEFAULT_LLMS as DEMO_LLMS
from ..integrations.model_profiles import ModelProfiles
from ..integrations.webhooks import Webhooks
from ..runtime.agent import AgentRegistry
from ..runtime.aio import cancel_and_wait
from ..store import Store
from . import asyncapi, problems, routes_events, routes_health, routes_reports, routes_sessions, routes_tools
from .deps import Services
from .guards import BrowserGuard, JsonBodies, PrivatePaths, SecurityHeaders
from .limits import BodyLimit, RequestDeadline
from .stream_slots import StreamSlots

logger = logging.getLogger("switchboard.api.app")

CONSOLE_DIR = Path(__file__).parent.parent / "console"

DESCRIPTION = """Control plane for live AI agent sessions: inject input, interrupt speech, watch tool progress,
cancel tools. Errors are `application/problem+json`. Every POST accepts an `Idempotency-Key` header."""


IDEMPOTENCY_PURGE_EVERY_S = 3600.0
# The backstop deadline on every HTTP request; routes that wait on the runtime bound that wait by request_timeout_s
# themselves (deps.deadline), so this one fires only for what they do not cover (store reads, idempotency records).
REQUEST_DEADLINE_GRACE_S = 1.0


async def _purge_idempotency_keys(store: Store, settings: Settings) -> None:
    """Forget idempotency keys older than their retention (at least 24 h), once an hour."""
    while True:
        try:
            cutoff = datetime.now(UTC) - timedelta(seconds=settings.idempotency_ttl_s)
            purged = await store.idempotency_purge(cutoff)
            if purged:
                logger.info("purged %d idempotency key(s)", purged)
        except Exception:
            logger.exception("idempotency key purge failed; will retry")
        await asyncio.sleep(IDEMPOTENCY_PURGE_EVERY_S)


def create_app(settings: Settings | None = None, *, registry: AgentRegistry | None = None) -> FastAPI:
    settings = settings or Settings()
    registry = registry or AgentRegistry.load(settings.agents, builtin=DEMO_AGENTS)
    webhooks = Webhooks(max_response_bytes=settings.max_webhook_response_bytes)
    metrics = Metrics()
    # ValueError: the service does not start
    models = ModelProfiles(settings.models, sessions_may_script=settings.sessions_may_script)
    # agent name -> the model a session of that agent uses when it gives none: the built-in agents' own, and those an
    # agents file declares (its agents cannot take a built-in agent's name)
    default_llms: dict[str, dict[str, Any]] = dict(DEMO_LLMS)
    if settings.agents_file is not None:
        declared = load_agents_file(settings.agents_file, webhooks)  # AgentsFileError: the service does not start
        declared.register(registry)
        for agent, config in declared.default_llms.items():
            try:
                models.server_config(config)
            except ValueError as err:
                raise ValueError(f"{settings.agents_file}: agent {agent!r}: llm: {err}") from None
        default_llms.update(declared.default_llms)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store.from_url(settings.database_url)
        if settings.migrate_on_start:
            await store.migrate()
        await store.start()
        hub = EventHub(default_buffer=settings.ws_buffer)
        host = SessionHost(
            store=store,
            registry=registry,
            hub=hub,
            settings=settings,
            on_event=metrics.on_event,
            default_llms=default_llms,
            models=models,
        )
        metrics.bind(lambda: len(host.sessions), lambda: hub.subscriber_count)
        app.state.services = Services(
            settings=settings,
            store=store,
            hub=hub,
            host=host,
            webhooks=webhooks,
            metrics=metrics,
            streams=StreamSlots(
                per_process=settings.ws_max_streams, per_credential=settings.ws_max_streams_per_credential
            ),
        )
        purge_task = asyncio.create_task(_purge_idempotency_keys(store, settings), name="idempotency-purge")
        try:
            await host.recover_all()
            logger.info("switchboard ready (%d live sessions)", len(host.sessions))
            yield
        finally:
            await cancel_and_wait(purge_task)
            await host.aclose()
            await webhooks.aclose()
            await store.aclose()

    app = problems.ProblemAPI(
        title="Switchboard",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        openapi_tags=[
            {"name": "sessions", "description": "Live sessions and operator commands"},
            {"name": "tools", "description": "Tool calls: list, read, cancel"},
            {"name": "events", "description": "WebSocket event streams"},
            {"name": "health", "description": "Liveness, readiness, metrics"},
        ],
    )
    problems.install(app)
    for router in (routes_sessions.router, routes_tools.router, routes_reports.router):
        app.include_router(router, responses=problems.problem_responses(*problems.API_ERRORS))
    app.include_router(routes_events.router)
    app.include_router(routes_health.router)
    app.include_router(asyncapi.router)  # GET /asyncapi.json, like /openapi.json: public, outside the schema
    # the operator console: static ES modules, a pure client of the public API (/console redirects to /console/)
    app.mount("/console", StaticFiles(directory=CONSOLE_DIR, html=True), name="console")
    # added first, so inside BodyLimit: the deadline counts handling time, not the time the body takes to arrive
    app.add_middleware(RequestDeadline, timeout_s=settings.request_timeout_s + REQUEST_DEADLINE_GRACE_S)
    app.add_middleware(JsonBodies)  # inside BodyLimit: an oversize body is a 413 whatever its type
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        read_timeout_s=settings.body_read_timeout_s,
        body_timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(PrivatePaths, settings=settings)
    # outermost: a request browsers must not make is refused before anything else; every answer gets the headers
    app.add_middleware(BrowserGuard, settings=settings)
    app.add_middleware(SecurityHeaders)
    return app
