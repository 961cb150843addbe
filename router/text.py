"""Text of any length, kept to a bound, and text of any content, kept to one printable line (pure): the
lowest layer, which targets, types, logs and reports use."""

from __future__ import annotations


def cut_text(text: str, limit: int) -> str:
    """``text`` when it has at most ``limit`` characters, else its start and a marker saying how long it
    was: how a peer's or a caller's text of any length is kept."""
    if len(text) <= limit:
        return text
    marker = f"…[cut: {len(text)} chars]"
    return text[: max(0, limit - len(marker))] + marker


def escaped_char(c: str) -> str:
    """``c`` as a terminal line shows it: a quote or backslash escaped, a control, format or unpaired
    surrogate character as its code (``\\u000a``), anything printable as it is."""
    if c in '"\\':
        return "\\" + c
    if c == " " or c.isprintable():
        return c
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"


def one_line(text: str) -> str:
    """``text`` with its control, format and unpaired surrogate characters escaped, the rest as it is:
    a peer's or an operator's text with a newline in it began a line of its own, and an unpaired
    surrogate (a file name's undecodable byte) could not be written to a strict UTF-8 stream."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else escaped_char(c) for c in text)
