"""The media edge's close codes and the limits they name (``media.routes``, ``cluster.relay``; published in the
AsyncAPI document)."""

from __future__ import annotations

from ..problems import UNAVAILABLE_CLOSE

OUTBOX_FRAMES = 4096  # frames queued for a slow edge before it is closed (4008)
SEND_TIMEOUT_S = 10.0
# an edge that connected with `resume` and dropped: its speeches play on and what is sent is kept this long for its
# next connection (a network drop, a reconnect after 4008 or 1011), then it is an edge that left
RESUME_HOLD_S = 10.0

CLOSE_NORMAL = 1000
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = UNAVAILABLE_CLOSE  # 1013: the database is unavailable
CLOSE_SLOW_CONSUMER = 4008
CLOSE_BAD_REQUEST = 4400
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_REPLACED = 4409
CLOSE_NOT_ACTIVE = 4410
CLOSE_TOO_MANY_FRAMES = 4429

# the reasons of a 4410 while the session is being handed over to another node; the second one tells the edge that the
# final transcript it just sent was not taken, and is to be sent again once connected again
MOVING = "session moving to another node; connect again"
TRANSCRIPT_NOT_TAKEN = "session moving; transcript not taken: connect again and send it again"

#: Every close code of the media edge and what it means to the edge (published in the AsyncAPI document).
CLOSE_CODES: dict[int, str] = {
    CLOSE_NORMAL: "The session ended (closed or failed; also when it had ended before the edge connected: the "
    "reason says `session closed` or `session failed`), or the edge left. Do not connect again.",
    CLOSE_UNSUPPORTED_DATA: "The edge sent a binary message; only JSON text frames are accepted.",
    CLOSE_MESSAGE_TOO_BIG: "The edge sent a frame larger than the server accepts (the session's text limit, "
    "`SWITCHBOARD_MAX_TEXT_CHARS`, plus 1 KiB).",
    CLOSE_INTERNAL_ERROR: "The server failed, or the edge did not answer its keepalive pings: reconnect.",
    CLOSE_TRY_AGAIN_LATER: "The database is unavailable (the node could not find where the session runs, or read "
    "it): connect again in a moment, to any node.",
    CLOSE_SLOW_CONSUMER: f"Too slow: more than {OUTBOX_FRAMES} frames waited for the edge, or a send stalled for "
    f"{SEND_TIMEOUT_S:.0f} s. The speech it was playing ends interrupted; reconnect.",
    CLOSE_BAD_REQUEST: "`edge_id` and `connection` are not both given, or not as described (an id of 1 to 64 "
    "characters `A-Z a-z 0-9 . _ ~ -`; a whole number from 1). Cluster mode: also (reason `invalid_path`) a query "
    "that cannot be sent on to the node that runs the session (an invalid percent-escape).",
    CLOSE_UNAUTHENTICATED: "No valid credential (an API key as a Bearer header, or a session token as `token` or a "
    "Bearer header).",
    CLOSE_FORBIDDEN: "The credential lacks the `media:connect` scope, or is a session token of another session. "
    "Cluster mode: also a connection that claims to come from another node without the cluster secret.",
    CLOSE_NOT_FOUND: "No such session.",
    CLOSE_REPLACED: "Another edge connected to this session and replaced this one. The speech this one was playing "
    "ended interrupted at its last reported position. Also the answer to a connection that is not newer than the "
    "last one taken from the same `edge_id` (an attempt the edge gave up on, delivered late): it is refused, the "
    "edge's newer connection goes on.",
    CLOSE_NOT_ACTIVE: "The session is not active here: it is being recovered, was suspended by a shutdown or moved "
    "to another node; in cluster mode also: the node that runs it could not be "
    "reached, or went away (failover). Connect again in a moment, to any node. The reason "
    f"`{TRANSCRIPT_NOT_TAKEN}` says that the final transcript the edge sent last was not taken: send it again once "
    "connected again (the session moved as it arrived). An edge that gives its final transcripts an `id` sends "
    "again, on its next connection, each one it has no `transcript.taken` for, whatever the close.",
    CLOSE_TOO_MANY_FRAMES: "Too many frames per second on this connection (`SWITCHBOARD_MEDIA_MAX_FRAMES_PER_S`, "
    "default 100, over a burst of twice as many). A credential over its transcript budget is not closed: its final "
    "transcripts are refused `rate_limited`.",
}
