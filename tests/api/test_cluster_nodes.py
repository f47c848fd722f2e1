"""GET /v1/cluster/nodes shows every state a node can be in, `draining` included (a node stopping in cluster mode)."""

from __future__ import annotations

from switchboard.api.deps import Services
from switchboard.store import NodeState

from .conftest import Api


async def test_a_draining_node_is_listed_as_draining(api: Api):
    found: Services = api.app.state.services
    node_id = found.host.node_id
    assert node_id is not None
    await found.store.nodes.set_state(node_id, NodeState.DRAINING)
    r = await api.client.get("/v1/cluster/nodes")
    assert r.status_code == 200, r.text
    assert [(n["id"], n["state"]) for n in r.json()["items"]] == [(node_id, "draining")]
