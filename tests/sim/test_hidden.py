"""The hidden truth: each switch changes the true run times as documented, and only when on."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from hlb.sim.catalogue import Catalogue
from hlb.sim.eval import _hidden, add_arguments
from hlb.sim.execution import TIME_SHARING_FACTOR, ExecutionModel, shared_uplink_rate
from hlb.sim.hidden import HIDDEN_DEFAULTS, SHARED_DEVICE_TASKS, Episode, HiddenConfig, HiddenTruth
from hlb.sim.metrics import compute_metrics
from hlb.sim.policies import make_sim_policy
from hlb.sim.result import SimResult
from hlb.sim.scenarios import build_cluster, build_workload
from hlb.sim.simulator import SimConfig, Simulation, simulate
from hlb.sim.topology import Inventory, homogeneous_cluster, inventory_from_document, mixed_cluster
from hlb.sim.workloads import Dependency
from tests.sim.builders import CLASS, EXACT, V100, task

P100, T4 = "P100-PCIE-16GB", "T4"


def hidden(**switches: Any) -> SimConfig:
    return replace(EXACT, hidden=HiddenConfig(**switches))


def by_id(result: SimResult) -> dict[str, Any]:
    return {r.task_id: r for r in result.tasks}


def run_s(record: Any) -> float:
    return float(record.finish_s - record.start_s)


# -- off ---------------------------------------------------------------------------------------


def test_every_part_is_off_by_default_and_strengths_alone_change_nothing(catalogue: Catalogue) -> None:
    assert SimConfig().hidden == HiddenConfig()
    assert SimConfig().max_tasks_per_device == 1
    inventory = build_cluster("mixed:8", catalogue)
    tasks = build_workload("mixed", 3, 10, catalogue, inventory, 0.8)
    # Strengths without their switches (share 0, no throttling, no link sharing) are still off.
    strengths = HiddenConfig(slow_device_speed=(0.1, 0.2), throttle_speed=(0.1, 0.2), throttle_duration_s=60.0)
    plain = Simulation(catalogue, inventory, tasks, "hetero-greedy", 3, SimConfig())
    quiet = Simulation(catalogue, inventory, tasks, "hetero-greedy", 3, SimConfig(hidden=strengths))
    results = [plain.run(), quiet.run()]
    assert compute_metrics(results[0]) == compute_metrics(results[1])
    assert [r.finish_s for r in results[0].tasks] == [r.finish_s for r in results[1].tasks]
    assert quiet.hidden.job_speed == {}
    assert quiet.hidden.episodes == []
    assert (quiet.devices.speed == 1.0).all()


# -- per-job speed -----------------------------------------------------------------------------


def test_a_job_runs_its_speed_multiplier_faster_on_every_device(catalogue: Catalogue) -> None:
    inventory = mixed_cluster(catalogue, {V100: 1, T4: 1})
    tasks = [
        task("on-v100", 3600.0, job_id="j", allowed_models=(V100,)),
        task("on-t4", 3600.0, job_id="j", allowed_models=(T4,)),
        task("other", 3600.0, job_id="k", arrival_s=1e5),
    ]
    sim = Simulation(catalogue, inventory, tasks, "least-loaded", 0, hidden(job_speed_sigma=0.5))
    records = by_id(sim.run())
    speed = sim.hidden.job_speed
    assert set(speed) == {"j", "k"}
    assert speed["j"] != speed["k"]
    assert all(m != 1.0 for m in speed.values())
    for task_id, model in (("on-v100", V100), ("on-t4", T4)):
        assert run_s(records[task_id]) == pytest.approx(catalogue.runtime_s(3600.0, CLASS, model) / speed["j"])
    model = records["other"].models[0]
    assert run_s(records["other"]) == pytest.approx(catalogue.runtime_s(3600.0, CLASS, model) / speed["k"])
    # A job's ideal run time is its true one: the bound moves with the job.
    assert records["on-v100"].ideal_s == pytest.approx(catalogue.runtime_s(3600.0, CLASS, V100) / speed["j"])
    assert {r.task_id: r.job_speed for r in records.values()} == {
        "on-v100": speed["j"],
        "on-t4": speed["j"],
        "other": speed["k"],
    }


def test_the_run_time_error_with_the_job_taken_out_leaves_only_what_a_scheduler_could_know(
    catalogue: Catalogue,
) -> None:
    """Told the catalogue's true speeds, a policy misses each task by its job's hidden draw alone:
    its run-time error is that draw's, and none once the draw is taken out."""
    inventory = mixed_cluster(catalogue, {V100: 2, T4: 2})
    tasks = [task(f"t{i}", 3600.0, job_id=f"j{i}", arrival_s=1e5 * i) for i in range(6)]
    oracle = make_sim_policy("oracle-speeds")
    sim = Simulation(catalogue, inventory, tasks, oracle, 0, hidden(job_speed_sigma=0.5))
    metrics = compute_metrics(sim.run())
    draws = np.abs(np.log([sim.hidden.job_speed[f"j{i}"] for i in range(6)]))
    assert metrics["runtime_error"] == pytest.approx(float(np.median(draws)))
    assert metrics["runtime_error"] > 0.05
    assert metrics["runtime_error_job_removed"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["runtime_error_prior"] == metrics["runtime_error"]  # it corrects no prior


def test_a_policy_that_corrects_the_prior_is_judged_beside_the_prior_on_the_same_placements(
    catalogue: Catalogue,
) -> None:
    """The table learns each model's speed from the tasks that finish; the profiles it corrects
    (nameplate) are recorded for the same placements, so their errors pair task by task."""
    inventory = mixed_cluster(catalogue, {V100: 2, P100: 2})
    tasks = [task(f"t{i}", 3600.0, job_id=f"j{i}", arrival_s=5e3 * i) for i in range(12)]
    table = make_sim_policy("rules-table", profiles="nameplate")
    result = Simulation(catalogue, inventory, tasks, table, 0, hidden(job_speed_sigma=0.2)).run()
    estimated = [(r.estimated_s, r.prior_estimated_s) for r in result.tasks if r.state == "finished"]
    assert len(estimated) == 12
    assert all(ours > 0 and prior > 0 for ours, prior in estimated)
    assert any(ours != pytest.approx(prior) for ours, prior in estimated)  # once it has learned
    assert estimated[0][0] == pytest.approx(estimated[0][1])  # before any task finished: the prior
    metrics = compute_metrics(result)
    assert metrics["runtime_error"] < metrics["runtime_error_prior"]


def test_job_speeds_are_lognormal_with_median_one() -> None:
    truth = HiddenTruth(HiddenConfig(job_speed_sigma=0.3), np.random.SeedSequence(5), [f"j{i}" for i in range(4000)], 0)
    logs = np.log(list(truth.job_speed.values()))
    assert abs(float(np.median(logs))) < 0.02
    assert float(np.std(logs)) == pytest.approx(0.3, abs=0.015)


# -- slow devices and throttling ----------------------------------------------------------------


def test_a_slow_device_runs_slower_and_its_telemetry_shows_it(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 8)
    tasks = [task(f"t{i}", 36000.0) for i in range(8)]
    sim = Simulation(catalogue, inventory, tasks, "least-loaded", 0, hidden(slow_device_share=0.5))
    speed = sim.hidden.persistent_speed
    slow = np.flatnonzero(speed < 1.0)
    assert 0 < len(slow) < 8  # the seed gives both kinds
    low, high = HiddenConfig().slow_device_speed
    assert ((speed[slow] >= low) & (speed[slow] <= high)).all()
    # The report sampled at 300 s reaches the scheduler at 330 s: every device is busy.
    sim.run_until(331.0)
    graph = sim.scheduler.graph
    rows = graph.device_rows(sim.devices.ids)
    power, temperature = graph.devices.power_w[rows], graph.devices.temperature_c[rows]
    utilization = graph.devices.utilization[rows]
    profile = catalogue.profile(V100)
    assert (utilization == 1.0).all()  # busy, slowly: utilization alone does not tell
    np.testing.assert_allclose(power, profile.idle_power_w + (profile.peak_power_w - profile.idle_power_w) * speed)
    np.testing.assert_allclose(temperature, 30.0 + 50.0 + 40.0 * (1.0 - speed))
    healthy = np.flatnonzero(speed == 1.0)
    assert power[slow].max() < power[healthy].min()
    assert temperature[slow].min() > temperature[healthy].max()
    records = by_id(sim.run())
    alone = catalogue.runtime_s(36000.0, CLASS, V100)
    for record in records.values():
        row = sim.devices.index[record.device_ids[0]]
        assert run_s(record) == pytest.approx(alone / speed[row])


def finish_with_episodes(runtime_s: float, episodes: list[Episode]) -> float:
    """When work of ``runtime_s`` full-speed seconds started at 0 ends, slowed by ``episodes``."""
    t, left = 0.0, runtime_s
    for episode in sorted(episodes, key=lambda e: e.start_s):
        if episode.start_s >= t + left:
            break
        left -= episode.start_s - t
        span = episode.end_s - episode.start_s
        if span * episode.speed >= left:
            return episode.start_s + left / episode.speed
        left -= span * episode.speed
        t = episode.end_s
    return t + left


def test_throttling_episodes_slow_what_runs_while_they_last(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 1)
    config = hidden(throttle_every_s=7200.0, throttle_duration_s=3600.0)
    runtime = catalogue.runtime_s(20 * 3600.0, CLASS, V100)
    sim = Simulation(catalogue, inventory, [task("t", 20 * 3600.0)], "least-loaded", 2, config)
    record = by_id(sim.run())["t"]
    during = [e for e in sim.hidden.episodes if e.start_s < record.finish_s]
    assert len(during) >= 3
    low, high = HiddenConfig().throttle_speed
    assert all(low <= e.speed <= high and e.end_s > e.start_s for e in during)
    assert record.finish_s == pytest.approx(finish_with_episodes(runtime, during))
    assert record.finish_s > runtime
    # The device's speed recovers between episodes.
    assert sim.devices.speed[0] in (1.0, sim.hidden.episodes[-1].speed)


def test_every_policy_sees_the_same_hidden_draws_for_a_seed(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:16", catalogue)
    tasks = build_workload("gavel", 7, 20, catalogue, inventory, 0.8)
    config = replace(EXACT, hidden=HIDDEN_DEFAULTS, max_tasks_per_device=SHARED_DEVICE_TASKS)
    runs = [Simulation(catalogue, inventory, tasks, policy, 7, config) for policy in ("random", "hetero-greedy")]
    results = [sim.run() for sim in runs]
    first, second = (sim.hidden for sim in runs)
    assert first.job_speed == second.job_speed
    assert len(first.job_speed) == 20
    np.testing.assert_array_equal(first.persistent_speed, second.persistent_speed)
    horizon = min(r.end_s for r in results)
    common = [
        sorted((e for e in h.episodes if e.start_s < horizon), key=lambda e: (e.row, e.start_s))
        for h in (first, second)
    ]
    assert common[0] == common[1]
    assert common[0]
    # The policies decided differently under the same truth.
    assert [r.device_ids for r in results[0].tasks] != [r.device_ids for r in results[1].tasks]
    other = Simulation(catalogue, inventory, tasks, "random", 8, config).hidden
    assert other.job_speed != first.job_speed


def test_one_part_on_leaves_the_draws_of_the_others() -> None:
    jobs = [f"j{i}" for i in range(50)]
    alone = HiddenTruth(HiddenConfig(job_speed_sigma=0.3), np.random.SeedSequence(1), jobs, 64)
    every = HiddenTruth(HIDDEN_DEFAULTS, np.random.SeedSequence(1), jobs, 64)
    assert alone.job_speed == every.job_speed
    slow = HiddenTruth(HiddenConfig(slow_device_share=0.05), np.random.SeedSequence(1), jobs, 64)
    np.testing.assert_array_equal(slow.persistent_speed, every.persistent_speed)


# -- co-location --------------------------------------------------------------------------------


def test_a_pair_gavel_did_not_measure_shares_the_device_half_and_half(catalogue: Catalogue) -> None:
    assert catalogue.colocation_factors(V100, "a3c", "resnet50-bs128") == (0.0, 0.0)
    inventory = homogeneous_cluster(catalogue, V100, 1)
    a = task("a", 3600.0, workload_class="a3c")
    b = task("b", 36000.0, workload_class="resnet50-bs128")
    records = by_id(simulate(catalogue, inventory, [a, b], config=replace(EXACT, max_tasks_per_device=2)))
    alone_a = catalogue.runtime_s(3600.0, "a3c", V100)
    assert records["a"].finish_s == pytest.approx(alone_a / TIME_SHARING_FACTOR)


# -- link sharing -------------------------------------------------------------------------------


def two_racks_of_links(
    catalogue: Catalogue, devices_a: list[dict[str, Any]], devices_b: list[dict[str, Any]]
) -> Inventory:
    nvlink = {"kind": "nvlink", "bandwidth_gbps": 2400, "latency_us": 1}
    pcie = {"kind": "pcie", "bandwidth_gbps": 128, "latency_us": 1.5}
    hosts = [
        {"id": "a", "rack": "rack", "cpu_cores": 8, "memory_gb": 64, "device_link": nvlink,
         "uplink": {"kind": "infiniband", "bandwidth_gbps": 100, "latency_us": 1.5}, "devices": devices_a},
        {"id": "b", "rack": "rack", "cpu_cores": 8, "memory_gb": 64, "device_link": pcie,
         "uplink": {"kind": "ethernet", "bandwidth_gbps": 25, "latency_us": 10}, "devices": devices_b},
    ]  # fmt: skip
    document = {"format": "hlb-inventory/1", "switches": [{"id": "rack"}], "hosts": hosts}
    return inventory_from_document(document, catalogue)


def test_concurrent_transfers_share_the_links_they_cross(catalogue: Catalogue) -> None:
    inventory = two_racks_of_links(catalogue, [{"model": V100, "count": 2}], [{"model": T4, "count": 2}])
    tasks = []
    for i in (1, 2):
        tasks.append(task(f"up{i}", 600.0, job_id=f"dag{i}", allowed_models=(V100,)))
        tasks.append(
            task(f"down{i}", 600.0, job_id=f"dag{i}", allowed_models=(T4,), dependencies=(Dependency(f"up{i}", 10.0),))
        )
    latency_s = (1 + 1.5 + 10 + 1.5) * 1e-6  # nvlink, infiniband, ethernet, pcie
    alone = latency_s + 80.0 / 25.0  # the 25 Gbit/s ethernet uplink of host b limits
    off = by_id(simulate(catalogue, inventory, tasks, config=EXACT))
    assert [off[f"down{i}"].transfer_s for i in (1, 2)] == pytest.approx([alone, alone])
    on = by_id(simulate(catalogue, inventory, tasks, config=hidden(link_sharing=True)))
    assert on["up1"].finish_s == on["up2"].finish_s  # both transfers start together
    # The first gets the links to itself; the second half of the ethernet uplink, still its bottleneck.
    assert sorted(on[f"down{i}"].transfer_s for i in (1, 2)) == pytest.approx([alone, latency_s + 80.0 / 12.5])


def test_spread_gangs_crossing_one_uplink_share_it(catalogue: Catalogue) -> None:
    # Host a holds a V100 and a P100; b a V100; c a P100: each gang must spread, both over a's uplink.
    uplink = {"kind": "ethernet", "bandwidth_gbps": 100, "latency_us": 5}
    hosts = [
        {"id": h, "rack": "rack", "cpu_cores": 8, "memory_gb": 64, "uplink": uplink, "devices": devices}
        for h, devices in (
            ("a", [{"model": V100, "count": 1}, {"model": P100, "count": 1}]),
            ("b", [{"model": V100, "count": 1}]),
            ("c", [{"model": P100, "count": 1}]),
        )
    ]
    inventory = inventory_from_document(
        {"format": "hlb-inventory/1", "switches": [{"id": "rack"}], "hosts": hosts}, catalogue
    )
    gangs = [
        task("g-v100", 7200.0, num_devices=2, allowed_models=(V100,)),
        task("g-p100", 7200.0, num_devices=2, allowed_models=(P100,)),
    ]
    alone = {
        g.id: catalogue.runtime_s(7200.0, CLASS, m, 2, consolidated=False)
        for g, m in zip(gangs, (V100, P100), strict=True)
    }
    off = by_id(simulate(catalogue, inventory, gangs, config=EXACT))
    assert {k: run_s(off[k]) for k in alone} == pytest.approx(alone)
    on = by_id(simulate(catalogue, inventory, gangs, config=hidden(link_sharing=True)))
    assert {on[k].start_s for k in alone} == {0.0}
    execution = ExecutionModel(catalogue)
    steps = execution.steps(gangs[0])
    rates = {}
    for gang, model in zip(gangs, (V100, P100), strict=True):
        network_s = execution.network_s_per_step(gang, [model])
        assert network_s == pytest.approx(
            1 / execution.gang_rate(gang, model, False) - 1 / execution.gang_rate(gang, model, True)
        )
        rates[gang.id] = (
            execution.gang_rate(gang, model, False),
            shared_uplink_rate(execution.gang_rate(gang, model, False), network_s, 2),
        )
    # Both run at the shared rate until the first ends; the other then has the uplink to itself.
    first = min(rates, key=lambda k: steps / rates[k][1])
    second = next(k for k in rates if k != first)
    t1 = steps / rates[first][1]
    assert on[first].finish_s == pytest.approx(t1)
    assert on[second].finish_s == pytest.approx(t1 + (steps - rates[second][1] * t1) / rates[second][0])
    assert on[first].finish_s > alone[first]


# -- hlb eval ----------------------------------------------------------------------------------


def eval_flags(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


def test_hlb_eval_hides_the_truth_by_default_and_each_flag_sets_its_own_part() -> None:
    assert _hidden(eval_flags()) == (HIDDEN_DEFAULTS, 1)  # the truth hidden, devices exclusive
    assert _hidden(eval_flags("--no-hidden")) == (HiddenConfig(), 1)
    assert _hidden(eval_flags("--hidden")) == (HIDDEN_DEFAULTS, 1)
    assert _hidden(eval_flags("--hidden", "--share-devices", str(SHARED_DEVICE_TASKS))) == (
        HIDDEN_DEFAULTS,
        SHARED_DEVICE_TASKS,
    )
    config, share = _hidden(
        eval_flags("--hidden", "--job-speed-sigma", "0", "--no-link-sharing", "--share-devices", "1")
    )
    assert (config.job_speed_sigma, config.link_sharing, share) == (0.0, False, 1)
    assert config.slow_device_share == HIDDEN_DEFAULTS.slow_device_share
    config, share = _hidden(eval_flags("--no-hidden", "--throttle-every-h", "6", "--slow-devices", "0.1"))
    assert (config.throttle_every_s, config.slow_device_share, config.job_speed_sigma, share) == (21600.0, 0.1, 0.0, 1)
    assert math.isinf(_hidden(eval_flags("--hidden", "--throttle-every-h", "inf"))[0].throttle_every_s)
    with pytest.raises(ValueError, match="slow_device_share"):
        _hidden(eval_flags("--slow-devices", "2"))
    assert _hidden(eval_flags("--slow-devices", "0.1"))[0].job_speed_sigma == HIDDEN_DEFAULTS.job_speed_sigma


def test_a_fork_draws_the_same_throttling_as_its_parent_and_leaves_the_parent_as_it_was(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:24", catalogue)
    tasks = build_workload("gavel", 5, 40, catalogue, inventory, 1.2)
    config = SimConfig(hidden=replace(HIDDEN_DEFAULTS, throttle_every_s=4 * 3600.0))
    alone = Simulation(catalogue, inventory, tasks, "hetero-greedy", 5, config).run()
    sim = Simulation(catalogue, inventory, tasks, "hetero-greedy", 5, config)
    sim.run_until(3 * 3600.0)
    fork = sim.fork()
    grandchild = fork.fork()
    from_fork = fork.run()  # draws first on every stream the parent has not drawn from since
    from_grandchild = grandchild.run()
    from_parent = sim.run()
    assert len(alone.timeline.t_s) > 10
    for result in (from_fork, from_grandchild, from_parent):
        assert result.end_s == alone.end_s
        assert result.energy_j == pytest.approx(alone.energy_j, rel=1e-9)
        assert [(t.task_id, t.finish_s, t.device_ids) for t in result.tasks] == [
            (t.task_id, t.finish_s, t.device_ids) for t in alone.tasks
        ]
    assert sim.hidden.episodes == fork.hidden.episodes == grandchild.hidden.episodes
    assert len(sim.hidden.episodes) > 20
