"""host:port parsing (router/targets.py): review-lessons §17 — explicit ports honoured, ambiguity rejected."""

from __future__ import annotations

import re

import pytest

from router.targets import HostPort, TargetError, format_target, is_host, parse_target, parse_target_list


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("10.0.0.1:7000", HostPort("10.0.0.1", 7000)),
        ("kvcm-0.svc.local:6390", HostPort("kvcm-0.svc.local", 6390)),
        ("  host:1  ", HostPort("host", 1)),
        ("host:65535", HostPort("host", 65535)),
        ("[::1]:8080", HostPort("::1", 8080)),
        ("[2001:DB8:0:0::1]:443", HostPort("2001:db8::1", 443)),
    ],
)
def test_explicit_port_is_honoured_even_with_a_default(entry: str, expected: HostPort) -> None:
    assert parse_target(entry, default_port=6381) == expected
    assert parse_target(entry) == expected


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("10.0.0.1", HostPort("10.0.0.1", 6381)),
        ("KVCM.Example.COM.", HostPort("kvcm.example.com", 6381)),
        ("localhost", HostPort("localhost", 6381)),
        ("[fe80::1]", HostPort("fe80::1", 6381)),
        ("::1", HostPort("::1", 6381)),
        ("2001:db8::1", HostPort("2001:db8::1", 6381)),
    ],
)
def test_bare_host_takes_the_default_port(entry: str, expected: HostPort) -> None:
    assert parse_target(entry, default_port=6381) == expected


def test_bare_host_without_a_default_port_is_an_error_naming_it() -> None:
    with pytest.raises(TargetError, match=r"'kvcm-0'.*no port"):
        parse_target("kvcm-0")


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("http://1.2.3.4:8000", "without a scheme"),
        ("grpc://[::1]:50051", "without a scheme"),
        ("user:pw@1.2.3.4:8000", "without a user:password prefix"),
        ("admin@10.0.0.1", "without a user:password prefix"),
    ],
)
def test_an_entry_written_as_a_url_says_what_to_drop(entry: str, says: str) -> None:
    with pytest.raises(TargetError, match=says):
        parse_target(entry, 80)


def test_a_port_of_thousands_of_digits_is_out_of_range_not_a_crash() -> None:
    """int() refuses more than 4,300 digits with a plain ValueError, which callers do not expect."""
    with pytest.raises(TargetError, match="port of 5000 digits out of range") as caught:
        parse_target("10.0.0.2:" + "9" * 5000)
    assert len(str(caught.value)) < 200  # the entry is cut in the message
    assert parse_target("10.0.0.2:000080") == HostPort("10.0.0.2", 80)  # leading zeros are no digits too many


def test_default_port_out_of_range_is_rejected() -> None:
    with pytest.raises(TargetError, match="default port 0"):
        parse_target("kvcm-0", default_port=0)
    with pytest.raises(TargetError, match="default port 65536"):
        parse_target("kvcm-0", default_port=65536)


@pytest.mark.parametrize(
    ("port", "accepted"),
    [("0", False), ("1", True), ("65535", True), ("65536", False), ("99999999999999999999", False)],
)
def test_port_range_both_bounds(port: str, accepted: bool) -> None:
    entry = f"host:{port}"
    if accepted:
        assert parse_target(entry).port == int(port)
    else:
        with pytest.raises(TargetError, match=re.escape(f"out of range 1..65535 in target '{entry}'")):
            parse_target(entry)


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        # An unbracketed IPv6 that also reads as addr:port: is 8080 a port or the last group?
        ("fe80::1:8080", "ambiguous target 'fe80::1:8080'"),
        ("::1:80", "ambiguous target '::1:80'"),
        # Unbracketed IPv6 with a port glued on that does not even parse.
        ("2001:db8::1::80", "ambiguous target '2001:db8::1::80'"),
        ("host:80:90", "ambiguous target 'host:80:90'"),
        # Numeric dotted names a resolver would read as some other IPv4 address.
        ("1.2.3:80", "bad IPv4 address '1.2.3'"),
        ("010.0.0.1:80", "bad IPv4 address '010.0.0.1'"),
        ("256.1.1.1", "bad IPv4 address '256.1.1.1'"),
        ("host:", "bad port '' in target 'host:'"),
        ("host:http", "bad port 'http' in target 'host:http'"),
        ("host:+80", "bad port '+80'"),
        ("host: 80", "bad port ' 80'"),
        ("host:８０", "bad port '８０'"),  # fullwidth digits
        ("host:²", "bad port '²'"),  # str.isdigit() accepts it, int() does not
        (":80", "empty host in target ':80'"),
        ("bad_host!:80", "bad host 'bad_host!'"),
        ("[::1", "unclosed '[' in target '[::1'"),
        ("[1.2.3.4]:80", "bad IPv6 address '1.2.3.4'"),
        ("[::1]80", "unexpected '80' after ']'"),
        ("[::1]:", "bad port ''"),
        ("", "empty target entry"),
        # A zone id is an interface's name or index: a peer's host field carried any text through it.
        ("[fe80::1%x y]:80", "bad IPv6 zone id 'x y'"),
        ("[fe80::1%" + "A" * 16 + "]:80", "bad IPv6 zone id"),
    ],
)
def test_bad_entries_are_rejected_naming_the_entry(entry: str, fragment: str) -> None:
    with pytest.raises(TargetError, match=re.escape(fragment)):
        parse_target(entry, default_port=6381)


