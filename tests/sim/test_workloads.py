"""Workload generators: deterministic for a seed, and drawing what their docstrings say."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from hlb.sim.catalogue import Catalogue, load_catalogue
from hlb.sim.traces import check_dependencies
from hlb.sim.workloads import (
    PHILLY_SAMPLE_PATH,
    Dependency,
    Task,
    gavel_jobs,
    gavel_mean_device_seconds,
    inference_pipelines,
    inference_services,
    load_philly_table,
    merge_workloads,
    philly_jobs,
    shared_philly_csv,
    training_pipelines,
)
from hlb.v1 import events_pb2

V100 = "V100-SXM2-16GB"


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    return load_catalogue()


Generator = Callable[[int, Catalogue], list[Task]]
GENERATORS: dict[str, Generator] = {
    "gavel": lambda seed, c: gavel_jobs(seed, 200, c, load=0.8, capacity_devices=64),
    "philly-replay": lambda seed, c: philly_jobs(seed, 200, c, load_philly_table()),
    "philly-load": lambda seed, c: philly_jobs(seed, 200, c, load_philly_table(), load=0.9, capacity_devices=64),
    "training-pipelines": lambda seed, c: training_pipelines(seed, 50, c),
    "inference-pipelines": lambda seed, c: inference_pipelines(seed, 50, c),
    "inference-services": lambda seed, c: inference_services(seed, 50, c),
}


@pytest.mark.parametrize("name", GENERATORS)
def test_a_generator_gives_the_same_tasks_for_the_same_seed(catalogue: Catalogue, name: str) -> None:
    generate = GENERATORS[name]
    first = generate(7, catalogue)
    assert first == generate(7, catalogue)
    assert first != generate(8, catalogue)
    assert first == generate(np.random.default_rng(7), catalogue)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", GENERATORS)
def test_generated_tasks_arrive_in_order_and_form_valid_dags(catalogue: Catalogue, name: str) -> None:
    tasks = GENERATORS[name](3, catalogue)
    arrivals = [t.arrival_s for t in tasks]
    assert arrivals == sorted(arrivals)
    check_dependencies(tasks)
    for task in tasks:
        assert task.workload_class in catalogue.classes
        assert task.num_devices in catalogue.classes[task.workload_class].gang_sizes
        assert task.work_ref_s > 0


def test_gavel_arrivals_match_the_target_load(catalogue: Catalogue) -> None:
    load, devices, count = 0.7, 128, 20_000
    tasks = gavel_jobs(11, count, catalogue, load=load, capacity_devices=devices)
    expected_rate = load * devices / gavel_mean_device_seconds()
    observed_rate = count / tasks[-1].arrival_s
    assert observed_rate == pytest.approx(expected_rate, rel=0.03)
    device_seconds = sum(float(t.labels["gang_runtime_v100_s"]) * t.num_devices for t in tasks)
    assert device_seconds / tasks[-1].arrival_s / devices == pytest.approx(load, rel=0.1)


def test_gavel_draws_gangs_and_durations_as_gavel_does(catalogue: Catalogue) -> None:
    tasks = gavel_jobs(5, 20_000, catalogue, load=1.0, capacity_devices=100)
    gangs = Counter(t.num_devices for t in tasks)
    for gang, share in {1: 0.7, 2: 0.1, 4: 0.15, 8: 0.05}.items():
        assert gangs[gang] / len(tasks) == pytest.approx(share, abs=0.01)
    durations = np.array([float(t.labels["gang_runtime_v100_s"]) for t in tasks])
    assert durations.min() >= 60 * 10**1.5
    assert durations.max() <= 60 * 10**4
    assert np.mean(durations > 60 * 10**3) == pytest.approx(0.2, abs=0.01)
    assert all(t.num_devices == 1 or catalogue.classes[t.workload_class].gang_sizes == (1, 2, 4, 8) for t in tasks)
    assert len({t.workload_class for t in tasks}) == 26


def test_single_gpu_gavel_jobs_have_gang_one(catalogue: Catalogue) -> None:
    tasks = gavel_jobs(5, 500, catalogue, load=1.0, capacity_devices=10, multi_gpu=False)
    assert {t.num_devices for t in tasks} == {1}


def test_gavel_work_is_the_gang_runtime_in_one_v100_seconds(catalogue: Catalogue) -> None:
    gang_jobs = [t for t in gavel_jobs(2, 300, catalogue, load=1.0, capacity_devices=10) if t.num_devices > 1]
    assert gang_jobs
    for task in gang_jobs:
        runtime = catalogue.runtime_s(task.work_ref_s, task.workload_class, V100, task.num_devices)
        assert runtime == pytest.approx(float(task.labels["gang_runtime_v100_s"]))


def test_gavel_rejects_a_non_positive_load(catalogue: Catalogue) -> None:
    with pytest.raises(ValueError, match="load"):
        gavel_jobs(0, 10, catalogue, load=0.0, capacity_devices=10)


def test_philly_replay_keeps_recorded_sizes_and_spacing(catalogue: Catalogue) -> None:
    table = load_philly_table()
    tasks = philly_jobs(4, 300, catalogue, table)
    assert tasks[0].arrival_s == 0.0
    rows = [int(t.labels["philly_row"]) for t in tasks]
    for task, row in zip(tasks, rows, strict=True):
        assert task.num_devices == table.num_gpus[row]
        assert table.duration_s[row] >= 60
        assert task.arrival_s == pytest.approx(table.submit_s[row] - table.submit_s[rows[0]])
        runtime = catalogue.runtime_s(task.work_ref_s, task.workload_class, V100, task.num_devices)
        assert runtime == pytest.approx(table.duration_s[row])


def test_philly_at_a_target_load_arrives_at_the_matching_rate(catalogue: Catalogue) -> None:
    table = load_philly_table()
    tasks = philly_jobs(9, 20_000, catalogue, table, load=0.5, capacity_devices=256)
    rows = np.array([int(t.labels["philly_row"]) for t in tasks])
    device_seconds = float(np.sum(table.duration_s[rows] * table.num_gpus[rows]))
    # Philly's durations are heavy-tailed (up to 54 days), so the sampled load is noisy.
    assert device_seconds / tasks[-1].arrival_s / 256 == pytest.approx(0.5, rel=0.25)


def test_the_shipped_philly_sample_is_every_fortieth_row_of_the_shared_file() -> None:
    full = shared_philly_csv()
    if not full.is_file():
        pytest.skip(f"public data not found at {full} (set HLB_SHARED_DATA)")
    lines = full.read_text().splitlines(keepends=True)
    assert PHILLY_SAMPLE_PATH.read_text() == "".join(lines[:1] + lines[1::40])
    assert len(load_philly_table(full).duration_s) == 82_247


def test_training_pipelines_chain_prep_train_eval_with_transfers(catalogue: Catalogue) -> None:
    tasks = training_pipelines(1, 10, catalogue)
    assert len(tasks) == 30
    prep, train, evaluate = tasks[0:3]
    assert (prep.kind, train.kind, evaluate.kind) == ("batch_stage", "training", "batch_stage")
    assert prep.dependencies == ()
    assert [d.task_id for d in train.dependencies] == [prep.id]
    assert [d.task_id for d in evaluate.dependencies] == [train.id]
    assert 1.0 <= train.dependencies[0].transfer_gb <= 100.0
    assert 0.1 <= evaluate.dependencies[0].transfer_gb <= 10.0
    assert 0.05 * train.work_ref_s <= prep.work_ref_s <= 0.2 * train.work_ref_s
    assert len({t.job_id for t in tasks}) == 10


def test_inference_pipelines_fork_and_join(catalogue: Catalogue) -> None:
    tasks = inference_pipelines(1, 3, catalogue)
    job = [t for t in tasks if t.job_id == tasks[0].job_id]
    by_stage = {t.id.rsplit("/", 1)[1]: t for t in job}
    assert set(by_stage) == {"detect", "embed", "caption", "rank"}
    assert {d.task_id for d in by_stage["rank"].dependencies} == {by_stage["embed"].id, by_stage["caption"].id}
    assert all(t.kind == "inference" for t in tasks)


def test_inference_services_have_slos_above_their_request_work(catalogue: Catalogue) -> None:
    for task in inference_services(6, 100, catalogue):
        request_ms = float(task.labels["request_work_ref_ms"])
        assert task.kind == "inference"
        assert task.latency_slo_ms / request_ms in (pytest.approx(2.0), pytest.approx(3.0), pytest.approx(5.0))
        busy = task.work_ref_s / float(task.labels["duration_s"])
        assert 0.2 <= busy <= 0.7


def test_a_task_converts_to_a_task_spec() -> None:
    task = Task(
        id="j/t",
        job_id="j",
        arrival_s=1.5,
        kind="inference",
        workload_class="resnet50-bs16",
        num_devices=2,
        memory_per_device_gb=3.5,
        work_ref_s=90.0,
        priority=3,
        latency_slo_ms=50.0,
        deadline_s=60.0,
        dependencies=(Dependency("j/a", 0.25),),
        allowed_kinds=("gpu", "asic"),
        allowed_models=("T4",),
        labels={"team": "search"},
    )
    spec = task.to_task_spec(epoch_ms=1_000_000)
    assert spec.kind == events_pb2.TASK_KIND_INFERENCE
    assert (spec.num_devices, spec.memory_per_device_gb, spec.work_ref_s) == (2, 3.5, 90.0)
    assert spec.submit_time_ms == 1_001_500
    assert spec.deadline_ms == 1_060_000
    assert spec.latency_slo_ms == 50.0
    assert [(d.task_id, d.transfer_gb) for d in spec.dependencies] == [("j/a", 0.25)]
    assert list(spec.allowed_kinds) == [events_pb2.DEVICE_KIND_GPU, events_pb2.DEVICE_KIND_ASIC]
    assert dict(spec.labels) == {"team": "search"}


def test_no_deadline_is_zero_in_the_spec(catalogue: Catalogue) -> None:
    spec = gavel_jobs(0, 1, catalogue, load=1.0, capacity_devices=1)[0].to_task_spec()
    assert spec.deadline_ms == 0
    assert spec.workload_class in catalogue.classes


@pytest.mark.parametrize(
    "change",
    [{"kind": "fine-tuning"}, {"num_devices": 0}, {"work_ref_s": -1.0}, {"allowed_kinds": ("quantum",)}],
)
def test_an_invalid_task_is_refused(change: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "id": "t",
        "job_id": "j",
        "arrival_s": 0.0,
        "kind": "training",
        "workload_class": "a3c",
        "num_devices": 1,
        "memory_per_device_gb": 1.0,
        "work_ref_s": 10.0,
    }
    with pytest.raises(ValueError, match="task 't'"):
        Task(**(fields | change))  # type: ignore[arg-type]


def test_merged_workloads_are_ordered_and_refuse_colliding_ids(catalogue: Catalogue) -> None:
    gavel = gavel_jobs(1, 50, catalogue, load=1.0, capacity_devices=8)
    services = inference_services(1, 10, catalogue)
    merged = merge_workloads(gavel, services)
    assert len(merged) == 60
    assert [t.arrival_s for t in merged] == sorted(t.arrival_s for t in merged)
    with pytest.raises(ValueError, match="collide"):
        merge_workloads(gavel, gavel)
