"""DirectSend: a live event is sent from the hub's publish while the stream's reader waits idle; a send that
suspends is finished by a task, later events wait for it, and the order of frames holds."""

from __future__ import annotations

import asyncio
from typing import Any

from switchboard.api.streams.direct_send import DirectSend
from switchboard.control.hub import EventHub
from switchboard.runtime.events import Event
from tests.waiting import WAIT_S


class Socket:
    """A WebSocket whose sends complete at once unless ``open_ev`` is clear (its buffer is full)."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.open_ev = asyncio.Event()
        self.open_ev.set()

    async def send_text(self, text: str) -> None:
        await self.open_ev.wait()
        self.sent.append(text)


class Clock:
    since: float | None = None


def event(seq: int, type: str = "tool.progress") -> Event:
    return Event(seq=seq, session_id="s", type=type, data={})


async def test_sends_in_the_publish_while_idle_and_in_order_when_a_send_suspends():
    hub, socket = EventHub(), Socket()
    sub = hub.subscribe(session_ids=["s"], maxsize=100)
    resume = [0]
    direct = DirectSend(
        socket.send_text, sub, lambda e, text: [f"{e.seq}a", f"{e.seq}b"], resume, Clock(), ["session.closed"]
    )  # type: ignore[arg-type]
    sub.direct = direct
    got: list[Any] = []

    async def reader() -> None:  # the pump: waits in get(), sends what is buffered after a pending direct send
        while True:
            _, ev, _ = await sub.get()
            await direct.settled()
            for frame in (f"{ev.seq}a", f"{ev.seq}b"):
                await socket.send_text(frame)
            got.append(ev.seq)

    task = asyncio.create_task(reader())
    await asyncio.sleep(0)
    hub.publish([(1, event(1))])
    assert socket.sent == ["1a", "1b"] and resume == [1] and got == []  # sent in the publish, no wake-up
    socket.open_ev.clear()
    hub.publish([(2, event(2))])  # suspends on its first frame: a task finishes it
    hub.publish([(3, event(3))])  # buffered: the reader sends it once event 2 is out
    await asyncio.sleep(0.01)
    assert socket.sent == ["1a", "1b"] and direct.pending is not None
    socket.open_ev.set()
    await asyncio.sleep(0.01)
    assert socket.sent == ["1a", "1b", "2a", "2b", "3a", "3b"] and got == [3] and resume == [2]
    hub.publish([(4, event(4, "session.closed"))])  # a terminal event is the reader's, which ends the stream
    await asyncio.sleep(0.01)
    assert got == [3, 4]
    task.cancel()
    await direct.aclose()
    sub.close()


async def test_a_failed_direct_send_ends_the_readers_wait():
    hub = EventHub()
    sub = hub.subscribe(session_ids=["s"], maxsize=100)

    class Broken(Socket):
        async def send_text(self, text: str) -> None:
            raise ConnectionResetError("gone")

    sub.direct = DirectSend(Broken().send_text, sub, lambda e, text: ["x"], [0], Clock(), [])  # type: ignore[arg-type]
    waiting = asyncio.create_task(sub.get())
    await asyncio.sleep(0)
    hub.publish([(1, event(1))])
    try:
        await asyncio.wait_for(waiting, WAIT_S)
    except ConnectionResetError:
        pass
    else:
        raise AssertionError("the reader did not hear of the failed send")
    sub.close()


async def test_the_events_of_one_publish_are_written_together_or_go_through_send_text():
    hub, socket = EventHub(), Socket()
    sub = hub.subscribe(session_ids=["s"], maxsize=100)
    writes: list[tuple[str, ...]] = []
    takes = [True, False]  # the connection takes the first publish at once, not the second (its buffer is full)

    def send_shared(*texts: str) -> bool:
        if takes.pop(0):
            writes.append(texts)
            return True
        return False

    resume = [0]
    direct = DirectSend(
        socket.send_text, sub, lambda e, t: [f"{e.seq}a", f"{e.seq}b"], resume, Clock(), [], shared=send_shared
    )
    sub.direct = direct
    waiting = asyncio.create_task(sub.get())
    await asyncio.sleep(0)
    hub.publish([(1, event(1)), (2, event(2))])
    assert writes == [("1a", "1b", "2a", "2b")] and socket.sent == [] and resume == [2]  # one write for both
    hub.publish([(3, event(3))])
    assert writes == [("1a", "1b", "2a", "2b")] and socket.sent == ["3a", "3b"] and resume == [3]  # in order, once
    waiting.cancel()
    await direct.aclose()
    sub.close()


async def test_a_publish_with_a_terminal_event_leaves_it_and_what_follows_to_the_reader():
    hub, socket = EventHub(), Socket()
    sub = hub.subscribe(session_ids=["s"], maxsize=100)
    resume = [0]
    joined: list[str] = []
    direct = DirectSend(
        socket.send_text, sub, lambda e, t: [f"{e.seq};"], resume, Clock(), ["session.closed"], joined=True
    )
    sub.direct = direct
    waiting = asyncio.create_task(sub.get())
    await asyncio.sleep(0)
    hub.publish([(1, event(1)), (2, event(2)), (3, event(3, "session.closed")), (4, event(4))])
    joined += socket.sent
    assert joined == ["1;2;"] and resume == [2]  # joined: one send for the byte stream
    assert (await asyncio.wait_for(waiting, WAIT_S))[1].seq == 3 and sub.pending() == 1  # the reader ends the stream
    await direct.aclose()
    sub.close()


async def test_a_frame_that_cannot_be_made_ends_that_stream_and_not_the_publish():
    hub, socket = EventHub(), Socket()
    broken, fine = hub.subscribe(session_ids=["s"], maxsize=100), hub.subscribe(session_ids=["s"], maxsize=100)

    def cannot(event: Event, text: str) -> list[str]:
        raise ValueError("no translation")

    broken.direct = DirectSend(socket.send_text, broken, cannot, [0], Clock(), [])
    resume = [0]
    fine.direct = DirectSend(socket.send_text, fine, lambda e, t: [f"{e.seq}"], resume, Clock(), [])
    waiting = [asyncio.create_task(broken.get()), asyncio.create_task(fine.get())]
    await asyncio.sleep(0)
    hub.publish([(1, event(1))])  # whichever subscription is offered first, the other still gets the event
    assert socket.sent == ["1"] and resume == [1]
    try:
        await asyncio.wait_for(waiting[0], WAIT_S)
    except ValueError:
        pass
    else:
        raise AssertionError("the broken stream's reader did not hear why")
    waiting[1].cancel()
    broken.close()
    fine.close()


class Gate(Socket):
    """A socket that takes ``room`` frames, then blocks until ``open_ev`` is set."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    async def send_text(self, text: str) -> None:
        if len(self.sent) >= self.room:
            self.open_ev.clear()
        await super().send_text(text)


