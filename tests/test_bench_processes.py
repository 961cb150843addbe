"""``kvroute bench --quick --only P9`` runs end to end: both process counts measured against the same
simulator child, every process tree stopped, the CPU pinning undone. Shapes only, never speed."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from pathlib import Path

import grpc
import psutil
import pytest

from kvroute_sim.bench.processes import CALLERS, WARM_CALLS_PER_CALLER, _drive
from router.cli import main
from router.wire import router_v1_pb2
from router.wire.paths import ROUTER_ROUTE


def test_quick_p9_measures_one_and_two_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    affinity = os.sched_getaffinity(0)

    assert main(["bench", "--quick", "--only", "P9", "--out", str(out)]) == 0

    assert psutil.Process().children(recursive=True) == []  # serve trees and the simulator child are gone
    assert os.sched_getaffinity(0) == affinity
    (figure,) = json.loads(out.read_text(encoding="utf-8"))["figures"]
    assert figure["key"] == "P9" and figure["verdict"] == "-"
    data = figure["data"]
    assert data["cpus"] and data["ratio"] > 0
    levels = data["levels"]
    assert [lv["processes"] for lv in levels] == [1, 2]
    for level in levels:
        assert level["answered"] > 0 and level["decisions_per_s"] > 0
        assert sum(level["outcomes"].values()) == level["answered"]
        # Each router process printed its drain summary; each answered some (warm-up included).
        assert len(level["answered_by_process"]) == level["processes"]
        assert all(n > 0 for n in level["answered_by_process"]), level
    printed = capsys.readouterr().out
    assert "| P9 " in printed and "with 2" in printed


def test_p9s_measured_window_starts_once_every_caller_is_warm() -> None:
    """The CPU before the window is read when every warm call is done: warm calls and connection set-up
    are outside it, as the answers it is divided by are the measured ones only."""
    served = 0
    lock = threading.Lock()

    def route(request: bytes, context: grpc.ServicerContext) -> bytes:
        nonlocal served
        with lock:
            served += 1
        return router_v1_pb2.RouteDecision(request_id="r").SerializeToString()

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=CALLERS))
    service, method = ROUTER_ROUTE.lstrip("/").split("/")
    handler = grpc.unary_unary_rpc_method_handler(route)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        warm = [b""] * (CALLERS * WARM_CALLS_PER_CALLER)
        served_at_start: list[int] = []
        at_start = lambda: served_at_start.append(served)  # noqa: E731
        _, results = _drive(f"127.0.0.1:{port}", [b""] * 64, warm, 30.0, at_start=at_start)
    finally:
        server.stop(None)
    assert served_at_start == [len(warm)]
    assert sum(r.answered for r in results) == 64 == served - len(warm)
