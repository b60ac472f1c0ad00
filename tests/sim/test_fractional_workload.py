"""The fractional workload family and the shared cluster of ``hlb eval`` (docs/simulator.md,
"Shared and fractional devices")."""

from __future__ import annotations

import numpy as np
import pytest

from hlb.sim.catalogue import Catalogue
from hlb.sim.hidden import HiddenConfig
from hlb.sim.metrics import compute_metrics, share_metrics
from hlb.sim.report import FGD_DIFFERENCES, against_fgd_markdown
from hlb.sim.result import ShareTimeline, SimResult, TaskRecord, Timeline
from hlb.sim.scenarios import MIG_LAYOUT, build_cluster, build_workload, v100_equivalents
from hlb.sim.simulator import SimConfig, simulate
from hlb.sim.workloads import FRACTIONAL_SHARE, FRACTIONAL_SHARE_COUNTS, WHOLE_GPU_COUNTS, fractional_jobs
from tests.sim.builders import CLASS, EXACT, V100, task

A100 = "A100-SXM4-80GB"


def test_the_shared_cluster_shares_every_device_but_a100s_which_it_cuts_into_partitions(catalogue: Catalogue) -> None:
    plain = build_cluster("mixed:64", catalogue)
    shared = build_cluster("shared:64", catalogue)
    whole = [d for d in shared.devices if not d.parent_id]
    assert [d.id for d in whole] == [d.id for d in plain.devices]
    a100 = [d for d in whole if d.model == "A100-SXM4-80GB"]
    assert a100
    assert all(not d.sharing for d in a100)
    assert all(d.sharing == "mps" for d in whole if d.model != "A100-SXM4-80GB")
    partitions = [d for d in shared.devices if d.parent_id]
    assert len(partitions) == len(a100) * len(MIG_LAYOUT)
    first = [p for p in partitions if p.parent_id == a100[0].id]
    assert [(p.partition_profile, p.compute_share_milli, p.memory_gb) for p in first] == [
        (profile, share, memory) for profile, memory, share in MIG_LAYOUT
    ]
    assert sum(p.compute_share_milli for p in first) <= 1000
    # Capacity counts each physical device once, however it is cut.
    assert v100_equivalents(catalogue, shared) == pytest.approx(v100_equivalents(catalogue, plain))


def test_the_fractional_family_draws_the_trace_shares_and_gang_sizes(catalogue: Catalogue) -> None:
    tasks = fractional_jobs(3, 4000, catalogue, load=1.0, capacity_devices=50.0)
    assert tasks == fractional_jobs(3, 4000, catalogue, load=1.0, capacity_devices=50.0)
    shares = np.array([t.device_share_milli for t in tasks])
    fractional = shares > 0
    assert fractional.mean() == pytest.approx(FRACTIONAL_SHARE, abs=0.03)
    assert set(shares[fractional]) <= set(FRACTIONAL_SHARE_COUNTS)
    # The most common share of the trace's window is the most common drawn.
    drawn = {s: int((shares == s).sum()) for s in FRACTIONAL_SHARE_COUNTS}
    assert max(drawn, key=lambda s: drawn[s]) == max(FRACTIONAL_SHARE_COUNTS, key=lambda s: FRACTIONAL_SHARE_COUNTS[s])
    assert all(t.num_devices == 1 and t.memory_per_device_gb > 0 for t in tasks if t.device_share_milli)
    assert {t.num_devices for t in tasks if not t.device_share_milli} <= set(WHOLE_GPU_COUNTS)
    services = [t for t in tasks if t.kind == "inference"]
    assert services
    assert all(t.device_share_milli and t.latency_slo_ms > 0 for t in services)


def test_fractional_requests_run_on_shares_and_partitions_of_the_shared_cluster(catalogue: Catalogue) -> None:
    inventory = build_cluster("shared:32", catalogue)
    tasks = build_workload("fractional", 1, 100, catalogue, inventory, 1.5)
    result = simulate(catalogue, inventory, tasks, "hetero-greedy", seed=1)
    records = {r.task_id: r for r in result.tasks}
    assert all(r.state == "finished" for r in records.values())
    partitions = {d.id for d in inventory.devices if d.parent_id}
    fractional = [t for t in tasks if t.device_share_milli]
    # Some shares went to partitions and some to shared devices: both paths ran.
    on_partition = [t for t in fractional if records[t.id].device_ids[0] in partitions]
    assert on_partition
    assert len(on_partition) < len(fractional)
    assert not any(records[t.id].device_ids[0] in partitions for t in tasks if not t.device_share_milli)


def test_share_metrics_average_allocation_over_arrivals_and_free_capacity_over_waits() -> None:
    records = [
        TaskRecord("a", "a", "training", "c", 1, 0.0, (), 1.0, 1.0),
        TaskRecord("b", "b", "training", "c", 1, 100.0, (), 1.0, 1.0),
    ]
    # 4 physical devices; requests wait from 50 s to 150 s, while 1 GPU is free (0.5 of it a fragment).
    shares = ShareTimeline(
        t_s=[0.0, 50.0, 150.0],
        allocated_gpus=[2.0, 3.0, 4.0],
        free_gpus=[2.0, 1.0, 0.0],
        fragmentation_gpus=[1.0, 0.5, 0.0],
        queued=[0, 2, 0],
    )
    result = SimResult("p", 0, records, 4, 200.0, 0.0, 0.0, 1.0, Timeline(), 2, 0, 0, {}, 4, shares)
    metrics = share_metrics(result)
    assert metrics["gpu_allocation"] == pytest.approx((2.0 * 50 + 3.0 * 50) / (4 * 100))
    assert metrics["unallocated_saturated"] == pytest.approx(1.0 / 4)
    assert metrics["fragmentation_saturated"] == pytest.approx(0.5 / 4)
    assert metrics["fragmentation_share"] == pytest.approx((1.0 * 50 + 0.5 * 50) / (4 * 100))
    assert metrics["saturated_time"] == pytest.approx(0.5)
    assert share_metrics(SimResult("p", 0, records, 4, 200.0, 0.0, 0.0, 1.0, Timeline(), 2, 0, 0)) == {}


