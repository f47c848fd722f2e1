"""Text keeps every character exactly as given on both databases: NUL, other control characters, lone surrogates
and the store's own escape character round-trip through every column and every JSON value."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from switchboard.runtime.chat import ChatMessage, FunctionCall, FunctionCallOutput
from switchboard.runtime.events import Event
from switchboard.runtime.ports import Commit, SessionState
from switchboard.runtime.speech import SpeechInfo, SpeechState
from switchboard.runtime.tools import ProgressUpdate, ToolCallInfo, ToolStatus
from switchboard.store import IdempotencyRecord, SessionRecord, Store
from switchboard.store.text import ESC, decode_json_text, decode_text, encode_json_text, encode_text

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)

# NUL, every other C0 control, DEL, C1, the escape character and what looks like its encodings, backslashes
# next to a NUL, a lone surrogate of each half, a real astral character.
ODD = (
    "a\x00b"
    + "".join(chr(c) for c in range(1, 32))
    + "\x7f\x85"
    + ESC
    + f"{ESC}0{ESC}e{ESC}ud800"
    + "\\u0000\\\x00\\\\u0000"
    + "\ud800x\udfff"
    + "😀\x00"
)
# As a mapping key: the same, without the lone surrogates (pydantic validates ``str`` keys as UTF-8).
KEY = ODD.replace("\ud800", "").replace("\udfff", "")


@pytest.mark.parametrize(
    "value", ["", "plain", "\x00", ODD, ESC * 3, "\\" * 5 + "\x00", '"\x00"', "\ud83d", "\udc00\x00"]
)
def test_the_encoding_is_reversible_and_stores_no_nul_or_surrogate(value: str) -> None:
    stored = encode_text(value)
    assert "\x00" not in stored
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in stored)
    assert decode_text(stored) == value
    import json

    text = encode_json_text(json.dumps({value: [value]}, ensure_ascii=False))
    assert "\\u0000" not in text.replace("\\\\", "")
    assert json.loads(decode_json_text(text)) == {value: [value]}


async def test_nul_and_control_characters_round_trip_through_every_table(store: Store) -> None:
    chat = store.chat_store()
    items = [
        ChatMessage(id="m1", role="user", text=ODD, created_at=T0),
        FunctionCall(id="fc1", call_id="c1", name="lookup", arguments={KEY: ODD, "n": [ODD]}, created_at=T0),
        FunctionCallOutput(id="o1", call_id="c1", name="lookup", output=ODD, created_at=T0),
    ]
    call = ToolCallInfo(
        call_id="c1",
        name="lookup",
        status=ToolStatus.COMPLETED,
        arguments={KEY: ODD},
        progress=[ProgressUpdate(message=ODD, at=T0)],
        output=ODD,
        started_at=T0,
        ended_at=T0,
    )
    speech = SpeechInfo(
        id="sp1",
        source="say",
        state=SpeechState.DONE,
        interrupted=False,
        allow_interruptions=True,
        text=ODD,
        played_text=ODD,
        created_at=T0,
    )
    await chat.commit(
        "s1",
        Commit(
            items=items, tool_calls=[call], speeches=[speech], session=SessionState(agent="demo", llm_state={KEY: ODD})
        ),
    )
    event = Event(session_id="s1", seq=1, type="user.input", at=T0, data={"text": ODD, KEY: [ODD]})
    await store.event_sink().publish(event)

    assert await store.chat_items("s1") == items
    assert await store.tool_calls("s1") == [call]
    assert await store.speeches("s1") == [speech]
    (got,) = await store.events("s1")
    assert got.data == {"text": ODD, KEY: [ODD]}
    assert (await store.get_session("s1")).llm_state == {KEY: ODD}  # type: ignore[union-attr]
    loaded = (await store.load_sessions_bulk(["s1"]))["s1"]
    assert loaded.items == items
    assert loaded.tool_calls == [call]
    assert loaded.speeches == [speech]
    assert [ev.data for _, ev in await store.events_multi(session_ids=None, since_id=0, limit=10)] == [got.data]


async def test_keys_and_metadata_with_nul_round_trip(store: Store) -> None:
    await store.create_session(SessionRecord(id="s\x00" + ESC, agent="a\x00", metadata={"k\x00": "v\x00"}))
    rec = await store.get_session("s\x00" + ESC)
    assert rec is not None and rec.agent == "a\x00" and rec.metadata == {"k\x00": "v\x00"}
    assert await store.get_session("s") is None and await store.get_session("s\x00") is None
    put = IdempotencyRecord(key="k\x00", scope="POST\x00", request_hash="h", status_code=202, response_body=[ODD])
    assert await store.idempotency_put(put)
    again = await store.idempotency_get("k\x00", "POST\x00")
    assert again is not None and again.response_body == [ODD]


async def test_event_type_filters_still_match_after_encoding(store: Store) -> None:
    sink = store.event_sink()
    await sink.publish(Event(session_id="s1", seq=1, type="tool.ended", at=T0, data={"output": "\x00"}))
    await sink.publish(Event(session_id="s1", seq=2, type="chat.item", at=T0, data={}))
    assert [e.seq for e in await store.events("s1", types=["tool.*"])] == [1]
    assert [e.seq for e in await store.events("s1", types=["chat.item"])] == [2]
