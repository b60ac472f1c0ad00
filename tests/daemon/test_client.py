"""``hlb place`` against a real gRPC server on loopback: tables by default, JSON with --json."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.api import GrpcServer, SchedulerService
from daemon.cli import main
from daemon.graph import InfraGraph
from daemon.ledger import PlacementLedger
from daemon.policy import make_policy
from daemon.scheduler import Scheduler
from hlb.v1 import events_pb2 as ev


@pytest.fixture
def target() -> Iterator[str]:
    graph = InfraGraph()
    for i, (model, memory) in enumerate((("A100-SXM4-80GB", 80.0), ("V100-SXM2-16GB", 16.0))):
        spec = ev.Device(id=f"gpu{i}", host_id="h0", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=memory)
        graph.apply_telemetry(ev.TelemetryEvent(device_upsert=spec))
    tpu = ev.Device(id="tpu0", host_id="h1", kind=ev.DEVICE_KIND_TPU, model="TPU-v4", memory_gb=32)
    graph.apply_telemetry(ev.TelemetryEvent(device_upsert=tpu))
    scheduler = Scheduler(graph, make_policy("hetero-greedy"), PlacementLedger(), "c", clock=lambda: 1.0)
    service = SchedulerService(scheduler, threading.RLock(), lambda spec: None)
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(_start(service))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.port}"
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


async def _start(service: SchedulerService) -> GrpcServer:
    server = GrpcServer(service, "127.0.0.1:0", 4 * 1024 * 1024, reflect=False)
    await server.start()
    await server.set_serving()
    return server


def place(target: str, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["place", "--target", target, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_place_from_flags_prints_a_table(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = place(target, capsys, "--id", "t1", "--memory-gb", "40", "--workload", "resnet50")
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == ["SEQ", "TASK", "POLICY", "SCORE", "DEVICES"]
    assert row.split()[:3] == ["1", "t1", "hetero-greedy"]
    assert row.endswith("gpu0")


def test_place_from_a_json_file_with_json_output(
    target: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "task.json"
    spec.write_text(json.dumps({"id": "f1", "memoryPerDeviceGb": 20, "allowedKinds": ["DEVICE_KIND_TPU"]}))
    code, out, _ = place(target, capsys, "--file", str(spec), "--json")
    assert code == 0
    placement = json.loads(out)
    assert placement.pop("score") < 0  # minus the estimated finish relative to an idle reference device
    assert placement | {"decided_at_ms": "x"} == {
        "task_id": "f1",
        "cell": "c",
        "device_ids": ["tpu0"],
        "policy": "hetero-greedy",
        "sequence": "1",
        "decided_at_ms": "x",
    }


def test_a_pending_task_says_why_and_where_it_waits(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = place(target, capsys, "--id", "huge", "--memory-gb", "500")
    assert code == 0
    assert out.startswith("task huge is pending (queue position 1): no feasible device")


def test_explain_shows_candidates_and_ruled_out_devices(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = place(target, capsys, "--explain", "--id", "e", "--memory-gb", "20", "--kind", "gpu")
    assert code == 0
    assert "would place on gpu0" in out
    assert "candidates (best first):" in out
    ruled_out = out.split("ruled out:")[1]
    assert "gpu1" in ruled_out
    assert "memory:" in ruled_out
    assert "tpu0" in ruled_out
    assert "kind:" in ruled_out
    code, out, _ = place(target, capsys, "--explain", "--id", "e2", "--json")
    assert code == 0
    assert len(json.loads(out)["candidates"]) == 3


def test_score_lists_every_candidate_in_order(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = place(target, capsys, "--score", "tpu0", "gpu1", "ghost", "--memory-gb", "20", "--id", "s")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "policy hetero-greedy"
    assert [line.split()[:2] for line in lines[2:]] == [["tpu0", "yes"], ["gpu1", "no"], ["ghost", "no"]]
    assert lines[3].endswith("memory")
    assert lines[4].endswith("unknown device")


def test_get_and_watch(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    place(target, capsys, "--id", "w1")
    code, out, _ = place(target, capsys, "--get", "w1", "--json")
    assert (code, json.loads(out)["task_id"]) == (0, "w1")
    code, out, _ = place(target, capsys, "--watch", "--count", "1", "--json")
    assert (code, json.loads(out)["sequence"]) == (0, "1")


def test_errors_are_one_line_with_the_status(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = place(target, capsys, "--get", "ghost")
    assert code == 1
    assert err.strip() == "hlb place: NOT_FOUND: unknown task 'ghost'"
    code, _, err = place(target, capsys, "--id", "bad", "--memory-gb", "-1")
    assert code == 1
    assert err.startswith("hlb place: INVALID_ARGUMENT:")
    assert "memory_per_device_gb" in err


def test_a_service_declares_its_load_in_labels(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    load = ("--label", "request_rate_per_s=40", "--label", "request_work_ref_ms=10")
    code, out, _ = place(target, capsys, "--id", "svc", "--latency-slo-ms", "50", "--task-kind", "inference", *load)
    assert code == 0
    assert out.splitlines()[1].split()[:2] == ["1", "svc"]
    code, _, err = place(target, capsys, "--id", "bad", "--latency-slo-ms", "50", "--label", "request_rate_per_s=lots")
    assert code != 0
    assert "label request_rate_per_s='lots' is not a number" in err
    with pytest.raises(SystemExit):
        place(target, capsys, "--id", "x", "--label", "no-equals-sign")
    assert "is not KEY=VALUE" in capsys.readouterr().err
    code, out, _ = place(target, capsys, "--get", "bad")
    assert code != 0  # refused: never submitted
