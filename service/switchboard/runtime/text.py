"""Text from outside is made valid Unicode where it enters: one rule for every entry point.

A Python ``str`` can hold a lone surrogate (U+D800..U+DFFF): a JSON body with ``"\\ud800"``, a backend report, a
model server that splits or garbles an escape. Such text has no UTF-8 form: it could not be sent to a client, a
subscriber or a model, nor written as it is. The rule: a surrogate pair written as two halves becomes the character
it encodes, and a lone surrogate becomes U+FFFD (the replacement character), as any UTF-8 decoder would do with
bytes it cannot read. Every other character, NUL and control characters included, is kept exactly.

Entry points applying it: API request bodies, webhook reports and answers, the model's streamed output.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
_HIGH_LAST = re.compile("[\ud800-\udbff]$")


def valid_text(value: str) -> str:
    """``value`` with surrogate halves joined into their character and lone ones replaced by U+FFFD."""
    if _SURROGATE.search(value) is None:
        return value
    return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def valid_json(value: Any) -> Any:
    """``valid_text`` applied to every string in a JSON-like value (mapping keys too)."""
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, dict):
        return {valid_json(k): valid_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [valid_json(v) for v in value]
    return value


class StreamText:
    """``valid_text`` over a text that arrives in pieces: a high surrogate at the end of one piece waits for the
    next, which may start with its low half (a server can split a pair between two chunks)."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, piece: str) -> str:
        piece = self._held + piece
        self._held = ""
        if _HIGH_LAST.search(piece) is not None:
            piece, self._held = piece[:-1], piece[-1]
        return valid_text(piece)

    def end(self) -> str:
        """What is still held (a lone high surrogate: U+FFFD), once the text is complete."""
        held, self._held = self._held, ""
        return valid_text(held)
