"""The simulator: hand-computed runtimes, co-location, transfers, energy, failures, determinism."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hlb.daemon.decide.presets import gnn_scorer, make_policy
from hlb.sim.catalogue import Catalogue
from hlb.sim.lookahead import LookaheadPolicy, PinnedPolicy
from hlb.sim.metrics import compute_metrics
from hlb.sim.network import Network
from hlb.sim.policies import make_sim_policy
from hlb.sim.result import SimResult
from hlb.sim.scenarios import build_cluster, build_workload
from hlb.sim.simulator import FailureConfig, SimConfig, Simulation, simulate
from hlb.sim.telemetry import TelemetryConfig
from hlb.sim.topology import Inventory, homogeneous_cluster, inventory_from_document
from hlb.sim.traces import read_trace
from hlb.sim.workloads import Dependency, Task, merge_workloads
from hlb.v1 import events_pb2 as ev
from tests.sim.builders import EXACT, V100, task

FIXTURES = Path(__file__).parent / "fixtures"


def host(host_id: str, rack: str, devices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    uplink = {"kind": "ethernet", "bandwidth_gbps": 100, "latency_us": 5}
    return {"id": host_id, "rack": rack, "cpu_cores": 8, "memory_gb": 64, "uplink": uplink, "devices": devices, **extra}


def two_host_inventory(catalogue: Catalogue) -> Inventory:
    """A V100 host and a T4 host in one rack; links chosen for a hand-computed route."""
    document = {
        "format": "hlb-inventory/1",
        "switches": [{"id": "rack"}],
        "hosts": [
            host(
                "a",
                "rack",
                [{"id": "a/v100", "model": V100}],
                device_link={"kind": "nvlink", "bandwidth_gbps": 2400, "latency_us": 1},
                uplink={"kind": "infiniband", "bandwidth_gbps": 100, "latency_us": 1.5},
            ),
            host(
                "b",
                "rack",
                [{"id": "b/t4", "model": "T4"}],
                device_link={"kind": "pcie", "bandwidth_gbps": 128, "latency_us": 1.5},
                uplink={"kind": "ethernet", "bandwidth_gbps": 25, "latency_us": 10},
            ),
        ],
    }
    return inventory_from_document(document, catalogue)


def by_id(result: SimResult) -> dict[str, Any]:
    return {r.task_id: r for r in result.tasks}


def test_one_task_on_one_device_runs_for_the_catalogue_runtime(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 1)
    result = simulate(catalogue, inventory, [task("t", 3600.0, arrival_s=100.0)], config=EXACT)
    record = by_id(result)["t"]
    assert record.state == "finished"
    assert record.start_s == 100.0
    assert record.finish_s - record.arrival_s == pytest.approx(catalogue.runtime_s(3600.0, "resnet18-bs16", V100))
    assert record.device_ids == (inventory.devices[0].id,)
    assert compute_metrics(result)["slowdown_mean"] == pytest.approx(1.0)


def test_gang_runtime_depends_on_consolidation(catalogue: Catalogue) -> None:
    consolidated = homogeneous_cluster(catalogue, V100, 8)  # one 8-GPU host
    spread = inventory_from_document(
        {
            "format": "hlb-inventory/1",
            "switches": [{"id": "rack"}],
            "hosts": [host(f"h{i}", "rack", [{"model": V100, "count": 1}]) for i in range(4)],
        },
        catalogue,
    )
    gang = task("g", 7200.0, num_devices=4)
    for inventory, together in ((consolidated, True), (spread, False)):
        record = by_id(simulate(catalogue, inventory, [gang], config=EXACT))["g"]
        expected = catalogue.runtime_s(7200.0, "resnet18-bs16", V100, 4, consolidated=together)
        assert record.finish_s == pytest.approx(expected)
    assert catalogue.runtime_s(7200.0, "resnet18-bs16", V100, 4, True) != catalogue.runtime_s(
        7200.0, "resnet18-bs16", V100, 4, False
    )


def test_two_tasks_sharing_a_device_run_at_the_measured_colocation_factors(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 1)
    a = task("a", 3600.0, workload_class="a3c", memory_per_device_gb=4.0)
    b = task("b", 3600.0, workload_class="cyclegan", memory_per_device_gb=4.0)
    shared = replace(EXACT, max_tasks_per_device=2)
    records = by_id(simulate(catalogue, inventory, [a, b], config=shared))
    fa, fb = catalogue.colocation_factors(V100, "a3c", "cyclegan", 1)
    alone_a, alone_b = catalogue.runtime_s(3600.0, "a3c", V100), catalogue.runtime_s(3600.0, "cyclegan", V100)
    # Both start at 0 on the one device; the first to finish ran shared all along, the other
    # then runs what it has left alone.
    shared_a, shared_b = alone_a / fa, alone_b / fb
    first, second, second_alone, second_shared = (
        ("a", "b", alone_b, shared_b) if shared_a < shared_b else ("b", "a", alone_a, shared_a)
    )
    t1 = min(shared_a, shared_b)
    assert records[first].finish_s == pytest.approx(t1)
    assert records[second].finish_s == pytest.approx(t1 + (1.0 - t1 / second_shared) * second_alone)


def test_network_route_is_latency_plus_size_over_bottleneck(catalogue: Catalogue) -> None:
    network = Network(two_host_inventory(catalogue))
    # nvlink 1 µs + infiniband 1.5 µs + ethernet 10 µs + pcie 1.5 µs; the 25 Gbit/s ethernet limits.
    assert network.transfer_s("a/v100", "b/t4", 10.0) == pytest.approx(14e-6 + 80.0 / 25.0)
    assert network.transfer_s("a/v100", "a/v100", 10.0) == 0.0


def test_a_dependent_task_starts_after_its_input_has_crossed_the_links(catalogue: Catalogue) -> None:
    inventory = two_host_inventory(catalogue)
    up = task("up", 600.0, job_id="dag", allowed_models=(V100,))
    down = task("down", 600.0, job_id="dag", allowed_models=("T4",), dependencies=(Dependency("up", 10.0),))
    records = by_id(simulate(catalogue, inventory, [up, down], config=EXACT))
    transfer = 14e-6 + 80.0 / 25.0
    assert records["down"].placed_s == pytest.approx(records["up"].finish_s)
    assert records["down"].start_s == pytest.approx(records["up"].finish_s + transfer)
    assert records["down"].transfer_s == pytest.approx(transfer)
    runtime = catalogue.runtime_s(600.0, "resnet18-bs16", "T4")
    assert records["down"].finish_s == pytest.approx(records["down"].start_s + runtime)


def test_energy_is_idle_power_over_time_plus_the_busy_device_dynamic_power(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 2)
    result = simulate(catalogue, inventory, [task("t", 3600.0, arrival_s=1000.0)], config=EXACT)
    runtime = catalogue.runtime_s(3600.0, "resnet18-bs16", V100)
    profile = catalogue.profile(V100)
    idle_w = 2 * profile.idle_power_w
    assert result.end_s == pytest.approx(1000.0 + runtime)
    expected = idle_w * result.end_s + (profile.peak_power_w - profile.idle_power_w) * runtime
    assert result.energy_j == pytest.approx(expected)
    metrics = compute_metrics(result)
    assert metrics["energy_kwh"] == pytest.approx(expected / 3.6e6)
    # Before the arrival the cluster draws exactly its idle power.
    assert result.timeline.power_w[0] == pytest.approx(idle_w)


def test_a_failed_device_fails_its_tasks_and_they_are_resubmitted(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 2)
    runtime = catalogue.runtime_s(36000.0, "resnet18-bs16", V100)
    config = replace(EXACT, failures=FailureConfig(mtbf_s=runtime / 2, mttr_s=600.0))
    tasks = [task(f"t{i}", 36000.0) for i in range(2)]
    sim = Simulation(catalogue, inventory, tasks, seed=3, config=config)
    result = sim.run()
    assert result.failures > 0
    assert all(r.state == "finished" for r in result.tasks)
    retried = [r for r in result.tasks if r.attempts > 1]
    assert retried
    for record in retried:
        # The scheduler saw every attempt; the first failed and the last finished.
        assert sim.scheduler.graph.tasks[record.task_id].state.label == "failed"
        assert sim.scheduler.graph.tasks[f"{record.task_id}#{record.attempts}"].state.label == "finished"
        assert record.finish_s - record.arrival_s > runtime


def test_dependents_of_a_failed_task_are_resubmitted_against_the_new_attempt(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 4)
    tasks = []
    for job in range(6):
        prep = task(f"j{job}/prep", 600.0, job_id=f"j{job}", arrival_s=100.0 * job)
        train = replace(prep, id=f"j{job}/train", work_ref_s=3000.0, dependencies=(Dependency(prep.id, 5.0),))
        evaluate = replace(prep, id=f"j{job}/eval", dependencies=(Dependency(train.id, 1.0),))
        tasks += [prep, train, evaluate]
    config = replace(EXACT, failures=FailureConfig(mtbf_s=8000.0, mttr_s=300.0))
    result = simulate(catalogue, inventory, tasks, seed=1, config=config)
    assert result.failures > 0
    assert all(r.state == "finished" for r in result.tasks)
    finish = {r.task_id: r.finish_s for r in result.tasks}
    for record in result.tasks:
        assert all(record.start_s >= finish[d] for d in record.dependencies)


def conserving_decider(seen: list[int]) -> Any:
    """Checks, at every decision, that no device holds more memory than it has."""

    def decide(sim: Simulation) -> list[ev.Placement]:
        assert np.all(sim.memory_used_gb() <= sim.memory_gb() + 1e-9)
        seen.append(sim.scheduler.pending_count)
        return sim.scheduler.schedule_pending()

    return decide


def test_conservation_every_task_ends_and_no_device_is_overfilled(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:16", catalogue)
    tasks = build_workload("mixed", 2, 40, catalogue, inventory, 1.2)
    config = SimConfig(failures=FailureConfig(mtbf_s=200000.0, mttr_s=3600.0))
    calls: list[int] = []
    sim = Simulation(catalogue, inventory, tasks, seed=2, config=config, decider=conserving_decider(calls))
    result = sim.run()
    assert calls
    assert {r.state for r in result.tasks} <= {"finished", "failed", "pending", "unrunnable"}
    ended = [r for r in result.tasks if r.state != "pending"]
    waiting = {t.spec.id for t in sim.scheduler.graph.tasks.values() if t.state.label == "pending"}
    # A task still pending in the simulation is pending (under its current attempt) in the scheduler.
    assert {sim.scheduler.graph.tasks[f"{r.task_id}#{r.attempts}" if r.attempts > 1 else r.task_id].spec.id
            for r in result.tasks if r.state == "pending"} <= waiting  # fmt: skip
    assert sum(r.state == "finished" for r in ended) >= 0.9 * len(tasks)
    assert all(r.reason for r in result.tasks if r.state in ("failed", "unrunnable"))
    assert not any(r.reason.startswith("out of memory") for r in result.tasks)
    # One placement at most per attempt (dependents cancelled for a resubmission are never placed).
    assert len(sim.scheduler.ledger) <= sum(r.attempts for r in result.tasks)


def run_metrics(catalogue: Catalogue, seed: int, policy: str = "least-loaded") -> dict[str, float]:
    inventory = build_cluster("mixed:16", catalogue)
    tasks = build_workload("gavel", seed, 30, catalogue, inventory, 0.8)
    config = SimConfig(failures=FailureConfig(mtbf_s=500000.0))
    return compute_metrics(simulate(catalogue, inventory, tasks, policy, seed, config))


def test_the_same_seed_gives_the_same_results(catalogue: Catalogue) -> None:
    first, again, other = run_metrics(catalogue, 4), run_metrics(catalogue, 4), run_metrics(catalogue, 5)
    assert first == again
    assert first != other


def test_estimate_error_changes_what_the_scheduler_is_told_not_the_work_that_runs(catalogue: Catalogue) -> None:
    """With ``estimate_sigma`` the scheduler sees each task's work off by a factor drawn per task
    and seed; a policy that never reads the estimates (least-loaded) runs exactly as with exact ones."""
    inventory = build_cluster("mixed:16", catalogue)
    tasks = build_workload("gavel", 4, 40, catalogue, inventory, 0.8)

    def run(sigma: float, policy: str) -> tuple[Simulation, dict[str, float]]:
        sim = Simulation(catalogue, inventory, tasks, policy, 4, SimConfig(estimate_sigma=sigma))
        return sim, compute_metrics(sim.run())

    noisy, noisy_metrics = run(1.0, "least-loaded")
    _, exact_metrics = run(0.0, "least-loaded")
    # Least-loaded estimates nothing: no run-time error to measure.
    for error in (
        "runtime_error",
        "runtime_error_job_removed",
        "runtime_error_prior",
        "runtime_error_prior_job_removed",
    ):
        assert math.isnan(noisy_metrics.pop(error))
        assert math.isnan(exact_metrics.pop(error))
    assert noisy_metrics == exact_metrics  # the true work is unchanged
    told = {t.spec.id: t.spec.work_ref_s for t in noisy.scheduler.graph.tasks.values()}
    truth = {t.id: t.work_ref_s for t in tasks}
    ratios = np.array([told[i] / truth[i] for i in told if truth[i] > 0])
    assert len(ratios) > 10
    assert 0.6 < float(np.log(ratios).std()) < 1.4  # sigma 1
    again, _ = run(1.0, "least-loaded")
    assert {t.spec.id: t.spec.work_ref_s for t in again.scheduler.graph.tasks.values()} == told  # per seed
    # Hetero-greedy ranks one task's devices by its estimate, a factor that cancels; the GNN's
    # waiting and shortest-first order compare estimates of different tasks, so it decides otherwise.
    noisy_greedy, exact_greedy = run(1.0, "hetero-greedy")[1], run(0.0, "hetero-greedy")[1]
    assert noisy_greedy.pop("runtime_error") > exact_greedy.pop("runtime_error")
    for error in ("runtime_error_job_removed", "runtime_error_prior", "runtime_error_prior_job_removed"):
        assert noisy_greedy.pop(error) > exact_greedy.pop(error)
    for estimates in ("runtime_bias", "runtime_bias_gangs"):  # of the estimates, not of what ran
        assert noisy_greedy.pop(estimates) != exact_greedy.pop(estimates)
    assert noisy_greedy == exact_greedy
    gnn = [
        compute_metrics(simulate(catalogue, inventory, tasks, make_sim_policy("gnn"), 4, SimConfig(estimate_sigma=s)))
        for s in (1.0, 0.0)
    ]
    assert gnn[0]["jct_mean_s"] != gnn[1]["jct_mean_s"]


def test_estimate_bias_overstates_every_estimate_by_its_factor(catalogue: Catalogue) -> None:
    """``estimate_bias`` multiplies every estimate the scheduler is told (alone, exactly that factor;
    with ``estimate_sigma``, the same random factors as without the bias, times it). The true work
    runs: least-loaded, which never reads estimates, runs as with exact ones; the GNN, whose waiting
    weighs a busy device's expected free time, decides otherwise."""
    inventory = build_cluster("mixed:16", catalogue)
    tasks = build_workload("gavel", 4, 40, catalogue, inventory, 0.8)
    truth = {t.id: t.work_ref_s for t in tasks}

    def told(config: SimConfig) -> dict[str, float]:
        sim = Simulation(catalogue, inventory, tasks, "least-loaded", 4, config)
        sim.run()
        return {i: t.spec.work_ref_s / truth[i] for i, t in sim.scheduler.graph.tasks.items() if truth.get(i, 0) > 0}

    biased = told(SimConfig(estimate_bias=3.0))
    assert len(biased) > 10
    assert np.allclose(list(biased.values()), 3.0)
    noisy, both = told(SimConfig(estimate_sigma=0.5)), told(SimConfig(estimate_sigma=0.5, estimate_bias=3.0))
    assert both.keys() == noisy.keys()
    assert np.allclose([both[i] for i in noisy], [3.0 * noisy[i] for i in noisy])
    exact = compute_metrics(Simulation(catalogue, inventory, tasks, "least-loaded", 4, SimConfig()).run())
    assert (
        compute_metrics(Simulation(catalogue, inventory, tasks, "least-loaded", 4, SimConfig(estimate_bias=3.0)).run())
        == exact
    )
    gnn = [
        compute_metrics(simulate(catalogue, inventory, tasks, make_sim_policy("gnn"), 4, SimConfig(estimate_bias=b)))
        for b in (3.0, 1.0)
    ]
    assert gnn[0]["jct_mean_s"] != gnn[1]["jct_mean_s"]


