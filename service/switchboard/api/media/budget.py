"""The stored-input budget of media edges: the user's transcripts one caller may have stored, per second, across all
its edges and sessions (docs/media-edge.md, "Budgets").

An edge's frames are bounded per connection (``SWITCHBOARD_MEDIA_MAX_FRAMES_PER_S``), but one credential may be the
edge of every session, and each transcript is a stored ``user.input`` event of up to ``SWITCHBOARD_MAX_TEXT_CHARS``
characters (a final one also a chat item and a reply): one key once stored 279 inputs a second, 22 MB in 10 s. So
transcripts are charged to their caller's budget (``Principal.budget``: an API key, whichever of its session tokens
connects), one bucket of characters per caller, refilled at ``SWITCHBOARD_MEDIA_TRANSCRIPT_CHARS_PER_S`` up to twice
as many; a transcript costs its length, at least ``MIN_COST_CHARS`` (so that short ones are counted too). In cluster
mode the bucket is the cluster's, in Redis, as the command limits are (``rate_limit.SharedRateLimits``: the node's
own while Redis does not answer).

Over budget, nothing is lost that matters: an interim transcript is coalesced (not stored; the next interim or the
final one supersedes it), and interims may spend only the first half of the bucket, so the user's finished turns always
find the other half; a final transcript is refused with an ``error`` frame ``rate_limited`` naming when to send it
again (``retry_after_s``), and the edge keeps it until taken.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...runtime.media_frames import FrameRefused, UserTranscriptFrame
from ..rate_limit import RateLimiter

MIN_COST_CHARS = 100  # what a transcript costs at least: the default budget takes 200 short ones a second
RATE_LIMITED = "rate_limited"


@dataclass(frozen=True, slots=True)
class TranscriptBudget:
    """The callers' buckets (``limiter``, in characters) and how transcripts are charged to them."""

    limiter: RateLimiter

    async def charge(self, budget: str, frame: UserTranscriptFrame) -> float | None:
        """Charge ``frame`` to ``budget``: None when taken, else the seconds until it would be."""
        limiter = self.limiter
        if not limiter.enabled:
            return None
        share = limiter.burst if frame.final else limiter.burst / 2
        # never more than its share of the bucket: a long final transcript on a small budget is still taken, in time
        cost = min(float(max(len(frame.text), MIN_COST_CHARS)), share)
        return await limiter.acquire(budget, cost=cost, burst=share)


def rate_limited(frame: UserTranscriptFrame, wait_s: float) -> FrameRefused:
    """The refusal of a final transcript over budget: the edge keeps it and sends it again after ``wait_s``."""
    retry_after_s = round(max(wait_s, 0.001), 3)
    return FrameRefused(
        RATE_LIMITED,
        f"too many transcripts from this credential; send it again in {retry_after_s} s",
        frame.type,
        frame.id,
        retry_after_s=retry_after_s,
    )
