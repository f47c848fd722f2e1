"""The line `switchboard tail` prints for each event type, plain and in colour."""

from __future__ import annotations

from typing import Any

import pytest

from switchboard.cli.output import Style, describe, event_line
from switchboard.runtime.event_types import EVENT_PAYLOADS, EventPayload

PLAIN = Style(False, True)
ASCII = Style(False, False)
COLOUR = Style(True, True)


def ev(kind: str, **data: Any) -> dict[str, Any]:
    return {"seq": 7, "type": kind, "at": "2026-01-01T00:00:00+00:00", "data": data}


def c(text: str, codes: str) -> str:
    return f"\x1b[{codes}m{text}\x1b[0m"


LONG = " ".join(f"w{i}" for i in range(100))
LONG_SHOWN = LONG[:199] + "…"

# (event, plain line, coloured line)
CASES: list[tuple[dict[str, Any], str, str]] = [
    (
        ev("session.started", agent="concierge"),
        "session started with agent concierge",
        c("session started with agent concierge", "1"),
    ),
    (
        ev("session.recovered", agent="concierge"),
        "──── session recovered after a restart (agent concierge) ────",
        c("──── session recovered after a restart (agent concierge) ────", "1;33"),
    ),
    (ev("session.closed"), "session closed", c("session closed", "1")),
    (ev("session.failed", reason="boom"), "session failed: boom", c("session failed: boom", "1;31")),
    (
        ev("session.failed", reason="unknown agent 'claims'", agent="claims"),
        "session failed: unknown agent 'claims' (agent claims)",
        None,
    ),
    (ev("session.failed"), "session failed: no reason given", c("session failed: no reason given", "1;31")),
    (ev("agent.state", state="thinking"), "agent is thinking", c("agent is thinking", "2")),
    (ev("agent.handoff", from_agent="a", to_agent="b"), "handoff a → b", c("handoff a → b", "35")),
    (ev("user.input", text="hi  there\n"), "user: hi there", c("user: ", "32;1") + "hi there"),
    (
        ev("user.input", role="system", text="note", final=False),
        "system (interim): note",
        c("system (interim): ", "32;1") + "note",
    ),
    (ev("user.input", text=LONG), "user: " + LONG_SHOWN, c("user: ", "32;1") + LONG_SHOWN),
    (
        ev("speech.created", speech_id="sp1", source="reply"),
        "speech sp1 queued (reply)",
        c("speech sp1 queued (reply)", "2"),
    ),
    (
        ev("generation.started", speech_id="sp1", step=2),
        "thinking (speech sp1, step 2)",
        c("thinking (speech sp1, step 2)", "2"),
    ),
    (ev("speech.started", speech_id="sp1"), "speaking sp1", c("speaking sp1", "36")),
    (
        ev("speech.interrupted", speech_id="sp1", played_text="Hello, I"),
        "interrupted sp1; heard: Hello, I",
        c("interrupted sp1; heard: ", "33;1") + "Hello, I",
    ),
    (ev("speech.done", speech_id="sp1"), "speech sp1 done", c("speech sp1 done", "2")),
    (
        ev("speech.done", speech_id="sp1", interrupted=True),
        "speech sp1 done (interrupted)",
        c("speech sp1 done (interrupted)", "2"),
    ),
    (
        ev("chat.item", item={"type": "message", "role": "assistant", "text": "Hi."}),
        "assistant: Hi.",
        c("assistant: ", "36;1") + "Hi." + c("", "33"),
    ),
    (
        ev("chat.item", item={"type": "message", "role": "assistant", "text": "Hel", "interrupted": True}),
        "assistant: Hel [interrupted]",
        c("assistant: ", "36;1") + "Hel" + c(" [interrupted]", "33"),
    ),
    (
        ev("chat.item", item={"type": "function_call", "name": "book", "arguments": {"n": 2, "city": "Zürich"}}),
        'call book(n=2, city="Zürich")',
        c('call book(n=2, city="Zürich")', "2"),
    ),
    (
        ev("chat.item", item={"type": "function_call", "name": "book", "arguments": "not a dict"}),
        "call book()",
        c("call book()", "2"),
    ),
    (
        ev("chat.item", item={"type": "function_call_output", "name": "book", "output": "booked"}),
        "output of book: booked",
        c("output of book: booked", "2"),
    ),
    (ev("chat.item", item={"type": "agent_handoff"}), "chat item agent_handoff", c("chat item agent_handoff", "2")),
    (ev("chat.item"), "chat item None", c("chat item None", "2")),
    (
        ev("tool.started", name="book", arguments={"n": 2}, call_id="c1", cancellable=True),
        "tool book(n=2) started c1 [cancellable]",
        c("tool book(n=2) started", "33") + c(" c1 [cancellable]", "2"),
    ),
    (
        ev("tool.started", name="book", arguments={}, call_id="c1"),
        "tool book() started c1",
        c("tool book() started", "33") + c(" c1", "2"),
    ),
    (
        ev("tool.progress", call_id="c1", progress=0.5, message="half way"),
        "c1 [██████████░░░░░░░░░░]  50% half way",
        c("c1", "33") + " [" + c("█" * 10, "32") + "░" * 10 + "]  50% half way",
    ),
    (
        ev("tool.progress", call_id="c1", message="working"),
        "c1 [" + "▒" * 20 + "] working",  # no fraction: indeterminate, no percentage
        c("c1", "33") + " [" + c("▒" * 20, "32") + "] working",
    ),
    (ev("tool.progress", call_id="c1", progress=1), "c1 [████████████████████] 100%", None),
    (ev("tool.progress", call_id="c1"), "c1 [" + "▒" * 20 + "]", None),
    (
        ev("operator.action", action="cancel_tool", actor="night-desk", call_id="c1", idempotency_key="k1"),
        "operator night-desk: cancel_tool (c1, key k1)",
        None,
    ),
    (ev("operator.action", action="close", actor="anonymous"), "operator anonymous: close", None),
    (
        ev("tool.ended", name="book", call_id="c1", status="completed", output="booked"),
        "tool book completed: booked",
        c("tool book completed", "32;1") + ": booked",
    ),
    (
        ev("tool.ended", call_id="c1", status="cancelled", output={"reason": "operator"}),
        'tool c1 cancelled: {"reason": "operator"}',
        c("tool c1 cancelled", "35;1") + ': {"reason": "operator"}',
    ),
    (
        ev("tool.ended", name="book", status="failed"),
        "tool book failed: null",
        c("tool book failed", "31;1") + ": null",
    ),
    (ev("tool.ended", name="book", status="running", output=""), "tool book running: ", None),
    (
        ev("generation.failed", error="rate limited"),
        "generation failed: rate limited",
        c("generation failed: rate limited", "31"),
    ),
    (ev("something.new", a=1, b="x"), '{"a": 1, "b": "x"}', c('{"a": 1, "b": "x"}', "2")),
    ({"type": "no.data", "data": None}, "{}", c("{}", "2")),
]