def test_estimate_limits_round_a_batch_estimate_up_to_the_next_limit(catalogue: Catalogue) -> None:
    """``estimate_limits_h`` rounds each batch task's estimate up to the first limit at or above it
    (an estimate above the last stays); the true work runs."""
    inventory = build_cluster("mixed:16", catalogue)
    tasks = build_workload("gavel", 4, 40, catalogue, inventory, 0.8)
    truth = {t.id: t.work_ref_s for t in tasks}
    limits = (1.0, 4.0, 24.0)
    sim = Simulation(catalogue, inventory, tasks, "least-loaded", 4, SimConfig(estimate_limits_h=limits))
    metrics = compute_metrics(sim.run())
    told = {i: t.spec.work_ref_s for i, t in sim.scheduler.graph.tasks.items() if truth.get(i, 0) > 0}
    assert len(told) > 10
    for task_id, estimate in told.items():
        hours = truth[task_id] / 3600.0
        expected = next((h * 3600.0 for h in limits if h >= hours), truth[task_id])
        assert estimate == pytest.approx(expected)
    assert {e / 3600.0 for e in told.values()} & set(limits)  # some were rounded
    assert metrics == compute_metrics(Simulation(catalogue, inventory, tasks, "least-loaded", 4, SimConfig()).run())


