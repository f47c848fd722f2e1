"""Declared JSON Schema -> pydantic model, so declared tools validate arguments exactly like Python tools.

Only the subset of JSON Schema that models use for tool parameters is supported, and anything else is refused when
the schema is loaded (rather than silently not enforced): ``type`` (one or a list), ``enum``, ``const``,
``properties``, ``required``, ``additionalProperties`` (true or false), ``items``, ``default``, the numeric bounds
``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum``, ``minLength``/``maxLength``/``pattern``,
``minItems``/``maxItems``, ``format`` on strings (one of ``FORMATS``, enforced: any other format is refused), and
the annotations ``description``, ``title``, ``examples``, ``$comment``, ``$schema`` (documentation, never checked).
As for Python tools, an object rejects properties it does not declare unless ``additionalProperties`` is true.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import date, datetime
from typing import Annotated, Any, Literal, Union
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

STRUCTURAL = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "default",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "format",
    }
)
ANNOTATIONS = frozenset({"description", "title", "examples", "$comment", "$schema"})
JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")


class SchemaError(ValueError):
    """The declared schema uses something this loader cannot enforce. ``path`` locates it inside the schema."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class _Unset:
    """Marks an optional property the model did not send (so it is not forwarded as null)."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unset>"


UNSET = _Unset()


_EMAIL = re.compile(r"[^@\s]+@[^@\s.]+(\.[^@\s.]+)+")
_URI_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")
_UUID = re.compile(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")


def _email(value: str) -> bool:
    return _EMAIL.fullmatch(value) is not None


def _uri(value: str) -> bool:
    """An absolute URI: a scheme, then no whitespace."""
    scheme = urlsplit(value).scheme if not any(c.isspace() for c in value) else ""
    return _URI_SCHEME.fullmatch(scheme) is not None and len(value) > len(scheme) + 1


def _date(value: str) -> bool:
    try:
        return _DATE.fullmatch(value) is not None and bool(date.fromisoformat(value))
    except ValueError:  # a month 13, a February 30
        return False


def _date_time(value: str) -> bool:
    """RFC 3339: a date, ``T``, a time and an offset (``Z`` or ``+hh:mm``)."""
    try:
        return _DATE_TIME.fullmatch(value) is not None and bool(datetime.fromisoformat(value.upper()))
    except ValueError:
        return False


def _uuid(value: str) -> bool:
    return _UUID.fullmatch(value) is not None


#: the string formats a declared schema may name, each checked: a model's argument that fails one never reaches the
#: backend (the value passed on is the string as sent)
FORMATS: dict[str, Callable[[str], bool]] = {
    "email": _email,
    "uri": _uri,
    "date": _date,
    "date-time": _date_time,
    "uuid": _uuid,
}


def _format_validator(schema: dict[str, Any], path: str) -> AfterValidator | None:
    if "format" not in schema:
        return None
    name = schema["format"]
    if name not in FORMATS:
        supported = ", ".join(FORMATS)
        raise SchemaError(_join(path, "format"), f"unsupported format {name!r} (supported on strings: {supported})")
    check = FORMATS[name]

    def validate(value: str) -> str:
        if not check(value):
            raise ValueError(f"not a valid {name}")
        return value

    return AfterValidator(validate)


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


def _check_keywords(schema: Any, path: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise SchemaError(path, "a schema must be an object")
    unknown = sorted(set(schema) - STRUCTURAL - ANNOTATIONS)
    if unknown:
        raise SchemaError(path, f"unsupported keyword(s): {', '.join(unknown)}")
    return schema


def _constraints(schema: dict[str, Any], path: str, names: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for keyword, arg in names.items():
        if keyword in schema:
            value = schema[keyword]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SchemaError(_join(path, keyword), "must be a number")
            out[arg] = value
    return out


def _scalar_type(kind: str, schema: dict[str, Any], path: str, model_name: str) -> Any:
    if kind == "string":
        extra = _constraints(schema, path, {"minLength": "min_length", "maxLength": "max_length"})
        if "pattern" in schema:
            try:
                re.compile(schema["pattern"])
            except (re.error, TypeError) as err:
                raise SchemaError(_join(path, "pattern"), f"invalid regular expression: {err}") from None
            extra["pattern"] = schema["pattern"]
        checks = [v for v in (_format_validator(schema, path),) if v is not None]
        return Annotated[str, Field(**extra), *checks] if extra or checks else str
    if kind in ("integer", "number"):
        extra = _constraints(
            schema, path, {"minimum": "ge", "maximum": "le", "exclusiveMinimum": "gt", "exclusiveMaximum": "lt"}
        )
        base: Any = int if kind == "integer" else float
        return Annotated[base, Field(**extra)] if extra else base
    if kind == "boolean":
        return bool
    if kind == "null":
        return None
    if kind == "array":
        item = _annotation(schema["items"], _join(path, "items"), f"{model_name}_item") if "items" in schema else Any
        extra = _constraints(schema, path, {"minItems": "min_length", "maxItems": "max_length"})
        return Annotated[list[item], Field(**extra)] if extra else list[item]  # type: ignore[valid-type]
    if kind == "object":
        if "properties" in schema or schema.get("additionalProperties") is False:
            return object_model(schema, path, model_name)
        return dict[str, Any]
    raise SchemaError(_join(path, "type"), f"unknown type {kind!r} (one of {', '.join(JSON_TYPES)})")


def _annotation(schema: Any, path: str, model_name: str) -> Any:
    schema = _check_keywords(schema, path)
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(_join(path, "enum"), "must be a non-empty list")
        if any(isinstance(v, dict | list) for v in values):
            raise SchemaError(_join(path, "enum"), "only strings, numbers, booleans and null are supported")
        return Literal[tuple(values)]
    if "const" in schema:
        if isinstance(schema["const"], dict | list):
            raise SchemaError(_join(path, "const"), "only strings, numbers, booleans and null are supported")
        return Literal[schema["const"]]
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "format" in schema and "string" not in kinds:
        raise SchemaError(_join(path, "format"), "only strings have a format here (add type 'string')")
    if kind is None:
        return Any
    if not kinds or not all(isinstance(k, str) for k in kinds):
        raise SchemaError(_join(path, "type"), "must be a type name or a list of type names")
    options = [_scalar_type(k, schema, path, model_name) for k in kinds]
    return options[0] if len(options) == 1 else Union[tuple(options)]  # noqa: UP007


def object_model(schema: Any, path: str, model_name: str) -> type[BaseModel]:
    """A pydantic model for an ``object`` schema. Property names become aliases, so any JSON name works."""
    schema = _check_keywords(schema, path)
    if schema.get("type", "object") != "object":
        raise SchemaError(_join(path, "type"), "must be 'object'")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise SchemaError(_join(path, "properties"), "must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise SchemaError(_join(path, "required"), "must be a list of property names")
    missing = [r for r in required if r not in properties]
    if missing:
        raise SchemaError(_join(path, "required"), f"names undeclared properties: {', '.join(missing)}")
    additional = schema.get("additionalProperties", False)
    if not isinstance(additional, bool):
        raise SchemaError(_join(path, "additionalProperties"), "only true or false is supported")
    fields: dict[str, Any] = {}
    for i, (prop, sub) in enumerate(properties.items()):
        sub_path = _join(path, f"properties.{prop}")
        annotation = _annotation(sub, sub_path, f"{model_name}_{i}")
        if prop in required:
            default: Any = ...
        elif "default" in sub:
            default = sub["default"]
        else:
            default = UNSET
        # internal names are positional: a JSON name may be anything, including a BaseModel attribute
        fields[f"p{i}"] = (annotation, Field(default, alias=prop, description=sub.get("description")))
    config = ConfigDict(extra="allow" if additional else "forbid", populate_by_name=False)
    return create_model(model_name, __config__=config, **fields)


def dump(value: Any) -> Any:
    """JSON-ready arguments from a validated model: declared names, declared defaults, no unsent optionals."""
    if isinstance(value, BaseModel):
        out: dict[str, Any] = {}
        for name, info in type(value).model_fields.items():
            v = getattr(value, name)
            if v is not UNSET:
                out[info.alias or name] = dump(v)
        out.update({k: dump(v) for k, v in (value.model_extra or {}).items()})
        return out
    if isinstance(value, list):
        return [dump(v) for v in value]
    if isinstance(value, dict):
        return {k: dump(v) for k, v in value.items()}
    return value
