"""The one rule for text that enters from outside: lone surrogates become U+FFFD, pairs join, the rest is kept."""

from __future__ import annotations

from switchboard.runtime.text import StreamText, valid_json, valid_text
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