@pytest.mark.parametrize(
    "host",
    ["0x7f000001", "0x7f.1", "0x7f.0.0.1", "0X7F.0.0.1", "0x7f.0.0.1.", "0x", "127.1", "1.2.3", "017700000001"],
)
def test_a_host_a_resolver_reads_as_another_ipv4_address_is_refused(host: str) -> None:
    """Every label a number, in decimal, octal or hexadecimal: inet_aton's forms, which getaddrinfo
    reads as an IPv4 address ("0x7f.1" is 127.0.0.1). The hexadecimal ones got past the guard, and the
    master's reported host (``is_host``) with them."""
    with pytest.raises(TargetError, match=re.escape(f"bad IPv4 address {host!r} in target '{host}:80'")):
        parse_target(f"{host}:80")
    assert not is_host(host)


@pytest.mark.parametrize("host", ["0xcafe.example", "x0x1", "0x7f.0.0.1.example", "0xg"])
def test_a_name_with_a_label_that_is_no_number_is_a_host_name(host: str) -> None:
    assert parse_target(f"{host}:80") == HostPort(host, 80)
    assert is_host(host)


def test_a_host_name_is_at_most_253_characters_without_its_trailing_dot_and_a_label_63() -> None:
    label = "a" * 63
    assert parse_target(f"{label}:1") == HostPort(label, 1)
    assert parse_target(f"x.{label}:1") == HostPort(f"x.{label}", 1)
    for long_label in (f"{label}a", f"x.{label}a"):
        with pytest.raises(TargetError, match=re.escape(f"bad host '{long_label}'")):
            parse_target(f"{long_label}:1")
    name = ".".join([label] * 3 + ["b" * 61])
    assert len(name) == 253
    # The trailing dot only marks the name as absolute: it counted, and refused a legal name.
    for written in (name, f"{name}."):
        assert parse_target(f"{written}:1") == HostPort(name, 1)
        assert is_host(written)
    for longer in (f"{name}b", f"{name}b."):
        with pytest.raises(TargetError, match="bad host"):
            parse_target(f"{longer}:1")
        assert not is_host(longer)


@pytest.mark.parametrize("host", ["host\n", "10.0.0.1\n", "host.\n"])
def test_a_host_with_a_final_newline_is_no_host(host: str) -> None:
    """A pattern's $ also matches before a final newline: the master's reported host was taken with it."""
    assert not is_host(host)


def test_format_target_brackets_ipv6_only() -> None:
    assert format_target("10.0.0.1", 80) == "10.0.0.1:80"
    assert format_target("::1", 80) == "[::1]:80"
    assert format_target("[::1]", 80) == "[::1]:80"
    assert str(HostPort("2001:db8::1", 443)) == "[2001:db8::1]:443"
    assert HostPort("2001:db8::1", 443).is_ipv6
    assert not HostPort("10.0.0.1", 443).is_ipv6


@pytest.mark.parametrize("entry", ["10.0.0.1:7000", "[::1]:8080", "[2001:db8::1]:443", "kvcm-0.local:6381"])
def test_parse_format_round_trip(entry: str) -> None:
    assert str(parse_target(entry)) == entry


def test_list_keeps_order_honours_ports_and_applies_default() -> None:
    parsed = parse_target_list("b:1, a, [::1]:9, [::2]", default_port=6381)
    assert parsed == (HostPort("b", 1), HostPort("a", 6381), HostPort("::1", 9), HostPort("::2", 6381))


def test_list_drops_duplicates_after_normalisation() -> None:
    parsed = parse_target_list("A:1,a:1,a.:1,[::1]:5,[0:0::1]:5,a,a:6381,a:2", default_port=6381)
    assert parsed == (HostPort("a", 1), HostPort("::1", 5), HostPort("a", 6381), HostPort("a", 2))


def test_list_skips_empty_entries() -> None:
    assert parse_target_list(" a:1 ,, ,b:2,", default_port=None) == (HostPort("a", 1), HostPort("b", 2))
    assert parse_target_list("") == ()


def test_list_reports_every_bad_entry_at_once() -> None:
    with pytest.raises(TargetError) as info:
        parse_target_list("good:1, bad:0, fe80::1:80, also bad:x, fine, :5", default_port=None)
    message = str(info.value)
    for fragment in ("'bad:0'", "'fe80::1:80'", "'also bad:x'", "'fine' has no port", "':5'"):
        assert fragment in message
    assert "good" not in message
    assert message.count(";") == 4  # five problems, one per entry
