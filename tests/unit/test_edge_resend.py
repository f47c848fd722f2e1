"""The reference media edge sends again, first, a final transcript its last connection did not take (the session was
being handed over to another node as it arrived: a 4410 whose reason says so)."""

from __future__ import annotations

import asyncio

from switchboard.cli.edge import Edge, EdgeOptions, Transcripts, _Retry


class Recording:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def send_transcript(self, text: str, *, final: bool = True) -> bool:
        self.sent.append(text)
        return True


async def test_a_transcript_not_taken_is_sent_first_on_the_next_connection() -> None:
    options = EdgeOptions(engine=None, out=None, player=None, barge_in=False)  # type: ignore[arg-type]
    options.transcripts.closed(4410, "session moving; transcript not taken: connect again and send it again")
    assert options.transcripts.resend is None  # nothing was said yet
    options.transcripts.last = "are you there?"
    options.transcripts.closed(4410, "session moving; transcript not taken: connect again and send it again")
    conn = Recording()
    edge = Edge(conn, options, say=lambda _: None)  # type: ignore[arg-type]
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    lines.put_nowait("and then?")
    user = asyncio.create_task(edge._user(lines))
    try:
        async with asyncio.timeout(5):
            while len(conn.sent) < 2:
                await asyncio.sleep(0.01)
    finally:
        user.cancel()
        await asyncio.gather(user, return_exceptions=True)
    assert conn.sent == ["are you there?", "and then?"]
    assert options.transcripts == Transcripts(last="and then?", resend=None)


def test_the_reference_edge_connects_again_after_the_database_was_unavailable() -> None:
    """A node that cannot reach its database closes the edge 1013 ("try again later"): a blip of the database, after
    which the session goes on; the reference edge connects again (it used to stop for good)."""
    retry = _Retry(for_s=30.0)
    assert retry.after(1013) is not None
    assert retry.after(4410) is not None
    assert retry.after(1000) is None and retry.after(4409) is None  # the session ended; another edge took over
