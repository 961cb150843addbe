"""Our protos beside the engine's and the central scheduler's own package-less modules (issue 2 §2
tests a and c).

(a) collision: the engine's generated module registers root-level names (StatusVersionPB,
    WorkerStatusPB, TaskInfoPB, KvCacheGroupModePB, RpcService) in the default descriptor
    pool; importing all of ours in the same process must not clash (review-lessons §5).
(c) wire: bytes serialized by our messages parse with the engine-style module and vice
    versa, every field value and optional-field presence preserved.

The engine-style module is compiled here from tests/data/engine_model_rpc_service.proto
(copied under the engine's file name, model_rpc_service.proto) with grpcio-tools, and
loaded from its file; nothing is put into or taken out of sys.modules.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import cast

import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from router.types import Role, RoleAddr
from router.wire import engine_status_pb2, kvcm_meta_pb2, master_flexlb_pb2, router_v1_pb2
from router.wire.decode import decode_worker_status, encode_status_version
from router.wire.master import MasterRouted, MasterScheduleRequest, decode_schedule_pb, encode_schedule_pb

ENGINE_PROTO = Path(__file__).resolve().parent / "data" / "engine_model_rpc_service.proto"
ENGINE_FILE_NAME = "model_rpc_service.proto"  # what the engine's own module registers
ENGINE_ROOT_NAMES = ("StatusVersionPB", "WorkerStatusPB", "TaskInfoPB")
FLEXLB_PROTO = Path(__file__).resolve().parent / "data" / "flexlb_service.proto"
FLEXLB_FILE_NAME = "flexlb_service.proto"
FLEXLB_ROOT_NAMES = ("FlexlbScheduleRequestPB", "FlexlbScheduleResponsePB", "FlexlbServerStatusPB")
OUR_MODULES = (kvcm_meta_pb2, engine_status_pb2, router_v1_pb2, master_flexlb_pb2)


def compile_proto(proto: Path, file_name: str, out_dir: Path) -> Path:
    """Run grpcio-tools' protoc on ``proto`` (registered as ``file_name``); return the _pb2.py path."""
    from grpc_tools import protoc  # type: ignore[import-untyped]

    src_dir = out_dir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(proto, src_dir / file_name)
    include = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        ["protoc", f"-I{src_dir}", f"-I{include}", f"--python_out={out_dir}", str(src_dir / file_name)]
    )
    assert code == 0, f"protoc failed on {proto}"
    return out_dir / (Path(file_name).stem + "_pb2.py")


def load_module(path: Path) -> ModuleType:
    """Execute a generated module from its file, without registering it in sys.modules."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine_pb2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_proto(ENGINE_PROTO, ENGINE_FILE_NAME, tmp_path_factory.mktemp("engine_gen"))


@pytest.fixture(scope="module")
def engine(engine_pb2_path: Path) -> ModuleType:
    return load_module(engine_pb2_path)


# --- (a) collision -----------------------------------------------------------------------------


def test_engine_module_registers_root_level_names(engine: ModuleType) -> None:
    """The stand-in really is package-less, i.e. the test exercises the clash it claims to."""
    assert engine.DESCRIPTOR.package == ""
    assert engine.WorkerStatusPB.DESCRIPTOR.full_name == "WorkerStatusPB"
    assert engine.DESCRIPTOR.services_by_name["RpcService"].full_name == "RpcService"


def test_ours_and_the_engines_coexist_in_the_default_pool(engine: ModuleType) -> None:
    """Ours were imported (at the top) before the engine's module was loaded; both are registered."""
    pool = descriptor_pool.Default()
    for name in ENGINE_ROOT_NAMES:
        theirs = pool.FindMessageTypeByName(name)
        assert theirs.file.name == ENGINE_FILE_NAME
        ours = pool.FindMessageTypeByName(f"kvroute.wire.engine.{name}")
        assert ours.file.name == engine_status_pb2.DESCRIPTOR.name
        assert ours is not theirs
    assert pool.FindEnumTypeByName("KvCacheGroupModePB").file.name == ENGINE_FILE_NAME
    assert pool.FindServiceByName("RpcService").methods_by_name["GetWorkerStatus"].input_type.full_name == (
        "StatusVersionPB"
    )
    for module in OUR_MODULES:
        assert module.DESCRIPTOR.package.startswith("kvroute."), module.DESCRIPTOR.name
        assert pool.FindFileByName(module.DESCRIPTOR.name) is module.DESCRIPTOR


