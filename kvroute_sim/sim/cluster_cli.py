"""``kvroute sim-cluster``: simulated KVCM replicas, workers and scheduler replicas on loopback.

KVCM replicas and workers are gRPC servers; the scheduler (``SimMaster``, ``--master-replicas``,
0 = none) serves HTTP JSON and gRPC (HTTP port + 2) and routes with the cluster's exact cache
and queue knowledge (``cluster_decide``).

Prints where everything listens (human-readable lines, or one JSON line with
``--print-json``), pre-seeds cached prefixes so a query returns matches, optionally
runs background traffic, and serves until SIGINT/SIGTERM (exit 0) or ``--duration``. ``--host`` is
an IP address (a name or a wildcard is refused, naming the flag, exit 2); a server that cannot bind
it (not this machine's) is one line naming the flag, exit 1.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import json
import math
import signal
import sys
from collections.abc import Callable

import trio

from kvroute_sim.sim.cluster import DEFAULT_KVCM_REPLICAS, DEFAULT_WORKERS, SimCluster, SimClusterAddresses
from kvroute_sim.sim.cluster_master import cluster_decide
from kvroute_sim.sim.master import SimMaster, SimMasterAddresses
from kvroute_sim.sim.traffic import (
    MAX_SYSTEM_PROMPT_TOKENS,
    SeededPrefix,
    TrafficSpec,
    TrafficStats,
    run_traffic,
    seed_prefixes,
)
from kvroute_sim.sim.worker import WorkerSpec
from router.exception_groups import leaves
from router.types import KeyFamily, Role

_WORKER = WorkerSpec()
_TRAFFIC = TrafficSpec()
DEFAULT_MASTER_REPLICAS = 3
EXIT_CANNOT_SERVE = 1


class HostError(Exception):
    """A server could not bind ``--host``."""


def _at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _advertised_ip(text: str) -> str:
    """``--host`` is where the servers bind and also the address they advertise (KVCM's host_ip_port
    entries and leader endpoint, the printed flags), which the wire contract makes an ``ip:port``: a
    name or a wildcard there would send clients to an address that is not one."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an IP address, as the servers advertise it (e.g. 127.0.0.1), got {text!r}"
        ) from None
    if address.is_unspecified:
        raise argparse.ArgumentTypeError(
            f"must be one address the servers can advertise, not the wildcard {text}"
        )
    return str(address)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", type=_at_least(1), default=DEFAULT_WORKERS, help="number of simulated workers"
    )
    parser.add_argument(
        "--kvcm-replicas",
        type=_at_least(1),
        default=DEFAULT_KVCM_REPLICAS,
        help="KVCM replicas (kvcm-0 leads)",
    )
    parser.add_argument(
        "--master-replicas",
        type=_at_least(0),
        default=DEFAULT_MASTER_REPLICAS,
        help="simulated scheduler replicas, the first elected (HTTP + gRPC on HTTP port + 2); 0 = none",
    )
    parser.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        help="seconds to run (default: until SIGINT/SIGTERM)",
    )
    parser.add_argument(
        "--block-size",
        type=_at_least(1),
        default=_WORKER.block_size,
        help="block size (tokens), also reported",
    )
    parser.add_argument(
        "--no-report-block-size", action="store_true", help="workers leave block_size unset (a stock engine)"
    )
    parser.add_argument(
        "--role", choices=[r.value for r in Role], default="PREFILL", help="role workers report"
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=_positive_float,
        default=_WORKER.prefill_tokens_per_s,
        help="worker throughput",
    )
    parser.add_argument(
        "--kv-capacity-blocks",
        type=_at_least(1),
        default=_WORKER.kv_capacity_blocks,
        help="per-worker LRU capacity",
    )
    parser.add_argument(
        "--followers-answer-queries", action="store_true", help="followers answer GetHostCacheState too"
    )
    parser.add_argument("--instance-id", default="", help="KVCM instance id to accept (default: any)")
    parser.add_argument(
        "--host",
        type=_advertised_ip,
        default="127.0.0.1",
        help="IP address every server binds and advertises (port 0: any free port)",
    )
    parser.add_argument("--max-threads", type=_at_least(1), default=8, help="handler threads per server")
    parser.add_argument(
        "--groups",
        type=_at_least(1),
        default=_TRAFFIC.groups,
        help="shared system prompts (seeded and in traffic)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=_at_least(1, MAX_SYSTEM_PROMPT_TOKENS),
        default=_TRAFFIC.system_prompt_tokens,
        help=f"tokens per system prompt (at most {MAX_SYSTEM_PROMPT_TOKENS})",
    )
    parser.add_argument(
        "--holders-per-group",
        type=_at_least(1),
        default=_TRAFFIC.holders_per_group,
        help="workers pre-seeded with each system prompt",
    )
    parser.add_argument("--no-seed", action="store_true", help="start with empty caches")
    parser.add_argument(
        "--key-family",
        choices=[f.value for f in KeyFamily],
        default=_TRAFFIC.key_family.value,
        help="block-key family of the seeded prompts",
    )
    parser.add_argument(
        "--traffic-rate",
        type=_non_negative_float,
        default=_TRAFFIC.rate_per_s,
        help="background requests per second (0 = off)",
    )
    parser.add_argument("--seed", type=int, default=_TRAFFIC.seed, help="random seed for seeding and traffic")
    parser.add_argument("--print-json", action="store_true", help="print one JSON line with every address")


