"""A log line is one line: whatever text a record carries (a client's path, a model's error, a tool's output), its
controls are shown as escapes, so nobody who can put text in a log can forge a line of it."""

from __future__ import annotations

import json
import logging

import pytest

from tests.log_capture import service_log

FORGED = "2026-01-01 00:00:00,000 ERROR switchboard.api: admin key rotated by root"
HOSTILE = f"x\n{FORGED}\r\n{FORGED}\x1b[2K\x85\u2028{FORGED}\u202e\x00"


def _margin_lines(text: str) -> list[str]:
    """The lines a reader takes for records: those that start at the margin."""
    return [line for line in text.splitlines() if line and not line.startswith(" ")]


@pytest.mark.parametrize("json_lines", [False, True])
def test_a_record_is_one_line_whatever_its_message_and_fields_hold(json_lines: bool):
    with service_log(json_lines=json_lines) as out:
        log = logging.getLogger("switchboard.test")
        log.warning("tool %s failed: %s", "book", HOSTILE, extra={"session_id": HOSTILE, "call_id": "c1"})
        try:
            raise ValueError(HOSTILE)
        except ValueError:
            log.exception("model error %s", HOSTILE)
    text = out.getvalue()
    for raw in ("\r", "\x1b", "\x85", "\u2028", "\u202e", "\x00"):
        assert raw not in text, repr(raw)
    records = _margin_lines(text)
    assert len(records) == 2, text
    if json_lines:
        assert json.loads(records[0])["message"] == f"tool book failed: {HOSTILE}"
        return
    escaped = f"x\\n{FORGED}\\r\\n{FORGED}\\x1b[2K\\x85\\u2028{FORGED}\\u202e\\x00"
    assert records[0].endswith(f"tool book failed: {escaped} session_id={escaped} call_id=c1")
    assert records[1].endswith(f"model error {escaped}")
    assert "    Traceback (most recent call last):" in text  # the traceback stays readable, on indented lines
