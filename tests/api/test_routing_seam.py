"""The routing seam knows every route about one session: each is served where its placement says
(api/cluster/routing.py), and a route added later is sent to the session's node unless it is declared otherwise."""

from __future__ import annotations

import pytest
from fastapi import APIRouter
from sqlalchemy import exc as sa_exc

from switchboard.api.app import create_app
from switchboard.api.cluster import routing
from switchboard.api.cluster.routing import PLACEMENTS, WS, Placement, placement_of, session_routes
from switchboard.control.settings import Settings

OWNER, READ, ANY = Placement.OWNER, Placement.OWNER_READ, Placement.ANYWHERE

# Decided for each route (a new route makes this test fail until its placement is decided here)
EXPECTED = {
    ("GET", "/v1/sessions/{sid}"): READ,
    ("DELETE", "/v1/sessions/{sid}"): OWNER,
    ("GET", "/v1/sessions/{sid}/chat"): ANY,
    ("POST", "/v1/sessions/{sid}/input"): OWNER,
    ("POST", "/v1/sessions/{sid}/say"): OWNER,
    ("POST", "/v1/sessions/{sid}/interrupt"): OWNER,
    ("POST", "/v1/sessions/{sid}/takeover"): OWNER,
    ("POST", "/v1/sessions/{sid}/takeover/say"): OWNER,
    ("DELETE", "/v1/sessions/{sid}/takeover"): OWNER,
    ("GET", "/v1/sessions/{sid}/speeches/{speech_id}"): READ,
    ("POST", "/v1/sessions/{sid}/tokens"): ANY,
    ("GET", "/v1/sessions/{sid}/export"): ANY,
    ("POST", "/v1/sessions/{sid}/coach"): OWNER,
    ("GET", "/v1/sessions/{sid}/scheduled"): ANY,
    ("GET", "/v1/sessions/{sid}/scheduled/{scheduled_id}"): ANY,
    ("DELETE", "/v1/sessions/{sid}/scheduled/{scheduled_id}"): OWNER,
    ("GET", "/v1/sessions/{sid}/tool-calls"): ANY,
    ("GET", "/v1/sessions/{sid}/tool-calls/{call_id}"): ANY,
    ("POST", "/v1/sessions/{sid}/tool-calls/{call_id}/cancel"): OWNER,
    ("POST", "/v1/sessions/{sid}/tool-calls/{call_id}/progress"): OWNER,
    ("POST", "/v1/sessions/{sid}/tool-calls/{call_id}/result"): OWNER,
    (WS, "/v1/sessions/{sid}/events"): ANY,
    (WS, "/v1/sessions/{sid}/media"): OWNER,
    ("GET", "/v1/sessions/{sid}/ag-ui"): ANY,
    ("POST", "/v1/sessions/{sid}/ag-ui"): ANY,
}


def _routes() -> dict[tuple[str, str], Placement]:
    app = create_app(Settings(database_url="sqlite+aiosqlite:///:memory:"))
    return {
        (method, route.template): placement_of(method, route.template)
        for route in session_routes(app.router)
        for method in route.methods
    }


def test_every_session_route_is_served_where_it_was_decided() -> None:
    assert _routes() == EXPECTED


def test_the_table_names_only_routes_that_exist() -> None:
    assert set(PLACEMENTS) <= set(_routes())


def test_a_route_added_later_goes_to_the_sessions_node_unless_declared() -> None:
    extra = APIRouter()

    @extra.post("/v1/sessions/{sid}/something-new")
    async def something_new(sid: str) -> None: ...

    app = create_app(Settings(database_url="sqlite+aiosqlite:///:memory:"))
    app.include_router(extra)
    found = {route.template: route.methods for route in session_routes(app.router)}
    assert found["/v1/sessions/{sid}/something-new"] == frozenset({"POST"})
    assert placement_of("POST", "/v1/sessions/{sid}/something-new") == OWNER


def test_the_seam_knows_the_credential_each_route_needs() -> None:
    app = create_app(Settings(database_url="sqlite+aiosqlite:///:memory:"))
    needs = {(sorted(r.methods)[0], r.template): r.needs.scope if r.needs else None for r in session_routes(app.router)}
    assert needs[("POST", "/v1/sessions/{sid}/input")] == "sessions:control"
    assert needs[("POST", "/v1/sessions/{sid}/tool-calls/{call_id}/result")] == "tools:report"
    assert needs[(WS, "/v1/sessions/{sid}/media")] == "media:connect"
    # every route the seam sends on is checked before it is: it knows what each one needs
    assert all(scope is not None for key, scope in needs.items() if EXPECTED[key] != ANY)


class _Unreachable:
    """A host whose database does not answer (a connection reset)."""

    def __init__(self, err: Exception) -> None:
        self.err = err
        self.store = self

    def live(self, sid: str) -> None:
        return None

    async def get_session(self, sid: str) -> None:
        raise self.err


async def test_the_seam_answers_that_the_database_is_unavailable_rather_than_failing() -> None:
    """Outside the routes, a database error would reach the client as a 500: the seam answers 503 instead (a chaos
    run saw 500s while PostgreSQL was reset)."""
    reset = sa_exc.OperationalError("SELECT", {}, ConnectionResetError("reset"), connection_invalidated=True)
    assert await routing._locate(_Unreachable(reset), "s1") is None  # type: ignore[arg-type]
    answer = routing.unavailable()
    assert answer.status_code == 503 and b"database_unavailable" in answer.body
    bad = sa_exc.ProgrammingError("SELECT", {}, Exception("no such column"))
    with pytest.raises(sa_exc.ProgrammingError):  # a bug is not an outage
        await routing._locate(_Unreachable(bad), "s1")  # type: ignore[arg-type]
