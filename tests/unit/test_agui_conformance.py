"""The AG-UI 1.1 conformance corpus (the part vendored in tests/agui_conformance) through ``ag-ui-validate``, the
validator the end-to-end tests judge Switchboard's streams with: it finds an error in every stream the specification
makes fatal and none in a clean one, so its verdict on Switchboard's streams is the specification's. And a run an
operator cuts short ends as the corpus's ``cancelled`` fixture does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ag_ui_validate.pytest_plugin import validate_agui

from switchboard.api.streams.agui import AguiTranslator
from switchboard.runtime.events import Event

STREAMS = Path(__file__).resolve().parents[1] / "agui_conformance" / "streams"
VENDORED = (
    "activity-snapshot-then-delta",
    "conformant-run-is-quiet",
    "content-without-start-fatal",
    "event-after-run-finished-fatal",
    "first-event-not-run-started-fatal",
    "nested-run-started-fatal",
    "open-message-at-run-finished-fatal",
    "raw-and-custom-pass-through",
    "run-error-then-new-run-continues",
    "run-finished-cancelled-outcome-accepted",
    "state-delta-applies",
    "tool-call-triad-assembles",
    "two-sequential-runs-accumulate",
)


def fixture(name: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((STREAMS / f"{name}.json").read_text(encoding="utf-8"))
    return found


def test_the_vendored_streams_are_the_listed_ones():
    assert sorted(p.stem for p in STREAMS.glob("*.json")) == list(VENDORED)
    assert all(fixture(name)["name"] == name for name in VENDORED)


@pytest.mark.parametrize("name", VENDORED)
def test_the_validator_gives_the_corpus_verdict(name: str):
    expect = fixture(name)["expect"]
    report = validate_agui(fixture(name)["stream"])
    if expect["outcome"] == "failed":
        assert report.summary.errors > 0, f"{name}: the specification makes this stream fatal"
    else:
        problems = [d for d in report.diagnostics if d.severity in ("error", "warning")]
        assert report.summary.errors == 0, problems
        if expect.get("noWarnings"):
            assert report.summary.warnings == 0, problems


def test_a_run_an_operator_cuts_short_ends_as_the_cancelled_fixture():
    log = [
        ("user.input", {"item_id": "i1", "text": "talk", "final": True, "role": "user"}),
        ("speech.created", {"speech_id": "s1", "source": "reply"}),
        ("agent.state", {"state": "speaking"}),
        ("speech.interrupted", {"speech_id": "s1", "played_text": "delivered before the stop"}),
        ("operator.action", {"action": "interrupt", "actor": "op", "speech_id": "s1"}),
    ]
    translator = AguiTranslator("cancelled")
    made = [
        json.loads(e.model_dump_json(by_alias=True))
        for i, (t, d) in enumerate(log)
        for e in translator.translate(Event(seq=i + 1, session_id="cancelled", type=t, data=d))
    ]
    corpus_end = fixture("run-finished-cancelled-outcome-accepted")["stream"][-1]
    assert made[-1]["type"] == corpus_end["type"] and made[-1]["outcome"] == corpus_end["outcome"]
    report = validate_agui(made)
    assert report.summary.errors == report.summary.warnings == 0
