"""The checked-in generated code matches what the pinned generators make of the .proto files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _generator() -> object:
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["proto_generate"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_code_has_not_drifted_from_the_proto_files(tmp_path: Path) -> None:
    generate = _generator().generate  # type: ignore[attr-defined]
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path)}
    checked_in_dir = REPO / "proto" / "hlb" / "v1"
    checked_in = {p.name: p.read_bytes() for p in checked_in_dir.iterdir() if "_pb2" in p.name}
    assert sorted(fresh) == sorted(checked_in), "generated files added or removed: run `make proto`"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"generated code is stale, run `make proto`: {stale}"


@pytest.mark.parametrize("module", ["hlb.v1.events_pb2", "hlb.v1.scheduler_pb2", "hlb.v1.scheduler_pb2_grpc"])
def test_every_generated_module_imports(module: str) -> None:
    assert importlib.import_module(module).__name__ == module


def test_the_scheduler_service_has_every_rpc_of_the_design() -> None:
    from hlb.v1 import scheduler_pb2

    methods = set(scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].methods_by_name)
    assert methods == {
        "Place", "PlaceBatch", "GetPlacement", "WatchPlacements", "ScoreDevices", "Explain", "GetClusterState",
    }  # fmt: skip
