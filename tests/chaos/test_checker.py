"""The chaos checker on small hand-written histories: each class of violation is found, and a clean run has none
(so a checker that cannot fail would fail here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.retryable import RETRYABLE

from .checker import Violation, check
from .history import History

SID = "sess_1"


def _event(eid: int, seq: int, kind: str, **data: Any) -> dict[str, Any]:
    return {"id": eid, "session_id": SID, "seq": seq, "type": kind, "data": data, "at": 100.0 + seq}


def _clean() -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """A tools session: created, one input answered, one tool call completed and replied to, seen by a stream."""
    records: list[dict[str, Any]] = [
        {"kind": "session", "sid": SID, "role": "tools"},
        _op("create", None, "c1", 201, {"id": SID}),
        _op("input", SID, "i1", 202, {"item_id": "item_1", "speech_id": "sp_1"}, text="input i1", interrupt=False),
    ]
    events = [
        _event(1, 1, "session.started"),
        _event(2, 2, "user.input", item_id="item_1", text="input i1", final=True),
        _event(3, 3, "speech.created", speech_id="sp_1", source="reply"),
        _event(4, 4, "generation.started", speech_id="sp_1", step=0),
        _event(6, 5, "tool.started", call_id="call_1", name="slow"),
        _event(7, 6, "tool.ended", call_id="call_1", status="completed"),
        _event(8, 7, "generation.started", speech_id="sp_1", step=1),
        _event(9, 8, "speech.done", speech_id="sp_1", interrupted=False),
    ]
    records.append(
        {
            "kind": "stream",
            "sid": SID,
            "frames": [[e["seq"], e["type"], 0.0] for e in events],
            "connections": 2,
            "closes": [],
        }
    )
    records.append(
        {
            "kind": "multi",
            "frames": [[e["id"], SID, e["seq"], e["type"]] for e in events],
            "connections": 1,
            "closes": [],
        }
    )
    records.append({"kind": "settle", "ok": True, "seconds": 1.0, "detail": ""})
    durable = {
        "sessions": [
            {
                "id": SID,
                "agent": "tester",
                "state": "active",
                "metadata": {"chaos_key": "c1"},
                "owner_node": "node-a",
                "owner_epoch": 3,
            }
        ],
        "chat_items": [
            _item(0, "item_1", "message", None, role="user", text="input i1"),
            _item(1, "item_2", "function_call", "call_1"),
            _item(2, "item_3", "function_call_output", "call_1"),
        ],
        "tool_calls": [
            {
                "session_id": SID,
                "call_id": "call_1",
                "name": "slow",
                "status": "completed",
                "background": False,
                "speech_id": "sp_1",
                "output": "slept",
            }
        ],
        "speeches": [
            {"session_id": SID, "id": "sp_1", "source": "reply", "state": "done", "interrupted": False, "text": "x"}
        ],
        "events": events,
        "idempotency_keys": [
            {"key": "c1", "scope": "s", "status_code": 201},
            {"key": "i1", "scope": "s", "status_code": 202},
        ],
        "nodes": [{"id": "node-a", "state": "live", "leased": True}],
    }
    return records, durable


def _op(op: str, sid: str | None, key: str, status: int, body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "kind": "op",
        "op": op,
        "sid": sid,
        "key": key,
        "t0": 10.0,
        "t1": 10.1,
        "attempts": [[10.1, status, None]],
        "status": status,
        "code": None,
        "body": body,
        **fields,
    }


def _item(pos: int, item_id: str, kind: str, call_id: str | None, **data: Any) -> dict[str, Any]:
    return {
        "session_id": SID,
        "pos": pos,
        "item_id": item_id,
        "type": kind,
        "call_id": call_id,
        "data": {"id": item_id, "type": kind, **data},
    }


def _classes(records: list[dict[str, Any]], durable: dict[str, list[dict[str, Any]]]) -> dict[str, list[Violation]]:
    found: dict[str, list[Violation]] = {}
    for violation in check(History.of_records(records), durable):
        found.setdefault(violation.cls, []).append(violation)
    return found


def test_a_clean_history_has_no_violation():
    records, durable = _clean()
    assert _classes(records, durable) == {}


def test_an_accepted_input_missing_from_the_chat_is_lost_and_a_keyed_input_applied_twice_is_a_duplicate():
    records, durable = _clean()
    records.append(_op("input", SID, "i2", 202, {"item_id": "item_9", "speech_id": "sp_9"}, text="input i2"))
    durable["idempotency_keys"].append({"key": "i2", "scope": "s", "status_code": 202})
    assert set(_classes(records, durable)) == {"lost-input"}

    records, durable = _clean()
    durable["chat_items"].append(_item(3, "item_7", "message", None, role="user", text="input i1"))
    assert set(_classes(records, durable)) == {"duplicate-effect"}


def test_one_create_key_with_two_sessions_is_a_duplicate_and_a_2xx_without_its_key_record_is_flagged():
    records, durable = _clean()
    durable["sessions"].append({**durable["sessions"][0], "id": "sess_2"})
    found = _classes(records, durable)
    assert "duplicate-effect" in found

    records, durable = _clean()
    durable["idempotency_keys"] = [k for k in durable["idempotency_keys"] if k["key"] != "i1"]
    assert set(_classes(records, durable)) == {"idempotency-record"}


def test_an_input_without_a_generation_after_it_is_unanswered_unless_a_client_interrupt_ended_its_queued_reply():
    records, durable = _clean()
    durable["events"] = [e for e in durable["events"] if e["type"] != "generation.started"]
    _renumber(records, durable)
    found = _classes(records, durable)
    assert "unanswered-input" in found and "unreplied-result" in found

    records, durable = _clean()
    records[0]["role"] = "chat"
    durable["events"] = [e for e in durable["events"] if e["type"] != "generation.started" and "tool" not in e["type"]]
    durable["events"][-1]["data"]["interrupted"] = True
    durable["tool_calls"] = []
    durable["chat_items"] = durable["chat_items"][:1]
    _renumber(records, durable)
    assert set(_classes(records, durable)) == {"unanswered-input"}
    records.append(_op("interrupt", SID, "x1", 200, {"speech_id": "sp_1", "interrupted": True}))
    durable["idempotency_keys"].append({"key": "x1", "scope": "s", "status_code": 200})
    assert _classes(records, durable) == {}


def test_a_call_left_running_or_with_two_outputs_or_whose_row_disagrees_with_its_event():
    for change in ("running", "two outputs", "status"):
        records, durable = _clean()
        if change == "running":
            durable["tool_calls"][0]["status"] = "running"
        elif change == "two outputs":
            durable["chat_items"].append(_item(3, "item_4", "function_call_output", "call_1"))
        else:
            durable["tool_calls"][0]["status"] = "interrupted"
        assert set(_classes(records, durable)) == {"call-ends"}, change


def test_a_gap_in_the_log_and_streams_that_missed_repeated_or_invented_an_event():
    records, durable = _clean()
    durable["events"][3]["seq"] = 40
    assert "event-log" in _classes(records, durable)

    for change in ("missed", "repeated", "phantom"):
        records, durable = _clean()
        stream = next(r for r in records if r["kind"] == "stream")
        if change == "missed":
            del stream["frames"][2]
        elif change == "repeated":
            stream["frames"].insert(3, list(stream["frames"][2]))
        else:
            stream["frames"][4][1] = "tool.progress"
        found = _classes(records, durable)
        assert set(found) == {"stream"}, (change, found)

    records, durable = _clean()
    multi = next(r for r in records if r["kind"] == "multi")
    del multi["frames"][1]
    assert set(_classes(records, durable)) == {"stream"}


def test_a_5xx_other_than_the_retryable_503s_an_unowned_session_a_session_ended_edge_close_and_no_settle():
    records, durable = _clean()
    records[2]["attempts"].insert(0, [10.0, 503, "session_moving"])
    assert _classes(records, durable) == {}
    records[2]["attempts"].insert(0, [10.0, 500, "internal_error"])
    records.append(
        {
            "kind": "edge",
            "sid": SID,
            "closes": [[11.0, 4410, ""], [12.0, 1000, "session closed"]],
            "barge_ins": [],
            "connections": 2,
            "speeches": 0,
        }
    )
    records.append({"kind": "settle", "ok": False, "seconds": 240.0, "detail": "calls running 1"})
    durable["nodes"][0]["leased"] = False
    found = _classes(records, durable)
    assert {k: len(v) for k, v in found.items()} == {
        "answer-5xx": 1,
        "edge-close": 1,
        "not-settled": 1,
        "unowned-session": 1,
    }


def _edge(*transcripts: dict[str, Any], closes: list[list[Any]] | None = None) -> dict[str, Any]:
    return {
        "kind": "edge",
        "sid": SID,
        "edge_id": "e1",
        "closes": closes or [],
        "barge_ins": [],
        "connections": 2,
        "attempts": 3,
        "speeches": 0,
        "transcripts": list(transcripts),
    }


def _transcript(tid: str, text: str, item_id: str | None, *, sends: int = 1) -> dict[str, Any]:
    """A final transcript as the edge recorded it: taken (at 12.0, as ``item_id``) unless ``item_id`` is None."""
    taken = item_id is not None
    return {
        "id": tid,
        "text": text,
        "said_at": 11.0,
        "taken_at": 12.0 if taken else None,
        "item_id": item_id,
        "sends": sends,
        "acks": int(taken),
        "errors": [],
    }


def _heard(records: list[dict[str, Any]], durable: dict[str, list[dict[str, Any]]], *messages: str) -> None:
    """A media session whose edge said two transcripts, both taken (the second after a resend); ``messages``: the
    item ids the chat holds for the first one's text."""
    records[0]["role"] = "media"
    records.append(_edge(_transcript("t1", "heard 1", "item_h1"), _transcript("t2", "heard 2", "item_h2", sends=2)))
    for n, item_id in enumerate([*messages, "item_h2"], start=10):
        text = "heard 2" if item_id == "item_h2" else "heard 1"
        durable["chat_items"].append(_item(n, item_id, "message", None, role="user", text=text))


