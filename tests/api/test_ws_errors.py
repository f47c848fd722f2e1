"""A WebSocket route that raises is closed with a code and logged with its ids: the error handlers are written for
HTTP requests and must not fail on a WebSocket (``'WebSocket' object has no attribute 'method'``)."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, WebSocket
from sqlalchemy import exc as sa_exc
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from switchboard.api import problems


def app_raising(exc: Exception) -> FastAPI:
    app = FastAPI()
    problems.install(app)

    @app.websocket("/v1/sessions/{sid}/events")
    async def stream(ws: WebSocket, sid: str) -> None:
        await ws.accept()
        raise exc

    return app


def closed_by(exc: Exception) -> int:
    with TestClient(app_raising(exc), raise_server_exceptions=False) as client:
        with client.websocket_connect("/v1/sessions/sess_1/events") as ws:
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_text()
    return closed.value.code


def test_a_database_outage_in_a_websocket_route_closes_it_1013_and_is_logged_with_the_session(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.WARNING, logger="switchboard")
    assert closed_by(ConnectionRefusedError(111, "Connection refused")) == problems.UNAVAILABLE_CLOSE
    records = [r for r in caplog.records if "the database is unavailable" in r.getMessage()]
    assert records and getattr(records[0], "sid", None) == "sess_1", caplog.text
    assert "/v1/sessions/sess_1/events" in records[0].getMessage()


def test_a_database_error_that_is_not_an_outage_closes_it_1011_and_is_logged_at_error(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.WARNING, logger="switchboard")
    error = sa_exc.IntegrityError("INSERT ...", {}, Exception("UNIQUE constraint failed"))
    assert closed_by(error) == problems.UNEXPECTED_CLOSE
    records = [r for r in caplog.records if "unhandled error" in r.getMessage()]
    assert records and records[0].levelno == logging.ERROR and getattr(records[0], "sid", None) == "sess_1"
