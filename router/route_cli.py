"""``kvroute route``: open a router in this process, route one request, print the decision.

    kvroute route --kvcm-bootstrap H:P[,...] --workers IP:HTTP_PORT[,...] --kvcm-instance-id ID \\
        (--tokens 1,2,3 | --tokens-file F | --keys k1,k2) [--request-id ID] [--budget-ms MS] [--json]

The router starts against the configured bootstrap and workers and is given a short, bounded
warm-up (discovery has workers and the KVCM leader is resolved, or ``--warmup-ms`` has passed),
then routes the request once. Output: one line, or with ``--json`` one JSON object with the
``kvroute.v1.RouteDecision`` fields plus ``stage_ms``, ``error``, ``candidates``, ``sources``, ``split``
and ``windows``.

Exit status: 0 with a worker, 1 when nothing could be routed (no worker known), 2 for a bad request
or a configuration that stops kvroute (every problem listed). ``kvroute explain`` (explain_cli) takes
the same input and prints every candidate instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import math
import re
import sys
from collections.abc import Callable

import trio
from google.protobuf.json_format import MessageToDict

from actors.leader_resolver import LeaderUnavailable
from router.api import RouterHandle, open_router
from router.config import KvrouteConfig
from router.files import open_regular_file
from router.logs import setup_logging, shown
from router.request import check_request, check_token_ids
from router.settings import LoadedConfig, SourceKind, add_arguments, load_or_report, log_startup_report
from router.sidecar import decision_to_proto
from router.types import BadRequest, Reason, RouteDecision, RouteRequest, RouteSource

log = logging.getLogger("kvroute.route")
# A token file is read no further than this: far beyond any prompt the limits allow (a token id is at
# most 20 characters and a separator), and small enough to hold in memory.
TOKENS_FILE_MAX_CHARS = 64 * 1024 * 1024
WARMUP_MAX_MS = 600_000.0  # ten minutes: --warmup-ms beyond it is a mistake, not a wait

DEFAULT_WARMUP_MS = 2000.0
DEFAULT_REQUEST_ID = "kvroute-cli"
_SEPARATORS = re.compile(r"[\s,]+")

EXIT_ROUTED = 0
EXIT_NOT_ROUTED = 1
EXIT_USAGE = 2


class InputError(ValueError):
    """Bad command-line input; the message names the flag."""


def configure_input(parser: argparse.ArgumentParser) -> None:
    """The request flags shared by ``route`` and ``explain``, then every setting's flag."""
    given = parser.add_argument_group("request")
    source = given.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", metavar="T1,T2,...", help="the prompt's token ids")
    source.add_argument("--tokens-file", metavar="FILE", help="file of token ids (separated by commas or whitespace)")
    source.add_argument("--keys", metavar="K1,K2,...", help="block cache keys, used as given")
    given.add_argument("--request-id", default=DEFAULT_REQUEST_ID, help="request id (default %(default)s)")
    given.add_argument(
        "--budget-ms", type=float, default=None, help="remaining TTFT budget in ms (default: --budget-cap-ms)"
    )
    given.add_argument("--seq-len", type=int, default=None, help="prompt length (default: from the input)")
    given.add_argument(
        "--warmup-ms",
        type=float,
        default=DEFAULT_WARMUP_MS,
        help="at most this long to wait for discovery and the KVCM leader before routing (default %(default)s)",
    )
    # These commands print the decision: they log only problems unless a level is asked for (``decide``).
    add_arguments(parser, notes={"log_level": "Here (route, explain): WARNING unless given."})


