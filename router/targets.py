"""Parsing and formatting of ``host:port`` targets (pure).

Rules: an explicit port is honoured, a bare host takes the
default port, anything ambiguous is an error naming the input. IPv6 hosts are
bracketed when a target is formed.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$"
)
_NUMERIC_DOTTED = re.compile(r"^[0-9.]+$")
# ``user:password@`` before a host, with or without a scheme: everything back to a delimiter that
# cannot be part of an address written in text (space, quote, comma, '=', brackets) is userinfo.
# The lookbehind starts a match only where a run of address characters starts: tried from inside a
# run too, a long run without an address in it cost time quadratic in its length.
_USERINFO = re.compile(
    r"""(?<![^\s@,;'"`<>()\[\]{}=])(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)?[^\s@,;'"`<>()\[\]{}=]+@(?=[^\s@])"""
)
REDACTED = "<redacted>"


class TargetError(ValueError):
    """A malformed ``host:port`` entry; the message names the entry."""


@dataclass(frozen=True, slots=True, order=True)
class HostPort:
    host: str  # bare host: IPv6 without brackets
    port: int

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    def __str__(self) -> str:
        return format_target(self.host, self.port)


NO_PORT = "has no port and there is no default port"  # what a bare host without a default is told


def format_target(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts bracketed."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _check_port(text: str, entry: str) -> int:
    # isascii: str.isdigit() also accepts "²" and other non-ASCII digits.
    if not (text.isascii() and text.isdigit()):
        raise TargetError(f"bad port {text!r} in target {entry!r}")
    if len(text.lstrip("0")) > 5:  # beyond any port, and int() refuses more than 4,300 digits with a ValueError
        shown = entry if len(entry) <= 80 else entry[:79] + "…"
        raise TargetError(f"port of {len(text)} digits out of range 1..65535 in target {shown!r}")
    port = int(text)
    if not 1 <= port <= 65535:
        raise TargetError(f"port {port} out of range 1..65535 in target {entry!r}")
    return port


def _check_host(host: str, entry: str) -> str:
    if not host:
        raise TargetError(f"empty host in target {entry!r}")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if _NUMERIC_DOTTED.match(host):
        # "1.2.3" or "010.0.0.1" would reach a resolver as some other IPv4 address (inet_aton forms).
        raise TargetError(f"bad IPv4 address {host!r} in target {entry!r}")
    if not _HOSTNAME.match(host):
        raise TargetError(f"bad host {host!r} in target {entry!r}")
    return host.rstrip(".").lower()


def is_host(text: str) -> bool:
    """Whether ``text`` is an IP address or a DNS host name: what ``parse_target`` accepts as a host."""
    try:
        _check_host(text, text)
    except TargetError:
        return False
    return True


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def redact_userinfo(text: str) -> str:
    """``text`` with the userinfo of every address in it replaced: ``admin:s3cr3t@10.0.0.1:80`` →
    ``<redacted>@10.0.0.1:80``. Whatever prints an address or a message that may quote one (a bad
    entry, a peer's error) passes it through this first."""
    if "@" not in text:
        return text
    return _USERINFO.sub(lambda m: f"{m['scheme'] or ''}{REDACTED}@", text)


def parse_target(entry: str, default_port: int | None = None) -> HostPort:
    """Parse one ``host[:port]`` entry.

    ``[v6]:port`` and ``[v6]`` are accepted; a bare IPv6 address without brackets
    is accepted only when no port could be meant (it parses as an address).
    """
    text = entry.strip()
    if not text:
        raise TargetError("empty target entry")
    if "://" in text:
        raise TargetError(f"target {entry!r}: give host:port, without a scheme such as http://")
    if "@" in text:
        raise TargetError(f"target {entry!r}: give host:port, without a user:password prefix")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise TargetError(f"unclosed '[' in target {entry!r}")
        host = text[1:end]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise TargetError(f"bad IPv6 address {host!r} in target {entry!r}") from exc
        rest = text[end + 1 :]
        if rest == "":
            port_text = None
        elif rest.startswith(":"):
            port_text = rest[1:]
        else:
            raise TargetError(f"unexpected {rest!r} after ']' in target {entry!r}")
        host = str(ipaddress.IPv6Address(host))
    elif text.count(":") > 1:
        # Unbracketed IPv6: only an address that cannot also be read as addr:port is unambiguous
        # ("fe80::1:8080" is an address, and also fe80::1 port 8080).
        try:
            host = str(ipaddress.IPv6Address(text))
        except ValueError as exc:
            raise TargetError(f"ambiguous target {entry!r}: bracket IPv6 hosts as [addr]:port") from exc
        head, _, tail = text.rpartition(":")
        if tail.isascii() and tail.isdigit() and _is_ipv6(head):
            raise TargetError(f"ambiguous target {entry!r}: bracket IPv6 hosts as [addr]:port")
        port_text = None
    else:
        host, sep, port_text_raw = text.partition(":")
        port_text = port_text_raw if sep else None
        host = _check_host(host, entry)
    if port_text is None:
        if default_port is None:
            raise TargetError(f"target {entry!r} {NO_PORT}")
        if not 1 <= default_port <= 65535:
            raise TargetError(f"default port {default_port} out of range 1..65535 for target {entry!r}")
        return HostPort(host, default_port)
    return HostPort(host, _check_port(port_text, entry))


def parse_target_list(text: str, default_port: int | None = None) -> tuple[HostPort, ...]:
    """Parse a comma-separated list; every bad entry is reported at once; duplicates are dropped."""
    entries = [e for e in (part.strip() for part in text.split(",")) if e]
    seen: dict[HostPort, None] = {}
    errors: list[str] = []
    for entry in entries:
        try:
            seen.setdefault(parse_target(entry, default_port))
        except TargetError as exc:
            errors.append(str(exc))
    if errors:
        raise TargetError("; ".join(errors))
    return tuple(seen)