def test_a_service_misses_its_slo_when_its_device_is_too_slow(catalogue: Catalogue) -> None:
    inventory = two_host_inventory(catalogue)
    reference_ms = 1000.0 / catalogue.throughput(V100, "resnet50-bs16", 1)
    labels = {"duration_s": "3600", "request_rate_per_s": "0.1", "request_work_ref_ms": repr(reference_ms)}
    services = [
        task(f"svc-{model}", 1.0, kind="inference", workload_class="resnet50-bs16", allowed_models=(model,),
             latency_slo_ms=1.2 * reference_ms, labels=labels)
        for model in (V100, "T4")
    ]  # fmt: skip
    records = by_id(simulate(catalogue, inventory, services, config=EXACT))
    assert records[f"svc-{V100}"].finish_s == pytest.approx(3600.0)
    assert not records[f"svc-{V100}"].slo_violated
    assert catalogue.throughput("T4", "resnet50-bs16", 1) < catalogue.throughput(V100, "resnet50-bs16", 1) / 1.2
    assert records["svc-T4"].slo_violated


def test_a_class_that_cannot_run_on_the_cluster_is_reported_not_placed(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, "Alveo-U280", 1)  # inference only
    result = simulate(catalogue, inventory, [task("t", 60.0)], config=EXACT)
    assert by_id(result)["t"].state == "unrunnable"
    assert math.isinf(by_id(result)["t"].ideal_s)