def test_a_run_on_shared_devices_reports_allocation_and_fragmentation(catalogue: Catalogue) -> None:
    inventory = build_cluster("shared:32", catalogue)
    tasks = build_workload("fractional", 2, 80, catalogue, inventory, 3.0)
    metrics = compute_metrics(simulate(catalogue, inventory, tasks, "fgd", seed=2))
    assert 0 < metrics["gpu_allocation"] <= 1
    assert 0 <= metrics["fragmentation_saturated"] <= metrics["unallocated_saturated"] <= 1
    assert metrics["saturated_time"] > 0
    plain = build_cluster("mixed:16", catalogue)
    whole = build_workload("gavel", 2, 20, catalogue, plain, 1.0)
    assert "gpu_allocation" not in compute_metrics(simulate(catalogue, plain, whole, "fgd", seed=2))


def test_shares_of_one_device_interfere_as_gavel_measured_their_pair_and_partitions_do_not(
    catalogue: Catalogue,
) -> None:
    inventory = build_cluster("shared:32", catalogue)
    v100 = next(d.id for d in inventory.devices if d.model == V100 and d.sharing)
    reco = task("reco", 6000.0, workload_class="recommendation-bs512", device_share_milli=500, allowed_models=(V100,))
    resnet = task("resnet", 600.0, workload_class="resnet50-bs16", device_share_milli=500, allowed_models=(V100,))
    on = SimConfig(telemetry=EXACT.telemetry, hidden=HiddenConfig(share_interference=True))
    runs = {}
    for name, config in (("off", EXACT), ("on", on)):
        result = simulate(catalogue, inventory, [reco, resnet], "best-fit", config=config)
        runs[name] = {r.task_id: r for r in result.tasks}
        assert {r.device_ids for r in runs[name].values()} == {(v100,)}
    kept = catalogue.colocation_factors(V100, "recommendation-bs512", "resnet50-bs16", 1)
    assert max(kept) < 0.5  # a measured pair that hurts both sides
    # Each keeps 1 - 0.5 * (1 - 2 * pair) of its share's rate while the other (a 500 share) runs.
    loss_reco, loss_resnet = (0.5 * (1 - 2 * k) for k in kept)
    resnet_alone = catalogue.runtime_s(600.0, "resnet50-bs16", V100) / 0.5
    reco_alone = catalogue.runtime_s(6000.0, "recommendation-bs512", V100) / 0.5
    off, both = runs["off"], runs["on"]
    assert off["resnet"].finish_s - off["resnet"].start_s == pytest.approx(resnet_alone)
    overlap = both["resnet"].finish_s - both["resnet"].start_s
    assert overlap == pytest.approx(resnet_alone / (1 - loss_resnet))
    assert both["reco"].finish_s - both["reco"].start_s == pytest.approx(
        overlap + reco_alone - overlap * (1 - loss_reco)
    )
    # On a partition nothing interferes: MIG isolates.
    mig = [task(f"m{i}", 600.0, device_share_milli=140, allowed_models=(A100,)) for i in range(2)]
    for name, config in (("off", EXACT), ("on", on)):
        result = simulate(catalogue, inventory, mig, "best-fit", config=config)
        runs[name] = {r.task_id: r for r in result.tasks}
    assert [runs["on"][t.id].finish_s for t in mig] == [runs["off"][t.id].finish_s for t in mig]


def test_a_share_s_ideal_run_time_is_on_its_share_or_the_largest_partition_that_takes_it(
    catalogue: Catalogue,
) -> None:
    inventory = build_cluster("shared:32", catalogue)
    small = task("small", 600.0, device_share_milli=250, allowed_models=(A100,))
    big = task("big", 600.0, device_share_milli=500, allowed_models=(A100,))
    records = {r.task_id: r for r in simulate(catalogue, inventory, [small, big], config=EXACT).tasks}
    a100_s = catalogue.runtime_s(600.0, CLASS, A100)
    # A 250 share fits the 3g partition (428); no A100 partition takes 500, nor is any A100 shareable.
    assert records["small"].ideal_s == pytest.approx(a100_s / 0.428)
    assert records["small"].min_device_s == pytest.approx(a100_s)
    assert records["big"].ideal_s == float("inf")


def test_every_policy_is_compared_with_fgd_seed_by_seed_on_shared_devices() -> None:
    def run(policy: str, seed: int, unallocated: float, jct_s: float) -> dict[str, object]:
        metrics = dict.fromkeys(FGD_DIFFERENCES, 0.5) | {"unallocated_saturated": unallocated, "jct_mean_s": jct_s}
        return {"workload": "fractional", "load": 3.0, "policy": policy, "seed": seed, "metrics": metrics}

    runs = [run("fgd", s, 0.1 + s / 100, 100.0) for s in range(3)]
    runs += [run("rules", s, 0.3 + s / 100, 80.0) for s in range(3)]
    table = against_fgd_markdown(runs)
    # The same difference on every seed: +0.200 with no spread; JCT 20% lower on every seed.
    assert "| rules | 3 | +0.200 [+0.200, +0.200] |" in table
    assert "-20.0% [-20.0, -20.0]" in table
    assert against_fgd_markdown([r for r in runs if r["policy"] == "rules"]) == ""
