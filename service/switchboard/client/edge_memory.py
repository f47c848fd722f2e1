"""What a media edge (``switchboard edge``, the Pipecat integration) remembers from one media connection to the
next: its edge id and the number of its connection attempts, and the final transcripts the session has not yet said
it took.

A closed connection does not tell an edge whether the final transcript it had just sent was taken: the node may have
died with it unread or after committing it, a relay may have lost it, the session may have moved as it arrived. So
each final transcript carries a fresh id and is kept until a ``transcript.taken`` names it; every new connection
sends the kept ones again first, in order, with the same ids, and the session takes each at most once
(docs/media-edge.md, "A final transcript is taken once").
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

PENDING_LIMIT = 100  # transcripts kept unanswered; a service that never answers must not grow the edge without end
RESEND_CODE = "command_failed"  # the service could not apply it this time: send it again in a moment
WAIT_CODE = "rate_limited"  # over the credential's transcript budget: send it again after its retry_after_s
DROP_CODES = frozenset({"transcript_id_reused", "text_too_long"})  # sending it again cannot help


@dataclass(frozen=True)
class Transcript:
    id: str
    text: str


class PendingTranscripts:
    """The final transcripts sent and not yet taken, oldest first, at most ``limit`` of them."""

    def __init__(self, limit: int = PENDING_LIMIT) -> None:
        self.limit = limit
        self._kept: dict[str, Transcript] = {}  # in the order they were said

    def add(self, text: str) -> tuple[Transcript, Transcript | None]:
        """A new final transcript, kept until taken, and the oldest one given up to make room for it (if any)."""
        said = Transcript(str(uuid.uuid4()), text)
        self._kept[said.id] = said
        dropped = None
        if len(self._kept) > self.limit:
            dropped = self._kept.pop(next(iter(self._kept)))
        return said, dropped

    def pending(self) -> list[Transcript]:
        return list(self._kept.values())

    def get(self, transcript_id: str) -> Transcript | None:
        return self._kept.get(transcript_id)

    def discard(self, transcript_id: str) -> Transcript | None:
        """Forget the transcript: taken, or refused for good."""
        return self._kept.pop(transcript_id, None)

    def __len__(self) -> int:
        return len(self._kept)


class EdgeIdentity:
    """A random id for this run of the edge and the number of each connection attempt (1, 2, 3, ...), sent in every
    connect URL: a stale attempt that reaches the service late, after a newer one, is refused instead of replacing
    the edge's live connection."""

    def __init__(self) -> None:
        self.edge_id = secrets.token_urlsafe(16)  # 22 URL-safe characters
        self.attempts = 0

    def next_attempt(self) -> int:
        self.attempts += 1
        return self.attempts
