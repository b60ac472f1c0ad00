"""The client examples of docs/clients.md, run as written against a daemon (only the address is
changed): Python, Go (code generated from the shipped .proto files) and Node (proto-loader with
``keepCase``, whose dry run places nothing)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hlb.sim.agent import inventory_events
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon, memory_settings
from tests.tools import TOOLS_BIN, tool

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "clients.md"
DEFAULT_TARGET = "127.0.0.1:50051"
DEVICES = sum(e.HasField("device_upsert") for e in inventory_events("default"))


def example(first_line: str) -> str:
    """The code block of docs/clients.md whose first line is ``first_line``."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", DOC.read_text(), re.S)
    (found,) = [str(b) for b in blocks if b.startswith(first_line)]
    return found


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = memory_settings(tmp_path_factory.mktemp("clients"), scheduler={"policy": "least-loaded"})
    with BackgroundDaemon(settings) as running, grpc.insecure_channel(running.target) as channel:
        for event in inventory_events("default"):
            running.bus.publish(settings.kafka.topics.telemetry, b"default", event.SerializeToString())
        stub = api_grpc.SchedulerStub(channel)
        while stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices < DEVICES:
            pass
        yield running.target


def last_sequence(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return api_grpc.SchedulerStub(channel).GetClusterState(api.GetClusterStateRequest(), timeout=5).last_sequence


def test_the_python_example_places_a_task(target: str, tmp_path: Path) -> None:
    script = tmp_path / "place.py"
    script.write_text(example("# place.py").replace(DEFAULT_TARGET, target))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("placed on ")


def test_the_go_example_generates_the_code_and_places_a_task(target: str, tmp_path: Path) -> None:
    tool("go")
    client = tmp_path / "hlbclient"
    client.mkdir()
    (client / "main.go").write_text(example("// main.go").replace(DEFAULT_TARGET, target))
    steps = example("go install google.golang.org/protobuf/cmd/protoc-gen-go")
    env = {
        **os.environ,
        "GOBIN": str(TOOLS_BIN),  # the generators `make tools` built, or built here
        "PATH": f"{TOOLS_BIN}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "GOFLAGS": "-mod=mod",
    }
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", steps], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^placed on \[\S+\] sequence \d+$", run.stdout, re.M), run.stdout


def test_the_node_example_dry_run_places_nothing(target: str, tmp_path: Path) -> None:
    node = tool("node")
    modules = REPO / ".cache" / "tools" / "node" / "node_modules"
    if not (modules / "@grpc" / "grpc-js").is_dir() or not (modules / "@grpc" / "proto-loader").is_dir():
        pytest.skip(f"@grpc/grpc-js and @grpc/proto-loader not in {modules}: `make tools` installs them with npm")
    script = tmp_path / "place.js"
    script.write_text(example("// place.js").replace(DEFAULT_TARGET, target))
    before = last_sequence(target)
    env = {**os.environ, "PROTO_ROOT": str(REPO / "proto"), "NODE_PATH": str(modules)}
    run = subprocess.run([node, str(script)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    reply = json.loads(run.stdout)
    assert reply["outcome"] == "placement"
    assert reply["placement"]["task_id"] == "node-1"  # keepCase: the names of the .proto file
    assert reply["placement"]["sequence"] == "0"  # a dry run's placement has no number ...
    assert last_sequence(target) == before  # ... and the ledger took nothing