@pytest.mark.parametrize(
    ("event", "plain", "coloured"), CASES, ids=[f"{e['type']}-{i}" for i, (e, _, _) in enumerate(CASES)]
)
def test_describe(event: dict[str, Any], plain: str, coloured: str | None) -> None:
    assert describe(event, PLAIN) == plain
    if coloured is not None:
        assert describe(event, COLOUR) == coloured


def test_progress_names_the_tool_started_earlier_and_draws_ascii_without_unicode() -> None:
    event = ev("tool.progress", call_id="c1", progress=0.25, message="step 1/4")
    assert describe(event, ASCII, {"c1": "search"}) == "search [#####---------------]  25% step 1/4"
    assert describe(event, ASCII, {"other": "x"}) == "c1 [#####---------------]  25% step 1/4"


def test_event_line_puts_seq_clock_and_type_in_columns() -> None:
    line = event_line(ev("session.closed"), PLAIN)
    seq, clock, kind, *rest = line.split()
    assert (seq, kind, " ".join(rest)) == ("7", "session.closed", "session closed")
    assert len(clock) == len("00:00:00.000")
    assert line == f"    7 {clock} session.closed      session closed"
    assert event_line({"seq": 1, "type": "x", "at": "not a time", "data": {}}, PLAIN).startswith("    1 not a time x ")


