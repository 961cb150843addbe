"""Parsing and formatting of ``host:port`` targets (pure).

Rules: an explicit port is honoured, a bare host takes the
default port, anything ambiguous is an error naming the input. IPv6 hosts are
bracketed when a target is formed.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from router.text import cut_text

# At most 253 characters without the trailing dot, which only marks the name as absolute.
_HOSTNAME = re.compile(
    r"^(?=.{1,253}\.?$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$"
)
# An interface name or index, as the kernel names them (IFNAMSIZ: 15 characters and the NUL).
_ZONE_ID = re.compile(r"[A-Za-z0-9_.@:-]{1,15}")
_NUMERIC_DOTTED = re.compile(r"^[0-9.]+$")
# One to four labels, each a number in decimal, octal or hexadecimal: inet_aton's forms of an IPv4
# address ("127.1", "0x7f.1", "0x7f000001"), which a resolver reads as one.
_INET_ATON_FORM = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)(?:\.(?:0x[0-9a-f]*|[0-9]+)){0,3}\.?", re.IGNORECASE | re.ASCII)
# What ends a run of text that could hold ``user:password`` before an '@', scanning back from it.
# A password may hold any of RFC 3986's sub-delimiters (``!$&'()*+,;=``) and ':', so those do not.
_RUN_ENDS = frozenset(' \t\r\n\f\v@"`<>')
# Inside the run, what ends the user part (which holds no ':'): a list's comma, an assignment's '='.
_USER_ENDS = frozenset(",;='()[]{}/")
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


_SHOWN_CHARS = 80  # a refused target, host or port quoted in a message: its start, and how long it was


def _shown(text: str) -> str:
    """``text`` quoted for an error message, cut to its start: a target list of thousands of characters
    made a message of thousands. Redacted first: a cut that drops the '@' would leave the userinfo
    before it for the message's own redaction to miss."""
    return repr(cut_text(redact_userinfo(text), _SHOWN_CHARS))


def _check_port(text: str, entry: str) -> int:
    # isascii: str.isdigit() also accepts "²" and other non-ASCII digits.
    if not (text.isascii() and text.isdigit()):
        raise TargetError(f"bad port {_shown(text)} in target {_shown(entry)}")
    if len(text.lstrip("0")) > 5:  # beyond any port, and int() refuses more than 4,300 digits with a ValueError
        raise TargetError(f"port of {len(text)} digits out of range 1..65535 in target {_shown(entry)}")
    port = int(text)
    if not 1 <= port <= 65535:
        raise TargetError(f"port {port} out of range 1..65535 in target {_shown(entry)}")
    return port