def run(args: argparse.Namespace) -> int:
    try:
        cluster, traffic = build_cluster(args)
    except ValueError as exc:
        print(f"kvroute sim-cluster: error: {exc}", file=sys.stderr)
        return 2
    host_errors: list[BaseException] = []
    try:
        trio.run(_serve, cluster, traffic, args)
    except* HostError as group:
        host_errors.extend(leaves(group))
    for error in host_errors:
        print(f"kvroute sim-cluster: {error}", file=sys.stderr)
    return EXIT_CANNOT_SERVE if host_errors else 0


def build_cluster(args: argparse.Namespace) -> tuple[SimCluster, TrafficSpec]:
    """The cluster and its seeding and traffic, from the parsed flags (nothing served yet)."""
    worker_spec = WorkerSpec(
        role=f"RoleType.{args.role}",
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        block_size=None if args.no_report_block_size else args.block_size,
        kv_capacity_blocks=args.kv_capacity_blocks,
    )
    cluster = SimCluster(
        [worker_spec] * args.workers,
        args.kvcm_replicas,
        block_size=args.block_size,
        followers_answer_queries=args.followers_answer_queries,
        instance_id=args.instance_id,
    )
    traffic = TrafficSpec(
        groups=args.groups,
        system_prompt_tokens=args.prompt_tokens,
        holders_per_group=args.holders_per_group,
        rate_per_s=args.traffic_rate,
        key_family=KeyFamily(args.key_family),
        seed=args.seed,
    )
    return cluster, traffic


async def _serve(cluster: SimCluster, traffic: TrafficSpec, args: argparse.Namespace) -> None:
    stats = TrafficStats()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            master: SimMasterAddresses | None = None
            try:
                addresses = await nursery.start(
                    functools.partial(cluster.serve_grpc, host=args.host, max_threads=args.max_threads)
                )
                if args.master_replicas > 0:
                    # The handlers read the same clock the cluster's servers do (safe off the trio thread).
                    decide = cluster_decide(cluster, trio.lowlevel.current_clock().current_time, traffic.key_family)
                    sim_master = SimMaster(replicas=args.master_replicas, decide=decide)
                    master = await nursery.start(functools.partial(sim_master.run, host=args.host))
            except* OSError as group:  # a server could not bind: the address is not this machine's
                raise HostError(f"--host {args.host}: " + "; ".join(map(str, leaves(group)))) from None
            seeded = () if args.no_seed else seed_prefixes(cluster, traffic)
            _print_addresses(addresses, master, seeded, args.print_json)
            nursery.start_soon(run_traffic, cluster, traffic, stats)
            with trio.move_on_after(math.inf if args.duration is None else args.duration):
                async for signum in signals:
                    print(
                        f"sim-cluster: {signal.Signals(signum).name}, stopping", file=sys.stderr, flush=True
                    )
                    break
            nursery.cancel_scope.cancel()
    if args.traffic_rate > 0:
        print(
            f"sim-cluster: traffic sent={stats.sent} rejected={stats.rejected}", file=sys.stderr, flush=True
        )


def _print_addresses(
    addresses: SimClusterAddresses,
    master: SimMasterAddresses | None,
    seeded: tuple[SeededPrefix, ...],
    as_json: bool,
) -> None:
    if as_json:
        document = addresses.to_json()
        document["seeded_prefixes"] = [s.to_json() for s in seeded]
        document["master_hosts"] = list(master.hosts) if master is not None else []
        document["master_elected"] = master.elected if master is not None else None
        print(json.dumps(document, sort_keys=True), flush=True)
        return
    for node, target in addresses.kvcm_nodes:
        role = "leader" if node == addresses.leader else "follower"
        print(f"kvcm {node} {target} {role}")
    for worker in addresses.workers:
        print(f"worker {worker.http_target} status={worker.status_target}")
    if master is not None:
        for host, grpc_target in zip(master.hosts, master.grpc_targets, strict=True):
            role = "elected" if host == master.elected else "replica"
            print(f"master {host} grpc={grpc_target} {role}")
    for prefix in seeded:
        print(
            f"seeded group={prefix.group} blocks={len(prefix.block_keys)} workers={','.join(prefix.workers)}"
        )
    print(f"--kvcm-bootstrap {addresses.kvcm_bootstrap}")
    print(f"--workers {addresses.workers_arg}", flush=True)
    if master is not None:
        print(f"--master-hosts {','.join(master.hosts)}", flush=True)
