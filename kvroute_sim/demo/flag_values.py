"""Parsers of the demo's numeric flags: one rule and one wording for a number's range, whichever
command takes it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(
    kind: type[int] | type[float], minimum: float, maximum: float = math.inf, *, above: bool = False
) -> Callable[[str], float]:
    """A parser of ``kind`` numbers >= ``minimum`` (> with ``above``) and <= ``maximum``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        try:
            infinite = not math.isfinite(value)
        except OverflowError:  # an integer beyond float's range
            raise argparse.ArgumentTypeError(f"too large, got {text}") from None
        if infinite or value < minimum or (above and value == minimum) or value > maximum:
            if maximum == math.inf:
                wanted = f"{'>' if above else '>='} {minimum}"
            elif above:
                wanted = f"> {_word(minimum)} and <= {_word(maximum)}"
            else:
                wanted = f"in {_word(minimum)}..{_word(maximum)}"
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    return parse


def _word(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