def _check_host(host: str, entry: str) -> str:
    if not host:
        raise TargetError(f"empty host in target {_shown(entry)}")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        # An IPv6 zone id is whatever follows "%" but "%" and "/": a peer's host field (a scheduler's
        # server_ip, KVCM's leader host) carried newlines and kilobytes of text through it.
        zone = address.scope_id if isinstance(address, ipaddress.IPv6Address) else None
        if zone is not None and not _ZONE_ID.fullmatch(zone):
            raise TargetError(f"bad IPv6 zone id {_shown(zone)} in target {_shown(entry)}")
        return str(address)
    if _NUMERIC_DOTTED.match(host) or _INET_ATON_FORM.fullmatch(host):
        # "1.2.3", "010.0.0.1" or "0x7f.1" would reach a resolver as some other IPv4 address.
        raise TargetError(f"bad IPv4 address {_shown(host)} in target {_shown(entry)}")
    if not _HOSTNAME.fullmatch(host):  # match's $ would let a final newline through
        raise TargetError(f"bad host {_shown(host)} in target {_shown(entry)}")
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
    entry, a peer's error) passes it through this first. A password may hold any sub-delimiter
    (``pa;ss``, ``p(ss)``); where a list's comma could be a password's, more is hidden, never less.
    Linear in the text: each '@' looks back only as far as the previous one."""
    if "@" not in text:
        return text
    out: list[str] = []
    done = 0  # text[:done] is in out
    at = text.find("@")
    while at != -1:
        start = _userinfo_start(text, done, at)
        if start is not None:
            out.append(text[done:start])
            out.append(REDACTED)
            done = at
        at = text.find("@", at + 1)
    out.append(text[done:])
    return "".join(out)


def _userinfo_start(text: str, floor: int, at: int) -> int | None:
    """Where the userinfo before the '@' at ``at`` starts (None: there is none), looking back no
    further than ``floor`` or the previous '@'."""
    start = at
    while start > floor and text[start - 1] not in _RUN_ENDS:
        start -= 1
    if start > 0 and text[start - 1] == "@":
        start = _after_host(text, start, at)  # the run begins with the previous address's host[:port]
    scheme = text.rfind("://", start, at)
    if scheme != -1:
        start = scheme + 3
    colon = text.find(":", start, at)
    last = at if colon == -1 else colon  # the user part ends at the first ':'
    for i in range(last - 1, start - 1, -1):
        if text[i] in _USER_ENDS:
            start = i + 1
            break
    return start if start < at else None


def _after_host(text: str, start: int, at: int) -> int:
    """Past the ``host[:port]`` (and the one separator after it) that opens ``text[start:at]``."""
    i = start
    if i < at and text[i] == "[":
        close = text.find("]", i, at)
        i = at if close == -1 else close + 1
    else:
        while i < at and text[i] not in ":/,;=":
            i += 1
    if i < at and text[i] == ":":
        j = i + 1
        while j < at and text[j].isdigit():
            j += 1
        if j > i + 1:
            i = j
    if i < at and text[i] in _USER_ENDS:
        i += 1
    return i


def parse_target(entry: str, default_port: int | None = None) -> HostPort:
    """Parse one ``host[:port]`` entry.

    ``[v6]:port`` and ``[v6]`` are accepted; a bare IPv6 address without brackets
    is accepted only when no port could be meant (it parses as an address).
    """
    text = entry.strip()
    if not text:
        raise TargetError("empty target entry")
    if "://" in text:
        raise TargetError(f"target {_shown(entry)}: give host:port, without a scheme such as http://")
    if "@" in text:
        raise TargetError(f"target {_shown(entry)}: give host:port, without a user:password prefix")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise TargetError(f"unclosed '[' in target {_shown(entry)}")
        host = text[1:end]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise TargetError(f"bad IPv6 address {_shown(host)} in target {_shown(entry)}") from exc
        rest = text[end + 1 :]
        if rest == "":
            port_text = None
        elif rest.startswith(":"):
            port_text = rest[1:]
        else:
            raise TargetError(f"unexpected {_shown(rest)} after ']' in target {_shown(entry)}")
        host = _check_host(host, entry)  # its zone id too
    elif text.count(":") > 1:
        # Unbracketed IPv6: only an address that cannot also be read as addr:port is unambiguous
        # ("fe80::1:8080" is an address, and also fe80::1 port 8080).
        try:
            ipaddress.IPv6Address(text)
        except ValueError as exc:
            raise TargetError(f"ambiguous target {_shown(entry)}: bracket IPv6 hosts as [addr]:port") from exc
        host = _check_host(text, entry)  # its zone id too
        head, _, tail = text.rpartition(":")
        if tail.isascii() and tail.isdigit() and _is_ipv6(head):
            raise TargetError(f"ambiguous target {_shown(entry)}: bracket IPv6 hosts as [addr]:port")
        port_text = None
    else:
        host, sep, port_text_raw = text.partition(":")
        port_text = port_text_raw if sep else None
        host = _check_host(host, entry)
    if port_text is None:
        if default_port is None:
            raise TargetError(f"target {_shown(entry)} {NO_PORT}")
        if not 1 <= default_port <= 65535:
            raise TargetError(f"default port {default_port} out of range 1..65535 for target {_shown(entry)}")
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
