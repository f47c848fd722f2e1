"""Models built from values already known to be valid, without validating them again.

Recovery reads back every chat item and tool call of every live session: records this service validated when it
made them and the store wrote. Validating each again (or ``model_construct``, which works out defaults and aliases
field by field) costs more than the rest of reading them; ``trusted`` only puts the values in place. Validation stays
where data comes from outside: the API, the model's output, a stored row that does not read back as expected.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def trusted(cls: type[M], values: dict[str, Any]) -> M:
    """An instance of ``cls`` that holds ``values`` as they are (they become its ``__dict__``).

    ``values`` gives every field of ``cls`` (no default is filled in), in their order, each already of its field's
    type: the caller vouches for it. ``cls`` has no ``model_post_init``, no private attributes and no extra fields.
    The result equals ``cls.model_validate(values)`` for such values, but costs a fraction of it.
    """
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", set(values))
    object.__setattr__(obj, "__pydantic_extra__", None)
    object.__setattr__(obj, "__pydantic_private__", None)
    return obj


def trustable(cls: type[BaseModel]) -> bool:
    """Whether ``trusted`` builds instances of ``cls`` as validation would (checked by the tests of each user)."""
    return not (cls.__pydantic_post_init__ or cls.__private_attributes__ or cls.model_config.get("extra") == "allow")
