"""The service's own log output (``logs.configure``: its format, its redaction) captured as text."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from switchboard.control import logs


@contextmanager
def service_log(*, json_lines: bool = False, secrets: Iterable[str] = ()) -> Iterator[io.StringIO]:
    """Configure logging as ``switchboard serve`` does, into a buffer; the previous handlers come back after."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level, sys.stderr
    stream = io.StringIO()
    try:
        sys.stderr = stream
        logs.configure("DEBUG", json_lines=json_lines, secrets=secrets)
        yield stream
    finally:
        sys.stderr = saved[2]
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
