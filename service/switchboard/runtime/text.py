"""Text from outside is made valid Unicode where it enters: one rule for every entry point.

A Python ``str`` can hold a lone surrogate (U+D800..U+DFFF): a JSON body with ``"\\ud800"``, a backend report, a
model server that splits or garbles an escape. Such text has no UTF-8 form: it could not be sent to a client, a
subscriber or a model, nor written as it is. The rule: a surrogate pair written as two halves becomes the character
it encodes, and a lone surrogate becomes U+FFFD (the replacement character), as any UTF-8 decoder would do with
bytes it cannot read. Every other character, NUL and control characters included, is kept exactly.

Entry points applying it: API request bodies, webhook reports and answers, the model's streamed output.

JSON from outside is also bounded in depth (``MAX_JSON_DEPTH``): ``read_json`` and ``valid_json`` answer deeper
nesting with ``TooDeep``, a ``ValueError`` like any JSON that cannot be read, where it would otherwise end in a
``RecursionError`` (media frames, event-stream messages, tool arguments, bodies, webhook answers).
"""

from __future__ import annotations

import json
import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
_HIGH_LAST = re.compile("[\ud800-\udbff]$")


def valid_text(value: str) -> str:
    """``value`` with surrogate halves joined into their character and lone ones replaced by U+FFFD."""
    if _SURROGATE.search(value) is None:
        return value
    return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


MAX_JSON_DEPTH = 100  # arrays and objects in one another: far more than any body, frame or answer needs


class TooDeep(ValueError):
    """JSON nested deeper than ``MAX_JSON_DEPTH``: bad input, like JSON that cannot be read. Read as it is, it would
    exhaust Python's recursion (``[[[[...]]]]`` 100,000 deep fits in one frame) or pydantic's, later, in a store or
    an encoder."""

    def __init__(self) -> None:
        super().__init__(f"JSON nested more than {MAX_JSON_DEPTH} deep")


def read_json(text: str | bytes) -> Any:
    """``json.loads`` for text from outside: whatever cannot be read, nested too deeply included (``TooDeep``), is a
    ``ValueError`` (``json`` itself raises ``RecursionError``)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep from None
    _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    """``TooDeep`` for a value nested deeper than ``MAX_JSON_DEPTH``, found without recursion."""
    level: list[Any] = [value]
    for _ in range(MAX_JSON_DEPTH):
        level = [child for item in level for child in _children(item) if isinstance(child, dict | list)]
        if not level:
            return
    raise TooDeep


def _children(value: Any) -> Any:
    if isinstance(value, dict):
        return value.values()
    return value if isinstance(value, list) else ()


def valid_json(value: Any) -> Any:
    """``valid_text`` applied to every string in a JSON-like value (mapping keys too); ``TooDeep`` for one nested
    deeper than ``MAX_JSON_DEPTH``."""
    _check_depth(value)
    return _valid_json(value)


def _valid_json(value: Any) -> Any:
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, dict):
        return {_valid_json(k): _valid_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_valid_json(v) for v in value]
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
