"""Where a session runs: the one answer every session-scoped request is routed by (``api.cluster.routing``), whichever
node it reached. Nothing here is kept in memory for the cluster: a session live on this node is served here, and any
other is looked up in the database, which names its owner (``sessions.owner_node``) and whether that node holds its
lease (by the database's clock).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ...runtime.status import SessionStatus
from ...store import SessionRecord
from ..host import SessionHost


class Retry(StrEnum):
    """Why a session cannot be served now, as the retryable 503 code a client sees (docs/cluster.md)."""

    MOVING = "session_moving"  # handed over (a drain, a lost lease), not adopted yet
    RECOVERING = "session_recovering"  # this node claimed it and is recovering it
    MOVED = "session_moved"  # its owner is not live (dead, frozen): it is adopted elsewhere in a moment


@dataclass(frozen=True, slots=True)
class Here:
    """Served by this node: the session is live here, or is not live anywhere (ended, unknown): the route answers."""


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """Run by another live node, reachable at ``url``."""

    node_id: str
    url: str


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Live, but not servable anywhere at this instant (it is moving): retry in a moment, on any node."""

    retry: Retry
    detail: str


Location = Here | Elsewhere | Unavailable
HERE = Here()


async def locate(host: SessionHost, sid: str, record: SessionRecord | None = None) -> Location:
    """Where session ``sid`` is served now (``record``: its row, if the caller read it already). Only a session not
    live on this node costs a read (two when it runs on another node: its owner's address is read with its lease)."""
    if host.live(sid) is not None:
        return HERE
    rec = record or await host.store.get_session(sid)
    if rec is None or not SessionStatus(rec.state).live:
        return HERE
    lease = host.lease
    owner = rec.owner_node
    if lease is None:
        return HERE  # unfenced (tests): this process is the only one
    moving = Unavailable(Retry.MOVING, f"Session {sid!r} is moving to another node; retry.")
    if sid in lease.fence.lost and owner in (host.node_id, None):
        # this node let go of it (a drain's hand-over, a late lease renewal): it moves to another node in a moment
        return moving
    alone = not host.settings.cluster_mode  # a single node serves what it does not run as not active
    if owner is None:
        return HERE if alone else moving
    if owner == host.node_id:
        if not lease.fence.owns(sid):
            return HERE if alone else moving
        return Unavailable(Retry.RECOVERING, f"Session {sid!r} is being recovered; retry.")
    url = await host.store.nodes.live_url(owner)
    if url is None:
        return Unavailable(Retry.MOVED, f"Session {sid!r} is run by node {owner}, which is not live; retry.")
    return Elsewhere(owner, url)


__all__ = ["HERE", "Elsewhere", "Here", "Location", "Retry", "Unavailable", "locate"]
