"""Credentials removed from text that leaves the process: log lines, and the error messages observers see."""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

# Credentials travel in the Authorization header and, for WebSockets, in ``?token=``; the server's own request lines
# (uvicorn logs the path with its query string) and debug header dumps would otherwise write them to the log.
_SECRETS = (
    (re.compile(r"(?i)\b(authorization[\"']?\s*[:=,]\s*[\"']?)[^\r\n\"']+"), r"\1[redacted]"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[^\s\"',)]+"), r"\1 [redacted]"),
    (re.compile(r"(?i)\b((?:access_)?token=)[^&\s\"'<>]+"), r"\1[redacted]"),
    (re.compile(r"\bsbt_[A-Za-z0-9_\-.=]+"), "sbt_[redacted]"),
)


# a query parameter whose name is only "token" (or "api_key": a key sent where a token goes) once decoded
# (``?tok%65n=``): the server decodes names, so must we
_QUERY_PARAM = re.compile(r"([?&;])([^=&\s\"'<>?]+)=([^&\s\"'<>]*)")
_CREDENTIAL_PARAMS = frozenset({"token", "access_token", "api_key", "apikey", "key"})


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