def test_an_edge_transcript_taken_once_as_a_user_message_is_clean():
    records, durable = _clean()
    _heard(records, durable, "item_h1")
    assert _classes(records, durable) == {}


def test_an_edge_transcript_taken_but_not_in_the_chat_or_as_another_item_is_lost():
    for messages in ((), ("item_other",)):
        records, durable = _clean()
        _heard(records, durable, *messages)
        found = _classes(records, durable)
        assert {k: len(v) for k, v in found.items()} == {"lost-input": 1}, messages
        assert "t1" in found["lost-input"][0].detail


def test_an_edge_transcript_never_taken_is_lost_while_its_session_lives():
    records, durable = _clean()
    records[0]["role"] = "media"
    records.append(_edge(_transcript("t1", "heard 1", None, sends=4)))
    found = _classes(records, durable)
    assert {k: len(v) for k, v in found.items()} == {"lost-input": 1}
    assert "never taken" in found["lost-input"][0].detail

    durable["sessions"][0]["state"] = "closed"
    assert _classes(records, durable) == {}


def test_an_edge_transcript_stored_twice_is_a_duplicate():
    records, durable = _clean()
    _heard(records, durable, "item_h1", "item_h1b")
    found = _classes(records, durable)
    assert {k: len(v) for k, v in found.items()} == {"duplicate-effect": 1}
    assert "t1" in found["duplicate-effect"][0].detail


