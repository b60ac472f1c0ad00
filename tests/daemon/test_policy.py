"""Each baseline policy ranks feasible devices as its name promises, and gangs respect locality."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hlb.daemon.config import ModelSettings
from hlb.daemon.decide.framework import ObjectiveWeights, PluginPolicy, Policy, choose_gang
from hlb.daemon.decide.gnn.scorer import GnnScorer
from hlb.daemon.decide.presets import POLICY_NAMES, PRESETS, make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import BestFit, Heft, HeteroGreedy, LeastLoaded, RoundRobin
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev

GPU = ev.DEVICE_KIND_GPU
V100, A100, K80 = "V100-SXM2-16GB", "A100-SXM4-80GB", "K80-GK210"


def add_device(graph: InfraGraph, device_id: str, host: str, model: str = V100, memory_gb: float = 16) -> None:
    spec = ev.Device(id=device_id, host_id=host, kind=GPU, model=model, memory_gb=memory_gb, peak_power_w=300)
    graph.apply_telemetry(ev.TelemetryEvent(device_upsert=spec))


def set_host(graph: InfraGraph, host: str, rack: str) -> None:
    graph.apply_telemetry(ev.TelemetryEvent(host_upsert=ev.Host(id=host, rack_id=rack)))


def best(policy: Policy, graph: InfraGraph, spec: ev.TaskSpec) -> list[str]:
    rows, _ = choose_gang(policy, spec, graph, graph.feasible_rows(spec))
    return graph.device_ids_of(rows)


def test_make_policy_knows_exactly_the_documented_names() -> None:
    assert POLICY_NAMES == ("random", "round-robin", "least-loaded", "best-fit", "hetero-greedy", "heft", "fgd")
    for name in POLICY_NAMES:
        assert make_policy(name, {"completion_time": 1.0}, seed=3).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
    assert (*POLICY_NAMES, "rules", "rules-table", "gnn") == PRESETS
    rules = make_policy("rules")
    assert isinstance(rules, PluginPolicy)
    assert isinstance(rules.scorer, HeteroGreedy)
    assert rules.name == "rules"
    gnn = make_policy("gnn", model=ModelSettings(path=Path("/nonexistent/hlb-model")))
    assert isinstance(gnn, PluginPolicy)
    assert isinstance(gnn.scorer, GnnScorer)
    assert gnn.scorer.mode == "sync"
    assert gnn.name == "hetero-greedy"  # no model there: the best baseline decides
    assert not gnn.waits  # and the rules do not run meanwhile


def test_weights_are_validated() -> None:
    assert ObjectiveWeights.of({"energy": 2}) == ObjectiveWeights(energy=2.0)
    with pytest.raises(ValueError, match="unknown"):
        ObjectiveWeights.of({"latency": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        ObjectiveWeights.of({"energy": -1.0})


def test_random_is_reproducible_from_its_seed() -> None:
    graph = InfraGraph()
    for i in range(50):
        add_device(graph, f"d{i}", "h")
    rows = graph.devices.live_rows()
    spec = ev.TaskSpec(id="t")
    a, b, c = (make_policy("random", seed=s).score(spec, graph, rows) for s in (7, 7, 8))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_round_robin_takes_devices_in_turn_and_only_placements_advance_it() -> None:
    graph = InfraGraph(max_tasks_per_device=0)
    for i in range(3):
        add_device(graph, f"d{i}", "h")
    scheduler = Scheduler(graph, RoundRobin(), PlacementLedger(), "c", clock=lambda: 0.0)
    assert scheduler.place(ev.TaskSpec(id="probe"), dry_run=True).placement is not None
    placed: list[str] = []
    for i in range(4):
        decision = scheduler.place(ev.TaskSpec(id=f"t{i}"))
        assert decision.placement is not None
        placed.extend(decision.placement.device_ids)
    assert placed == ["d0", "d1", "d2", "d0"]


def test_least_loaded_prefers_the_idle_device() -> None:
    graph = InfraGraph()
    add_device(graph, "busy", "h")
    add_device(graph, "idle", "h")
    metrics = [ev.DeviceMetrics(device_id="busy", utilization=0.8), ev.DeviceMetrics(device_id="idle", utilization=0.1)]
    graph.apply_device_metrics(metrics)
    assert best(LeastLoaded(), graph, ev.TaskSpec(id="t")) == ["idle"]


def test_best_fit_packs_into_the_fullest_device_that_fits() -> None:
    graph = InfraGraph()
    add_device(graph, "roomy", "h", memory_gb=80)
    add_device(graph, "snug", "h", memory_gb=10)
    assert best(BestFit(), graph, ev.TaskSpec(id="t", memory_per_device_gb=8)) == ["snug"]
    assert best(LeastLoaded(), graph, ev.TaskSpec(id="t", memory_per_device_gb=8)) == ["roomy"]


def test_hetero_greedy_picks_the_fastest_device_until_sharing_makes_it_slower() -> None:
    graph = InfraGraph()
    add_device(graph, "k80", "h0", K80, 12)
    add_device(graph, "v100", "h0", V100, 16)
    add_device(graph, "a100", "h1", A100, 80)
    spec = ev.TaskSpec(id="t", workload_class="resnet50-bs64", work_ref_s=3600)
    policy = HeteroGreedy()
    assert best(policy, graph, spec) == ["a100"]
    scheduler = Scheduler(graph, policy, PlacementLedger(), "c", clock=lambda: 0.0)
    for i in range(3):  # three tasks share the A100: a fourth finishes sooner on the V100
        graph.bind(graph.add_task(ev.TaskSpec(id=f"bg{i}"), "c"), [graph.devices.index["a100"]])
    decision = scheduler.place(spec)
    assert decision.placement is not None
    assert list(decision.placement.device_ids) == ["v100"]


def test_the_energy_weight_trades_speed_for_energy() -> None:
    graph = InfraGraph()
    fast = ev.Device(id="fast", host_id="h", kind=GPU, model=A100, memory_gb=80, peak_power_w=400)
    frugal = ev.Device(id="frugal", host_id="h", kind=GPU, model="T4", memory_gb=16, peak_power_w=70)
    for device in (fast, frugal):
        graph.apply_telemetry(ev.TelemetryEvent(device_upsert=device))
    spec = ev.TaskSpec(id="t", workload_class="resnet50-bs64", work_ref_s=100)
    assert best(HeteroGreedy(ObjectiveWeights()), graph, spec) == ["fast"]
    assert best(HeteroGreedy(ObjectiveWeights(completion_time=0.0, energy=1.0)), graph, spec) == ["frugal"]


def test_heft_counts_the_transfer_of_inputs_from_where_they_ran() -> None:
    graph = InfraGraph()
    add_device(graph, "here", "h0", V100)
    add_device(graph, "there", "h1", A100, 80)
    upstream = graph.add_task(ev.TaskSpec(id="prep"), "c")
    graph.bind(upstream, [graph.devices.index["here"]])
    graph.release(upstream, TaskState.FINISHED)  # its output stays where it ran
    small = ev.TaskSpec(
        id="a",
        workload_class="resnet50-bs64",
        work_ref_s=100,
        dependencies=[ev.Dependency(task_id="prep", transfer_gb=0.1)],
    )
    huge = ev.TaskSpec(
        id="b",
        workload_class="resnet50-bs64",
        work_ref_s=100,
        dependencies=[ev.Dependency(task_id="prep", transfer_gb=10_000)],
    )
    assert best(Heft(), graph, small) == ["there"]  # faster device, cheap transfer
    assert best(Heft(), graph, huge) == ["here"]  # moving 10 TB over the network costs more
    assert best(HeteroGreedy(), graph, huge) == ["there"]  # greedy does not look at inputs


def test_heft_orders_the_queue_by_upward_rank_within_a_priority() -> None:
    graph = InfraGraph()
    add_device(graph, "d", "h", V100, 16)
    scheduler = Scheduler(graph, Heft(), PlacementLedger(), "c", clock=lambda: 0.0)
    # 'short' arrives first, but 'root' heads a chain of long work: HEFT takes 'root' first.
    for spec in [
        ev.TaskSpec(id="short", work_ref_s=10, memory_per_device_gb=12),
        ev.TaskSpec(id="root", work_ref_s=10, memory_per_device_gb=12),
        ev.TaskSpec(id="tail", work_ref_s=1000, memory_per_device_gb=12, dependencies=[ev.Dependency(task_id="root")]),
    ]:
        scheduler.submit(spec, "c")
    # Ranks: root 10 + 1000, tail 1000, short 10 (tail waits for root, so short is placed next).
    assert [scheduler.queue_position(t) for t in ("root", "tail", "short")] == [1, 2, 3]
    assert [p.task_id for p in scheduler.schedule_pending()] == ["root"]
    fifo = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), "c", clock=lambda: 0.0)
    for task_id in ("short", "root"):
        fifo.submit(ev.TaskSpec(id=task_id), "c")
    assert fifo.queue_position("short") == 1


def test_a_gang_prefers_one_host_then_one_rack_among_the_best_devices() -> None:
    graph = InfraGraph()
    for host, rack in (("h0", "r0"), ("h1", "r0"), ("h2", "r1"), ("h3", "r1")):
        set_host(graph, host, rack)
    add_device(graph, "h0-a", "h0")
    add_device(graph, "h1-a", "h1")
    add_device(graph, "h2-a", "h2")
    add_device(graph, "h2-b", "h2")
    add_device(graph, "h3-a", "h3")
    spec = ev.TaskSpec(id="t", num_devices=2)
    assert sorted(best(LeastLoaded(), graph, spec)) == ["h2-a", "h2-b"]  # the only host with two
    three = ev.TaskSpec(id="t3", num_devices=3)
    assert sorted(best(LeastLoaded(), graph, three)) == ["h2-a", "h2-b", "h3-a"]  # rack r1 has three
    four = ev.TaskSpec(id="t4", num_devices=4)
    assert len(best(LeastLoaded(), graph, four)) == 4  # no rack has four: the best four anywhere
    assert best(LeastLoaded(), graph, ev.TaskSpec(id="t6", num_devices=6)) == []


def test_swapping_the_policy_reorders_the_queue() -> None:
    graph = InfraGraph()
    add_device(graph, "d", "h")
    scheduler = Scheduler(graph, LeastLoaded(), PlacementLedger(), "c", clock=lambda: 0.0)
    for spec in [ev.TaskSpec(id="short", work_ref_s=10), ev.TaskSpec(id="long", work_ref_s=1000)]:
        scheduler.submit(spec, "c")
    assert scheduler.queue_position("short") == 1  # arrival order
    scheduler.policy = Heft()
    assert scheduler.queue_position("long") == 1  # HEFT: the larger upward rank first
