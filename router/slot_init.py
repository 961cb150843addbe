"""``@slot_init``: a frozen, slotted dataclass whose ``__init__`` sets each slot through its descriptor.

The ``__init__`` that ``@dataclass(frozen=True)`` writes cannot assign ``self.x = x`` (the class's
``__setattr__`` refuses), so it calls ``object.__setattr__(self, "x", x)`` for every field: an
attribute lookup, a call and a generic attribute set by name each time — several times the cost of
the assignment. A slotted class holds each field in a member descriptor whose ``__set__`` stores it
directly, which the frozen ``__setattr__`` cannot stop either. Built that way, an ``__init__`` takes
about half the time, with the same signature, defaults, default factories and ``__post_init__``;
the instance is the same frozen value (assignment still raises ``FrozenInstanceError``).

Used on the value types a routed decision builds (several dozen per decision), not on every
dataclass: elsewhere the stock ``__init__`` is cheap enough and needs no second look. The class
keeps the stock one as ``__dataclass_init__``, against which the tests check each decorated type.
Refused at import: a class that is not a frozen, slotted dataclass with a generated ``__init__``,
or one with ``InitVar``, ``ClassVar`` or keyword-only fields (not needed so far, so not written), or a
field named as the generated code's own names (``self``, ``_FACTORY``, ``_s0``…).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, TypeVar

T = TypeVar("T")


class _Factory:
    """The default of a parameter whose field has a ``default_factory``: call it when still given."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()
_GENERATED_NAME = re.compile(r"_[sdf][0-9]+")  # the generated __init__'s names for setters, defaults, factories


def slot_init(cls: type[T]) -> type[T]:
    """Replace the ``__init__`` of ``cls`` (a frozen, slotted dataclass) by one that sets its slots
    directly; return ``cls``."""
    if "__dataclass_params__" not in cls.__dict__ or "__slots__" not in cls.__dict__:
        raise TypeError(f"@slot_init: {cls.__qualname__} must be a @dataclass(frozen=True, slots=True)")
    params = cls.__dict__["__dataclass_params__"]
    if not params.frozen or not params.init:
        raise TypeError(f"@slot_init: {cls.__qualname__} must be a frozen dataclass with a generated __init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # a dataclass: its params are in its dict
    if len(fields) != len(cls.__dict__["__dataclass_fields__"]):
        raise TypeError(f"@slot_init: {cls.__qualname__} has an InitVar or ClassVar field")
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY}
    parameters: list[str] = []
    body: list[str] = []
    for i, field in enumerate(fields):
        if field.kw_only:
            raise TypeError(f"@slot_init: {cls.__qualname__}.{field.name} is keyword-only")
        if field.name == "self" or field.name == "_FACTORY" or _GENERATED_NAME.fullmatch(field.name):
            # A parameter of that name would shadow the generated code's own (a field ``_FACTORY`` made a
            # factory's field hold the marker): refused, as no field of ours needs one.
            raise TypeError(f"@slot_init: {cls.__qualname__}.{field.name} is a name the generated __init__ uses")
        # Names of our own making (``_s3``) in the generated code, refused as fields' names above.
        setter, default, factory = f"_s{i}", f"_d{i}", f"_f{i}"
        namespace[setter] = getattr(cls, field.name).__set__
        has_default = field.default is not dataclasses.MISSING
        has_factory = field.default_factory is not dataclasses.MISSING
        if has_default:
            namespace[default] = field.default
        if has_factory:
            namespace[factory] = field.default_factory
        if field.init:
            parameters.append(
                f"{field.name}={default}" if has_default else f"{field.name}=_FACTORY" if has_factory else field.name
            )
            value = f"{factory}() if {field.name} is _FACTORY else {field.name}" if has_factory else field.name
        else:
            value = default if has_default else f"{factory}()" if has_factory else ""
            if not value:
                continue  # no init, no default: dataclasses leaves the slot unset too
        body.append(f"{setter}(self, {value})")
    if hasattr(cls, "__post_init__"):
        body.append("self.__post_init__()")
    source = (
        f"def _make({', '.join(namespace)}):\n"
        f"    def __init__(self, {', '.join(parameters)}):\n"
        + "".join(f"        {line}\n" for line in body or ["pass"])
        + "    return __init__\n"
    )
    built: dict[str, Any] = {}
    exec(source, {}, built)  # the source is made above from the class's own field names
    init = built["_make"](**namespace)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    cls.__dataclass_init__ = cls.__init__  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
