"""What a cluster does as one, with real nodes on loopback, PostgreSQL and a Redis of the tests' own: a key's
write and read rate limits hold across the nodes (a command forwarded to its session's node, or a read asked of it,
costs one token, where it arrived), and fall back to each node's own buckets while Redis is down; a key's session
quota is counted once for the whole cluster; the attention list is every node's, from any node, and a node that does
not answer in time is named."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchboard.api.cluster.attention import ATTENTION_TIMEOUT_S, MISSING_NODES_HEADER
from switchboard.client import AsyncClient
from tests.waiting import WAIT_S

from .cluster_support import FORWARDED, LEASE_S, SECRET, RedisServer, cluster_node, start_all, until
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]

SCOPES = ["sessions:read", "sessions:write", "sessions:control", "metrics:read"]
SETUP, SPREAD, ALONE = ("setup-key-" + "s" * 16, "spread-key-" + "p" * 16, "alone-key-" + "a" * 16)
KEYS = json.dumps([{"key": key, "scopes": SCOPES} for key in (SETUP, SPREAD, ALONE)])
BURST = 4
FROZEN_LEASE_S = 45.0  # the attention test's nodes: longer than its frozen-node part takes on a loaded machine
LIMITS = {
    "SWITCHBOARD_WRITE_RATE_PER_S": "0.01",  # no refill in a test
    "SWITCHBOARD_WRITE_BURST": str(BURST),
    # Redis answering within the default 50 ms is not something a loaded machine promises: a late answer falls back to
    # the node's own bucket (a fifth command accepted); the fallback itself is tested with Redis stopped
    "SWITCHBOARD_RATE_LIMIT_REDIS_TIMEOUT_S": "5",
}

READ_LIMITS = {
    "SWITCHBOARD_READ_RATE_PER_S": "0.01",
    "SWITCHBOARD_READ_BURST": str(BURST),
    "SWITCHBOARD_RATE_LIMIT_REDIS_TIMEOUT_S": "5",
}


def _nodes(tmp_path: Path, database_url: str, redis: RedisServer, names: str = "abc", **env: str) -> list[Server]:
    return [
        cluster_node(
            tmp_path,
            database_url,
            f"node-{x}",
            redis.url,
            SWITCHBOARD_CLUSTER_SECRET=SECRET,
            SWITCHBOARD_API_KEYS=KEYS,
            **env,
        )
        for x in names
    ]


def _auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


async def _pinned(http: httpx.AsyncClient, node: Server, node_id: str, turns: list[dict[str, Any]]) -> str:
    """A session on ``node``: a request forwarded by a node is placed where it arrives (and was charged there)."""
    llm = {"provider": "scripted", "turns": turns, "fallback": {"text": "Noted."}}
    body = {"agent": "tester", "llm": llm}
    r = await http.post(f"{node.url}/v1/sessions", json=body, headers=_auth(SETUP, **{FORWARDED: SECRET}))
    assert r.status_code == 201, r.text
    assert r.json()["owner_node"] == node_id
    return str(r.json()["id"])


async def _say(http: httpx.AsyncClient, node: Server, sid: str, key: str) -> httpx.Response:
    return await http.post(f"{node.url}/v1/sessions/{sid}/say", json={"text": "Hi."}, headers=_auth(key))


def _limited(r: httpx.Response) -> bool:
    return r.status_code == 429 and r.json()["code"] == "rate_limited" and 1 <= int(r.headers["retry-after"]) <= 100


async def _metric(http: httpx.AsyncClient, node: Server, name: str) -> float:
    text = (await http.get(f"{node.url}/metrics", headers=_auth(SETUP))).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def test_a_key_is_limited_once_across_the_nodes_and_per_node_while_redis_is_down(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    """A key's burst spread over three nodes is spent once: `burst` commands in all, whichever node they reach and
    whether or not they are forwarded to the session's node (charged where they arrive, not again there). With
    Redis gone each node limits on its own, still charging a forwarded command once."""
    nodes = _nodes(tmp_path, database_url, redis, **LIMITS)
    a, b, c = nodes
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            on_a = await _pinned(http, a, "node-a", [])
            on_b = await _pinned(http, b, "node-b", [])
            # forwarded (b -> a, c -> a), at the owner (a, b): one token each, from the one bucket
            spread = [(b, on_a), (c, on_a), (a, on_a), (b, on_b)]
            answers = [await _say(http, node, sid, SPREAD) for node, sid in spread]
            assert [r.status_code for r in answers] == [202] * BURST, [r.text for r in answers]
            for node, sid in [(c, on_b), (a, on_a), (b, on_b), (c, on_a)]:
                r = await _say(http, node, sid, SPREAD)
                assert _limited(r), r.text
            assert await _metric(http, a, "switchboard_rate_limit_local_fallbacks_total") == 0

            redis.stop()  # the test's own redis-server
            # each node on its own: b's bucket pays for what b forwards to a, and a's is untouched by it
            answers = [await _say(http, b, on_a, ALONE) for _ in range(BURST)]
            assert [r.status_code for r in answers] == [202] * BURST, [r.text for r in answers]
            assert _limited(await _say(http, b, on_a, ALONE))
            answers = [await _say(http, a, on_a, ALONE) for _ in range(BURST)]
            assert [r.status_code for r in answers] == [202] * BURST, [r.text for r in answers]
            assert _limited(await _say(http, a, on_a, ALONE))
            assert (await _say(http, c, on_a, SPREAD)).status_code == 202  # c's own bucket: per node now
            assert await _metric(http, a, "switchboard_rate_limit_local_fallbacks_total") >= BURST
            ready = (await http.get(f"{a.url}/readyz")).json()
            assert ready["status"] == "ok" and "rate limits are each node's own" in ready["detail"], ready
    finally:
        for node in nodes:
            node.stop()


async def test_a_keys_reads_are_limited_once_across_the_nodes(tmp_path: Path, database_url: str, redis: RedisServer):
    """Reads have a budget of their own, the cluster's like commands': a read that reaches a node other than its
    session's, and is asked of the owner there (the session itself), costs one token where it arrived."""
    nodes = _nodes(tmp_path, database_url, redis, names="ab", **READ_LIMITS)
    a, b = nodes
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            on_a = await _pinned(http, a, "node-a", [])

            async def read(node: Server, path: str) -> httpx.Response:
                return await http.get(f"{node.url}/v1/sessions/{on_a}{path}", headers=_auth(SPREAD))

            # asked of the owner (b -> a), at the owner, from the database anywhere: one token each
            answers = [await read(node, path) for node, path in [(b, ""), (a, ""), (b, "/chat"), (a, "/chat")]]
            assert [r.status_code for r in answers] == [200] * BURST, [r.text for r in answers]
            for node, path in [(b, ""), (a, ""), (b, "/chat"), (a, "/tool-calls")]:
                r = await read(node, path)
                assert _limited(r) and "reads" in r.json()["detail"], r.text
            assert (await _say(http, b, on_a, SPREAD)).status_code == 202  # commands have their own budget
            assert (await http.get(f"{b.url}/v1/sessions/{on_a}", headers=_auth(ALONE))).status_code == 200
    finally:
        for node in nodes:
            node.stop()


