"""The edge side of a session's media WebSocket (``WS /v1/sessions/{sid}/media``): frames in, playback reports out.

An edge (a browser, a phone gateway, a room agent, ``switchboard edge``) plays the speeches the session sends and
reports what has been heard. Server frames arrive as :class:`MediaFrame`; the edge answers with the ``send_*``
methods. A connection that the service refuses raises the typed error of the refusal; a connection that is closed
ends the iteration, and ``close_code`` / ``close_reason`` say why.

>>> async with AsyncClient(url, api_key=key) as sb, sb.media(sid) as edge:
...     async for frame in edge:
...         if frame.type == "speech.start":
...             await edge.send_started(frame.speech_id)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlencode

from pydantic import BaseModel, ConfigDict, ValidationError
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as aconnect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from .errors import (
    BadRequest,
    Forbidden,
    NotFound,
    SwitchboardError,
    Unauthorized,
    Unavailable,
    fatal_close,
    unreachable,
)

OPEN_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 2**20
_REFUSALS: dict[int, type[SwitchboardError]] = {400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound}
_REFUSAL_REASONS = {
    4401: "no valid credential (an API key, or a session token)",
    4403: "the credential lacks the media:connect scope, or is a session token of another session",
    4404: "no such session",
}


class MediaFrame(BaseModel):
    """A frame from the service: ``speech.start|text|end|stop`` or ``error`` (other types pass through)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str
    speech_id: str | None = None
    delta: str | None = None  #: ``speech.text``: text to synthesise, appended to what came before
    allow_interruptions: bool | None = None  #: ``speech.start``
    code: str | None = None  #: ``error``
    detail: str | None = None  #: ``error``
    id: str | None = None  #: ``transcript.taken``, ``error``: the final transcript's id
    item_id: str | None = None  #: ``transcript.taken``: the user's chat item it became
    retry_after_s: float | None = None  #: ``error`` ``rate_limited``: send the transcript again after this


def media_url(
    base_url: str,
    session_id: str,
    *,
    token: str | None = None,
    edge_id: str | None = None,
    connection: int | None = None,
) -> str:
    """The media endpoint's URL. ``edge_id`` and ``connection`` number an edge's connection attempts, so that the
    service can refuse an old attempt that reaches it after a newer one (docs/media-edge-reference.md)."""
    base = ("ws" + base_url[4:] if base_url.startswith("http") else base_url).rstrip("/")
    url = f"{base}/v1/sessions/{quote(session_id, safe='')}/media"
    query: dict[str, str] = {"token": token} if token else {}
    if edge_id is not None and connection is not None:
        query.update(edge_id=edge_id, connection=str(connection))
    return f"{url}?{urlencode(query)}" if query else url


class MediaConnection:
    """One media connection (``async with``); iterate it for server frames."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        self.url = url
        self._headers = dict(headers)
        self._ws: ClientConnection | None = None

    async def __aenter__(self) -> MediaConnection:
        try:
            self._ws = await aconnect(
                self.url, additional_headers=self._headers, open_timeout=OPEN_TIMEOUT_S, max_size=MAX_FRAME_BYTES
            )
        except InvalidStatus as err:
            status = err.response.status_code
            if status >= 500:  # a server stopping as it took the connection, or a balancer with no server for it
                raise Unavailable(
                    status, "handshake_failed", f"The media endpoint failed the handshake ({status})"
                ) from err
            cls = _REFUSALS.get(status, SwitchboardError)
            raise cls(status, "handshake_refused", f"The media endpoint refused the connection ({status})") from err
        except (OSError, TimeoutError) as err:
            raise unreachable(self.url.split("?")[0], err) from err
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._ws is not None:
            await self._ws.close()

    @property
    def close_code(self) -> int | None:
        return self._ws.close_code if self._ws is not None else None

    @property
    def close_reason(self) -> str:
        return (self._ws.close_reason or "") if self._ws is not None else ""

    def refusal(self) -> SwitchboardError | None:
        """The typed error when the service closed the connection for a reason no retry fixes (auth, no session)."""
        code = self.close_code
        found = fatal_close(code, self.close_reason) if code is not None else None
        if found is None:
            return None
        why = _REFUSAL_REASONS.get(code or 0, "")
        detail = f"The media connection was refused ({code} {self.close_reason}){': ' + why if why else ''}."
        return type(found)(found.status, found.code, detail)

    async def __aiter__(self) -> AsyncIterator[MediaFrame]:
        assert self._ws is not None, "use `async with`"
        try:
            async for raw in self._ws:
                try:
                    yield MediaFrame.model_validate_json(raw)
                except ValidationError:
                    continue  # not a frame of this protocol: nothing an edge can act on
        except ConnectionClosed:
            return

    async def send(self, type: str, **fields: Any) -> bool:
        """Send one frame; False when the connection has gone (a failed send is a disconnect, not a crash)."""
        if self._ws is None:
            return False
        try:
            await self._ws.send(json.dumps({"type": type, **fields}))
        except ConnectionClosed:
            return False
        return True

    async def send_started(self, speech_id: str) -> bool:
        return await self.send("playback.started", speech_id=speech_id)

    async def send_progress(self, speech_id: str, played_chars: int) -> bool:
        return await self.send("playback.progress", speech_id=speech_id, played_chars=played_chars)

    async def send_finished(self, speech_id: str, *, interrupted: bool) -> bool:
        return await self.send("playback.finished", speech_id=speech_id, interrupted=interrupted)

    async def send_user_started(self) -> bool:
        return await self.send("user.speech_started")

    async def send_transcript(self, text: str, *, final: bool = True, id: str | None = None) -> bool:
        """``id``: a final transcript's, answered ``transcript.taken`` once the session has it (at most once)."""
        fields: dict[str, Any] = {"id": id} if id is not None else {}
        return await self.send("user.transcript", text=text, final=final, **fields)
