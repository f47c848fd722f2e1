"""A session this node let go of (after late lease renewals, or handing it over on a drain) while the database still
names this node its owner is moving, not over: commands answer 503 ``session_moving`` (a client retries), never 409
``session_not_active`` (a client gives up)."""

from __future__ import annotations

from switchboard.runtime.status import SessionStatus

from .conftest import Api


async def test_a_command_for_a_session_this_node_let_go_of_answers_moving(api: Api) -> None:
    sid = (await api.create())["id"]
    host = api.app.state.services.host
    assert host.lease is not None
    assert host.lease.lose_all("the lease was not renewed in time") == [sid]
    r = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "still there?"})
    assert r.status_code == 503, r.text
    assert r.json()["code"] == "session_moving" and r.headers["retry-after"] == "1"
    # reads still answer, from the database: live, owned by this node until it moves, and served by none meanwhile
    got = await api.client.get(f"/v1/sessions/{sid}")
    assert got.status_code == 200 and got.json()["state"] == "suspended", got.text


async def test_a_command_for_a_session_being_recovered_here_answers_recovering(api: Api) -> None:
    """A session a node adopted is in its hands before it has started again (its recovery settles what was in
    flight first): a command meanwhile answers 503 ``session_recovering``, never 409 ``session_not_active`` (a chaos
    run saw inputs given up on that way)."""
    sid = (await api.create())["id"]
    session = api.app.state.services.host.sessions[sid]
    session.state = SessionStatus.INITIALIZING  # as during its recovery, before it starts
    try:
        r = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "hello?"})
        assert r.status_code == 503, r.text
        assert r.json()["code"] == "session_recovering" and r.headers["retry-after"] == "1"
    finally:
        session.state = SessionStatus.ACTIVE


async def test_a_session_claimed_here_but_not_yet_recovered_never_reads_active(api: Api) -> None:
    """Between its claim (the database names this node its owner) and its start in memory, an adopted session is
    read as ``initializing``, as its commands answer 503 ``session_recovering``: a client that waits for ``active``
    before it sends a command is not sent a 503 (a cluster test that did so closed a session a moment too soon)."""
    sid = (await api.create())["id"]
    host = api.app.state.services.host
    session = host.sessions.pop(sid)  # as between an adoption's claim and the session's start here
    try:
        got = await api.client.get(f"/v1/sessions/{sid}")
        assert got.status_code == 200, got.text
        assert (got.json()["state"], got.json()["agent_state"]) == ("initializing", "initializing"), got.json()
        r = await api.client.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 503 and r.json()["code"] == "session_recovering", r.text
    finally:
        host.sessions[sid] = session
    got = await api.client.get(f"/v1/sessions/{sid}")
    assert got.json()["state"] == "active", got.json()
