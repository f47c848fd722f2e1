"""Structured logging: every record carries the session and call ids it was logged with."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

from ..runtime.redaction import redact

_CONTEXT_FIELDS = ("session_id", "call_id", "speech_id")


class RedactSecrets(logging.Filter):
    """A handler filter: no credential reaches a log line, whoever logged it. Besides what looks like one (``redact``),
    the server's own secrets (``secrets``: its API keys, token and cluster secrets) wherever they appear and however
    they are percent-escaped: a key a client put in the wrong query parameter, in a path or in a message, as
    ``%41DMIN-...`` or escaped twice, is still the key."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        # a secret as UTF-8 bytes read one char each, as percent-decoding yields them
        self._secrets = {form for secret in secrets if secret for form in (secret, _as_bytes(secret))}

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let the handler report it
            return True
        clean = self._without_secrets(redact(message))
        if clean != message:
            record.msg, record.args = clean, None
        return True

    def _without_secrets(self, text: str) -> str:
        if not self._secrets:
            return text
        decoded, origin = percent_decoded(text)
        spans = sorted(
            (origin[at], origin[at + len(secret)]) for secret in self._secrets for at in _occurrences(decoded, secret)
        )
        for start, end in reversed(_merged(spans)):
            text = f"{text[:start]}[redacted]{text[end:]}"
        return text


_PERCENT_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
DECODE_ROUNDS = 4  # %41, %2541, %252541...: a secret escaped more often than this is not a credential any server reads


def _as_bytes(secret: str) -> str:
    return secret.encode().decode("latin-1")


def percent_decoded(text: str) -> tuple[str, list[int]]:
    """``text`` percent-decoded until it no longer changes (at most ``DECODE_ROUNDS`` times), each escape one char
    (a byte), and for each of its chars (and its end) the index in ``text`` it was decoded from."""
    origin = list(range(len(text) + 1))
    for _ in range(DECODE_ROUNDS):
        chars: list[str] = []
        where: list[int] = []
        done = 0
        for escape in _PERCENT_ESCAPE.finditer(text):
            chars += [text[done : escape.start()], chr(int(escape.group(1), 16))]
            where += [*origin[done : escape.start()], origin[escape.start()]]
            done = escape.end()
        if not done:
            break
        text, origin = "".join(chars) + text[done:], where + origin[done:]
    return text, origin


def _occurrences(text: str, part: str) -> Iterator[int]:
    at = text.find(part)
    while at >= 0:
        yield at
        at = text.find(part, at + 1)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``spans`` with the overlapping ones joined (a secret holding another is replaced whole)."""
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


# What would let logged text break out of its line or rewrite a terminal that shows the log: C0 and C1 controls,
# DEL, the Unicode line and paragraph separators and the bidi overrides. Messages carry client text (paths, headers,
# agent and tool output): a raw newline in one would be a second, forged log line.
_LOG_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_LOG_CONTROLS |= {c: f"\\u{c:04x}" for c in (0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))}
_LOG_CONTROLS |= {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
_DETAIL_INDENT = "    "


def one_line(text: str) -> str:
    """``text`` with every control shown as an escape: it cannot end its log line or start another."""
    return text.translate(_LOG_CONTROLS)


class _TextFormatter(logging.Formatter):
    """One line per record, whatever its message and fields hold; a traceback follows on indented lines, so a line
    that starts at the margin is always a record's own."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        ids = " ".join(f"{k}={one_line(str(getattr(record, k)))}" for k in _CONTEXT_FIELDS if getattr(record, k, None))
        line = f"{line} {ids}" if ids else line
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        details = [
            text for text in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)) if text
        ]
        return "\n".join([line, *(_indented(text) for text in details)])


def _indented(detail: str) -> str:
    return "\n".join(_DETAIL_INDENT + one_line(part) for part in detail.splitlines())


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "at": datetime.fromtimestamp(record.created, tz=UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k in _CONTEXT_FIELDS:
            if getattr(record, k, None):
                out[k] = getattr(record, k)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
# the MCP transport says at INFO that it ends each request's transport, which /mcp (stateless) makes for every request
QUIET_LOGGERS = ("mcp.server.streamable_http",)


def configure(level: str = "INFO", *, json_lines: bool = False, secrets: Iterable[str] = ()) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactSecrets(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's loggers go through this handler and level too (its own config, or an earlier one in the same
    # process, may have given them handlers, a level or no propagation): one format, one redaction, one level
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