# Fields a line deliberately leaves out (ids the operator does not need on every line, or shown another way).
NOT_SHOWN: dict[str, set[str]] = {
    "session.recovered": {"interrupted_calls", "retried_calls", "interrupted_speeches"},
    "session.failed": {"interrupted_calls"},
    "user.input": {"item_id", "final", "role"},
    "operator.action": {"item_id"},  # the input has its own line (user.input)
    "session.taken_over": {"since"},  # the line's own time
    "session.handed_back": {"until"},  # the line's own time
    "generation.started": {"preemptive"},
    "generation.speculative": {"state", "user_text"},
    "generation.failed": {"speech_id", "step"},
    "tool.started": {"speech_id"},
    "tool.progress": {"call_id"},
    "tool.ended": {"call_id", "is_error", "reply_speech_id"},  # the reply it is owed has its own line (speech.created)
    "speech.done": {"interrupted"},
}


def _example(model: type[EventPayload]) -> EventPayload:
    """A payload of ``model`` with every text field set to a value that names it."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if annotation in (str, str | None):
            values[name] = f"<{name}>"
        elif name == "item":
            values[name] = {"type": "message", "id": "i1", "role": "assistant", "text": "<item>", "created_at": NOW}
    return model.model_validate({**_defaults(model), **values})


NOW = "2026-01-01T00:00:00+00:00"


def _defaults(model: type[EventPayload]) -> dict[str, Any]:
    # the non-text required fields of each payload, filled with plain values
    samples: dict[str, Any] = {
        "interrupted_calls": [],
        "retried_calls": [],
        "interrupted_speeches": [],
        "state": "thinking" if model.type == "agent.state" else "started",
        "final": True,
        "role": "user",
        "source": "reply",
        "interrupted": False,
        "step": 1,
        "preemptive": False,
        "arguments": {},
        "cancellable": False,
        "progress": 0.5,
        "status": "completed",
        "is_error": False,
        "action": "cancel_tool",
        "since": NOW,
        "until": NOW,
        "kind": "say",
        "at": "idle",
    }
    return {name: samples[name] for name in model.model_fields if name in samples}


@pytest.mark.parametrize("model", EVENT_PAYLOADS, ids=[m.type for m in EVENT_PAYLOADS])
def test_every_text_field_of_every_event_type_reaches_the_line(model: type[EventPayload]) -> None:
    """The line is built from the typed payload: a formatter reading a field the event does not carry (the
    ``reason`` of ``session.failed`` read as ``error``) prints nothing where the operator needs the text."""
    payload = _example(model)
    line = describe({"type": model.type, "data": payload.data()}, PLAIN)
    skipped = NOT_SHOWN.get(model.type, set())
    for name, value in payload.data().items():
        if name in skipped or not isinstance(value, str):
            continue
        assert value in line, f"{model.type}: {name} is not in {line!r}"


def _call(status: str, *progress: float | None) -> Any:
    from switchboard.client import ToolCall

    reports = [{"message": f"report {i}", "progress": p, "at": NOW} for i, p in enumerate(progress)]
    return ToolCall.model_validate(
        {
            "session_id": "s1",
            "call_id": "c1",
            "name": "track",
            "status": status,
            "cancellable": False,
            "scope": "agent",
            "background": True,
            "progress": reports,
            "started_at": NOW,
        }
    )


@pytest.mark.parametrize(
    ("call", "bar"),
    [
        (_call("running", 0.67), "[#######---]  67% report 0"),
        # the last report said 67%, but the call completed: its bar is full
        (_call("completed", 0.67), "[##########] 100% report 0"),
        # no fraction: an indeterminate bar, never a percentage
        (_call("running", None), "[~~~~~~~~~~] report 0"),
        (_call("running"), ""),
    ],
)
def test_the_tools_table_never_shows_a_finished_call_unfinished(call: Any, bar: str) -> None:
    from switchboard.cli.operator import _call_row

    assert _call_row(call, ASCII)[5] == bar
