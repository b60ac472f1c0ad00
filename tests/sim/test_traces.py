"""Trace files: hand-written CSV and JSON lines load, round-trip, and refuse what is broken."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlb.sim.catalogue import Catalogue, load_catalogue, shared_data_dir
from hlb.sim.traces import TraceError, read_gavel_msr_trace, read_trace, write_trace
from hlb.sim.workloads import (
    Dependency,
    Task,
    gavel_jobs,
    inference_pipelines,
    inference_services,
    merge_workloads,
    training_pipelines,
)

FIXTURES = Path(__file__).parent / "fixtures"
HEADER = "task_id,arrival_s,workload_class,work_ref_s"


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    return load_catalogue()


def test_the_hand_written_csv_trace_loads() -> None:
    tasks = read_trace(FIXTURES / "small_trace.csv")
    assert [t.id for t in tasks] == ["gang-1/train", "dag-1/prep", "dag-1/train", "dag-1/eval", "svc-1/serve"]
    gang, prep, train, evaluate, service = tasks
    assert (gang.num_devices, gang.work_ref_s, gang.allowed_kinds) == (4, 36000.0, ("gpu",))
    assert gang.preferred_models == ("V100-SXM2-16GB",)
    assert (prep.kind, prep.num_devices, prep.priority) == ("batch_stage", 1, 0)
    assert train.dependencies == (Dependency("dag-1/prep", 12.5),)
    assert (train.priority, train.deadline_s, train.allowed_kinds) == (2, 86400.0, ("gpu", "tpu"))
    assert train.labels == {"team": "nlp", "stage": "train"}
    assert evaluate.dependencies == (Dependency("dag-1/train", 0.75),)
    assert (service.kind, service.latency_slo_ms) == ("inference", 175.5)
    assert service.allowed_models == ("T4", "A100-SXM4-80GB")
    assert service.labels == {"request_rate_per_s": "10"}


def test_the_json_lines_trace_holds_the_same_tasks() -> None:
    assert read_trace(FIXTURES / "small_trace.jsonl") == read_trace(FIXTURES / "small_trace.csv")


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_the_hand_written_trace_round_trips(tmp_path: Path, suffix: str) -> None:
    tasks = read_trace(FIXTURES / "small_trace.csv")
    path = tmp_path / f"trace{suffix}"
    write_trace(path, tasks)
    assert read_trace(path) == tasks


@pytest.mark.parametrize("suffix", [".csv", ".ndjson"])
def test_generated_workloads_round_trip_exactly(catalogue: Catalogue, tmp_path: Path, suffix: str) -> None:
    tasks = merge_workloads(
        gavel_jobs(1, 100, catalogue, load=0.9, capacity_devices=32),
        training_pipelines(2, 10, catalogue),
        inference_pipelines(3, 10, catalogue),
        inference_services(4, 10, catalogue),
    )
    path = tmp_path / f"trace{suffix}"
    write_trace(path, tasks)
    assert read_trace(path) == tasks


def test_tasks_come_back_in_arrival_order(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(f"{HEADER}\nlate,50,a3c,1\nearly,10,a3c,1\n")
    assert [t.id for t in read_trace(path)] == ["early", "late"]


def test_defaults_fill_absent_fields(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(f"{HEADER}\nonly,0,a3c,60\n")
    (task,) = read_trace(path)
    assert (task.job_id, task.kind, task.num_devices, task.latency_slo_ms) == ("only", "training", 1, 0.0)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("unknown.csv", f"{HEADER},colour\nt,0,a3c,1,red\n", r"unknown.csv:2: unknown fields \['colour'\]"),
        ("missing.csv", "task_id,arrival_s\nt,0\n", "missing columns"),
        (
            "dangling.jsonl",
            '{"task_id":"t","arrival_s":0,"workload_class":"a3c","work_ref_s":1,'
            '"dependencies":[{"task_id":"ghost","transfer_gb":1}]}\n',
            "unknown task 'ghost'",
        ),
        ("cycle.csv", f"{HEADER},dependencies\na,0,a3c,1,b@1\nb,0,a3c,1,a@1\n", "cycle"),
        ("twice.csv", f"{HEADER}\nt,0,a3c,1\nt,1,a3c,1\n", "appears twice"),
        ("bad.jsonl", '{"task_id": "t",\n', r"bad.jsonl:1: not JSON"),
        ("kind.csv", f"{HEADER},kind\nt,0,a3c,1,fine-tuning\n", r"kind.csv:2: .*fine-tuning"),
        ("number.csv", f"{HEADER}\nt,soon,a3c,1\n", r"number.csv:2:"),
    ],
)
def test_a_broken_trace_is_refused_with_file_and_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_csv_refuses_values_it_cannot_separate(tmp_path: Path) -> None:
    task = Task("t", "j", 0.0, "training", "a3c", 1, 1.0, 10.0, labels={"note": "a;b"})
    with pytest.raises(TraceError, match="use JSON lines"):
        write_trace(tmp_path / "t.csv", [task])
    write_trace(tmp_path / "t.jsonl", [task])
    assert read_trace(tmp_path / "t.jsonl") == [task]


def test_gavel_msr_traces_convert(catalogue: Catalogue) -> None:
    folder = shared_data_dir() / "gavel" / "traces_msr_seed0"
    if not folder.is_dir():
        pytest.skip(f"public data not found at {folder} (set HLB_SHARED_DATA)")
    tasks = [t for path in sorted(folder.glob("*.trace")) for t in read_gavel_msr_trace(path, catalogue)]
    assert len(tasks) == 15_264
    assert max(int(t.labels["trace_gang"]) for t in tasks) == 64
    assert {t.num_devices for t in tasks} <= {1, 2, 4, 8}
    first = read_gavel_msr_trace(folder / "0e4a51.trace", catalogue)[0]
    # Transformer (batch size 128), 95,121 steps at the V100's 5.446 steps/s.
    assert first.workload_class == "transformer-bs128"
    assert first.work_ref_s == pytest.approx(95121 / 5.44610521981264)
