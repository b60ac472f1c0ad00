"""The daemon's device profiles: the opt-in exact ones are the simulator's measured truth (what
``oracle-speeds`` is told, an upper bound), every kind degrades gracefully."""

from __future__ import annotations

import math

import pytest

from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.profiles import DEFAULT_PROFILES_PATH, DeviceProfiles, default_profiles, profiles_of
from hlb.sim.catalogue import load_catalogue, profiles_document, render_document
from hlb.v1 import events_pb2 as ev

V100, A100, K80, FPGA = "V100-SXM2-16GB", "A100-SXM4-80GB", "K80-GK210", "Alveo-U280"


def test_the_exact_profiles_are_what_the_catalogue_generates() -> None:
    """``scheduler.profiles: exact`` is opt-in (nameplate is the default): it tells a scheduler the
    simulator's own truth, which is what the ``oracle-speeds`` upper bound needs it to be."""
    expected = render_document(profiles_document(load_catalogue()))
    assert DEFAULT_PROFILES_PATH.read_text() == expected, "run: python -m hlb.sim.catalogue profiles"


def test_speedups_match_the_catalogue_run_times() -> None:
    catalogue = load_catalogue()
    profiles = default_profiles()
    for model in (V100, A100, K80):
        for class_id in ("resnet50-bs64", "lm-bs20", "transformer-bs128"):
            for gang, consolidated in ((1, True), (4, True), (4, False)):
                runtime = catalogue.runtime_s(100.0, class_id, model, gang, consolidated)
                if math.isinf(runtime):  # not measured spread: the daemon uses the consolidated figure
                    runtime = catalogue.runtime_s(100.0, class_id, model, gang, True)
                speedup = profiles.gang_speedup(model, class_id, gang, consolidated)
                assert 100.0 / speedup == pytest.approx(runtime, rel=1e-5)


def test_reference_is_one_and_faster_devices_are_faster() -> None:
    profiles = default_profiles()
    assert profiles.gang_speedup(V100, "resnet50-bs64") == pytest.approx(1.0)
    assert profiles.gang_speedup(A100, "resnet50-bs64") > 1.0 > profiles.gang_speedup(K80, "resnet50-bs64")


def test_family_and_unknown_classes_and_gangs_fall_back() -> None:
    profiles = default_profiles()
    family = [profiles.gang_speedup(K80, f"resnet50-bs{b}") for b in (16, 32, 64, 128)]
    assert profiles.gang_speedup(K80, "resnet50") == pytest.approx(sum(family) / 4)
    assert profiles.gang_speedup(K80, "resnet50-bs48") == pytest.approx(sum(family) / 4)
    assert profiles.gang_speedup(K80, "no-such-class") > 0.0
    # Gang 16 is not in the table: twice gang 8 (linear from the nearest smaller size).
    assert profiles.gang_speedup(A100, "resnet50-bs64", 16) == pytest.approx(
        2 * profiles.gang_speedup(A100, "resnet50-bs64", 8)
    )


def test_unlisted_model_runs_at_its_peak_ratio_and_kind_mismatch_is_never() -> None:
    profiles = default_profiles()
    assert profiles.gang_speedup("X-1000", "resnet50", 2, peak_tflops=250.0) == pytest.approx(4.0)
    assert profiles.gang_speedup(FPGA, "resnet50", task_kind=ev.TASK_KIND_TRAINING) == 0.0
    assert profiles.gang_speedup(FPGA, "resnet50", task_kind=ev.TASK_KIND_INFERENCE) > 0.0


def test_row_run_times_over_a_graph() -> None:
    graph = InfraGraph()
    for i, (model, peak) in enumerate(((V100, 125.0), (A100, 312.0), ("X-1000", 62.5))):
        device = ev.Device(
            id=f"d{i}", host_id="h", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=80, peak_tflops=peak
        )
        graph.apply_telemetry(ev.TelemetryEvent(device_upsert=device))
    rows = graph.device_rows(["d0", "d1", "d2"])
    spec = ev.TaskSpec(id="t", workload_class="resnet50-bs64", work_ref_s=100.0)
    runtime = default_profiles().runtime_s(graph, rows, spec)
    assert runtime[0] == pytest.approx(100.0)
    assert runtime[1] < 100.0 < runtime[2] == pytest.approx(200.0)


def test_a_file_of_another_format_is_refused() -> None:
    with pytest.raises(ValueError, match="format"):
        DeviceProfiles({"format": "something-else"})


def test_what_a_scheduler_is_told_of_device_speeds_goes_from_exact_to_nameplate() -> None:
    exact, coarse, nameplate = (profiles_of(kind) for kind in ("exact", "coarse", "nameplate"))
    assert exact.gang_speedup("K80-GK210", "resnet50") != exact.gang_speedup("K80-GK210", "lm")  # per workload
    assert coarse.gang_speedup("K80-GK210", "resnet50") == coarse.gang_speedup("K80-GK210", "lm")  # one per model
    p100 = nameplate.models["P100-PCIE-16GB"]
    assert nameplate.gang_speedup("P100-PCIE-16GB", "resnet50", 4) == pytest.approx(
        4 * p100.peak_tflops / nameplate.reference_peak_tflops
    )
    # An inference-only device stays one that cannot train, whatever the scheduler is told.
    for told in (coarse, nameplate):
        assert told.gang_speedup("Alveo-U280", "resnet50", task_kind=ev.TASK_KIND_TRAINING) == 0.0
    with pytest.raises(ValueError, match="unknown profiles"):
        profiles_of("measured")


def test_a_policy_and_the_scheduler_estimate_with_the_profiles_the_policy_is_told() -> None:
    told = profiles_of("nameplate")
    policy = make_policy("rules", profiles=told)
    assert policy.estimates is told
    scheduler = Scheduler(InfraGraph(), policy, PlacementLedger(), "c", clock=lambda: 1.0)
    assert scheduler.device_waits.runtimes.profiles is told
    scheduler.policy = make_policy("rules")
    assert scheduler.device_waits.runtimes.profiles is default_profiles()  # a new policy's, on a reload
