"""Drift: our descriptors against the wire contract (a copy of which lives in tests/data/), and the
central scheduler's against tests/data/master_flexlb_contract.json (same notation).

Every message, field (name, number, type, label), reserved number, enum value and method
path in the contract must match ours exactly — and ours must have nothing the contract lacks.
Ours live in our own packages (never the upstream one), so the comparison is by short name.
The copy keeps this test running on any checkout; where the shared contract sits beside the
repository (``../shared/spec/wire_contract.json``), the copy must equal it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor_pb2 import FieldDescriptorProto

from router.wire import engine_status_pb2, kvcm_meta_pb2, master_flexlb_pb2, paths

CONTRACT_PATH = Path(__file__).resolve().parent / "data" / "wire_contract.json"
# The repository's parent may hold shared/ (CI copies it beside the fresh clone).
SHARED_CONTRACT_PATH = Path(__file__).resolve().parents[2] / "shared" / "spec" / "wire_contract.json"

MASTER_CONTRACT_PATH = Path(__file__).resolve().parent / "data" / "master_flexlb_contract.json"

CONTRACT: dict[str, Any] = json.loads(CONTRACT_PATH.read_text(encoding="utf-8"))
CONTRACT["flexlb"] = json.loads(MASTER_CONTRACT_PATH.read_text(encoding="utf-8"))

# contract section → our generated module
SECTIONS: dict[str, ModuleType] = {
    "kvcm": kvcm_meta_pb2,
    "engine_generation_k": engine_status_pb2,
    "flexlb": master_flexlb_pb2,
}

# contract method name → our pinned path constant
PINNED_PATHS: dict[str, str] = {
    "GetClusterInfo": paths.KVCM_GET_CLUSTER_INFO,
    "GetHostCacheState": paths.KVCM_GET_HOST_CACHE_STATE,
    "GetWorkerStatus": paths.WORKER_GET_STATUS,
    "Schedule": paths.MASTER_SCHEDULE,
    "Cancel": paths.MASTER_CANCEL,
}

SCALAR_NAMES = {
    FieldDescriptorProto.TYPE_STRING: "string",
    FieldDescriptorProto.TYPE_INT32: "int32",
    FieldDescriptorProto.TYPE_INT64: "int64",
    FieldDescriptorProto.TYPE_BOOL: "bool",
    FieldDescriptorProto.TYPE_DOUBLE: "double",
    FieldDescriptorProto.TYPE_FLOAT: "float",
    FieldDescriptorProto.TYPE_UINT32: "uint32",
    FieldDescriptorProto.TYPE_UINT64: "uint64",
    FieldDescriptorProto.TYPE_BYTES: "bytes",
}


def file_proto(module: ModuleType) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


def describe_field(package: str, field: FieldDescriptorProto) -> list[object]:
    """A field in the contract's notation: [name, number, type], plus "repeated" or "optional" if any."""
    if field.type in (FieldDescriptorProto.TYPE_MESSAGE, FieldDescriptorProto.TYPE_ENUM):
        kind = "message" if field.type == FieldDescriptorProto.TYPE_MESSAGE else "enum"
        prefix = f".{package}."
        assert field.type_name.startswith(prefix), f"{field.name}: {field.type_name} outside {package}"
        type_text = f"{kind} {field.type_name.removeprefix(prefix)}"
    else:
        type_text = SCALAR_NAMES[field.type]
    described: list[object] = [field.name, field.number, type_text]
    if field.label == FieldDescriptorProto.LABEL_REPEATED:
        described.append("repeated")
    elif field.proto3_optional:
        described.append("optional")
    return described


def section_params(key: str) -> list[tuple[str, str]]:
    return [(section, name) for section in SECTIONS for name in CONTRACT[section][key]]


def test_the_copy_is_the_shared_contract_where_that_is_present() -> None:
    if not SHARED_CONTRACT_PATH.is_file():
        pytest.skip(f"{SHARED_CONTRACT_PATH} is not beside this checkout: the copy is checked where it is")
    shared = json.loads(SHARED_CONTRACT_PATH.read_text(encoding="utf-8"))
    copy = json.loads(CONTRACT_PATH.read_text(encoding="utf-8"))
    assert shared == copy, f"tests/data/wire_contract.json differs from {SHARED_CONTRACT_PATH}: copy it again"


def test_contract_sections_are_the_ones_we_check() -> None:
    assert {k for k in CONTRACT if k != "about"} == set(SECTIONS)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_ours_live_outside_the_upstream_package(section: str) -> None:
    """Our package must differ from upstream's, or importing both would clash (review-lessons §5)."""
    package = file_proto(SECTIONS[section]).package
    assert package.startswith("kvroute.")
    assert package != CONTRACT[section]["upstream_package"]


@pytest.mark.parametrize("section", list(SECTIONS))
def test_same_set_of_messages_and_enums(section: str) -> None:
    proto = file_proto(SECTIONS[section])
    assert {m.name for m in proto.message_type} == set(CONTRACT[section]["messages"])
    assert {e.name for e in proto.enum_type} == set(CONTRACT[section]["enums"])
    assert not any(m.nested_type or m.enum_type for m in proto.message_type), "contract has no nested types"


@pytest.mark.parametrize(("section", "message"), section_params("messages"))
def test_message_fields(section: str, message: str) -> None:
    proto = file_proto(SECTIONS[section])
    ours = {m.name: m for m in proto.message_type}[message]
    described = sorted((describe_field(proto.package, f) for f in ours.field), key=lambda d: int(str(d[1])))
    expected = sorted(CONTRACT[section]["messages"][message], key=lambda d: int(d[1]))
    assert described == expected


@pytest.mark.parametrize(("section", "message"), section_params("messages"))
def test_reserved_numbers(section: str, message: str) -> None:
    """Exactly the contract's reserved numbers (WorkerStatusPB's 11 is unused, not reserved)."""
    ours = {m.name: m for m in file_proto(SECTIONS[section]).message_type}[message]
    reserved = {n for r in ours.reserved_range for n in range(r.start, r.end)}
    assert reserved == set(CONTRACT[section].get("reserved", {}).get(message, []))


@pytest.mark.parametrize(("section", "enum"), section_params("enums"))
def test_enum_values(section: str, enum: str) -> None:
    ours = {e.name: e for e in file_proto(SECTIONS[section]).enum_type}[enum]
    assert {v.name: v.number for v in ours.value} == CONTRACT[section]["enums"][enum]


@pytest.mark.parametrize(("section", "method"), section_params("methods"))
def test_method_paths_and_message_types(section: str, method: str) -> None:
    spec = CONTRACT[section]["methods"][method]
    assert PINNED_PATHS[method] == spec["path"]
    messages = SECTIONS[section].DESCRIPTOR.message_types_by_name
    assert spec["request"] in messages
    assert spec["response"] in messages


def test_every_upstream_path_is_pinned() -> None:
    contract_paths = {spec["path"] for section in SECTIONS for spec in CONTRACT[section]["methods"].values()}
    assert set(paths.ALL_UPSTREAM) == contract_paths
    assert len(paths.ALL_UPSTREAM) == len(contract_paths)


def test_repeated_int64_keys_are_packed() -> None:
    """wire-contract.md: `repeated int64` is packed (proto3's default); [packed=false] would drift."""
    field = kvcm_meta_pb2.GetHostCacheStateRequest.DESCRIPTOR.fields_by_name["block_cache_keys"]
    assert field.is_packed
