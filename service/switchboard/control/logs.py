"""Structured logging: every record carries the session and call ids it was logged with."""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from urllib.parse import unquote_plus

_CONTEXT_FIELDS = ("session_id", "call_id", "speech_id")

# Credentials travel in the Authorization header and, for WebSockets, in ``?token=``; the server's own request lines
# (uvicorn logs the path with its query string) and debug header dumps would otherwise write them to the log.
_SECRETS = (
    (re.compile(r"(?i)\b(authorization[\"']?\s*[:=,]\s*[\"']?)[^\r\n\"']+"), r"\1[redacted]"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[^\s\"',)]+"), r"\1 [redacted]"),
    (re.compile(r"(?i)\b((?:access_)?token=)[^&\s\"'<>]+"), r"\1[redacted]"),
    (re.compile(r"\bsbt_[A-Za-z0-9_\-.=]+"), "sbt_[redacted]"),
)


# a query parameter whose name is only "token" once decoded (``?tok%65n=``): the server decodes names, so must we
_QUERY_PARAM = re.compile(r"([?&;])([^=&\s\"'<>?]+)=([^&\s\"'<>]*)")
_CREDENTIAL_PARAMS = frozenset({"token", "access_token"})


def _redact_param(match: re.Match[str]) -> str:
    lead, name, value = match.groups()
    if value and unquote_plus(name).strip().lower() in _CREDENTIAL_PARAMS:
        return f"{lead}{name}=[redacted]"
    return match.group(0)


def redact(text: str) -> str:
    """``text`` with API keys and session tokens replaced by ``[redacted]``."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return _QUERY_PARAM.sub(_redact_param, text)


class RedactSecrets(logging.Filter):
    """A handler filter: no credential reaches a log line, whoever logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let the handler report it
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        ids = " ".join(f"{k}={getattr(record, k)}" for k in _CONTEXT_FIELDS if getattr(record, k, None))
        return f"{base} {ids}" if ids else base


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


def configure(level: str = "INFO", *, json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactSecrets())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
