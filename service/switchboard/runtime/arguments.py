"""A tool call's arguments as real models write them: parsed (and repaired when broken), nulls read as defaults,
and a canonical form that tells two calls with the same meaning apart from two different calls."""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any

import json_repair
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from .text import TooDeep, read_json

# Chat-template tokens that some models leak into their tool-call arguments (Gemma's ``<|"|``, ``<|im_end|>``,
# ``<end_of_turn>``...). Removed only from arguments that are not valid JSON as they are: a valid string that
# happens to contain such text is the model's meaning and is kept.
_TEMPLATE_TOKEN = re.compile(
    r"<\|[^<>|\s]{0,32}\|(?:\\?\"|>)?"  # <|...|>, and Gemma's quote token <|"| with the quote that follows it
    r"|</?(?:start_of_turn|end_of_turn|eos|bos|s)>"
)
#: Arguments longer than this are not repaired (a repair is a best effort, not a parser for anything).
MAX_REPAIR_CHARS = 64_000


def parse_arguments(raw: str) -> tuple[dict[str, Any], str | None]:
    """The arguments object of a call, and None; or ``{}`` and why there is none.

    Valid JSON is taken as it is. Otherwise leaked template tokens are removed and the JSON repaired (a missing
    closing brace, single quotes, unquoted keys); what cannot be repaired into an object is an error.
    """
    if not raw.strip():
        return {}, None
    try:
        value = read_json(raw)
    except TooDeep:  # past what is read, let alone repaired
        return {}, "arguments are nested too deeply"
    except json.JSONDecodeError as err:
        value = _repaired(raw)
        if value is None:
            return {}, f"arguments are not valid JSON ({err.msg})"
    if value is None:
        return {}, None
    if not isinstance(value, dict):
        return {}, "arguments must be a JSON object"
    return value, None


def _repaired(raw: str) -> Any:
    if len(raw) > MAX_REPAIR_CHARS:
        return None
    text = _TEMPLATE_TOKEN.sub("", raw).strip()
    if not text.startswith("{"):
        return None  # prose, or a value that is not an object: nothing to repair into arguments
    try:
        value = json_repair.loads(text)
    except Exception:  # the repairer is a best effort; any failure of it is "not repairable"
        return None
    return value if isinstance(value, dict) else None


def _admits_none(annotation: Any) -> bool:
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _admits_none(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return any(_admits_none(a) for a in typing.get_args(annotation))
    return False


def _models_in(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (directly, optionally, or as the items of a list) and whether it is a list."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _models_in(options[0]) if len(options) == 1 else (None, False)
    if origin in (list, tuple, set, frozenset):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        if len(args) == 1:
            inner, _ = _models_in(args[0])
            return inner, True
    return None, False


def nulls_to_defaults(model: type[BaseModel], raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with each ``null`` given for a parameter that has a default and does not accept null removed, so
    that the default applies; nested models too. Models send ``null`` for "not given"; a null the parameter
    accepts is kept (it is a value), and a null for a required parameter is left for validation to refuse."""
    out = dict(raw)
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in out:
            continue
        value = out[key]
        if value is None:
            if not field.is_required() and not _admits_none(field.annotation):
                del out[key]
            continue
        inner, many = _models_in(field.annotation)
        if inner is None:
            continue
        if many and isinstance(value, list):
            out[key] = [nulls_to_defaults(inner, v) if isinstance(v, dict) else v for v in value]
        elif not many and isinstance(value, dict):
            out[key] = nulls_to_defaults(inner, value)
    return out


def canonical(arguments: dict[str, Any]) -> str:
    """Validated arguments as canonical JSON: equal for calls that mean the same (an omitted argument and its
    default, ``1`` and ``1.0`` for a float), whatever the order of the keys."""
    return json.dumps(to_jsonable_python(arguments, fallback=repr), sort_keys=True, separators=(",", ":"))
