"""AG-UI runs of a session another node runs (cluster mode).

The node a run is posted to serves it, whichever node runs the session: the run's answer is the session's log, which
every node streams (the event fan-out, as for ``GET .../ag-ui``). It asks the owner only for what the live session
does, as a forwarded command is sent (``X-Switchboard-Forwarded`` with the cluster secret; the caller's credential
passed on and checked there): the run's own request, to the session's run path, with ``X-Switchboard-Run`` naming
the part asked for:

- ``input``: apply the run's input and answer what it answered (its chat item, its speech, where the log stood
  before it) as JSON, under the runId against the shared database, as a run posted to the owner does: a run is
  injected once whichever nodes it is posted to;
- ``abort <speech id>...``: the run's client went away: interrupt the agent if it is speaking one of these speeches
  (the run's, as this node's events name them).

The agent door's first run creates its thread's session where a create would place it (``deps.place_new_session``):
on another node, the create is sent there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import Request
from pydantic import ValidationError

from ...control.cluster.routing import Elsewhere, Retry
from ..cluster.forward import FORWARDED_HEADER, SessionElsewhere, forwarded_secret
from ..deps import services
from ..problems import Problem, ProblemError

logger = logging.getLogger("switchboard.api.streams.agui_relay")

RUN_PART_HEADER = "x-switchboard-run"


class Part(StrEnum):
    INPUT = "input"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class RunPart:
    """What another node asks of this one, the owner, for a run it serves: ``kind``, and for an abort the run's
    speeches."""

    kind: Part
    speeches: frozenset[str] = frozenset()


def run_part(request: Request) -> RunPart | None:
    """The part of a run another node asks for (None: a run to serve). Only a forwarded request asks for one (its
    header is checked against the cluster secret before any route runs)."""
    value = request.headers.get(RUN_PART_HEADER)
    if value is None or FORWARDED_HEADER not in request.headers:
        return None
    kind, *speeches = value.split() or [""]
    try:
        return RunPart(Part(kind), frozenset(speeches))
    except ValueError:
        raise ProblemError(400, "invalid_run_part", f"{RUN_PART_HEADER} names no part of a run.") from None


def _sent_on(request: Request) -> dict[str, str]:
    """The headers of a request this node sends another for ``request``: the cluster secret, the caller's
    credential."""
    headers = {FORWARDED_HEADER: forwarded_secret(services(request).settings.cluster_secret)}
    credential = request.headers.get("authorization")
    if credential is not None:
        headers["authorization"] = credential
    return headers


def _moved(node_id: str) -> ProblemError:
    detail = f"The session's node {node_id} did not answer; retry."
    return ProblemError(503, Retry.MOVED.value, detail, headers={"Retry-After": "1"})


def _problem(answer: httpx.Response, node_id: str) -> ProblemError:
    """The problem another node answered, to answer the client as it is."""
    try:
        found = Problem.model_validate_json(answer.content)
    except ValidationError:
        return _moved(node_id)
    retry = answer.headers.get("retry-after")
    return ProblemError(
        found.status, found.code, found.detail, headers={"Retry-After": retry} if retry else None, errors=found.errors
    )


@dataclass(frozen=True, slots=True)
class RunRelay:
    """The run's request as this node sends it to the session's owner: its session's run path, the caller's
    credential, the body."""

    path: str
    headers: dict[str, str]
    body: bytes
    client: httpx.AsyncClient
    count: Callable[[str, float | None], None]  # ``Metrics.on_forward``

    @classmethod
    async def of(cls, request: Request, sid: str) -> RunRelay | None:
        """The relay of the run ``request`` posts; None outside cluster mode, and for a request another node
        forwarded here (never sent on again)."""
        found = services(request)
        if not found.settings.cluster_mode or FORWARDED_HEADER in request.headers:
            return None
        headers = {**_sent_on(request), "content-type": "application/json"}
        path = f"/v1/sessions/{quote(sid, safe='')}/ag-ui"
        return cls(path, headers, await request.body(), found.forwarder, found.metrics.on_forward)

    async def _send(self, owner: Elsewhere, part: str) -> httpx.Response:
        url = owner.url.rstrip("/") + self.path
        return await self.client.post(url, content=self.body, headers={**self.headers, RUN_PART_HEADER: part})

    async def inject(self, owner: Elsewhere) -> dict[str, Any]:
        """The run's input, applied by ``owner``: what it answered (``item_id``, ``speech_id``, ``since``)."""
        sent = time.perf_counter()
        try:
            answer = await self._send(owner, Part.INPUT)
        except httpx.HTTPError as err:
            logger.warning("run input for node %s: not sent (%r)", owner.node_id, err)
            self.count("unreachable", None)
            raise _moved(owner.node_id) from None
        self.count("answered", time.perf_counter() - sent)
        if answer.status_code != 200:
            raise _problem(answer, owner.node_id)
        with contextlib.suppress(ValueError):
            started = answer.json()
            if isinstance(started, dict) and "item_id" in started and "since" in started:
                return started
        raise _moved(owner.node_id)

    async def abort(self, owner: Elsewhere, speeches: Collection[str]) -> None:
        """Have ``owner`` interrupt the agent if it is speaking one of ``speeches``."""
        try:
            answer = await self._send(owner, " ".join([Part.ABORT, *sorted(speeches)]))
        except httpx.HTTPError as err:
            logger.warning("run abort for node %s: not sent (%r)", owner.node_id, err)
            return
        if answer.status_code >= 400:
            logger.warning("run abort: node %s answered %s %s", owner.node_id, answer.status_code, answer.text)


async def create_at(request: Request, target: SessionElsewhere, sid: str, agent: str) -> None:
    """Create the thread's session ``sid`` running ``agent`` on the node ``target`` names, as a create forwarded
    there is (the same id and body again is no conflict: two first runs of a thread may both create it)."""
    if target.url is None:
        raise _moved(target.node_id)
    found = services(request)
    url = target.url.rstrip("/") + "/v1/sessions"
    sent = time.perf_counter()
    try:
        answer = await found.forwarder.post(url, json={"id": sid, "agent": agent}, headers=_sent_on(request))
    except httpx.HTTPError as err:
        logger.warning("thread %s: its create for node %s was not sent (%r)", sid, target.node_id, err)
        found.metrics.on_forward("unreachable", None)
        raise _moved(target.node_id) from None
    found.metrics.on_forward("answered", time.perf_counter() - sent)
    if answer.status_code not in (200, 201):
        raise _problem(answer, target.node_id)