async def test_a_stream_stopped_mid_publish_resumes_after_the_last_event_its_client_got():
    """A publish of several events whose send suspends part-way: the stream's position follows each event written,
    so a stream closed meanwhile (4008 "resume with since=N") names exactly the last event its client got."""
    hub = EventHub()
    socket = Gate(room=3)  # event 1's two frames and event 2's first, then the socket is full
    sub = hub.subscribe(session_ids=["s"], maxsize=100)
    resume = [0]
    frames = {1: ["1a", "1b"], 2: ["2a", "2b"], 3: [], 4: ["4a"]}  # event 3 makes no frame (AG-UI drops some)
    direct = DirectSend(socket.send_text, sub, lambda e, _: frames[e.seq], resume, Clock(), ["session.closed"])  # type: ignore[arg-type]
    sub.direct = direct

    async def idle_reader() -> None:
        await sub.get()

    reader = asyncio.create_task(idle_reader())
    await asyncio.sleep(0)
    socket.open_ev.clear()  # the first send suspends: a task sends the rest
    hub.publish([(seq, event(seq)) for seq in (1, 2, 3, 4)])
    socket.open_ev.set()
    await asyncio.sleep(0.01)
    assert socket.sent == ["1a", "1b", "2a"] and direct.pending is not None
    await direct.aclose()  # the stream is closed: its position is event 1's, the last its client got whole
    assert resume == [1]
    reader.cancel()
    sub.close()


async def test_an_event_at_or_below_the_streams_position_is_not_sent_again_whichever_way_it_comes():
    """The replay and the live events overlap (an event the replay read may reach the hub after the stream went
    live), and in cluster mode an event can reach a node twice: the stream's position is the gate of the publish's
    sends and of the pump's alike."""
    hub, socket = EventHub(), Socket()
    sub = hub.subscribe(session_ids=["s"], maxsize=100)
    resume = [5]  # the replay sent up to seq 5
    direct = DirectSend(socket.send_text, sub, lambda e, _: [f"{e.seq}"], resume, Clock(), ["session.closed"])
    sub.direct = direct
    waiting = asyncio.create_task(sub.get())
    await asyncio.sleep(0)
    hub.publish([(4, event(4)), (5, event(5)), (6, event(6))])
    hub.publish([(5, event(5)), (6, event(6))])
    assert socket.sent == ["6"] and resume == [6] and sub.pending() == 0 and not waiting.done()
    waiting.cancel()
    for seq in (3, 6, 7, 7):  # the pump's own: replayed, or buffered while it was busy
        await direct.send(event(seq), None)
    assert socket.sent == ["6", "7"] and resume == [7]
    await direct.aclose()
    sub.close()
