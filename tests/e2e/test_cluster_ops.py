"""Cluster operations with real nodes (two ``switchboard serve`` processes on PostgreSQL and a redis-server of the
test's own): the per-node metrics on /metrics, and the console's cluster panel and owner node in a real browser
(Debian's Chromium via Playwright), before and after the owner of a session is killed."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from .cluster_support import LEASE_S, RedisServer, cluster_node
from .console_support import create_session, launch_chromium, require_chromium, wait_until
from .server import Server
from .test_faults import PG_URL, pg_database

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """These tests run no event loop of their own (the servers are other processes; Playwright's sync API keeps one
    running in this thread, which the suite's async task check cannot share)."""


@contextlib.contextmanager
def database_url() -> Iterator[str]:
    """A fresh PostgreSQL database (``pg_database``, driven from synchronous code)."""
    loop = asyncio.new_event_loop()
    database = pg_database()
    try:
        name = loop.run_until_complete(database.__aenter__())
        try:
            yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
        finally:
            loop.run_until_complete(database.__aexit__(None, None, None))
    finally:
        loop.close()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Server, Server]]:
    redis = RedisServer(tmp_path)
    redis.start()
    try:
        with database_url() as url:
            a = cluster_node(tmp_path, url, "node-a", redis.url).start(timeout=60)
            b = cluster_node(tmp_path, url, "node-b", redis.url).start(timeout=60)
            try:
                yield a, b
            finally:
                a.kill()
                b.stop()
    finally:
        redis.stop()


def metrics(server: Server) -> dict[str, float]:
    """Every sample of /metrics, by its name and labels as printed."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def test_each_node_reports_its_sessions_forwards_adoptions_fencing_and_lease(nodes: tuple[Server, Server]) -> None:
    a, b = nodes
    with httpx.Client(base_url=a.url, timeout=20) as on_a, httpx.Client(base_url=b.url, timeout=20) as on_b:
        sid = create_session(on_a, [])
        assert on_a.get(f"/v1/sessions/{sid}").json()["owner_node"] == "node-a"
        for text in ("one", "two"):  # sent to b, run by a
            assert on_b.post(f"/v1/sessions/{sid}/input", json={"text": text}).status_code == 202
    on_a_metrics, on_b_metrics = metrics(a), metrics(b)
    assert on_a_metrics["switchboard_node_owned_sessions"] == 1
    assert on_b_metrics["switchboard_node_owned_sessions"] == 0
    assert on_b_metrics['switchboard_node_forwards_total{outcome="answered"}'] == 2
    assert on_b_metrics["switchboard_node_forward_seconds_count"] == 2
    assert 'switchboard_node_forwards_total{outcome="answered"}' not in on_a_metrics  # a ran them itself
    # counted by the node that answered the client, by its route template
    assert (
        on_b_metrics['switchboard_http_requests_total{method="POST",route="/v1/sessions/{sid}/input",status="202"}']
        == 2
    )
    # no `*_created` series, on any node
    assert not [name for name in (*on_a_metrics, *on_b_metrics) if name.split("{")[0].endswith("_created")]
    for node_metrics in (on_a_metrics, on_b_metrics):
        assert node_metrics["switchboard_node_fencing_refusals_total"] == 0
        assert node_metrics["switchboard_node_adoptions_total"] == 0
        assert node_metrics["switchboard_node_lease_renewals_failed_total"] == 0
        # the registration is the first renewal
        assert node_metrics["switchboard_node_lease_renew_seconds_count"] >= 1
        assert 0 < node_metrics["switchboard_node_lease_renew_seconds_sum"] < LEASE_S
    a.kill()
    wait_until(lambda: metrics(b)["switchboard_node_owned_sessions"] == 1, timeout=LEASE_S + 30, what="adoption")
    assert metrics(b)["switchboard_node_adoptions_total"] == 1


@pytest.fixture
def browser() -> Iterator[Any]:
    require_chromium()
    with launch_chromium() as b:
        yield b


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda err: errors.append(str(err)))
    pg.on("console", lambda msg: errors.append(msg.text) if "Content Security Policy" in msg.text else None)
    pg.set_default_timeout(15_000)
    try:
        yield pg
    finally:
        context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def node_row(page: Any, node_id: str) -> dict[str, str]:
    row = page.locator(f'#cluster-nodes tr[data-node-id="{node_id}"]')
    return {
        "state": row.locator(".node-state").inner_text(),
        "sessions": row.locator(".node-sessions").inner_text(),
        "heartbeat": row.locator(".node-heartbeat").inner_text(),
        "url": row.locator(".node-url").inner_text(),
    }


@pytest.mark.browser
def test_the_console_shows_the_cluster_and_each_sessions_node(nodes: tuple[Server, Server], page: Any) -> None:
    a, b = nodes
    with httpx.Client(base_url=a.url, timeout=20) as on_a:
        sid = create_session(on_a, [])
    page.goto(f"{b.url}/console/#session={sid}")  # the console of the node that does not run it
    page.wait_for_selector("#cluster:not([hidden])")
    page.wait_for_function("() => document.querySelectorAll('#cluster-nodes tr').length === 2")
    wait_until(lambda: node_row(page, "node-a")["sessions"] == "1", what="node-a's session count")
    row_a, row_b = node_row(page, "node-a"), node_row(page, "node-b")
    assert (row_a["state"], row_a["url"]) == ("live", a.url)
    assert (row_b["state"], row_b["sessions"], row_b["url"]) == ("live", "0", b.url)
    assert re.fullmatch(r"\d+s ago", row_a["heartbeat"]), row_a
    assert page.inner_text("#cluster-count") == "2 live"
    # the session's node: its row in the sessions table, and the session header
    session_row = page.locator(f'#sessions tr[data-session-id="{sid}"]')
    session_row.wait_for()
    assert session_row.locator("td.node").inner_text() == "node-a"
    assert page.is_visible('th[data-sort="owner_node"]')
    header_node = page.locator(".session-head dd.node")
    wait_until(lambda: header_node.inner_text() == "node-a", what="the header's node")

    # the owner dies: the panel shows it dead, and the session on the node that took it over
    a.kill()
    wait_until(lambda: node_row(page, "node-a")["state"] == "dead", timeout=LEASE_S + 30, what="node-a dead")
    wait_until(lambda: node_row(page, "node-b")["sessions"] == "1", what="node-b's session count")
    assert page.inner_text("#cluster-count") == "1 live"
    wait_until(lambda: header_node.inner_text() == "node-b", what="the header's new node")
    wait_until(lambda: session_row.locator("td.node").inner_text() == "node-b", what="the row's node")


@pytest.mark.browser
def test_a_single_node_console_shows_no_cluster(tmp_path: Path, page: Any) -> None:
    server = Server(tmp_path).start()
    try:
        with httpx.Client(base_url=server.url, timeout=20) as client:
            sid = create_session(client, [])
            nodes = client.get("/v1/cluster/nodes").json()["items"]
            assert [n["mode"] for n in nodes] == ["single"]
        page.goto(f"{server.url}/console/#session={sid}")
        page.locator(f'#sessions tr[data-session-id="{sid}"]').wait_for()
        # the panel asked the service and found no cluster: it stays hidden, and so does the node of each session
        page.wait_for_function("() => window.switchboard.cluster.nodes.size === 1")
        assert page.is_hidden("#cluster")
        assert not page.is_visible('th[data-sort="owner_node"]')
        assert not page.is_visible(".session-head dd.node")
    finally:
        server.stop()