def test_engine_first_then_all_of_ours_in_a_fresh_process(engine_pb2_path: Path, tmp_path: Path) -> None:
    """The other import order, in a clean interpreter: the engine's module first, then all of ours."""
    script = textwrap.dedent(
        f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("model_rpc_service_pb2", {str(engine_pb2_path)!r})
        engine = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(engine)
        from router.wire import kvcm_meta_pb2, engine_status_pb2, router_v1_pb2, master_flexlb_pb2, decode
        from google.protobuf import descriptor_pool
        pool = descriptor_pool.Default()
        assert pool.FindMessageTypeByName("WorkerStatusPB").file.name == {ENGINE_FILE_NAME!r}
        ours = pool.FindMessageTypeByName("kvroute.wire.engine.WorkerStatusPB")
        assert ours.file.name == "engine_status.proto"
        print("coexist-ok")
        """
    )
    # cwd is an empty directory, so the only `router` importable is the installed one.
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "coexist-ok"


def test_a_second_package_less_copy_does_clash(engine: ModuleType, tmp_path: Path) -> None:
    """Control: the clash this suite guards against is real — a package-less copy of the engine's
    messages under another file name (the seed PR's mistake) fails to load beside the engine's module."""
    clashing = compile_proto(ENGINE_PROTO, "seed_pr_worker_status.proto", tmp_path)
    with pytest.raises(TypeError, match="duplicate symbol"):
        load_module(clashing)


# --- (c) wire compatibility ------------------------------------------------------------------------


def populate(message: Message, salt: int) -> None:
    """Set every field of ``message`` to a distinct non-default value (recursively, repeated → 2 items)."""
    for field in message.DESCRIPTOR.fields:
        value_seed = salt * 1000 + field.number
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                for i in range(2):
                    populate(getattr(message, field.name).add(), value_seed * 10 + i)
            else:
                populate(getattr(message, field.name), value_seed)
            continue
        # (the stubs type DESCRIPTOR as python-or-upb; at run time it is one FieldDescriptor API)
        scalar = cast(FieldDescriptor, field)
        values = [scalar_value(scalar, value_seed), scalar_value(scalar, value_seed + 1)]
        if field.is_repeated:
            getattr(message, field.name).extend(values)
        else:
            setattr(message, field.name, values[0])


def scalar_value(field: FieldDescriptor, seed: int) -> object:
    if field.type == FieldDescriptor.TYPE_STRING:
        return f"{field.name}-{seed}"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return f"{field.name}-{seed}".encode()
    if field.type == FieldDescriptor.TYPE_UINT32:
        return seed
    if field.type == FieldDescriptor.TYPE_BOOL:
        return True
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return seed + 0.25
    if field.type == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        return field.enum_type.values[-1].number
    if field.type == FieldDescriptor.TYPE_INT32:
        return -seed if seed % 2 else seed
    if field.type == FieldDescriptor.TYPE_INT64:
        # Beyond 32 bits and sometimes negative, so a width or sign mismatch would show.
        return -(seed << 33) if seed % 2 else seed << 33
    raise AssertionError(f"populate(): no value for field type {field.type} ({field.full_name})")


def field_values(message: Message) -> dict[str, object]:
    """Every field as (presence, value), recursively; keyed by field name (names match across the two)."""
    out: dict[str, object] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                out[field.name] = [field_values(item) for item in value]
            else:
                out[field.name] = (message.HasField(field.name), field_values(value))
        elif field.is_repeated:
            out[field.name] = list(value)
        elif field.has_presence:
            out[field.name] = (message.HasField(field.name), value)
        else:
            out[field.name] = value
    return out


@pytest.mark.parametrize("name", ["StatusVersionPB", "TaskInfoPB", "WorkerStatusPB"])
def test_every_field_survives_ours_to_engine_and_back(engine: ModuleType, name: str) -> None:
    ours = getattr(engine_status_pb2, name)()
    populate(ours, salt=1)
    theirs = getattr(engine, name).FromString(ours.SerializeToString())
    assert field_values(theirs) == field_values(ours)
    again = getattr(engine_status_pb2, name).FromString(theirs.SerializeToString())
    assert field_values(again) == field_values(ours)
    assert again.SerializeToString(deterministic=True) == ours.SerializeToString(deterministic=True)


@pytest.mark.parametrize("name", ["StatusVersionPB", "TaskInfoPB", "WorkerStatusPB"])
def test_every_field_survives_engine_to_ours(engine: ModuleType, name: str) -> None:
    theirs = getattr(engine, name)()
    populate(theirs, salt=2)
    ours = getattr(engine_status_pb2, name).FromString(theirs.SerializeToString())
    assert field_values(ours) == field_values(theirs)
    assert len(UnknownFieldSet(ours)) == 0, "every engine field must be known to ours"


def test_optional_presence_crosses_the_wire_both_ways(engine: ModuleType) -> None:
    theirs = engine.WorkerStatusPB()
    for i in range(3):
        task = theirs.running_task_info.add(request_id=f"r{i}", input_length=100, prefix_length=10)
        task.completed_prefill_tokens = 40
        task.remaining_prefill_tokens = 50
        task.last_completed_prefill_step_id = 7
    # Task 0: optional fields present and non-zero; task 1: present and zero; task 2: absent.
    for name in ("completed_prefill_tokens", "remaining_prefill_tokens", "last_completed_prefill_step_id"):
        setattr(theirs.running_task_info[1], name, 0)
        theirs.running_task_info[2].ClearField(name)
    ours = engine_status_pb2.WorkerStatusPB.FromString(theirs.SerializeToString())
    presence = [t.HasField("remaining_prefill_tokens") for t in ours.running_task_info]
    assert presence == [True, True, False]
    assert [t.remaining_prefill_tokens for t in ours.running_task_info] == [50, 0, 0]
    back = engine.WorkerStatusPB.FromString(ours.SerializeToString())
    assert [t.HasField("completed_prefill_tokens") for t in back.running_task_info] == [True, True, False]
    assert [t.HasField("last_completed_prefill_step_id") for t in back.running_task_info] == [
        True,
        True,
        False,
    ]


def test_our_decoder_reads_the_engines_bytes(engine: ModuleType) -> None:
    """End to end: an engine-encoded reply through router.wire.decode keeps presence and the waiting split."""
    theirs = engine.WorkerStatusPB(
        role="RoleType.PDFUSION", alive=True, status_version=9, latest_finished_version=4, block_size=64
    )
    theirs.running_task_info.add(request_id="run-present-zero", input_length=300, prefix_length=100)
    theirs.running_task_info[0].remaining_prefill_tokens = 0
    theirs.running_task_info.add(request_id="run-absent", input_length=300, prefix_length=100)
    theirs.running_task_info.add(request_id="wait", input_length=50, prefix_length=0, is_waiting=True)
    status = decode_worker_status(theirs.SerializeToString(), "10.0.0.1:8001")
    assert status.role is Role.PDFUSION
    assert status.block_size == 64
    assert [t.request_id for t in status.running] == ["run-present-zero", "run-absent"]
    assert [t.remaining_prefill_tokens for t in status.running] == [0, None]
    assert [t.uncached_tokens for t in status.running] == [0, 200]
    assert [t.request_id for t in status.waiting] == ["wait"]
    assert status.outstanding_uncached_tokens == 250


def test_our_status_request_reads_as_the_engines(engine: ModuleType) -> None:
    theirs = engine.StatusVersionPB.FromString(encode_status_version(41))
    assert (theirs.latest_cache_version, theirs.latest_finished_version) == (-1, 41)


# --- the central scheduler's package-less module ----------------------------------------------------


@pytest.fixture(scope="module")
def flexlb_pb2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_proto(FLEXLB_PROTO, FLEXLB_FILE_NAME, tmp_path_factory.mktemp("flexlb_gen"))


@pytest.fixture(scope="module")
def flexlb(flexlb_pb2_path: Path) -> ModuleType:
    return load_module(flexlb_pb2_path)


def test_ours_and_the_schedulers_coexist_in_the_default_pool(flexlb: ModuleType) -> None:
    assert flexlb.DESCRIPTOR.package == ""
    pool = descriptor_pool.Default()
    for name in FLEXLB_ROOT_NAMES:
        theirs = pool.FindMessageTypeByName(name)
        assert theirs.file.name == FLEXLB_FILE_NAME
        ours = pool.FindMessageTypeByName(f"kvroute.master.v1.{name}")
        assert ours.file.name == master_flexlb_pb2.DESCRIPTOR.name
    assert pool.FindServiceByName("FlexlbService").file.name == FLEXLB_FILE_NAME
    assert pool.FindServiceByName("kvroute.master.v1.FlexlbService").file.name == "master_flexlb.proto"


def test_scheduler_first_then_all_of_ours_in_a_fresh_process(flexlb_pb2_path: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("flexlb_service_pb2", {str(flexlb_pb2_path)!r})
        flexlb = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(flexlb)
        from router.wire import kvcm_meta_pb2, engine_status_pb2, router_v1_pb2, master_flexlb_pb2, master
        from google.protobuf import descriptor_pool
        pool = descriptor_pool.Default()
        assert pool.FindServiceByName("FlexlbService").file.name == {FLEXLB_FILE_NAME!r}
        assert pool.FindMessageTypeByName("kvroute.master.v1.FlexlbScheduleResponsePB").file.name == (
            "master_flexlb.proto"
        )
        print("coexist-ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "coexist-ok"


@pytest.mark.parametrize("name", ["FlexlbScheduleRequestPB", "FlexlbServerStatusPB", "FlexlbScheduleResponsePB"])
def test_scheduler_messages_survive_ours_to_theirs_and_back(flexlb: ModuleType, name: str) -> None:
    ours = getattr(master_flexlb_pb2, name)()
    populate(ours, salt=3)
    theirs = getattr(flexlb, name).FromString(ours.SerializeToString())
    again = getattr(master_flexlb_pb2, name).FromString(theirs.SerializeToString())
    assert field_values(again) == field_values(ours)


def test_their_request_reads_ours_and_their_extra_reply_fields_are_ignored(flexlb: ModuleType) -> None:
    request = MasterScheduleRequest("123", (1, 2), 16, 32, None, 1000, 5)
    theirs = flexlb.FlexlbScheduleRequestPB.FromString(encode_schedule_pb(request))
    assert (theirs.request_id, list(theirs.block_cache_keys), theirs.cache_key_block_size) == (123, [1, 2], 16)
    reply = flexlb.FlexlbScheduleResponsePB(success=True, code=200, real_master_host="10.0.0.9:7001", queue_length=1)
    reply.server_status.add(role="ROLE_TYPE_PREFILL", server_ip="10.0.0.1", http_port=8000, grpc_port=8001)
    reply.lifecycle.request_id = 123
    reply.lifecycle.state = 2
    reply.lifecycle.batch_id = 77
    assert decode_schedule_pb(reply.SerializeToString(), "10.0.0.9:7003") == MasterRouted(
        (RoleAddr(Role.PREFILL, "10.0.0.1", 8000, 8001),), "10.0.0.9:7001", 1
    )
