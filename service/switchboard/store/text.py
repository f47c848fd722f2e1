"""Text keeps every character exactly as given, on every database.

PostgreSQL cannot store U+0000 (``text`` and ``jsonb`` reject it), and neither database can store a lone
surrogate (U+D800..U+DFFF has no UTF-8 encoding). The store encodes both reversibly at its boundary, for every
string it writes (columns and JSON), and decodes on read, so a tool output, an input or a model's text holding one
round-trips exactly instead of making a write fail forever.

The encoding uses one escape character from the private-use area, ``ESC`` (U+E000):

- ``ESC`` itself becomes ``ESC e``;
- U+0000 becomes ``ESC 0``;
- a lone surrogate U+D8AB becomes ``ESC u d8ab``.

Text holding none of these three is stored unchanged (the common case costs one scan).
"""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

ESC = "\ue000"

# Plain text: the characters to encode.
_PLAIN_SPECIAL = re.compile("[\ue000\x00\ud800-\udfff]")
# JSON text (as ``json.dumps(ensure_ascii=False)`` writes it): NUL appears as the escape ``\u0000``; an escaped
# backslash is matched first so that ``\\u0000`` (a backslash, then "u0000") is left alone.
_JSON_SPECIAL = re.compile(r"\\\\|\\u0000|[\ue000\ud800-\udfff]")
_ENCODED = re.compile("\ue000(?:(e)|(0)|u([0-9a-f]{4}))")


def _encode_char(ch: str) -> str:
    if ch == ESC:
        return ESC + "e"
    if ch == "\x00":
        return ESC + "0"
    return f"{ESC}u{ord(ch):04x}"


def encode_text(value: str) -> str:
    """``value`` as stored: NUL, lone surrogates and the escape character encoded."""
    if _PLAIN_SPECIAL.search(value) is None:
        return value
    return _PLAIN_SPECIAL.sub(lambda m: _encode_char(m.group()), value)


def _decode_plain(m: re.Match[str]) -> str:
    if m.group(1):
        return ESC
    if m.group(2):
        return "\x00"
    return chr(int(m.group(3), 16))


def decode_text(value: str) -> str:
    """The original of a stored string (``encode_text`` reversed)."""
    if ESC not in value:
        return value
    return _ENCODED.sub(_decode_plain, value)


def _encode_json_token(m: re.Match[str]) -> str:
    token = m.group()
    if token == "\\\\":
        return token
    if token == "\\u0000":
        return ESC + "0"
    return _encode_char(token)


def encode_json_text(text: str) -> str:
    """JSON text as stored: within its strings (keys too), the same encoding as ``encode_text``."""
    if "\\u0000" not in text and _PLAIN_SPECIAL.search(text) is None:
        return text
    return _JSON_SPECIAL.sub(_encode_json_token, text)


def _decode_json(m: re.Match[str]) -> str:
    if m.group(1):
        return ESC
    if m.group(2):
        return "\\u0000"
    return "\\u" + m.group(3)


def decode_json_text(text: str) -> str:
    """Stored JSON text back to the JSON text of the original values (NUL and surrogates as ``\\u`` escapes)."""
    if ESC not in text:
        return text
    return _ENCODED.sub(_decode_json, text)


def _encode_value(value: Any) -> Any:
    return encode_text(value) if value.__class__ is str else value


def _decode_value(value: Any) -> Any:
    # Read for every string column of every row (recovery reads hundreds of thousands): one test in the common case.
    if value.__class__ is str and ESC in value:
        return _ENCODED.sub(_decode_plain, value)
    return value


class _Exact(sa.TypeDecorator[str]):
    impl: Any
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return _encode_value(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return _decode_value(value)

    # The processors themselves, not TypeDecorator's generic wrappers around the two methods above (which cost
    # several calls per value). The drivers have no processors of their own for text.
    def bind_processor(self, dialect: Dialect) -> Any:
        inner = self.impl_instance.bind_processor(dialect)
        return _encode_value if inner is None else super().bind_processor(dialect)

    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        inner = self.impl_instance.result_processor(dialect, coltype)
        return _decode_value if inner is None else super().result_processor(dialect, coltype)

    def coerce_compared_value(self, op: Any, value: Any) -> sa.types.TypeEngine[Any]:
        return self


class Text(_Exact):
    """A text column whose values round-trip exactly (``encode_text`` / ``decode_text``)."""

    impl = sa.Text
    cache_ok = True


class String(_Exact):
    """A ``VARCHAR`` column (keys, names, states) whose values round-trip exactly."""

    impl = sa.String
    cache_ok = True


class JSONText(sa.TypeDecorator[str]):
    """A JSON column read as its JSON text (parsed and validated later in one step), decoded."""

    impl = sa.Text
    cache_ok = True

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return decode_json_text(value) if isinstance(value, str) else value
