"""The FastAPI application: ``create_app(settings)`` with a lifespan that builds and tears down in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.staticfiles import StaticFiles
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from starlette.routing import Route

from .. import __version__
from ..control import tracing
from ..control.alerts import AlertEngine, RetryPolicy
from ..control.cluster.drain import drain
from ..control.cluster.fanout import RedisFanout
from ..control.cluster.feed import ClusterFeed
from ..control.cluster.ownership import AnotherInstanceRunning, NodeLease
from ..control.cluster.shared_buckets import SharedBuckets, key_prefix
from ..control.database_wait import DatabaseWait
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
from . import asyncapi, docs_pages, openapi_doc, problems, routes_agents, routes_alerts, routes_health
from .cluster import routes as cluster_routes
from .cluster.forward import ForwardedGuard, SessionElsewhere, forward
from .cluster.routing import OwnerRouting
from .connections import ConnectionGate, ConnectionLimits
from .deps import Services, services
from .guards import BrowserGuard, JsonBodies, PrivatePaths, SecurityHeaders
from .limits import BodyLimit, RequestDeadline
from .mcp.server import PATH as MCP_PATH
from .mcp.server import McpService
from .media import routes as media_routes
from .media.budget import TranscriptBudget
from .rate_limit import RateLimiter, SharedRateLimits
from .request_metrics import RequestMetrics
from .sessions import export as session_export
from .sessions import routes as session_routes
from .sessions import scheduled as session_scheduled
from .sessions import takeover as session_takeover
from .sessions.export_budget import ExportBudget
from .streams import agui_routes, agui_runs
from .streams import events as event_routes
from .streams.stream_slots import StreamSlots
from .tools import reports as tool_reports
from .tools import routes as tool_routes
from .traces import CommandSpans

logger = logging.getLogger("switchboard.api.app")

CONSOLE_DIR = Path(__file__).parent.parent / "console"

DESCRIPTION = """Control plane for live AI agent sessions: inject input, interrupt speech, watch tool progress,
cancel tools. Errors are `application/problem+json`. Every POST accepts an `Idempotency-Key` header.
Credentials: an API key, or for one session's reads and streams a session token, as `Authorization: Bearer`; each
operation says which and the scope it needs. `/healthz` and `/readyz` need none, nor do these docs unless the server
sets `SWITCHBOARD_PUBLIC_DOCS=false`."""

# the document is served by the server it describes (so `/docs` calls the server it came from); a client generated
# from the committed copy is given the server's address, by default this one
SERVERS: list[dict[str, Any]] = [
    {"url": "/", "description": "The server serving this document"},
    {
        "url": "http://{host}",
        "description": "A Switchboard server (default: its own default address)",
        "variables": {"host": {"default": "127.0.0.1:8080", "description": "Host and port"}},
    },
]


IDEMPOTENCY_PURGE_EVERY_S = 3600.0
# The backstop deadline on every HTTP request; routes that wait on the runtime bound that wait by request_timeout_s
# themselves (deps.deadline), so this one fires only for what they do not cover (store reads, idempotency records).
REQUEST_DEADLINE_GRACE_S = 1.0
IDLE_IN_TRANSACTION_MIN_MS = 1000


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


async def _expire_sessions(host: SessionHost, store: Store, settings: Settings) -> None:
    """Close sessions idle for ``idle_timeout_s`` and delete ended ones after ``closed_retention_s`` (0 turns either
    off), every ``housekeeping_interval_s``."""
    while True:
        await asyncio.sleep(settings.housekeeping_interval_s)
        try:
            if settings.idle_timeout_s:
                await host.close_idle(settings.idle_timeout_s)
            if settings.closed_retention_s:
                cutoff = datetime.now(UTC) - timedelta(seconds=settings.closed_retention_s)
                purged = await store.purge_ended_sessions(cutoff)
                if purged:
                    logger.info("deleted %d session(s) ended before %s", len(purged), cutoff.isoformat())
        except Exception:
            logger.exception("session housekeeping failed; will retry")


def _rate_limits(settings: Settings, metrics: Metrics, door: str, rate_per_s: float, burst: float) -> RateLimiter:
    """Each node's own buckets; in cluster mode the cluster's, in Redis (the node's own while Redis is away), under a
    prefix of their own for each door but commands (whose keys predate the others)."""
    if not settings.redis_url or rate_per_s <= 0:
        return RateLimiter(rate_per_s=rate_per_s, burst=burst)
    shared = SharedBuckets(
        settings.redis_url,
        rate_per_s=rate_per_s,
        burst=burst,
        prefix=key_prefix(settings.database_url) + ("" if door == "commands" else f"{door}:"),
        timeout_s=settings.rate_limit_redis_timeout_s,
    )
    return SharedRateLimits(shared, door=door, on_fallback=metrics.rate_limit_fallbacks.inc)


def _transcript_budget(settings: Settings, metrics: Metrics) -> TranscriptBudget:
    """Media edges' transcripts, their characters, per caller (``media.budget``)."""
    rate = settings.media_transcript_chars_per_s
    return TranscriptBudget(_rate_limits(settings, metrics, "media", rate, 2 * rate))


def _alert_engine(host: SessionHost, store: Store, settings: Settings, metrics: Metrics, node_id: str) -> AlertEngine:
    """The alerts of the sessions this node runs, sent to the configured sinks (``control.alerts``)."""
    policy = RetryPolicy(
        max_attempts=settings.alert_max_attempts,
        backoff_s=settings.alert_backoff_s,
        backoff_max_s=settings.alert_backoff_max_s,
        queue_max=settings.alert_queue_max,
    )
    return AlertEngine(
        store=store,
        tracker=host.attention,
        sessions=host.sessions,
        node_id=node_id,
        sinks=settings.alert_sinks,
        policy=policy,
        interval_s=settings.alert_interval_s,
        observer=metrics,
        store_unavailable=lambda: store.writer.unavailable,
    )


def create_app(
    settings: Settings | None = None,
    *,
    registry: AgentRegistry | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> FastAPI:
    """The service. ``tracer_provider``: where its spans go (default: as the ``OTEL_*`` variables say, if at all)."""
    settings = settings or Settings()
    own_provider = tracer_provider is None
    if tracer_provider is None:
        tracer_provider = tracing.configure()  # ValueError (an exporter that is not installed): it does not start
    traces = tracing.Tracing(tracer_provider) if tracer_provider is not None else None
    registry = registry or AgentRegistry.load(settings.agents, builtin=DEMO_AGENTS if settings.demo_agents else None)
    webhooks = Webhooks(max_response_bytes=settings.max_webhook_response_bytes, report_secret=settings.token_secret)
    if traces is not None:
        webhooks.trace_headers = traces.call_headers
    metrics = Metrics()
    # connections before their request (slow headers, many connections): `switchboard serve` hands it to uvicorn
    limits = ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        per_client=settings.connections_per_client,
        pending=settings.max_pending_connections,
    )
    gate = ConnectionGate(limits, on_close=metrics.connection_closed)
    metrics.bind_connections(lambda: len(gate.pending))
    # ValueError: the service does not start
    models = ModelProfiles(settings.models, sessions_may_script=settings.sessions_may_script)
    # agent name -> the model a session of that agent uses when it gives none: the built-in agents' own, and those an
    # agents file declares (its agents cannot take a built-in agent's name)
    default_llms: dict[str, dict[str, Any]] = dict(DEMO_LLMS) if settings.demo_agents else {}
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
        # a transaction left idle half a lease is a frozen process's: its locks must not outlive its lease
        idle_ms = max(IDLE_IN_TRANSACTION_MIN_MS, int(settings.effective_lease_s * 500))
        store = Store.from_url(
            settings.database_url, idle_in_transaction_ms=idle_ms, timeout_s=settings.database_timeout_s
        )
        # a start that overlaps a database outage waits for it (DATABASE_WAIT_S), at each step below
        wait = app.state.database_wait = DatabaseWait(settings.database_wait_s)
        lease = NodeLease(store, settings)
        try:
            if settings.migrate_on_start:
                await wait.retry("migrating the database", store.migrate)
            await lease.start(wait)
        except BaseException as err:
            if isinstance(err, AnotherInstanceRunning):  # the service does not start: say why on one line
                logger.error("not starting: %s", err)
            await store.aclose()
            raise
        store.writer.on_commit = metrics.on_store_commit
        store.writer.ordered_events = settings.cluster_mode  # the multi-session stream's cursor, across nodes
        await store.start()
        hub = EventHub(default_buffer=settings.ws_buffer)
        fanout = (
            RedisFanout(
                settings.redis_url,
                hub,
                lease.node_id,
                database_url=settings.database_url,
                # a loopback cluster may run without a cluster secret; never without a shared token secret
                secret=settings.cluster_secret or settings.token_secret,
            )
            if settings.redis_url
            else None
        )
        # a forwarded command gets the owner's whole deadline (its backstop included) before this node gives up on it
        forwarder = httpx.AsyncClient(timeout=settings.request_timeout_s + REQUEST_DEADLINE_GRACE_S + 1.0)
        host = SessionHost(
            store=store,
            registry=registry,
            hub=hub,
            settings=settings,
            on_event=metrics.on_event,
            default_llms=default_llms,
            models=models,
            lease=lease,
            on_durable=fanout.on_durable if fanout is not None else None,
            model_observer=metrics,
            wrap_sink=traces.sink if traces is not None else None,
            wrap_llm=traces.wrap_llm if traces is not None else None,
        )
        writes = _rate_limits(settings, metrics, "commands", settings.write_rate_per_s, settings.write_burst)
        reads = _rate_limits(settings, metrics, "reads", settings.read_rate_per_s, settings.read_burst)
        transcripts = _transcript_budget(settings, metrics)
        exports = ExportBudget(
            max_running=settings.export_max,
            max_per_caller=settings.export_max_per_key,
            bytes_per_s=settings.export_bytes_per_s,
        )
        metrics.bind(lambda: len(host.sessions), lambda: hub.subscriber_count)
        metrics.bind_node(host)
        metrics.bind_attention(host, [sink.name for sink in settings.alert_sinks])
        app.state.services = Services(
            settings=settings,
            store=store,
            hub=hub,
            host=host,
            webhooks=webhooks,
            metrics=metrics,
            streams=StreamSlots(
                per_process=settings.ws_max_streams,
                per_credential=settings.ws_max_streams_per_credential,
                reserve=settings.operator_stream_reserve,
            ),
            writes=writes,
            reads=reads,
            exports=exports,
            transcripts=transcripts,
            forwarder=forwarder,
            fanout=fanout,
        )
        tasks = [asyncio.create_task(_purge_idempotency_keys(store, settings), name="idempotency-purge")]
        feed = ClusterFeed(store, hub, redis_up=lambda: fanout.available) if fanout is not None else None
        if fanout is not None and feed is not None:
            fanout.on_wake = host.wake_adopt
            fanout.start()
            await wait.retry("reading the cluster's event position", feed.start)
            metrics.bind_cluster(fanout, feed)
        if settings.cluster_mode:  # run by `switchboard serve` on SIGTERM while it still serves HTTP
            wake = fanout.wake_adopters if fanout is not None else None
            app.state.drain = lambda: drain(host, wake=wake, timeout_s=settings.drain_timeout_s)
        try:
            await wait.retry("recovering the sessions", host.recover_all)
            tasks.append(asyncio.create_task(_expire_sessions(host, store, settings), name="session-expiry"))
            # take over the sessions of nodes that die (cluster mode); retry a session whose recovery failed (both)
            adopt = host.adopt_forever(lease.lease_s / 2, claim=settings.cluster_mode)
            tasks.append(asyncio.create_task(adopt, name="adopt"))
            if settings.alert_sinks:
                host.alerts = _alert_engine(host, store, settings, metrics, lease.node_id)
                host.alerts.start()
            logger.info("switchboard ready (%d live sessions)", len(host.sessions))
            logger.info("agents: %s", ", ".join(registry.names()))
            logger.info("operator console: http://%s:%d/console/", settings.host, settings.port)
            async with mcp.run():  # ends first: no tool call is made of a service being torn down
                yield
        finally:
            await cancel_and_wait(*tasks)
            if host.alerts is not None:
                await host.alerts.aclose()
            await host.aclose()
            await webhooks.aclose()
            await forwarder.aclose()
            exports.close()
            for limits in (reads, writes, transcripts.limiter):
                if isinstance(limits, SharedRateLimits):
                    await limits.aclose()
            if feed is not None:
                await feed.aclose()
            if fanout is not None:
                await fanout.aclose()
            await store.writer.aclose()  # every write durable before the node says it stopped (its sessions free)
            await lease.aclose()
            await store.aclose()
            if own_provider and isinstance(tracer_provider, SdkTracerProvider):
                tracer_provider.shutdown()  # exports what is still batched

    app = openapi_doc.SwitchboardAPI(
        title="Switchboard",
        version=__version__,
        description=DESCRIPTION,
        license_info={"name": "Apache-2.0", "identifier": "Apache-2.0"},
        servers=SERVERS,
        lifespan=lifespan,
        docs_url=None,  # docs_pages serves /docs from this origin (FastAPI's pages load it from a CDN)
        redoc_url=None,
        openapi_tags=[
            {"name": "sessions", "description": "Live sessions and operator commands"},
            {"name": "tools", "description": "Tool calls: list, read, cancel"},
            {"name": "agents", "description": "The agents sessions can run, their tools and models"},
            {"name": "events", "description": "WebSocket event streams"},
            {"name": "health", "description": "Liveness, readiness, metrics"},
            {"name": "cluster", "description": "The nodes serving this database"},
        ],
    )
    problems.install(app)
    app.state.connection_gate = gate
    # MCP clients: each tool call is its REST request, made through this application (``mcp.server``)
    mcp = McpService(app, max_text_chars=settings.max_text_chars)

    @app.exception_handler(SessionElsewhere)
    async def _elsewhere(request: Request, exc: SessionElsewhere) -> Response:
        found = services(request)
        return await forward(
            request, exc, found.forwarder, found.settings.cluster_secret, count=found.metrics.on_forward
        )

    routers = (
        session_routes,
        session_takeover,
        session_scheduled,
        session_export,
        tool_routes,
        tool_reports,
        routes_agents,
        routes_alerts,
        cluster_routes,
    )
    for router in (module.router for module in routers):
        app.include_router(router, responses=problems.problem_responses(*problems.API_ERRORS))
    app.include_router(event_routes.router)
    app.include_router(media_routes.router)
    app.include_router(agui_routes.router, responses=problems.problem_responses(*problems.API_ERRORS))
    app.include_router(agui_runs.router, responses=problems.problem_responses(*problems.API_ERRORS))
    app.include_router(routes_health.router)
    app.include_router(asyncapi.router)  # GET /asyncapi.json, like /openapi.json: outside the schema
    docs_pages.mount(app)
    # stateless: no stream to GET (405, as the transport allows), no session to DELETE
    app.router.routes.append(Route(MCP_PATH, mcp, methods=["POST"], include_in_schema=False))
    # the operator console: static ES modules, a pure client of the public API (/console redirects to /console/)
    app.mount("/console", StaticFiles(directory=CONSOLE_DIR, html=True), name="console")
    # added first, so inside BodyLimit: the deadline counts handling time, not the time the body takes to arrive
    app.add_middleware(RequestDeadline, timeout_s=settings.request_timeout_s + REQUEST_DEADLINE_GRACE_S)
    app.add_middleware(JsonBodies)  # inside BodyLimit: an oversize body is a 413 whatever its type
    # every request about one session reaches the node that runs it (cluster mode); inside BodyLimit (a forwarded body
    # is bounded), outside the deadline (the owner's own deadline bounds a forwarded command)
    if settings.cluster_mode:  # a layer that would pass every request on costs each request a call and its frames
        app.add_middleware(OwnerRouting, router=app.router, enabled=True)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        read_timeout_s=settings.body_read_timeout_s,
        body_timeout_s=settings.body_timeout_s,
    )
    app.state.tracing = traces
    if settings.auth_enabled:  # with auth off every path is public
        app.add_middleware(PrivatePaths, settings=settings)
    app.add_middleware(ForwardedGuard, cluster_mode=settings.cluster_mode, secret=settings.cluster_secret)
    # outermost: a request browsers must not make is refused before anything else; every answer gets the headers
    app.add_middleware(BrowserGuard, settings=settings)
    app.add_middleware(SecurityHeaders)
    if traces is not None:  # outside all: a refused command is a span too
        app.add_middleware(CommandSpans, tracer=traces.tracer)
    # outermost: every answer counted, timed and logged, a refusal by any middleware too
    app.add_middleware(RequestMetrics, metrics=metrics, router=app.router)
    return app
