"""The one rule for text that enters from outside: lone surrogates become U+FFFD, pairs join, the rest is kept."""

from __future__ import annotations

import json

import pytest

from switchboard.integrations.webhooks import BackendResult
from switchboard.runtime.arguments import parse_arguments
from switchboard.runtime.text import MAX_JSON_DEPTH, StreamText, TooDeep, read_json, valid_json, valid_text
from switchboard.runtime.tools import render_output


def test_lone_surrogates_become_the_replacement_character_and_everything_else_is_kept() -> None:
    assert valid_text("plain \x00\x01\x1b é 😀") == "plain \x00\x01\x1b é 😀"
    assert valid_text("a\ud800b\udfffc") == "a\ufffdb\ufffdc"
    assert valid_text("\ud83d\ude00") == "😀"  # a pair written as two halves is its character
    assert valid_text("\ude00\ud83d") == "\ufffd\ufffd"
    assert valid_json({"k\ud800": ["\udc00", 1, None, {"x": "\x00"}]}) == {
        "k\ufffd": ["\ufffd", 1, None, {"x": "\x00"}]
    }


def test_a_pair_split_between_two_pieces_of_a_stream_is_joined() -> None:
    text = StreamText()
    assert text.feed("x\ud83d") == "x"
    assert text.feed("\ude00y\ud800") == "😀y"
    assert text.feed("z") == "\ufffdz"
    assert text.feed("end\udbff") == "end"
    assert text.end() == "\ufffd"
    assert text.end() == ""


def test_a_tools_result_holding_a_lone_surrogate_is_rendered_valid() -> None:
    assert render_output("done \ud800\x00") == "done \ufffd\x00"
    assert render_output({"a": "\x00"}) == '{"a": "\\u0000"}'


def test_json_nested_too_deeply_is_a_value_error_wherever_it_is_read() -> None:
    """``[[[[...]]]]`` past ``MAX_JSON_DEPTH`` is bad input (a ``ValueError``), not a ``RecursionError``: read from
    text, walked once read (a body FastAPI parsed), or a webhook backend's answer."""
    fits = "[" * MAX_JSON_DEPTH + "1" + "]" * MAX_JSON_DEPTH
    assert read_json(fits) is not None and valid_json(json.loads(fits)) == json.loads(fits)
    for depth in (MAX_JSON_DEPTH + 1, 5_000, 100_000):
        nested = "[" * depth + "]" * depth
        with pytest.raises(TooDeep):
            read_json(nested)
        with pytest.raises(ValueError):
            BackendResult.from_answer(('{"output": "x", "extra": ' + nested + "}").encode())
    walked = json.loads('{"a": ' + "[" * 500 + "]" * 500 + "}")
    with pytest.raises(TooDeep):
        valid_json(walked)


def test_tool_arguments_nested_too_deeply_are_an_error_not_a_crash() -> None:
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        assert parse_arguments("[" * depth + "]" * depth) == ({}, "arguments are nested too deeply")
