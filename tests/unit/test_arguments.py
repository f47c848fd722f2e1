"""Tool-call arguments as real models write them: repair, nulls as defaults, and the canonical key of duplicates."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, create_model

from switchboard.runtime.arguments import MAX_REPAIR_CHARS, canonical, nulls_to_defaults, parse_arguments


def test_valid_json_is_taken_as_it_is_and_only_broken_json_is_repaired() -> None:
    assert parse_arguments('{"a": "<|im_end|>"}') == ({"a": "<|im_end|>"}, None)
    assert parse_arguments('{"a": 1}<|im_end|>') == ({"a": 1}, None)
    assert parse_arguments("{'a': 'x',}") == ({"a": "x"}, None)
    assert parse_arguments("") == ({}, None) and parse_arguments("null") == ({}, None)


def test_what_cannot_be_repaired_into_an_object_is_an_error() -> None:
    for raw in ("Sure, here are the arguments", "[1, 2", '"just text'):
        args, error = parse_arguments(raw)
        assert args == {} and error is not None and "not valid JSON" in error
    assert parse_arguments("[1, 2]") == ({}, "arguments must be a JSON object")
    huge = '{"a": "' + "x" * MAX_REPAIR_CHARS  # a repair is a best effort, bounded
    assert parse_arguments(huge)[1] is not None


class Inner(BaseModel):
    size: int = 3


Model = create_model(
    "Model",
    plain=(int, 5),
    nullable=(str | None, "kept"),
    required=(int, ...),
    nested=(Inner | None, None),
    many=(list[Inner], Field(default_factory=list)),
    annotated=(Annotated[int, Field(ge=0)], 1),
)


def test_nulls_become_defaults_only_where_the_parameter_has_one_and_does_not_accept_null() -> None:
    raw = {
        "plain": None,
        "nullable": None,
        "required": None,
        "nested": {"size": None},
        "many": [{"size": None}, {"size": 7}],
        "annotated": None,
    }
    out = nulls_to_defaults(Model, raw)
    assert out == {"nullable": None, "required": None, "nested": {}, "many": [{}, {"size": 7}]}
    assert raw["plain"] is None, "the model's arguments are not changed in place"


def test_the_canonical_key_ignores_key_order_and_float_spelling() -> None:
    assert canonical({"a": 1.0, "b": [1, {"c": None}]}) == canonical({"b": [1, {"c": None}], "a": 1.0})
    assert canonical({"a": Inner()}) == canonical({"a": {"size": 3}})
    assert canonical({"a": 1}) != canonical({"a": 2})
