"""``@slot_init`` builds the same values as the ``__init__`` dataclasses writes, and refuses what it
cannot build.

Every type the product decorates is found by walking its modules, and built both ways from the same
arguments (a stand-in object for each required field, the defaults for the rest): the fields, the
``repr``, the equality, the ``__init__``'s parameters and the frozenness must agree."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from typing import Any

import pytest

import actors
import router
from router.slot_init import slot_init


def _product_modules() -> Iterator[Any]:
    for package in (router, actors):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("_pb2") or info.name.endswith("_pb2_grpc"):
                continue
            yield importlib.import_module(info.name)


def _decorated() -> list[type[Any]]:
    found: dict[str, type[Any]] = {}
    for module in _product_modules():
        for _, value in inspect.getmembers(module, inspect.isclass):
            if "__dataclass_init__" in value.__dict__:
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[name] for name in sorted(found)]


DECORATED = _decorated()


def test_the_request_path_s_value_types_are_decorated() -> None:
    names = {cls.__qualname__ for cls in DECORATED}
    # The ones built per routed decision; a rename must not silently drop the fast __init__.
    assert {"RouteRequest", "RouteDecision", "HostMatch", "CandidateExplain", "ProbeResult", "Selection"} <= names


def _fields_of(instance: Any) -> dict[str, Any]:
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


def _arguments(cls: type[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Arguments for ``cls``: a stand-in object for each required field, the defaults left out."""
    positional: list[Any] = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            positional.append(object())
    return positional, {}


@pytest.mark.parametrize("cls", DECORATED, ids=lambda cls: cls.__qualname__)
def test_a_decorated_type_builds_what_the_stock_init_builds(cls: type[Any]) -> None:
    stock = cls.__dict__["__dataclass_init__"]
    positional, named = _arguments(cls)
    try:
        expected = object.__new__(cls)
        stock(expected, *positional, **named)
    except Exception as exc:  # a __post_init__ that checks its fields refuses stand-ins: both must
        with pytest.raises(type(exc)):
            cls(*positional, **named)
        return
    built = cls(*positional, **named)
    assert _fields_of(built) == _fields_of(expected)
    assert built == expected
    assert repr(built) == repr(expected)
    assert inspect.signature(cls.__init__).parameters.keys() == inspect.signature(stock).parameters.keys()
    first = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, first, None)


def test_defaults_factories_and_post_init_run_as_the_stock_init_runs_them() -> None:
    @slot_init
    @dataclasses.dataclass(frozen=True, slots=True)
    class Value:
        a: int
        b: str = "b"
        items: tuple[int, ...] = dataclasses.field(default_factory=lambda: (1, 2))
        seen: list[int] = dataclasses.field(default_factory=list, init=False, compare=False)
        total: int = dataclasses.field(default=0, init=False)

        def __post_init__(self) -> None:
            object.__setattr__(self, "total", self.a + sum(self.items))

    assert Value(1) == Value(1, "b", (1, 2))
    assert Value(1).total == 4 and Value(1, items=(5,)).total == 6
    assert Value(1).seen == [] and Value(1).seen is not Value(1).seen  # a fresh list each time
    assert hash(Value(2, "x")) == hash(Value(2, "x"))
    with pytest.raises(TypeError):
        Value()  # type: ignore[call-arg]  # a required field left out is refused as before
    with pytest.raises(dataclasses.FrozenInstanceError):
        Value(1).a = 2  # type: ignore[misc]


def test_what_it_cannot_build_is_refused_at_decoration() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class KeywordOnly:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        extra: dataclasses.InitVar[int]

    class Plain:
        __slots__ = ("a",)

    @dataclasses.dataclass(frozen=True, slots=True)
    class ShadowsTheMarker:  # its factory's field held the marker, the parameter shadowing it
        _FACTORY: int
        b: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class ShadowsASetter:
        a: int
        _s0: int

    for cls, says in (
        (ShadowsTheMarker, "ShadowsTheMarker._FACTORY is a name the generated __init__ uses"),
        (ShadowsASetter, "ShadowsASetter._s0 is a name the generated __init__ uses"),
        (NoSlots, "must be a @dataclass"),
        (NotFrozen, "must be a frozen dataclass"),
        (KeywordOnly, "KeywordOnly.a is keyword-only"),
        (WithInitVar, "has an InitVar"),
        (Plain, "must be a @dataclass"),
    ):
        with pytest.raises(TypeError, match=says):
            slot_init(cls)