def test_a_4409_to_an_edge_is_an_edge_close_even_after_its_session_ended():
    records, durable = _clean()
    records.append(_edge(closes=[[11.0, 4410, "session moved"], [12.0, 1011, ""]]))
    assert _classes(records, durable) == {}
    records[-1]["closes"].append([13.0, 4409, "replaced by another edge"])
    assert {k: len(v) for k, v in _classes(records, durable).items()} == {"edge-close": 1}
    durable["sessions"][0]["state"] = "closed"
    assert {k: len(v) for k, v in _classes(records, durable).items()} == {"edge-close": 1}


def test_a_media_handshake_answered_5xx_other_than_503_is_flagged():
    records, durable = _clean()
    records.append(_edge(closes=[[11.0, 503, "handshake"], [12.0, 404, "handshake"]]))
    assert _classes(records, durable) == {}
    records[-1]["closes"].append([13.0, 500, "handshake"])
    assert {k: len(v) for k, v in _classes(records, durable).items()} == {"answer-5xx": 1}


def test_an_input_whose_queued_reply_a_later_edge_transcript_ended_is_answered():
    records, durable = _clean()
    records[0]["role"] = "media"
    durable["events"] = [e for e in durable["events"] if e["type"] != "generation.started" and "tool" not in e["type"]]
    durable["events"][-1]["data"]["interrupted"] = True
    durable["tool_calls"] = []
    durable["chat_items"] = durable["chat_items"][:1]
    _renumber(records, durable)
    records.append(_edge(_transcript("t1", "heard 1", None)))
    assert set(_classes(records, durable)) == {"unanswered-input", "lost-input"}  # said, never taken: no excuse
    records[-1]["transcripts"] = [_transcript("t1", "heard 1", "item_h1")]
    durable["chat_items"].append(_item(1, "item_h1", "message", None, role="user", text="heard 1"))
    assert _classes(records, durable) == {}


