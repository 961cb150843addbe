"""Text of any length, kept to a bound (pure): the lowest layer, which targets and types both use."""

from __future__ import annotations


def cut_text(text: str, limit: int) -> str:
    """``text`` when it has at most ``limit`` characters, else its start and a marker saying how long it
    was: how a peer's or a caller's text of any length is kept."""
    if len(text) <= limit:
        return text
    marker = f"…[cut: {len(text)} chars]"
    return text[: max(0, limit - len(marker))] + marker
