"""Clients nobody on the project wrote find the API by reflection: ``grpc.reflection.v1`` (what
grpcurl and ghz ask for) as well as v1alpha, a method found by its full name, and grpcurl and ghz
themselves driving the daemon by reflection alone."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

from hlb.sim.agent import inventory_events
from tests.daemon.background import BackgroundDaemon, memory_settings
from tests.tools import tool

DEVICES = sum(e.HasField("device_upsert") for e in inventory_events("default"))


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = memory_settings(tmp_path_factory.mktemp("reflection"), scheduler={"policy": "least-loaded"})
    with BackgroundDaemon(settings) as running:
        for event in inventory_events("default"):
            running.bus.publish(settings.kafka.topics.telemetry, b"default", event.SerializeToString())
        yield running.target


def reflect(target: str, version: str, request: v1alpha.ServerReflectionRequest) -> v1alpha.ServerReflectionResponse:
    """One reflection request to ``grpc.reflection.<version>`` (the messages are the same in both)."""
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=v1alpha.ServerReflectionRequest.SerializeToString,
            response_deserializer=v1alpha.ServerReflectionResponse.FromString,
        )
        return next(iter(call(iter([request]), timeout=10)))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_both_reflection_versions_list_the_services(target: str, version: str) -> None:
    reply = reflect(target, version, v1alpha.ServerReflectionRequest(list_services=""))
    names = {s.name for s in reply.list_services_response.service}
    assert {"hlb.v1.Scheduler", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= names


@pytest.mark.parametrize("symbol", ["hlb.v1.Scheduler.Place", "grpc.reflection.v1.ServerReflection"])
def test_a_method_and_the_v1_service_are_found_by_name(target: str, symbol: str) -> None:
    """ghz asks for the file of ``hlb.v1.Scheduler.Place``: it answered "Symbol not found"."""
    reply = reflect(target, "v1", v1alpha.ServerReflectionRequest(file_containing_symbol=symbol))
    assert not reply.HasField("error_response"), reply.error_response.error_message
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b) for b in reply.file_descriptor_response.file_descriptor_proto
    ]
    service = symbol.rsplit(".", 1)[0] if symbol.endswith(".Place") else symbol
    package, _, name = service.rpartition(".")
    assert any(f.package == package and name in [s.name for s in f.service] for f in files)


def test_grpcurl_places_a_task_by_reflection(target: str) -> None:
    grpcurl = tool("grpcurl")
    listed = subprocess.run(
        [grpcurl, "-plaintext", target, "list"], check=False, capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert "hlb.v1.Scheduler" in listed.stdout.split()
    request = json.dumps({"task": {"id": "by-grpcurl", "memory_per_device_gb": 1}, "cell": "default"})
    placed = subprocess.run(
        [grpcurl, "-plaintext", "-d", request, target, "hlb.v1.Scheduler/Place"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert placed.returncode == 0, placed.stderr
    assert json.loads(placed.stdout)["placement"]["task_id"] == "by-grpcurl"
    # The Explain request of the issue: a task id and a cell, which the oneof used to refuse.
    explain = json.dumps({"task_id": "by-grpcurl", "cell": "default"})
    explained = subprocess.run(
        [grpcurl, "-plaintext", "-d", explain, target, "hlb.v1.Scheduler/Explain"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    assert json.loads(explained.stdout)["placement"]["task_id"] == "by-grpcurl"


def test_ghz_calls_the_daemon_by_reflection(target: str) -> None:
    ghz = tool("ghz")
    run = subprocess.run(
        [ghz, "--insecure", "--call", "hlb.v1.Scheduler.GetClusterState", "-d", "{}", "-n", "20", "-c", "2",
         "--format", "json", target],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["statusCodeDistribution"] == {"OK": 20}, report.get("errorDistribution")
