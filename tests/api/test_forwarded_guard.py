"""Node-to-node calls: the header that marks a request as forwarded by another node is a privilege (placement and
loop checks trust it), so a node refuses it unless it carries this cluster's secret."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from switchboard.api.cluster.forward import FORWARDED_HEADER, ForwardedGuard
from switchboard.api.problems import problem_response
from switchboard.control.settings import Settings
from tests.log_capture import service_log

from .conftest import Api

SECRET = "s" * 40


async def test_a_node_not_in_cluster_mode_refuses_every_forwarded_request(api: Api):
    for value in ("loopback", "", SECRET):
        r = await api.client.post("/v1/sessions", json={"agent": "tester"}, headers={FORWARDED_HEADER: value})
        assert r.status_code == 403, r.text
        assert r.json()["code"] == "forward_unauthenticated"
    r = await api.client.post("/v1/sessions", json={"agent": "tester"})
    assert r.status_code == 201, r.text


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await problem_response(200, "ok")(scope, receive, send)


@pytest.mark.parametrize(
    ("secret", "sent", "status"),
    [
        (SECRET, SECRET, 200),
        (SECRET, None, 200),  # not forwarded: an ordinary client request, authenticated as usual
        (SECRET, "", 403),
        (SECRET, "loopback", 403),
        (SECRET, SECRET[:-1] + "x", 403),
        (None, "loopback", 200),  # a cluster on loopback only, without a secret
        (None, SECRET, 403),
    ],
)
async def test_a_cluster_node_takes_a_forwarded_request_only_with_the_cluster_secret(
    secret: str | None, sent: str | None, status: int
):
    guard = ForwardedGuard(_ok, cluster_mode=True, secret=secret)
    headers = {FORWARDED_HEADER: sent} if sent is not None else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://test") as client:
        r = await client.post("/v1/sessions/s/input", json={}, headers=headers)
    assert r.status_code == status, r.text


@pytest.mark.parametrize(
    ("cluster_mode", "sent", "passed"),
    [
        (True, SECRET, True),
        (True, None, True),  # an edge connecting itself
        (True, "", False),
        (True, SECRET[:-1] + "x", False),
        (False, SECRET, False),  # a node not in cluster mode takes no relayed connection
    ],
)
async def test_a_relayed_websocket_is_taken_only_with_the_cluster_secret(
    cluster_mode: bool, sent: str | None, passed: bool
):
    """A media edge relayed by another node carries the header too: without the secret the connection is accepted
    and closed with 4403 before the route sees it."""
    reached: list[str] = []

    async def route(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    sent_messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent_messages.append(message)

    headers = [(FORWARDED_HEADER.encode(), sent.encode())] if sent is not None else []
    scope = {"type": "websocket", "path": "/v1/sessions/s/media", "headers": headers, "client": ("10.0.0.9", 5000)}
    await ForwardedGuard(route, cluster_mode=cluster_mode, secret=SECRET)(scope, receive, send)
    if passed:
        assert reached == ["/v1/sessions/s/media"] and sent_messages == []
    else:
        assert reached == []
        assert sent_messages == [
            {"type": "websocket.accept"},
            {"type": "websocket.close", "code": 4403, "reason": "forward_unauthenticated"},
        ]


@pytest.mark.parametrize("keys", [False, True])
def test_a_loopback_cluster_with_api_keys_needs_the_secret(keys: bool):
    """Without a secret, the forwarded mark's value is a known word ("loopback"): with auth off every caller may do
    everything anyway, but with API keys a key holder on the machine could claim a forward and skip the rate limit
    charged where a command arrives. So a cluster with keys does not start without the secret, even on loopback."""
    given: dict[str, Any] = {
        "database_url": "postgresql+asyncpg://postgres@127.0.0.1:5432/test",
        "redis_url": "redis://127.0.0.1:6379/0",
        "host": "127.0.0.1",
        "token_secret": "t" * 32,
    }
    if keys:
        given["api_keys"] = [{"key": "k" * 32, "scopes": ["sessions:read"]}]
    settings = Settings(**given)
    if not keys:
        settings.check_cluster()  # auth off: the loopback word is enough
        return
    with pytest.raises(ValueError, match="SWITCHBOARD_CLUSTER_SECRET"):
        settings.check_cluster()
    Settings(**given, cluster_secret=SECRET).check_cluster()


async def test_a_refused_forwarded_request_is_logged_on_one_line_as_sent():
    """The refusal's log line names the path as the client sent it: a ``%0A`` in it is not decoded into a second,
    forged log line (nor into an escaped newline that hides what was sent)."""
    guard = ForwardedGuard(_ok, cluster_mode=True, secret=SECRET)
    forged = "%0A2026-01-01%2000:00:00,000%20ERROR%20switchboard:%20forged"
    with service_log() as out:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://test") as client:
            r = await client.get(f"/v1/sessions/s{forged}?q=1%0D%0Ax", headers={FORWARDED_HEADER: "wrong"})
    assert r.status_code == 403
    lines = out.getvalue().splitlines()  # the test client's own request lines too
    assert not any(line.startswith(("2026-01-01", "x")) for line in lines), lines
    refusals = [line for line in lines if "refused a forwarded" in line]
    assert len(refusals) == 1, lines
    assert f"refused a forwarded GET /v1/sessions/s{forged}?q=1%0D%0Ax from " in refusals[0]
