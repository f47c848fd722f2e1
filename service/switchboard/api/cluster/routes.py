"""The nodes serving this database: each instance of the service, its lease and the sessions it owns."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..auth import Require
from ..deps import ServicesDep
from ..schemas import NodeList, NodeRead

router = APIRouter(tags=["cluster"])


@router.get(
    "/v1/cluster/nodes",
    operation_id="listNodes",
    response_model=NodeList,
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_nodes(services: ServicesDep) -> NodeList:
    """Every node that registered on this database (live ones first), with the live sessions each owns."""
    nodes = await services.store.nodes.list_nodes()
    return NodeList(
        items=[
            NodeRead(
                id=n.id,
                url=n.url,
                state=n.state.value,
                mode=n.mode.value,
                sessions=n.sessions,
                heartbeat_at=n.heartbeat_at,
                lease_until=n.lease_until,
            )
            for n in nodes
        ]
    )
