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


ADMIN = "ADMIN-key-0123456789abcdef"
CLUSTER = "cluster/secret+é"  # a secret with characters that quote() escapes: its UTF-8 bytes, escaped or not


@pytest.mark.parametrize(
    "sent",
    [
        ADMIN,
        "%41DMIN-key-0123456789abcdef",  # one character escaped
        "ADMIN%2Dkey%2D0123456789abcdef",  # the dashes escaped
        "ADMIN%2dkey%2d0123456789abcdef",  # lowercase hex
        "%41%44%4d%49%4e%2d%6b%65%79-0123456789abcdef",  # every character of a run
        "%2541DMIN-key-0123456789abcdef",  # escaped twice
        "%252541DMIN%252Dkey-0123456789abcdef",  # three times
        "cluster%2Fsecret%2B%C3%A9",
        "cluster%252Fsecret+%c3%a9",
    ],
)
def test_a_server_secret_is_redacted_however_it_is_escaped(sent: str):
    with service_log(secrets=[ADMIN, CLUSTER]) as out:
        logging.getLogger("uvicorn.error").info(
            '%s - "WebSocket %s" [accepted]', "127.0.0.1:5", f"/v1/events?session_ids=s1&api_k%65y={sent}&x=1"
        )
        logging.getLogger("switchboard.test").warning("a path: /v1/sessions/%s/events?since=3", sent)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith('"WebSocket /v1/events?session_ids=s1&api_k%65y=[redacted]&x=1" [accepted]'), lines[0]
    assert lines[1].endswith("a path: /v1/sessions/[redacted]/events?since=3"), lines[1]


def test_text_that_only_resembles_a_secret_is_kept():
    kept = ["%41DMIN-key-0123456789abcde", "ADMIN-key-0123456789abcdeX"[:-1] + "%zz", "100% sure %2", "%%41"]
    with service_log(secrets=[ADMIN]) as out:
        for text in kept:
            logging.getLogger("switchboard.test").warning("kept: %s", text)
    assert [line.split("kept: ", 1)[1] for line in out.getvalue().splitlines()] == kept