QUOTA = 3


async def _create_on(http: httpx.AsyncClient, node: Server, key: str) -> httpx.Response:
    """A create placed on ``node`` (as forwarded there: the least-loaded node would otherwise be chosen)."""
    body = {"agent": "tester", "llm": {"provider": "scripted", "turns": []}}
    return await http.post(f"{node.url}/v1/sessions", json=body, headers=_auth(key, **{FORWARDED: SECRET}))


def _over_quota(r: httpx.Response) -> bool:
    return r.status_code == 429 and r.json()["code"] == "session_quota_exceeded" and "retry-after" in r.headers


async def _created(http: httpx.AsyncClient, nodes: list[Server], key: str) -> list[str]:
    """One create by ``key`` on each of ``nodes`` in turn: the ids of the sessions made."""
    made = []
    for node in nodes:
        r = await _create_on(http, node, key)
        assert r.status_code == 201, r.text
        made.append(str(r.json()["id"]))
    return made


async def _close_all(http: httpx.AsyncClient, node: Server, sids: list[str]) -> None:
    for sid in sids:  # through one node: forwarded to each session's own
        r = await http.delete(f"{node.url}/v1/sessions/{sid}", headers=_auth(SPREAD))
        assert r.status_code == 204, r.text


async def test_a_key_runs_its_session_quota_once_across_the_nodes(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    """A key's `MAX_SESSIONS_PER_KEY` live sessions are counted over the whole cluster, not on each node: creates
    spread over two nodes stop at the quota, and so do creates fired at both nodes at once. A closed session frees
    its place on any node, another key has its own quota, and the sessions of a killed node, adopted by the other,
    still count once."""
    nodes = _nodes(tmp_path, database_url, redis, "ab", SWITCHBOARD_MAX_SESSIONS_PER_KEY=str(QUOTA))
    a, b = nodes
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            spread = await _created(http, [a, b, a], SPREAD)
            for node in (b, a):
                r = await _create_on(http, node, SPREAD)
                assert _over_quota(r), r.text
            assert (await _create_on(http, b, ALONE)).status_code == 201  # its own quota

            await _close_all(http, b, spread[:1])  # a's session, closed through b
            spread[:1] = await _created(http, [b], SPREAD)
            assert _over_quota(await _create_on(http, a, SPREAD))

            for _ in range(3):  # fired at both nodes at once: the quota, not the quota on each
                await _close_all(http, a, spread)
                answers = await asyncio.gather(*(_create_on(http, node, SPREAD) for node in [a, b] * 2 * QUOTA))
                made = [r for r in answers if r.status_code == 201]
                assert len(made) == QUOTA, [(r.status_code, r.text) for r in answers]
                assert all(_over_quota(r) for r in answers if r.status_code != 201), [r.text for r in answers]
                spread = [str(r.json()["id"]) for r in made]

            await _close_all(http, a, spread)
            on_a = await _created(http, [a, a], SPREAD)
            spread = on_a + await _created(http, [b], SPREAD)
            a.kill()
            for sid in on_a:
                await until(lambda sid=sid: _owned_by(http, b, sid, "node-b"), timeout_s=LEASE_S + 40)
            assert _over_quota(await _create_on(http, b, SPREAD))  # adopted: still counted, once
            await _close_all(http, b, spread[:1])
            assert (await _create_on(http, b, SPREAD)).status_code == 201
            assert _over_quota(await _create_on(http, b, SPREAD))
    finally:
        for node in nodes:
            node.stop()


async def _owned_by(http: httpx.AsyncClient, node: Server, sid: str, owner: str) -> bool:
    found = (await http.get(f"{node.url}/v1/sessions/{sid}", headers=_auth(SPREAD))).json()
    return bool(found["owner_node"] == owner and found["state"] == "active")


async def _attention(http: httpx.AsyncClient, node: Server, **params: str) -> httpx.Response:
    r = await http.get(f"{node.url}/v1/sessions", params={"attention": "true", **params}, headers=_auth(SETUP))
    assert r.status_code == 200, r.text
    return r


def _ids(r: httpx.Response) -> list[str]:
    return [s["id"] for s in r.json()["items"]]


async def test_every_node_answers_the_attention_list_of_the_whole_cluster(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    """Sessions that need an operator on two nodes are listed by each of the three, the longest waiting first; a
    node frozen (SIGSTOP) is left out within the timeout and named in the answer, by the typed client (the page's
    ``missing_nodes``) and by ``switchboard attention`` (a warning on stderr).

    The frozen node is named only while its lease holds: once it lapses, another node adopts its sessions. Three
    requests and a command-line process take longer than ``LEASE_S`` on a loaded machine, so these nodes hold a lease
    that outlasts that part of the test."""
    nodes = _nodes(tmp_path, database_url, redis, SWITCHBOARD_LEASE_S=str(FROZEN_LEASE_S))
    a, b, c = nodes
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            failing = [{"error": "upstream 502"}]
            first = await _pinned(http, a, "node-a", failing)
            second = await _pinned(http, b, "node-b", failing)
            await _pinned(http, c, "node-c", [])  # calm
            for sid in (first, second):  # through another node each: forwarded to the owner
                r = await http.post(f"{c.url}/v1/sessions/{sid}/input", json={"text": "hi"}, headers=_auth(SETUP))
                assert r.status_code == 202, r.text

                async def listed(sid: str = sid) -> bool:
                    return sid in _ids(await _attention(http, c))

                await until(listed)
            for node in nodes:
                r = await _attention(http, node)
                assert _ids(r) == [first, second], (node.url, r.text)
                assert MISSING_NODES_HEADER.lower() not in r.headers
                assert [s["owner_node"] for s in r.json()["items"]] == ["node-a", "node-b"]
                assert r.json()["items"][0]["attention"][0]["code"] == "generation_failed"
            assert _ids(await _attention(http, a, agent="tester", limit="1")) == [first]
            assert _ids(await _attention(http, b, agent="someone-else")) == []

            assert b.proc is not None
            b.proc.send_signal(signal.SIGSTOP)
            try:
                frozen_at = started = time.monotonic()
                r = await _attention(http, c)
                took = time.monotonic() - started
                assert _ids(r) == [first] and r.headers[MISSING_NODES_HEADER] == "node-b", (r.headers, r.text)
                # waiting for the frozen node would take the forwarder's whole timeout (the request deadline + 2 s)
                assert took < ATTENTION_TIMEOUT_S + 5, took
                # the typed client and the CLI say so too, while the frozen node's lease holds
                async with AsyncClient(c.url, api_key=SETUP) as sb:
                    page, cli = await asyncio.gather(sb.list_sessions(attention=True), _attention_cli(c))
                assert [s.id for s in page.items] == [first] and page.missing_nodes == ["node-b"]
                assert cli.returncode == 0 and cli.stdout.startswith("SESSION"), cli.stderr
                assert first in cli.stdout and second not in cli.stdout
                assert cli.stderr == "switchboard: not answering: node-b — their sessions are not listed\n"
                assert time.monotonic() - frozen_at < FROZEN_LEASE_S  # else the answers above could not be trusted
            finally:
                b.proc.send_signal(signal.SIGCONT)

            async def whole() -> bool:
                r = await _attention(http, a)
                return _ids(r) == [first, second] and MISSING_NODES_HEADER.lower() not in r.headers

            await until(whole)
            async with AsyncClient(a.url, api_key=SETUP) as sb:
                assert (await sb.list_sessions(attention=True)).missing_nodes == []
            cli = await _attention_cli(a)
            assert cli.returncode == 0 and cli.stderr == "" and second in cli.stdout
    finally:
        for node in nodes:
            node.stop()


async def _attention_cli(node: Server) -> subprocess.CompletedProcess[str]:
    """``switchboard attention`` against ``node``, as an operator runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    env.update(SWITCHBOARD_URL=node.url, SWITCHBOARD_KEY=SETUP)
    cmd = [sys.executable, "-m", "switchboard.cli", "attention"]
    return await asyncio.to_thread(subprocess.run, cmd, env=env, capture_output=True, text=True, timeout=WAIT_S)
