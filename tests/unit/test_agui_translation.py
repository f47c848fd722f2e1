"""The AG-UI translation: streams in the same state share one encoding of each event, and get exactly what a
translation of their own would give them, whatever point they started from."""

from __future__ import annotations

import json
from typing import Any

from ag_ui.core import RunFinishedCancelledOutcome, RunFinishedEvent
from ag_ui_validate.pytest_plugin import assert_valid_agui

from switchboard.api.streams.agui import AguiTranslator, RunTranslator, SharedEncodings, encode_sse, encode_ws
from switchboard.runtime.events import Event

LOG: list[tuple[str, dict[str, Any]]] = [
    ("session.started", {"agent": "a"}),
    ("agent.state", {"state": "listening"}),
    ("user.input", {"item_id": "i1", "text": "hi", "final": True, "role": "user"}),
    ("agent.state", {"state": "thinking"}),
    ("tool.started", {"call_id": "c1", "name": "t", "arguments": {"x": 1}, "cancellable": False, "speech_id": "s"}),
    ("tool.progress", {"call_id": "c1", "message": "half", "progress": 0.5}),
    ("agent.state", {"state": "listening"}),  # the call still runs: the run stays open
    ("tool.ended", {"call_id": "c1", "name": "t", "status": "completed", "output": "ok", "is_error": False}),
    ("session.closed", {}),
]


def events(sid: str) -> list[Event]:
    return [Event(seq=i + 1, session_id=sid, type=t, data=d) for i, (t, d) in enumerate(LOG)]


def test_shared_encodings_equal_a_streams_own_translation_from_any_start():
    log = events("shared-1")
    shared = SharedEncodings()
    for start in range(len(log)):
        own, first, second = AguiTranslator("shared-1"), AguiTranslator("shared-1"), AguiTranslator("shared-1")
        for event in log[start:]:
            expected = encode_sse(own.translate(event), event.seq)
            assert shared.sse(first, event) == expected
            assert shared.sse(second, event) == expected  # the second stream is served from the first's work
            assert first.state_key() == second.state_key() == own.state_key()


def test_a_run_lasts_until_the_agent_listens_with_none_of_its_calls_running():
    translator = AguiTranslator("run-1")
    out = [[e.type.value for e in translator.translate(ev)] for ev in events("run-1")]
    assert out[6] == ["STATE_DELTA"]  # listening, but c1 still runs
    assert out[7] == ["TOOL_CALL_RESULT", "RUN_FINISHED"]
    assert out[8] == ["RUN_STARTED", "STATE_DELTA", "RUN_FINISHED"]
    ws = AguiTranslator("run-2")
    frames = [json.loads(f) for ev in events("run-2") for f in encode_ws(ws.translate(ev), ev.seq)]
    assert_valid_agui(frames, max_warnings=0)
    assert [f["rawEvent"]["seq"] for f in frames if "rawEvent" in f] == list(range(1, len(LOG) + 1))


def test_streams_in_the_same_state_share_translations_and_a_state_change_is_seen():
    log = events("s-key")
    shared = SharedEncodings()
    first, second = AguiTranslator("s-key"), AguiTranslator("s-key")
    for event in log:
        assert shared.ws(first, event) == shared.ws(second, event)  # the second takes the first's translation
        assert second.state_key() == first.state_key()
    assert first.state_key() is first.state_key()  # built once per change of state, not per event
    fresh = AguiTranslator("s-key")  # a stream that joins later, from the start: the same frames as its own translation
    assert [shared.ws(fresh, e) for e in log] == [encode_ws(t, e.seq) for t, e in zip(replay(log), log, strict=True)]


def replay(log: list[Event]) -> list[Any]:
    translator = AguiTranslator(log[0].session_id)
    return [translator.translate(e) for e in log]


def test_a_progress_updates_chat_items_make_no_agui_event_and_the_stream_stays_resumable():
    pair = [
        {"type": "function_call", "id": "i2", "call_id": "c1/update/2", "name": "t", "arguments": "{}"},
        {"type": "function_call_output", "id": "i3", "call_id": "c1/update/2", "name": "t", "output": "50%"},
    ]
    log = events("upd")[:5]  # up to tool.started
    log += [Event(seq=6 + k, session_id="upd", type="chat.item", data={"item": item}) for k, item in enumerate(pair)]
    log.append(Event(seq=8, session_id="upd", type="tool.progress", data={"call_id": "c1", "message": "m"}))
    first_call = {"type": "function_call", "id": "i1", "call_id": "c1", "name": "t", "arguments": "{}"}
    log.append(Event(seq=9, session_id="upd", type="chat.item", data={"item": first_call}))
    log += [Event(seq=10 + k, session_id="upd", type=t, data=d) for k, (t, d) in enumerate(LOG[6:])]
    translator = AguiTranslator("upd")
    out = [[e.type.value for e in translator.translate(ev)] for ev in log]
    assert out[5] == out[6] == []  # the update's pair: its ACTIVITY_SNAPSHOT carries it
    assert out[7] == ["ACTIVITY_SNAPSHOT"]
    assert out[8] == ["CUSTOM"]  # any other tool item still does
    assert encode_sse([], 6) == "" and encode_ws([], 6) == []
    shared, fresh = SharedEncodings(), AguiTranslator("upd")
    frames = [json.loads(f) for ev in log for f in shared.ws(fresh, ev)]
    assert_valid_agui(frames, max_warnings=0)
    assert [f["rawEvent"]["seq"] for f in frames if "rawEvent" in f] == [1, 2, 3, 4, 5, 8, 9, 10, 11, 12]


