"""The Kubernetes scheduler extender: kube-scheduler's filter and prioritize verbs, answered by the
daemon's scheduler. A client built on kube-scheduler's own Go types (``tests/extender``) drives a
running daemon over HTTP; the mapping of pods and nodes is checked without it too."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.serve.extender import Extender, ExtenderError, task_of_pod
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev
from tests.daemon.background import BackgroundDaemon, memory_settings
from tests.tools import tool

REPO = Path(__file__).resolve().parents[2]
GO_CLIENT = REPO / "tests" / "extender"
NODES = {  # node (hlb host) -> (model, memory_gb, devices)
    "node-a": ("A100-SXM4-80GB", 80.0, 4),
    "node-b": ("V100-SXM2-16GB", 16.0, 2),
    "node-c": ("A100-SXM4-80GB", 80.0, 1),
}


def inventory() -> list[ev.TelemetryEvent]:
    return [
        ev.TelemetryEvent(
            cell="default",
            device_upsert=ev.Device(
                id=f"{node}/gpu{i}", host_id=node, kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=memory
            ),
        )
        for node, (model, memory, count) in NODES.items()
        for i in range(count)
    ]


def pod(name: str, gpus: str, memory_gb: str = "30", **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "annotations": {"hlb.io/memory-per-device-gb": memory_gb, **annotations},
        },
        "spec": {"containers": [{"name": "main", "resources": {"requests": {"nvidia.com/gpu": gpus}}}]},
    }


@pytest.fixture
def extender() -> Extender:
    graph = InfraGraph()
    for event in inventory():
        graph.apply_telemetry(event)
    scheduler = Scheduler(graph, make_policy("hetero-greedy"), PlacementLedger(), "default", clock=lambda: 1.0)
    return Extender(scheduler, threading.RLock())


def test_a_pod_is_a_task_named_by_namespace_and_name_with_its_gang_and_annotations() -> None:
    spec = task_of_pod(pod("train", "2", "30", **{"hlb.io/workload-class": "resnet50"}))
    assert (spec.id, spec.num_devices, spec.memory_per_device_gb, spec.workload_class) == (
        "team-a/train",
        2,
        30.0,
        "resnet50",
    )
    whole = pod("x", "1", **{"hlb.io/task": '{"id": "t9", "num_devices": 3, "allowed_models": ["TPU-v4"]}'})
    assert (task_of_pod(whole).id, task_of_pod(whole).num_devices, list(task_of_pod(whole).allowed_models)) == (
        "t9",
        3,
        ["TPU-v4"],
    )
    with pytest.raises(ExtenderError, match=r"device quantity '1500m' is not a whole number of devices"):
        task_of_pod(pod("x", "1500m"))


def test_filter_keeps_the_nodes_with_enough_feasible_devices_and_says_why_not(extender: Extender) -> None:
    answer = extender.filter({"Pod": pod("train", "2"), "NodeNames": [*NODES, "node-x"]})
    assert answer["NodeNames"] == ["node-a"]
    assert answer["FailedNodes"] == {
        "node-b": "hlb: 0 of 2 devices fit, the pod needs 2 (memory rules out 2)",
        "node-c": "hlb: 1 of 1 devices fit, the pod needs 2",
        "node-x": "hlb: node node-x is no host in hlb's graph",
    }
    assert answer["Error"] == ""


def test_prioritize_scales_the_best_devices_scores_to_0_to_10(extender: Extender) -> None:
    one = extender.prioritize({"Pod": pod("serve", "1"), "NodeNames": list(NODES)})
    scores = {p["Host"]: p["Score"] for p in one}
    assert scores["node-b"] == 0  # 30 GB on a 16 GB device: infeasible
    assert max(scores.values()) == 10
    assert all(0 <= s <= 10 for s in scores.values())


def test_a_pod_that_asks_for_no_device_passes_everywhere_unranked(extender: Extender) -> None:
    plain = {"metadata": {"name": "web"}, "spec": {"containers": [{"name": "c"}]}}
    assert extender.filter({"Pod": plain, "NodeNames": list(NODES)})["NodeNames"] == list(NODES)
    assert {p["Score"] for p in extender.prioritize({"Pod": plain, "NodeNames": list(NODES)})} == {0}


def test_bad_arguments_are_an_error_not_a_crash(extender: Extender) -> None:
    assert extender.filter({"NodeNames": ["node-a"]}) == {"Error": "ExtenderArgs.Pod: required"}
    assert extender.filter({"Pod": pod("p", "1")}) == {"Error": "ExtenderArgs: Nodes or NodeNames required"}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    settings = memory_settings(tmp_path, extender={"listen": "127.0.0.1:0"}, scheduler={"policy": "least-loaded"})
    with BackgroundDaemon(settings) as running:
        for event in inventory():
            running.bus.publish(settings.kafka.topics.telemetry, b"default", event.SerializeToString())
        server = running.daemon.extender_server
        assert server is not None
        url = f"http://127.0.0.1:{server.port}"
        deadline = [0]
        while deadline[0] < 500:  # until the inventory is applied: node-a passes
            answer = post(url, "filter", {"Pod": pod("probe", "2"), "NodeNames": ["node-a"]})
            if answer.get("NodeNames") == ["node-a"]:
                break
            deadline[0] += 1
            threading.Event().wait(0.02)
        yield url


def post(url: str, verb: str, body: object) -> Any:
    request = urllib.request.Request(f"{url}/{verb}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, **json.loads(exc.read())}


def test_the_daemon_serves_the_verbs_over_http(served: str) -> None:
    assert post(served, "filter", {"Pod": pod("p", "2"), "NodeNames": list(NODES)})["NodeNames"] == ["node-a"]
    assert post(served, "bind", {})["status"] == 404
    assert post(served, "prioritize", {"NodeNames": []}) == {"status": 400, "Error": "ExtenderArgs.Pod: required"}


def test_kube_schedulers_own_types_read_the_answers(served: str, tmp_path: Path) -> None:
    """tests/extender: requests encoded from k8s.io/kube-scheduler/extender/v1, answers decoded into
    its types with unknown fields refused, and docs/clients.md's KubeSchedulerConfiguration read
    strictly into k8s.io/kube-scheduler/config/v1 (Go modules from the module proxy on the first run)."""
    go = tool("go")
    out = tmp_path / "answers.json"
    env = {
        **os.environ,
        "HLB_EXTENDER_URL": served,
        "HLB_EXTENDER_NODES": ",".join(NODES),
        "HLB_EXTENDER_OUT": str(out),
        "GOFLAGS": "-mod=mod",
    }
    run = subprocess.run(
        [go, "test", "-count=1", "-v", "."],
        cwd=GO_CLIENT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--- PASS: TestDocumentedConfiguration" in run.stdout  # docs/clients.md's stanza parses
    answers = json.loads(out.read_text())
    assert answers["filter_names"]["NodeNames"] == ["node-a"]
    assert set(answers["filter_names"]["FailedNodes"]) == {"node-b", "node-c"}
    assert [n["metadata"]["name"] for n in answers["filter_nodes"]["Nodes"]["items"]] == ["node-a"]
    assert {p["Host"]: p["Score"] for p in answers["prioritize"]} == {"node-a": 10, "node-b": 0, "node-c": 0}
    assert answers["filter_huge"]["FailedNodes"]["node-a"] == "hlb: 4 of 4 devices fit, the pod needs 64"
