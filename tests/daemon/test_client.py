"""``hlb place`` against a real gRPC server on loopback: tables by default, JSON with --json."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from hlb.cli import main
from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.serve.api import GrpcServer, SchedulerService
from hlb.daemon.serve.client import _run, add_arguments
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

REPO = Path(__file__).resolve().parents[2]
NOBODY = "127.0.0.1:1"  # no daemon: where a refused command would have sent its call


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


def test_watch_from_now_shows_only_new_placements(target: str) -> None:
    channel = grpc.insecure_channel(target)
    stub = api_grpc.SchedulerStub(channel)
    for task_id in ("old-1", "old-2"):
        stub.Place(api.PlaceRequest(task=ev.TaskSpec(id=task_id)), timeout=10)
    args = argparse.ArgumentParser()
    add_arguments(args)
    out = io.StringIO()
    asked = threading.Event()

    class Watching:
        """The stub, telling when the watch has read the last sequence (what "now" is)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(stub, name)

        def WatchPlacements(self, request: Any, **kwargs: Any) -> Any:  # noqa: N802
            asked.set()
            return stub.WatchPlacements(request, **kwargs)

    watching = threading.Thread(
        target=_run, args=(Watching(), args.parse_args(["--watch", "--from", "now", "--count", "1", "--json"]), out)
    )
    watching.start()
    assert asked.wait(30), "the watch never started"
    stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="new-1")), timeout=10)  # after "now": new
    watching.join(30)
    assert not watching.is_alive(), "the new placement was not shown"
    shown = json.loads(out.getvalue())
    assert (shown["task_id"], shown["sequence"]) == ("new-1", "3")
    channel.close()


class ExplainRecorder:
    """A stub that keeps the Explain requests it is given."""

    def __init__(self) -> None:
        self.requests: list[api.ExplainRequest] = []

    def Explain(self, request: api.ExplainRequest, timeout: float) -> api.ExplainResponse:  # noqa: N802
        self.requests.append(request)
        return api.ExplainResponse(policy="p")


def test_explain_of_a_known_task_keeps_the_cell() -> None:
    """The cell sat in the request's ``target`` oneof: setting the task id cleared it."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    recorder = ExplainRecorder()
    _run(recorder, parser.parse_args(["--get", "x", "--explain", "--cell", "other"]), io.StringIO())  # type: ignore[arg-type]
    assert [(r.task_id, r.cell) for r in recorder.requests] == [("x", "other")]
    # And in protobuf's JSON mapping, as grpcurl and Node send it.
    parsed = json_format.Parse('{"task_id": "r2", "cell": "default"}', api.ExplainRequest())
    assert (parsed.WhichOneof("target"), parsed.task_id, parsed.cell) == ("task_id", "r2", "default")


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


def cluster_state(target: str) -> api.ClusterState:
    with grpc.insecure_channel(target) as channel:
        return api_grpc.SchedulerStub(channel).GetClusterState(api.GetClusterStateRequest(), timeout=10)


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run ``hlb place ARGS``, expect argparse to refuse it (status 2); its error line."""
    with pytest.raises(SystemExit) as exited:
        main(["place", *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_an_empty_get_is_refused_and_places_nothing(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--get ""`` once read as "no --get" and placed a new task."""
    assert refused(capsys, "--target", target, "--get", "").endswith("argument --get: a task id is required")
    assert refused(capsys, "--target", target, "--get", "", "--explain").endswith("a task id is required")
    state = cluster_state(target)
    assert (state.last_sequence, state.pending_tasks, state.running_tasks) == (0, 0, 0)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--id", ""), "argument --id: a task id is required"),
        (("--after", ""), "argument --after: a task id is required"),
        (("--score", "gpu0", ""), "argument --score: a device id is required"),
        (("--target", ""), "argument --target: a host:port is required"),
        (("--tls-server-name", ""), "argument --tls-server-name: a name is required"),
    ],
)
def test_other_empty_strings_are_refused_not_read_as_left_out(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], error: str
) -> None:
    assert refused(capsys, "--target", NOBODY, *args).endswith(error)


@pytest.mark.parametrize(
    ("args", "allowed"),
    [
        (("--devices", "-3"), "from 1 to 4294967295"),
        (("--devices", "0"), "from 1 to 4294967295"),  # proto's "0 means 1" is for an unset field
        (("--devices", "4294967296"), "from 1 to 4294967295"),
        (("--priority", "99999999999"), "from -2147483648 to 2147483647"),
        (("--priority", "-2147483649"), "from -2147483648 to 2147483647"),
        (("--watch", "--from", "-5"), "from 0 to 18446744073709551615, or 'now'"),
        (("--explain", "--top", "0"), "from 1 to 4294967295"),
        (("--watch", "--count", "-1"), "at least 0"),
        (("--timeout", "0"), "above 0, at most 86400"),
        (("--timeout", "nan"), "above 0, at most 86400"),
        (("--timeout", "inf"), "above 0, at most 86400"),
    ],
)
def test_out_of_range_numbers_are_refused_with_the_range(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], allowed: str
) -> None:
    """Protobuf raised ``ValueError: Value out of range`` from inside the call for these."""
    error = refused(capsys, "--target", NOBODY, *args)
    assert f"argument {args[-2]}: {args[-1]} is out of range" in error
    assert error.endswith(allowed)


def test_numbers_at_the_ends_of_their_range_are_sent(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = place(target, capsys, "--id", "top", "--priority", "2147483647", "--json")
    assert (code, json.loads(out)["task_id"]) == (0, "top")
    code, out, _ = place(target, capsys, "--id", "bottom", "--priority", "-2147483648", "--json")
    assert (code, json.loads(out)["task_id"]) == (0, "bottom")
    code, out, _ = place(target, capsys, "--watch", "--from", "0", "--count", "1", "--json")
    assert (code, json.loads(out)["sequence"]) == (0, "1")


def test_a_file_that_is_not_utf8_is_refused_like_bad_json(
    target: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "bad.json"
    spec.write_bytes(b"\xff\xfe{}")
    with pytest.raises(SystemExit) as exited:
        place(target, capsys, "--file", str(spec))
    assert exited.value.code == f"hlb place: {spec}: not UTF-8 text (invalid start byte at byte 0)"
    spec.write_text("{")
    with pytest.raises(SystemExit) as exited:
        place(target, capsys, "--file", str(spec))
    assert str(exited.value.code).startswith(f"hlb place: {spec}: ")
    assert cluster_state(target).last_sequence == 0


def test_a_reader_that_goes_away_ends_the_output_quietly(target: str) -> None:
    """``hlb place ... --explain | head -2``: no BrokenPipeError traceback, the shell's 141."""
    child = subprocess.Popen(
        [sys.executable, "-m", "hlb.cli", "place", "--target", target, "--explain", "--memory-gb", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    assert child.stdout is not None
    child.stdout.close()  # before the child writes anything: its first write finds no reader
    _, err = child.communicate(timeout=60)
    assert (child.returncode, err.decode()) == (141, "")