def log_of(sid: str, entries: list[tuple[str, dict[str, Any]]]) -> list[Event]:
    return [Event(seq=i + 1, session_id=sid, type=t, data=d) for i, (t, d) in enumerate(entries)]


ASSISTANT = {"type": "message", "id": "i9", "role": "assistant", "text": "Done.", "interrupted": False}
BACKGROUND = [
    ("user.input", {"item_id": "i1", "text": "go", "final": True, "role": "user"}),
    ("speech.created", {"speech_id": "s1", "source": "reply"}),
    ("agent.state", {"state": "speaking"}),
    ("tool.started", {"call_id": "c1", "name": "t", "arguments": {}, "cancellable": False, "speech_id": "s1"}),
    ("speech.done", {"speech_id": "s1", "interrupted": False}),
    ("agent.state", {"state": "listening"}),  # the call runs on in the background
    # its end makes a deferred reply owed (committed with it): the run waits for that reply too
    (
        "tool.ended",
        {
            "call_id": "c1",
            "name": "t",
            "status": "completed",
            "output": "ok",
            "is_error": False,
            "reply_speech_id": "s2",
        },
    ),
    ("speech.created", {"speech_id": "s2", "source": "deferred_reply"}),
    ("agent.state", {"state": "speaking"}),
    ("chat.item", {"item": ASSISTANT}),
    ("agent.state", {"state": "listening"}),
    ("speech.done", {"speech_id": "s2", "interrupted": False}),
]


def test_the_reply_to_a_background_result_stays_in_the_run_of_the_result():
    translator = AguiTranslator("bg")
    out = [[e.type.value for e in translator.translate(ev)] for ev in log_of("bg", BACKGROUND)]
    assert out[6] == ["TOOL_CALL_RESULT"]  # quiet but for the reply it makes owed: the run goes on
    assert out[9] == ["TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END"]
    assert out[10] == ["STATE_DELTA"]  # listening, the reply's end still to be reported
    assert out[11] == ["CUSTOM", "RUN_FINISHED"]
    assert sum(o.count("RUN_STARTED") for o in out) == 1


def test_an_operators_interrupt_cancels_the_run_and_a_new_input_ends_the_turn_it_cuts_short():
    entries = [
        *BACKGROUND[:4],
        ("speech.interrupted", {"speech_id": "s1", "played_text": ""}),
        ("operator.action", {"action": "interrupt", "actor": "op", "speech_id": "s1"}),
        ("speech.done", {"speech_id": "s1", "interrupted": True}),  # a run of its own: c1 still runs
        ("user.input", {"item_id": "i2", "text": "again", "final": True, "role": "user"}),
        ("speech.created", {"speech_id": "s3", "source": "reply"}),
        ("speech.interrupted", {"speech_id": "s3", "played_text": ""}),
        ("user.input", {"item_id": "i3", "text": "and again", "final": True, "role": "user"}),
    ]
    translator = AguiTranslator("cut")
    out = [translator.translate(ev) for ev in log_of("cut", entries)]
    cancelled = out[5][-1]
    assert isinstance(cancelled, RunFinishedEvent) and cancelled.outcome == RunFinishedCancelledOutcome()
    assert [e.type.value for e in out[6]] == ["RUN_STARTED", "CUSTOM"]  # no RUN_FINISHED: c1 still runs
    # a new input ends the run still open; one whose speech it cut short, cancelled
    first, second = out[7][0], out[10][0]
    assert isinstance(first, RunFinishedEvent) and first.outcome is None
    assert isinstance(second, RunFinishedEvent) and second.outcome == RunFinishedCancelledOutcome()
    made = [json.loads(e.model_dump_json(by_alias=True)) for o in out for e in o]
    assert_valid_agui(made[:-2], max_warnings=0)  # up to the last run, opened by the last input


def test_a_run_translator_makes_the_clients_run_and_ends_with_it():
    user = {"type": "message", "id": "i1", "role": "user", "text": "go", "interrupted": False}
    entries = [
        ("agent.state", {"state": "listening"}),  # before its input: not the run's
        *BACKGROUND[:1],
        ("chat.item", {"item": user}),
        *BACKGROUND[1:],
        ("user.input", {"item_id": "i4", "text": "next", "final": True, "role": "user"}),
    ]
    run = RunTranslator("rt", "client-run", "i1")
    out = [[e.type.value for e in run.translate(ev)] for ev in log_of("rt", entries)]
    assert out[0] == [] and out[1] == ["RUN_STARTED"] and out[2] == []  # the client holds its own message
    assert out[-2] == ["CUSTOM", "RUN_FINISHED"] and run.over and out[-1] == []
    assert run.restarted(0).run_id == "client-run" and not run.calls


def test_every_sse_frame_carries_the_position_to_resume_from():
    translator = AguiTranslator("pos")
    text = encode_sse(translator.translate(events("pos")[0]), 1)
    frames = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert [f["type"] for f in frames] == ["RUN_STARTED", "STATE_SNAPSHOT"]
    assert [f["rawEvent"] for f in frames] == [{"seq": 0}, {"seq": 1}]  # the whole event again, or after it
    assert text.count("id: 1\n") == 1


def test_a_coaching_note_never_reaches_an_agui_client():
    """An operator's note is for the agent only: the user's own UI (an AG-UI client) is not sent it."""
    translator = AguiTranslator("coach-1")
    note = Event(seq=1, session_id="coach-1", type="session.coached", data={"id": "coach_1", "note": "be brief"})
    assert translator.translate(note) == []
    after = Event(seq=2, session_id="coach-1", type="session.started", data={"agent": "a"})
    frames = encode_sse(translator.translate(after), after.seq)
    assert "be brief" not in frames and frames