def configure(parser: argparse.ArgumentParser) -> None:
    configure_input(parser)
    parser.add_argument("--json", action="store_true", help="print the decision as one JSON object")


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    """Integers separated by commas or whitespace (brackets allowed around them); names ``flag``."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    words = [w for w in _SEPARATORS.split(body) if w]
    if not words:
        raise InputError(f"{flag}: no values given")
    values = []
    for i, word in enumerate(words):
        try:
            values.append(int(word, 10))
        except ValueError:
            raise InputError(f"{flag}: entry {i + 1} ({word!r}) is not an integer") from None
    return tuple(values)


def request_from_args(args: argparse.Namespace) -> RouteRequest:
    """The request the flags describe; raises InputError naming the flag."""
    tokens: tuple[int, ...] | None = None
    keys: tuple[int, ...] | None = None
    if args.tokens is not None:
        tokens = parse_ints(args.tokens, "--tokens")
    elif args.tokens_file is not None:
        try:
            with io.TextIOWrapper(open_regular_file(args.tokens_file), encoding="utf-8") as file:
                text = file.read(TOKENS_FILE_MAX_CHARS + 1)
        except OSError as exc:
            raise InputError(f"--tokens-file: cannot read {args.tokens_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise InputError(f"--tokens-file: {args.tokens_file} is not UTF-8 text (byte {exc.start})") from None
        if len(text) > TOKENS_FILE_MAX_CHARS:
            raise InputError(f"--tokens-file: {args.tokens_file} is longer than {TOKENS_FILE_MAX_CHARS} characters")
        tokens = parse_ints(text, f"--tokens-file {args.tokens_file}")
    else:
        keys = parse_ints(args.keys, "--keys")
    if not math.isfinite(args.warmup_ms) or not 0 <= args.warmup_ms <= WARMUP_MAX_MS:
        raise InputError(f"--warmup-ms: must be a number from 0 to {WARMUP_MAX_MS:.0f}, got {args.warmup_ms}")
    return RouteRequest(
        request_id=args.request_id,
        token_ids=tokens,
        block_cache_keys=keys,
        seq_len=args.seq_len,
        budget_ms=args.budget_ms,
    )


# The flag each request field comes from (token_ids: --tokens or --tokens-file, whichever was given).
_FLAGS = {
    "request_id": "--request-id",
    "block_cache_keys": "--keys",
    "seq_len": "--seq-len",
    "budget_ms": "--budget-ms",
}


def flag_of(field_name: str, args: argparse.Namespace) -> str:
    """The flag that gave the request field ``field_name`` (the field's name for one no flag gives)."""
    if field_name == "token_ids":
        return "--tokens" if args.tokens is not None else "--tokens-file"
    return _FLAGS.get(field_name, field_name)


def check_input(request: RouteRequest, config: KvrouteConfig, args: argparse.Namespace) -> None:
    """Raise InputError naming the flag when the router would refuse ``request`` by its pure checks
    (router.request: every field, and each token id a 64-bit integer), before a router is started and
    warmed up for it. A token id a key family cannot encode is left to the routing: the ids are hashed
    only when a source needs keys."""
    try:
        check_request(request, config.deployment, config.limits, hash_tokens=False)
        if request.token_ids is not None:
            check_token_ids(request.token_ids)
    except BadRequest as exc:
        raise InputError(f"{flag_of(exc.field_name, args)}: {exc.detail}") from None


async def warm_up(handle: RouterHandle, within_s: float) -> None:
    """Wait until discovery has workers, the KVCM leader is resolved and each worker has been probed
    once, or ``within_s`` has passed."""
    with trio.move_on_after(within_s) as scope:
        discovery = handle.discovery()
        generation = discovery.generation
        while not discovery.workers().workers:
            generation = await discovery.wait_for_change(generation)
        resolver = handle.leader_resolver()
        if resolver is not None:
            # A failed lookup ends this wait at once: the request then falls back, and says so.
            with contextlib.suppress(LeaderUnavailable):
                await resolver.leader()
        # A worker never heard from is routable: with the cluster down, the fallback's pick named one
        # and the command said "routed". Probed once, one that refuses is known down and passed over.
        await handle.prober().probe(discovery.workers().workers, scope.deadline).wait_all()


async def _route_once(loaded: LoadedConfig, request: RouteRequest, warmup_s: float) -> RouteDecision:
    async with open_router(loaded.effective, loaded=loaded) as handle:
        await warm_up(handle, warmup_s)
        return await handle.route(request)


def decide(args: argparse.Namespace, command: str) -> tuple[RouteDecision, KvrouteConfig] | int:
    """Load the configuration, route the request once: the decision and the configuration it was made
    under; an exit status instead when that is impossible."""
    loaded = load_or_report(args, command)
    if loaded is None:
        return EXIT_USAGE
    serve = loaded.effective.serve
    # Unless a log level is asked for, only problems reach the terminal: the decision is the output.
    level_given = loaded.sources["log_level"].kind is not SourceKind.DEFAULT
    setup_logging(serve.log_level if level_given else "WARNING", serve.log_format)
    log_startup_report(loaded, log)
    try:
        request = request_from_args(args)
        check_input(request, loaded.effective, args)
    except InputError as exc:
        print(f"kvroute {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    decision = trio.run(_route_once, loaded, request, args.warmup_ms / 1000.0)
    if decision.reason is Reason.BAD_REQUEST:  # a token id the key family cannot encode, say
        field_name, colon, detail = (decision.error or "").partition(": ")
        error = f"{flag_of(field_name, args)}: {detail}" if colon else decision.error
        print(f"kvroute {command}: bad request: {error}", file=sys.stderr)
        return EXIT_USAGE
    return decision, loaded.effective


def exit_status(decision: RouteDecision) -> int:
    return EXIT_NOT_ROUTED if decision.worker is None else EXIT_ROUTED


def decision_json(decision: RouteDecision) -> dict[str, object]:
    """The kvroute.v1.RouteDecision fields (every one, zero values included), plus stages, error, candidates,
    the chain of sources as the request walked it, and the deadline split's windows."""
    out: dict[str, object] = MessageToDict(
        decision_to_proto(decision), preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    out["stage_ms"] = dict(decision.stage_ms)
    out["error"] = decision.error
    out["candidates"] = [dataclasses.asdict(c) for c in decision.candidates]
    out["sources"] = [
        {
            "source": step.source.value,
            "outcome": step.outcome.value,
            "reason": None if step.reason is None else step.reason.value,
            "elapsed_ms": step.elapsed_ms,
        }
        for step in decision.sources
    ]
    out["split"] = None if decision.split is None else decision.split.value
    out["windows"] = [{"stage": w.stage.value, "end_ms": w.end_ms, "cut": w.cut} for w in decision.windows]
    return out


def decision_line(decision: RouteDecision) -> str:
    """One readable line."""
    head = f"{shown(decision.request_id)}: {decision.route_source.value} {decision.reason.value}"
    if decision.worker is None:
        return f"{head}: no worker ({decision.error or 'nothing to route to'})"
    role = decision.role.value if decision.role is not None else "?"
    return (
        f"{head} -> {decision.worker.http_target} (grpc port {decision.worker.grpc_port}, {role}), "
        f"hit {decision.hit_tokens} tokens ({decision.local_blocks} blocks), {decision.elapsed_ms:.2f} ms"
    )


def _render(decision: RouteDecision, args: argparse.Namespace, _config: KvrouteConfig) -> str:
    if args.json:
        return json.dumps(decision_json(decision), sort_keys=True)
    return decision_line(decision)


def run(args: argparse.Namespace) -> int:
    return run_command(args, "route", _render)


def run_command(
    args: argparse.Namespace,
    command: str,
    render: Callable[[RouteDecision, argparse.Namespace, KvrouteConfig], str],
) -> int:
    outcome = decide(args, command)
    if isinstance(outcome, int):
        return outcome
    decision, config = outcome
    print(render(decision, args, config), flush=True)
    if decision.route_source is RouteSource.NONE:
        print(f"kvroute {command}: not routed: {decision.error}", file=sys.stderr)
    return exit_status(decision)
