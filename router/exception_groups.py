"""What an exception group holds: trio's nurseries wrap errors, callers report the errors inside."""

from __future__ import annotations


def leaves(error: BaseException) -> list[BaseException]:
    """The errors inside ``error``'s (nested) exception groups, in order; ``[error]`` for a plain error."""
    if not isinstance(error, BaseExceptionGroup):
        return [error]
    return [leaf for inner in error.exceptions for leaf in leaves(inner)]


def sole_leaf(error: BaseException) -> BaseException | None:
    """The one error inside nested single-member groups (or ``error`` itself); None when there are several."""
    found = leaves(error)
    return found[0] if len(found) == 1 else None