def _renumber(records: list[dict[str, Any]], durable: dict[str, list[dict[str, Any]]]) -> None:
    """Give the events left seq 1..N again, and the clients' streams what the log now holds."""
    for seq, event in enumerate(durable["events"], start=1):
        event["seq"] = seq
    for record in records:
        if record["kind"] == "stream":
            record["frames"] = [[e["seq"], e["type"], 0.0] for e in durable["events"]]
        elif record["kind"] == "multi":
            record["frames"] = [[e["id"], SID, e["seq"], e["type"]] for e in durable["events"]]


def test_the_checker_retries_exactly_what_the_cluster_documents_as_retryable() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    table = doc.split("### Retryable answers", 1)[1].split("\n### ", 1)[0]
    documented = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert documented == set(RETRYABLE)


def _held(reply_generated: bool, *, generation_while_held: bool = False) -> tuple[list[Any], dict[str, Any]]:
    """A chat session: taken over, an input while held (answered with no speech), the operator's words, a hand-back
    that owes a reply."""
    records, durable = _clean()
    records[0]["role"] = "chat"
    durable["events"] = [*durable["events"][:4], durable["events"][-1]]  # input i1 answered; no tool call
    durable["tool_calls"], durable["chat_items"] = [], durable["chat_items"][:1]
    records.append(_op("takeover", SID, "t1", 200, {"operator": "desk", "since": "x"}))
    records.append(_op("input", SID, "i2", 202, {"item_id": "item_2", "speech_id": None}, text="input i2"))
    records.append(_op("takeover_say", SID, "s1", 202, {"speech_id": "sp_op"}, text="operator s1"))
    durable["chat_items"].append(_item(1, "item_2", "message", None, role="user", text="input i2"))
    durable["speeches"].append(
        {
            "session_id": SID,
            "id": "sp_op",
            "source": "operator",
            "state": "done",
            "interrupted": False,
            "text": "operator s1",
        }
    )
    for key, code in (("t1", 200), ("i2", 202), ("s1", 202)):
        durable["idempotency_keys"].append({"key": key, "scope": "s", "status_code": code})
    held = [
        _event(20, 0, "session.taken_over", operator="desk", since="x"),
        _event(21, 0, "user.input", item_id="item_2", text="input i2", final=True),
        _event(22, 0, "speech.created", speech_id="sp_op", source="operator"),
    ]
    if generation_while_held:
        held.append(_event(23, 0, "generation.started", speech_id="sp_x", step=0))
    held += [
        _event(24, 0, "speech.done", speech_id="sp_op", interrupted=False),
        _event(25, 0, "session.handed_back", operator="desk", since="x", until="y", reply_speech_id="sp_2"),
        _event(26, 0, "speech.created", speech_id="sp_2", source="reply"),
    ]
    if reply_generated:
        held.append(_event(27, 0, "generation.started", speech_id="sp_2", step=0))
    held.append(_event(28, 0, "speech.done", speech_id="sp_2", interrupted=False))
    durable["events"] += held
    _renumber(records, durable)
    return records, durable


def test_a_takeover_round_trip_with_its_reply_is_clean():
    assert _classes(*_held(True)) == {}


def test_a_generation_while_held_and_a_hand_back_whose_reply_never_ran_are_flagged():
    assert set(_classes(*_held(True, generation_while_held=True))) == {"held-generation"}
    assert set(_classes(*_held(False))) == {"unanswered-input"}
