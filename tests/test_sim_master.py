"""SimMaster itself: the default policy, its validation, and its real servers on loopback (real clock)."""

from __future__ import annotations

import httpx
import pytest
import trio

from kvroute_sim.sim.master import MasterFaults, SimMaster, pick_from
from router.config import MasterConfig
from router.transport.errors import Unavailable
from router.transport.master_http import HttpMasterTransport
from router.types import Role, RoleAddr
from router.wire import paths
from router.wire.master import MasterRouted, MasterScheduleRequest

WORKERS = [
    RoleAddr(Role.PREFILL, "10.0.0.1", 8000, 8001),
    RoleAddr(Role.PREFILL, "10.0.0.2", 8000, 8001),
    RoleAddr(Role.DECODE, "10.0.1.1", 9000, 9001),
    RoleAddr(Role.DECODE, "10.0.1.2", 9000, 9001),
]


def test_pick_from_names_one_worker_per_role_deterministically() -> None:
    decide = pick_from(WORKERS)
    picks = [tuple(decide(MasterScheduleRequest(f"r{i}"))) for i in range(40)]
    assert all([a.role for a in pick] == [Role.DECODE, Role.PREFILL] for pick in picks)
    assert picks == [tuple(pick_from(WORKERS)(MasterScheduleRequest(f"r{i}"))) for i in range(40)]
    assert {pick[1].ip for pick in picks} == {"10.0.0.1", "10.0.0.2"}  # both prefill workers are used
    assert list(pick_from([])(MasterScheduleRequest("x"))) == []


def test_replicas_must_be_positive() -> None:
    with pytest.raises(ValueError, match="replicas"):
        SimMaster(replicas=0)


async def test_a_replica_refusing_from_the_start(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        sim = SimMaster(WORKERS, replicas=2)
        sim.replicas[1].set_faults(MasterFaults(refuse=True), trio.current_time())
        addresses = await nursery.start(sim.run)
        await sim.replicas[1].wait_listening(False)
        async with HttpMasterTransport(MasterConfig()) as http:
            with pytest.raises(Unavailable):
                await http.schedule(addresses.hosts[1], MasterScheduleRequest("r"))
            sim.clear_faults()
            await sim.replicas[1].wait_listening(True)
            reply = await http.schedule(addresses.hosts[1], MasterScheduleRequest("r"))
            assert isinstance(reply, MasterRouted) and reply.real_master_host == addresses.hosts[0]


async def test_http_api_paths_and_methods(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        sim = SimMaster(WORKERS, replicas=1)
        addresses = await nursery.start(sim.run)
        async with httpx.AsyncClient(base_url=f"http://{addresses.hosts[0]}", trust_env=False) as client:
            missing = await client.post("/nope", content=b"{}")
            assert missing.status_code == 404
            wrong = await client.get(paths.MASTER_HTTP_INFO)
            assert wrong.status_code == 405
            bad = await client.post(paths.MASTER_HTTP_SCHEDULE, content=b"not json")
            assert (bad.status_code, bad.json()["code"]) == (400, 8406)
            info = await client.post(paths.MASTER_HTTP_INFO, content=b"{}")
            assert info.headers["content-type"] == "application/json"
            assert info.json()["real_master_host"] == addresses.elected


async def test_http_status_follows_the_error_code(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        sim = SimMaster(WORKERS, replicas=1)
        addresses = await nursery.start(sim.run)
        async with httpx.AsyncClient(base_url=f"http://{addresses.hosts[0]}", trust_env=False) as client:
            for code, status in ((8406, 400), (8502, 503), (8503, 500), (8400, 500)):
                sim.set_faults(0, MasterFaults(business_error=code))
                reply = await client.post(paths.MASTER_HTTP_SCHEDULE, json={"request_id": "r", "seq_len": 4})
                assert (reply.status_code, reply.json()["code"]) == (status, code)


async def test_a_numeric_request_id_is_coerced_and_echoed_under_bare_role_names(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        sim = SimMaster(WORKERS, replicas=1)
        addresses = await nursery.start(sim.run)
        async with httpx.AsyncClient(base_url=f"http://{addresses.hosts[0]}", trust_env=False) as client:
            for raw, request_id in ((b"42", "42"), (b"12.0", "12"), (b"1e3", "1000")):
                reply = await client.post(paths.MASTER_HTTP_SCHEDULE, content=b'{"request_id": ' + raw + b"}")
                assert reply.status_code == 200
                entries = [(e["role"], e["request_id"]) for e in reply.json()["server_status"]]
                assert entries == [("DECODE", request_id), ("PREFILL", request_id)]
            fractional = await client.post(paths.MASTER_HTTP_SCHEDULE, content=b'{"request_id": 12.5}')
            assert (fractional.status_code, fractional.json()["code"]) == (400, 8406)
            assert "request_id" in fractional.json()["error_message"]


async def test_http_refuses_keys_with_a_block_size_of_no_tokens(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        sim = SimMaster(WORKERS, replicas=1)
        addresses = await nursery.start(sim.run)
        async with httpx.AsyncClient(base_url=f"http://{addresses.hosts[0]}", trust_env=False) as client:
            for block_size in (-4, 0):
                body = {"request_id": "a", "block_cache_keys": [1], "block_size": block_size}
                reply = await client.post(paths.MASTER_HTTP_SCHEDULE, json=body)
                assert (reply.status_code, reply.json()["code"]) == (400, 8406)
                assert "block_size" in reply.json()["error_message"]
            assert sim.schedules == 0
