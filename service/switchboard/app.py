"""The FastAPI application: ``create_app(settings)`` with a lifespan that builds and tears down in order."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from . import __version__
from .api import problems, routes_events, routes_health, routes_sessions, routes_tools
from .api.limits import BodyLimit
from .demo import AGENTS as DEMO_AGENTS
from .host import SessionHost
from .hub import EventHub
from .metrics import Metrics
from .runtime.agent import AgentRegistry
from .settings import Settings
from .store import Store

logger = logging.getLogger("switchboard.app")

DESCRIPTION = """Control plane for live AI agent sessions: inject input, interrupt speech, watch tool progress,
cancel tools. Errors are `application/problem+json`. Every POST accepts an `Idempotency-Key` header."""


def create_app(settings: Settings | None = None, *, registry: AgentRegistry | None = None) -> FastAPI:
    settings = settings or Settings()
    registry = registry or AgentRegistry.load(settings.agents, builtin=DEMO_AGENTS)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store.from_url(settings.database_url)
        if settings.migrate_on_start:
            await store.migrate()
        await store.start()
        hub = EventHub(default_buffer=settings.ws_buffer)
        metrics: Metrics = app.state.metrics
        host = SessionHost(store=store, registry=registry, hub=hub, settings=settings, on_event=metrics.on_event)
        metrics.bind(lambda: len(host.sessions), lambda: hub.subscriber_count)
        app.state.store, app.state.hub, app.state.host = store, hub, host
        try:
            await host.recover_all()
            logger.info("switchboard ready (%d live sessions)", len(host.sessions))
            yield
        finally:
            await host.aclose()
            await store.aclose()

    app = FastAPI(
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
    app.state.settings = settings
    app.state.registry = registry
    app.state.metrics = Metrics()
    problems.install(app)
    app.include_router(routes_sessions.router)
    app.include_router(routes_tools.router)
    app.include_router(routes_events.router)
    app.include_router(routes_health.router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    return app
