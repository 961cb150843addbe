"""The master client's configuration rules (pure): its host list and the problems of its section."""

from __future__ import annotations

from router.config import MASTER_GRPC_PORT_OFFSET, MASTER_HTTP_PORT, MasterConfig, MasterProtocol
from router.problems import Problem, range_problems
from router.targets import TargetError, parse_target


def master_hosts(config: MasterConfig) -> tuple[str, ...]:
    """The configured scheduler hosts, canonical HOST:PORT (a bare host on ``MASTER_HTTP_PORT``), in the
    order given (empty: no master).

    Raises ValueError on an entry :func:`master_problems` reports.
    """
    hosts: list[str] = []
    for entry in (e.strip() for e in config.hosts.split(",")):
        if entry:
            hosts.append(str(parse_target(entry, MASTER_HTTP_PORT)))
    return tuple(hosts)


def names_a_host(config: MasterConfig) -> bool:
    """Whether the host list names any entry (a list of separators alone names none)."""
    return any(entry.strip() for entry in config.hosts.split(","))


def master_problems(config: MasterConfig) -> list[Problem]:
    """Every problem of the master section; empty when it is valid."""
    found = range_problems(config)
    seen: set[str] = set()
    for entry in (e.strip() for e in config.hosts.split(",")):
        if not entry:
            continue
        try:
            target = parse_target(entry, MASTER_HTTP_PORT)
        except TargetError as exc:
            found.append(Problem(("hosts",), str(exc)))
            continue
        # Over HTTP nothing is sent to the gRPC port (the scheduler's info goes over HTTP too).
        if config.protocol is MasterProtocol.GRPC and target.port + MASTER_GRPC_PORT_OFFSET > 65535:
            found.append(
                Problem(
                    ("hosts", "protocol"),
                    f"{entry!r}: port + {MASTER_GRPC_PORT_OFFSET} (the gRPC port the grpc protocol calls) "
                    "exceeds 65535",
                )
            )
        if str(target) in seen:
            found.append(Problem(("hosts",), f"{entry!r} is listed twice"))
        seen.add(str(target))
    if config.hosts and not names_a_host(config):
        # Given, so the breaker rules read a scheduler as configured where there is none.
        found.append(Problem(("hosts",), f"names no entry, only separators ({config.hosts!r})"))
    return found
