"""Liveness, readiness and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .deps import ServicesDep
from .guards import METRICS_SCOPE
from .openapi_doc import API_KEY, PUBLIC, security
from .problems import problem_responses
from .rate_limit import SharedRateLimits
from .schemas import Health

router = APIRouter(tags=["health"])

# what any route answers a request browsers must not make (``guards.BrowserGuard``): with auth off, a Host or an
# Origin that is not loopback nor allowed
REFUSED_BY_BROWSER_GUARD = (403, "host_not_allowed or origin_not_allowed: a Host or Origin this server does not serve")


@router.get(
    "/healthz",
    operation_id="healthz",
    response_model=Health,
    response_model_exclude_none=True,
    responses=problem_responses(REFUSED_BY_BROWSER_GUARD),
    openapi_extra=PUBLIC,
)
async def healthz() -> Health:
    """The process is up."""
    return Health(status="ok")


@router.get(
    "/readyz",
    operation_id="readyz",
    response_model=Health,
    responses={
        **problem_responses(REFUSED_BY_BROWSER_GUARD),
        503: {"model": Health, "description": "The database is unreachable, this node was fenced, or it is draining"},
    },
    openapi_extra=PUBLIC,
)
async def readyz(services: ServicesDep) -> Response:
    """The service can reach its database and still owns its sessions (a node that another instance took over
    answers 503 with why; a cluster node that is stopping answers 503 `draining`). In cluster mode, while Redis is
    down or does not answer it answers 200 with a `detail` saying so (degraded: streams read the database, rate limits
    are per node)."""
    lease = services.host.lease
    if lease is not None and lease.deposed is not None:
        body = Health(status="fenced", detail=lease.deposed).model_dump(exclude_none=True)
        return JSONResponse(body, status_code=503)
    if lease is not None and lease.draining:  # a load balancer sends this node nothing new
        draining = Health(status="draining", detail="stopping: handing its sessions to the other nodes")
        return JSONResponse(draining.model_dump(exclude_none=True), status_code=503, headers={"Retry-After": "1"})
    if await services.store.ping():
        fanout, limits = services.fanout, (services.writes, services.reads)
        degraded = (
            "degraded: redis unavailable; event streams read other nodes' events from the database (a little late), "
            "rate limits are each node's own, commands are unaffected, nothing is lost"
        )
        redis_down = fanout is not None and not fanout.available
        redis_down = redis_down or any(isinstance(x, SharedRateLimits) and not x.shared_available for x in limits)
        detail = degraded if redis_down else None
        return JSONResponse(Health(status="ok", detail=detail).model_dump(exclude_none=True))
    body = Health(status="unavailable", detail="database unreachable").model_dump(exclude_none=True)
    return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})


@router.get(
    "/metrics",
    operation_id="metrics",
    response_class=Response,
    responses={
        200: {"description": "The metrics", "content": {CONTENT_TYPE_LATEST.partition(";")[0]: {"schema": {}}}},
        **problem_responses(
            401, (403, "The credential lacks `metrics:read`, or host_not_allowed or origin_not_allowed")
        ),
    },
    openapi_extra=security({API_KEY: [METRICS_SCOPE]}),  # checked by ``guards.PrivatePaths``
)
async def metrics(services: ServicesDep) -> Response:
    """Prometheus metrics. Needs an API key with `metrics:read`, unless the server sets
    `SWITCHBOARD_PUBLIC_METRICS=true` (then no credential)."""
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
