"""Structured logging: every record carries the session and call ids it was logged with."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from urllib.parse import quote

from ..runtime.redaction import redact

_CONTEXT_FIELDS = ("session_id", "call_id", "speech_id")


class RedactSecrets(logging.Filter):
    """A handler filter: no credential reaches a log line, whoever logged it. Besides what looks like one (``redact``),
    the server's own secrets (``secrets``: its API keys, token and cluster secrets) wherever they appear: a key a
    client put in the wrong query parameter, in a path or in a message is still the key."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        known = {form for secret in secrets if secret for form in (secret, quote(secret, safe=""))}
        self._secrets = sorted(known, key=len, reverse=True)  # a secret holding another is replaced whole

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let the handler report it
            return True
        clean = redact(message)
        for secret in self._secrets:
            if secret in clean:
                clean = clean.replace(secret, "[redacted]")
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


UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


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