def test_an_external_decider_must_place_through_the_scheduler(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 1)

    def rogue(sim: Simulation) -> list[ev.Placement]:
        return [ev.Placement(task_id="t", device_ids=[inventory.devices[0].id])]

    with pytest.raises(ValueError, match="never recorded"):
        simulate(catalogue, inventory, [task("t", 60.0)], decider=rogue)


def test_policies_are_chosen_by_name_or_given_as_objects(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 2)
    by_name = simulate(catalogue, inventory, [task("t", 60.0)], "least-loaded")
    by_object = simulate(catalogue, inventory, [task("t", 60.0)], make_policy("least-loaded"))
    assert by_name.policy == by_object.policy == "least-loaded"
    assert by_name.tasks == by_object.tasks


def test_lookahead_decides_through_the_same_scheduler(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:8", catalogue)
    tasks = build_workload("gavel", 1, 12, catalogue, inventory, 0.9)
    policy = LookaheadPolicy(k=3, horizon_s=4 * 3600.0)
    sim = Simulation(catalogue, inventory, tasks, policy, seed=1)
    result = sim.run()
    assert policy.rollouts > 0
    assert all(r.state == "finished" for r in result.tasks)
    assert {p.policy for p in sim.scheduler.ledger.since(1)} == {"lookahead"}


def test_a_fork_decides_with_the_policy_it_is_given(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:8", catalogue)
    sim = Simulation(catalogue, inventory, build_workload("gavel", 1, 6, catalogue, inventory, 0.9), "least-loaded")
    sim.run_until(600.0)
    pinned = PinnedPolicy("nobody", None, make_policy("hetero-greedy"))
    fork = sim.fork(pinned)
    assert fork.policy is pinned
    assert fork.scheduler.policy is pinned
    assert sim.policy.name == sim.scheduler.policy.name == "least-loaded"
    assert fork.scheduler.graph is not sim.scheduler.graph
    default = sim.fork()
    assert default.policy is not sim.policy
    assert default.scheduler.policy is default.policy


def test_a_fork_of_a_run_with_the_gnn_finishes_as_the_run_does(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:8", catalogue)
    tasks = build_workload("gavel", 1, 12, catalogue, inventory, 0.9)
    expected = Simulation(catalogue, inventory, tasks, make_sim_policy("gnn"), seed=1).run()
    sim = Simulation(catalogue, inventory, tasks, make_sim_policy("gnn"), seed=1)
    sim.run_until(expected.end_s / 3)
    assert 0 < len(sim.scheduler.ledger) < expected.placements  # decisions on both sides of the fork
    fork = sim.fork()  # decides with a copy of the GNN policy, on the fork's graph and clock
    scorer, original = gnn_scorer(fork.policy), gnn_scorer(sim.policy)
    assert scorer is not None
    assert scorer is not original  # the fork's own copy of the GNN scorer
    assert fork.policy.name == "gnn"
    assert fork.run().tasks == expected.tasks
    assert sim.now_s < expected.end_s  # the fork ran on its own
    assert scorer.clock_ms() == fork.clock.now_ms() != sim.clock.now_ms()  # and dated its tasks by its clock
    assert sim.run().tasks == expected.tasks


def test_a_pinned_task_takes_its_rows_now_and_the_base_decides_the_rest_waits_included(
    catalogue: Catalogue,
) -> None:
    inventory = build_cluster("mixed:8", catalogue)
    tasks = build_workload("gavel", 1, 12, catalogue, inventory, 0.9)
    alone = Simulation(catalogue, inventory, tasks, make_sim_policy("rules"), seed=1)
    expected = alone.run()
    assert alone.scheduler.waits_decided > 0  # the rules wait for faster devices here
    unpinned = Simulation(catalogue, inventory, tasks, PinnedPolicy("", None, make_sim_policy("rules")), seed=1)
    assert unpinned.run().tasks == expected.tasks
    assert unpinned.scheduler.waits_decided == alone.scheduler.waits_decided
    # The first task (every device free then), pinned to devices of one host of another model
    # than the base's choice.
    first = min(tasks, key=lambda t: t.arrival_s)
    chosen = {r.task_id: r for r in expected.tasks}[first.id].models[0]
    fits = [d for d in inventory.devices if d.model != chosen and d.memory_gb >= first.memory_per_device_gb]
    hosts = {d.host_id: [e.id for e in fits if e.host_id == d.host_id] for d in fits}
    other = next(ids for ids in hosts.values() if len(ids) >= first.num_devices)[: first.num_devices]
    rows = alone.scheduler.graph.device_rows(other)
    pinned = Simulation(catalogue, inventory, tasks, PinnedPolicy(first.id, rows, make_sim_policy("rules")), seed=1)
    records = {r.task_id: r for r in pinned.run().tasks}
    assert records[first.id].device_ids == tuple(other)
    assert pinned.scheduler.waits_decided > 0


def test_lookahead_over_a_base_that_waits_leaves_its_own_choice_to_it(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:8", catalogue)
    tasks = build_workload("gavel", 1, 12, catalogue, inventory, 0.9)
    alone = Simulation(catalogue, inventory, tasks, make_sim_policy("rules"), seed=1)
    expected = alone.run()
    # One candidate only: the base's own choice, with its wait; no rollout.
    policy = LookaheadPolicy(make_sim_policy("rules"), k=1)
    sim = Simulation(catalogue, inventory, tasks, policy, seed=1)
    assert sim.run().tasks == expected.tasks
    assert sim.scheduler.waits_decided == alone.scheduler.waits_decided > 0
    assert policy.waits
    assert policy.rollouts == 0


def replay(catalogue: Catalogue, trace: Sequence[Task]) -> SimResult:
    from hlb.sim.topology import load_inventory

    inventory = load_inventory(FIXTURES / "small_inventory.json", catalogue)
    return simulate(catalogue, inventory, trace, seed=0, config=EXACT)


def test_a_hand_written_inventory_and_trace_replay(catalogue: Catalogue) -> None:
    from_csv = replay(catalogue, read_trace(FIXTURES / "small_trace.csv"))
    from_jsonl = replay(catalogue, read_trace(FIXTURES / "small_trace.jsonl"))
    assert from_csv.tasks == from_jsonl.tasks
    records = by_id(from_csv)
    assert all(r.state == "finished" for r in records.values())
    assert records["gang-1/train"].models == (V100,) * 4
    assert records["svc-1/serve"].models == ("T4",)
    assert records["dag-1/train"].start_s >= records["dag-1/prep"].finish_s
    assert records["dag-1/eval"].start_s >= records["dag-1/train"].finish_s
    assert "Alveo-U280" not in records["dag-1/train"].models


def test_unknown_classes_and_dependencies_are_clear_errors(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 1)
    with pytest.raises(ValueError, match="workload class 'nope'"):
        Simulation(catalogue, inventory, [task("t", 1.0, workload_class="nope")])
    with pytest.raises(ValueError, match="unknown task 'ghost'"):
        Simulation(catalogue, inventory, [task("t", 1.0, dependencies=(Dependency("ghost", 1.0),))])
    with pytest.raises(ValueError, match="unique"):
        Simulation(catalogue, inventory, merge_workloads([task("t", 1.0)]) * 2)


def scheduler_view(sim: Simulation) -> float:
    graph = sim.scheduler.graph
    return float(graph.devices.utilization[graph.device_rows([sim.inventory.devices[0].id])][0])


def test_telemetry_reaches_the_scheduler_late_and_noisy(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 1)
    tasks = [task("t", 36000.0)]
    exact = TelemetryConfig(interval_s=300.0, delay_s=30.0, utilization_noise=0.0, power_noise=0.0, memory_noise_gb=0.0)
    sim = Simulation(catalogue, inventory, tasks, config=SimConfig(telemetry=exact))
    # The task runs from t = 0; the sample at 0 was taken before it started, the next at 300 s
    # arrives at 330 s.
    sim.run_until(329.0)
    assert sim.true_utilization()[0] == 1.0
    assert scheduler_view(sim) == 0.0
    sim.run_until(331.0)
    assert scheduler_view(sim) == 1.0

    noisy = replace(exact, utilization_noise=0.2)
    sim = Simulation(catalogue, inventory, tasks, seed=1, config=SimConfig(telemetry=noisy))
    seen = []
    for step in range(1, 7):
        sim.run_until(330.0 + 1800.0 * step)
        seen.append(scheduler_view(sim))
    assert all(0.0 <= u <= 1.0 for u in seen)
    assert any(u < 1.0 for u in seen)  # noise, clipped at the top


def test_a_lookahead_horizon_in_tasks_ends_at_the_nth_next_arrival(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:8", catalogue)
    tasks = [task(f"t{i}", 600.0, arrival_s=1000.0 * i) for i in range(10)]
    policy = LookaheadPolicy(k=2, horizon_tasks=3, horizon_s=6 * 3600.0)
    sim = Simulation(catalogue, inventory, tasks, policy, seed=1)
    sim.run_until(2500.0)
    assert 2000.0 < sim.now_s <= 2500.0
    assert policy.horizon_end_s() == 5000.0  # the next three arrivals: 3,000, 4,000, 5,000
    policy.horizon_s = 1000.0
    assert policy.horizon_end_s() == sim.now_s + 1000.0  # at most horizon_s
    sim.run_until(9500.0)
    policy.horizon_s = 6 * 3600.0
    assert sim.now_s >= 9000.0
    assert policy.horizon_end_s() == sim.now_s + 330.0  # none left: the next telemetry delivery


def test_lookahead_draws_its_candidates_when_there_are_more_than_k(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:20", catalogue)
    tasks = build_workload("gavel", 2, 10, catalogue, inventory, 0.9)
    picks = []
    for _ in range(2):
        policy = LookaheadPolicy(k=2, horizon_tasks=4, seed=7)
        sim = Simulation(catalogue, inventory, tasks, policy, seed=2)
        sim.run_until(tasks[0].arrival_s)
        graph = sim.scheduler.graph
        rows = np.flatnonzero(graph.devices.alive)
        spec = sim.scheduler.graph.tasks[tasks[0].id].spec
        scores = policy.base.score(spec, graph, rows)
        every = LookaheadPolicy(k=10).candidates(spec, graph, rows, scores, rows[:1])
        chosen = policy.candidates(spec, graph, rows, scores, rows[:1])
        picks.append([tuple(c) for c in chosen])
        assert len(every) > 2
        assert len(chosen) == 2
        assert np.array_equal(chosen[0], every[0])
        assert any(np.array_equal(chosen[1], c) for c in every[1:])
    assert picks[0] == picks[1]  # the same seed draws the same


def test_lookahead_rolls_out_only_where_the_bases_model_could_run_short(catalogue: Catalogue) -> None:
    tasks = build_workload("gavel", 1, 12, catalogue, build_cluster("mixed:8", catalogue), 0.9)
    roomy = LookaheadPolicy(k=3, horizon_tasks=2)
    Simulation(catalogue, build_cluster("mixed:400", catalogue), tasks, roomy, seed=1).run()
    assert roomy.rollouts == 0
    assert roomy.skipped == len(tasks)
    tight = LookaheadPolicy(k=3, horizon_tasks=2)
    Simulation(catalogue, build_cluster("mixed:8", catalogue), tasks, tight, seed=1).run()
    assert tight.rollouts > 0
    cost = tight.cost()
    assert cost["lookahead_decisions"] == tight.decisions > 0
    assert cost["lookahead_ms_per_decision"] > 0
    assert 2 <= cost["lookahead_rollouts_per_decision"] <= 3
