"""Configuration problems in the configuration's own terms, and the one way to state a numeric range.

Pure: no I/O, nothing from the settings layer. Each component says what it cannot work with as a
``*_problems(config) -> list[Problem]`` function over its own config section, naming that section's
fields; the settings layer collects them for every section and renders each field as its flag and
environment variable. A constructor that must refuse bad configuration calls the same function
(through :func:`refuse`), so a rule is written once and the settings layer and the actor agree.

Numeric ranges are declared once, beside each default in ``router/config.py``, with :func:`bounded`;
:func:`range_problems` checks them for any config section.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T", int, float)

RANGE_METADATA = "kvroute.range"


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a config section, naming the fields involved (none: the section as a whole)."""

    fields: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return f"{', '.join(self.fields)}: {self.message}" if self.fields else self.message


class ConfigError(ValueError):
    """A component refused its config section; ``problems`` lists every reason at once."""

    def __init__(self, section: str, problems: Sequence[Problem]) -> None:
        listed = (
            f"{', '.join(f'{section}.{name}' for name in p.fields)}: {p.message}" if p.fields else p.message
            for p in problems
        )
        super().__init__(f"invalid {section} configuration: " + "; ".join(listed))
        self.section = section
        self.problems = tuple(problems)


def refuse(section: str, problems: Sequence[Problem]) -> None:
    """Raise ConfigError when there is any problem (constructors call this with their *_problems).

    ``section`` is the config section's name in KvrouteConfig (and in the TOML file), e.g. "prober".
    """
    if problems:
        raise ConfigError(section, problems)


# The smallest size a non-zero numeric setting may have (a duration of a nanosecond, a share of a
# billionth): anything smaller is no setting anyone means.
MIN_MAGNITUDE = 1e-9


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric setting may take; both ends are always given (no unbounded setting)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def problem(self, value: float) -> str | None:
        """Pure: why ``value`` is outside the range (None when inside)."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if isinstance(value, float) and value != 0.0 and abs(value) < MIN_MAGNITUDE:
            # Such a value passes every range, then divides a clock reading into infinity.
            return f"too small to use: a non-zero value is at least {MIN_MAGNITUDE:g} in size, got {value}"
        if self.low_open and not value > self.low:
            return f"must be > {_num(self.low)}, got {_shown(value)}"
        if not self.low_open and not value >= self.low:
            return f"must be >= {_num(self.low)}, got {_shown(value)}"
        if self.high_open and not value < self.high:
            return f"must be < {_num(self.high)}, got {_shown(value)}"
        if not self.high_open and not value <= self.high:
            return f"must be <= {_num(self.high)}, got {_shown(value)}"
        return None

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"


def _shown(value: float) -> str:
    """``value`` for a message: an integer too long to read (or to print at all, past Python's digit
    limit) by its size."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return str(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def bounded(default: T, low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> T:
    """A config field whose value must lie in [low, high]; ``low_open``/``high_open`` exclude an end."""
    declared = Range(low, high, low_open, high_open)
    if declared.problem(default) is not None:
        raise ValueError(f"default {default} is outside its own range {declared}")
    field: T = dataclasses.field(default=default, metadata={RANGE_METADATA: declared})
    return field


def range_of(field: dataclasses.Field[Any]) -> Range | None:
    found = field.metadata.get(RANGE_METADATA)
    return found if isinstance(found, Range) else None


def declared_range(section: type, name: str) -> Range:
    """The range a config section's field ``name`` declares (its ``bounded`` default)."""
    declared = next((range_of(f) for f in dataclasses.fields(section) if f.name == name), None)
    if declared is None:
        raise KeyError(f"{section.__name__}.{name} declares no range")
    return declared


def range_problems(config: Any) -> list[Problem]:
    """Every field of the config section ``config`` outside its declared range."""
    problems: list[Problem] = []
    for field in dataclasses.fields(config):
        declared = range_of(field)
        if declared is not None:
            message = declared.problem(getattr(config, field.name))
            if message is not None:
                problems.append(Problem((field.name,), message))
    return problems
