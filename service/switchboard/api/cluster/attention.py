"""The cluster's attention list: in cluster mode any node answers ``GET /v1/sessions?attention=true`` with the
sessions that need an operator on every node, not only its own.

What makes a session need attention is known only where it runs (its live state, the events its node saw, the
sessions that failed there), so the node that gets the request asks each other node holding a lease for its own list,
all at once, node-to-node as a forwarded request is sent (``X-Switchboard-Forwarded`` with the cluster secret, the
caller's own credential passed on and checked there). A request that arrives forwarded is answered with the node's
own list only: nothing is asked twice and nothing loops. The lists are merged with this node's, the longest waiting
first. A node that does not answer within ``ATTENTION_TIMEOUT_S`` (frozen, overloaded, unreachable) is left out and
named in the ``Switchboard-Missing-Nodes`` header; the answer never waits longer than that for anyone.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

import httpx
from fastapi import Request
from pydantic import ValidationError

from ...store import NodeState
from ..deps import Services
from ..schemas import MAX_SESSIONS_PAGE, SessionList, SessionRead
from .forward import FORWARDED_HEADER, forwarded_secret

logger = logging.getLogger("switchboard.api.cluster.attention")

ATTENTION_TIMEOUT_S = 1.0  # how long a node waits for the others' lists
MISSING_NODES_HEADER = "Switchboard-Missing-Nodes"
MISSING_NODES_DESCRIPTION = (
    "Cluster mode: the nodes (comma-separated ids) that did not answer in time; their sessions are not in this list. "
    "Absent when every node answered."
)


class ClusterAttention:
    """The attention list of the other live nodes, for one request (see the module docstring)."""

    def __init__(self, services: Services, request: Request) -> None:
        self.services = services
        self.request = request
        self.missing: list[str] = []

    async def others(self, agent: str | None) -> list[SessionRead]:
        """The other nodes' sessions that need attention (``agent``: of that agent only); the nodes that did not
        answer are left in ``missing``."""
        host = self.services.host
        nodes = await host.store.nodes.list_nodes(states=[NodeState.LIVE, NodeState.DRAINING])
        targets = [(n.id, n.url) for n in nodes if n.id != host.node_id and n.leased and n.url]
        answers = await asyncio.gather(*(self._ask(node_id, url, agent) for node_id, url in targets))
        found: list[SessionRead] = []
        for (node_id, _), items in zip(targets, answers, strict=True):
            if items is None:
                self.missing.append(node_id)
            else:
                found.extend(items)
        return found

    async def _ask(self, node_id: str, url: str, agent: str | None) -> list[SessionRead] | None:
        headers = {FORWARDED_HEADER: forwarded_secret(self.services.settings.cluster_secret)}
        credential = self.request.headers.get("authorization")
        if credential is not None:
            headers["authorization"] = credential
        params: dict[str, str | int] = {"attention": "true", "limit": MAX_SESSIONS_PAGE}
        if agent is not None:
            params["agent"] = agent
        target = url.rstrip("/") + self.request.url.path
        try:
            async with asyncio.timeout(ATTENTION_TIMEOUT_S):
                answer = await self.services.forwarder.get(target, params=params, headers=headers)
            answer.raise_for_status()
            return SessionList.model_validate_json(answer.content).items
        except (httpx.HTTPError, TimeoutError, ValidationError) as err:
            logger.warning("attention list: node %s did not answer (%r); left out", node_id, err)
            return None


def merged(*lists: list[SessionRead]) -> list[SessionRead]:
    """One list, each session once, the longest waiting first (by its oldest reason; sessions waiting since the
    same instant by id, so every node answers one order, whichever node's list came first)."""
    by_id: dict[str, SessionRead] = {}
    for items in lists:
        for item in items:
            by_id.setdefault(item.id, item)
    return sorted(by_id.values(), key=_waiting_since)


def _waiting_since(item: SessionRead) -> tuple[datetime, str]:
    return min((reason.since for reason in item.attention), default=item.last_activity_at), item.id
