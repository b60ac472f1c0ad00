"""The device catalogue carries Gavel's measurements unchanged and labels everything else modelled."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

from hlb.sim.catalogue import (
    DEFAULT_CATALOGUE_PATH,
    NAMEPLATE_FIELDS,
    Catalogue,
    load_catalogue,
    render_document,
    shared_data_dir,
)
from hlb.sim.catalogue_sources import (
    GAVEL_WORKER_MODELS,
    MODELLED_SPECS,
    REFERENCE_MODEL,
    build_document,
    modelled_speedup,
    workload_class_id,
)

V100 = "V100-SXM2-16GB"
P100 = "P100-PCIE-16GB"
K80 = "K80-GK210"


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    return load_catalogue()


@pytest.fixture(scope="module")
def shared() -> Path:
    path = shared_data_dir()
    if not (path / "gavel" / "simulation_throughputs.json").is_file():
        pytest.skip(f"public data not found at {path} (set HLB_SHARED_DATA)")
    return path


# Figures copied by hand from gavel/simulation_throughputs.json (steps/s).
@pytest.mark.parametrize(
    ("model", "class_id", "gang", "consolidated", "steps_per_s"),
    [
        (V100, "resnet50-bs64", 1, True, 4.394774823323071),
        (P100, "resnet50-bs64", 1, True, 2.6194694075770055),
        (K80, "resnet50-bs64", 1, True, 0.6190282202246573),
        (V100, "transformer-bs128", 8, True, 30.88352104398441),
        (P100, "recommendation-bs512", 1, True, 48.882390510045944),
        (K80, "cyclegan", 1, True, 0.5047705689725351),
        (V100, "lm-bs10", 2, False, 35.14049049611691),
        (P100, "resnet18-bs16", 4, True, 94.32078314001782),
        (V100, "resnet18-bs16", 4, False, 40.58866712641168),
    ],
)
def test_measured_throughputs_are_gavels_figures(
    catalogue: Catalogue, model: str, class_id: str, gang: int, consolidated: bool, steps_per_s: float
) -> None:
    assert catalogue.throughput(model, class_id, gang, consolidated) == steps_per_s


def test_a_spread_gang_of_one_is_the_isolated_figure(catalogue: Catalogue) -> None:
    assert catalogue.throughput(V100, "lm-bs10", 1, consolidated=False) == 81.65163491883021


def test_gavels_out_of_memory_zero_makes_a_class_infeasible(catalogue: Catalogue) -> None:
    assert catalogue.throughput(K80, "resnet50-bs128", 2) == 0.0
    assert math.isinf(catalogue.runtime_s(100.0, "resnet50-bs128", K80, gang_size=2))


def test_non_distributed_classes_have_no_gang_throughput(catalogue: Catalogue) -> None:
    assert catalogue.classes["a3c"].gang_sizes == (1,)
    assert catalogue.throughput(V100, "a3c", 2) == 0.0


def test_there_are_26_classes_and_19_run_distributed(catalogue: Catalogue) -> None:
    assert len(catalogue.classes) == 26
    assert sum(1 for c in catalogue.classes.values() if c.gang_sizes == (1, 2, 4, 8)) == 19


@pytest.mark.parametrize(
    ("job_type", "class_id"),
    [
        ("ResNet-50 (batch size 64)", "resnet50-bs64"),
        ("ResNet-18 (batch size 256)", "resnet18-bs256"),
        ("LM (batch size 5)", "lm-bs5"),
        ("Recommendation (batch size 8192)", "recommendation-bs8192"),
        ("CycleGAN", "cyclegan"),
        ("A3C", "a3c"),
    ],
)
def test_gavel_job_types_map_to_short_ids(job_type: str, class_id: str) -> None:
    assert workload_class_id(job_type) == class_id


def test_an_unknown_job_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown Gavel job type"):
        workload_class_id("BERT (batch size 8)")


def test_runtime_on_the_reference_is_the_work(catalogue: Catalogue) -> None:
    assert catalogue.runtime_s(3600.0, "resnet50-bs64", V100) == pytest.approx(3600.0)


def test_runtime_scales_with_measured_throughput(catalogue: Catalogue) -> None:
    expected = 3600.0 * 4.394774823323071 / 2.6194694075770055
    assert catalogue.runtime_s(3600.0, "resnet50-bs64", P100) == pytest.approx(expected)
    # Recommendation runs faster on a P100 than on a V100 in Gavel's measurements.
    assert catalogue.runtime_s(3600.0, "recommendation-bs512", P100) < 3600.0


def test_modelled_entries_are_labelled_modelled(catalogue: Catalogue) -> None:
    modelled = {m for m, p in catalogue.profiles.items() if p.modelled}
    assert modelled == set(MODELLED_SPECS)
    assert {"A100-SXM4-80GB", "H100-SXM5-80GB", "T4", "TPU-v4", "TPU-v5e"} <= modelled
    assert {catalogue.profile(m).kind for m in modelled} == {"gpu", "tpu", "asic", "fpga"}
    measured = {m for m, p in catalogue.profiles.items() if p.source == "measured"}
    assert measured == {*GAVEL_WORKER_MODELS.values(), "V100-SXM2-32GB"}


def test_the_file_labels_modelled_entries_with_their_rule_and_specs() -> None:
    document = json.loads(DEFAULT_CATALOGUE_PATH.read_text())
    for entry in document["devices"]:
        if entry["model"] in MODELLED_SPECS:
            assert entry["source"] == "modelled"
            assert entry["derived_from"] == REFERENCE_MODEL
            assert entry["spec"]["spec_source"]
            assert entry["spec"]["peak_tflops"] > 0
    assert "speedup" in document["modelling_rule"]["formula"]


def test_modelled_throughput_is_the_reference_scaled_by_the_rule(catalogue: Catalogue) -> None:
    reference_spec = {"peak_tflops": 125.0, "memory_bandwidth_gbs": 900.0}
    a100 = MODELLED_SPECS["A100-SXM4-80GB"]
    speedup = modelled_speedup(a100, reference_spec, "resnet50")
    # 1.0 * (312/125)**0.8 * (2039/900)**0.2
    assert speedup == pytest.approx((312 / 125) ** 0.8 * (2039 / 900) ** 0.2)
    for gang, consolidated in [(1, True), (4, True), (8, False)]:
        assert catalogue.throughput("A100-SXM4-80GB", "resnet50-bs64", gang, consolidated) == pytest.approx(
            catalogue.throughput(V100, "resnet50-bs64", gang, consolidated) * speedup
        )


def test_memory_bound_classes_gain_less_from_compute(catalogue: Catalogue) -> None:
    def gain(class_id: str) -> float:
        return catalogue.throughput("H100-SXM5-80GB", class_id) / catalogue.throughput(V100, class_id)

    assert gain("resnet50-bs64") > gain("recommendation-bs512") > 1.0


def test_the_fpga_serves_inference_only(catalogue: Catalogue) -> None:
    assert catalogue.profile("Alveo-U280").task_kinds == ("inference",)


def test_power_is_between_idle_and_tdp(catalogue: Catalogue) -> None:
    for profile in catalogue.profiles.values():
        assert 0 < profile.idle_power_w < profile.peak_power_w
    # The A100's idle power is Acme Seren's 5th percentile.
    assert catalogue.profile("A100-SXM4-80GB").idle_power_w == 61.8
    assert catalogue.profile(V100).peak_power_w == 300.0


def test_colocation_factors_come_from_gavels_pairs(catalogue: Catalogue) -> None:
    kept_a, kept_b = catalogue.colocation_factors(V100, "resnet50-bs64", "resnet18-bs16")
    assert kept_a == pytest.approx(4.0687113803879855 / 4.394774823323071)
    assert kept_b == pytest.approx(20.365558661109052 / 32.353384328946916)
    assert catalogue.colocation_factors(V100, "resnet18-bs16", "resnet50-bs64") == pytest.approx((kept_b, kept_a))


def test_modelled_devices_borrow_the_references_colocation(catalogue: Catalogue) -> None:
    assert catalogue.colocation_factors("TPU-v4", "resnet50-bs64", "resnet18-bs16") == catalogue.colocation_factors(
        V100, "resnet50-bs64", "resnet18-bs16"
    )


def test_unknown_model_names_the_model(catalogue: Catalogue) -> None:
    with pytest.raises(KeyError, match="MI400X"):
        catalogue.profile("MI400X")


def test_a_file_of_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"format": "something-else/9"}))
    with pytest.raises(ValueError, match="hlb-device-catalogue/1"):
        load_catalogue(path)


# ---------------------------------------------------------------- against ../shared/data


def test_rebuilding_from_shared_data_gives_the_checked_in_file(shared: Path) -> None:
    assert render_document(build_document(shared)) == DEFAULT_CATALOGUE_PATH.read_text()


def test_every_gavel_isolated_throughput_is_in_the_catalogue(shared: Path, catalogue: Catalogue) -> None:
    gavel = json.loads((shared / "gavel" / "simulation_throughputs.json").read_text())
    checked = 0
    for worker, model in GAVEL_WORKER_MODELS.items():
        for suffix, consolidated in (("", True), ("_unconsolidated", False)):
            for key, entry in gavel[worker + suffix].items():
                job_type, gang = ast.literal_eval(key)
                if gang == 1 and not consolidated:
                    continue  # gang 1 is the same either way; the catalogue keeps the consolidated one
                assert catalogue.throughput(model, workload_class_id(job_type), gang, consolidated) == entry["null"]
                checked += 1
    assert checked == 3 * 83 + 57 + 57 + 51


def test_every_gavel_colocation_pair_is_in_the_catalogue(shared: Path, catalogue: Catalogue) -> None:
    gavel = json.loads((shared / "gavel" / "simulation_throughputs.json").read_text())
    pairs = 0
    for worker, model in GAVEL_WORKER_MODELS.items():
        for key, entry in gavel[worker].items():
            job_type, gang = ast.literal_eval(key)
            for other, (tput, other_tput) in ((k, v) for k, v in entry.items() if k != "null"):
                other_type, _ = ast.literal_eval(other)
                assert catalogue.colocation[model][
                    (workload_class_id(job_type), workload_class_id(other_type), gang)
                ] == (tput, other_tput)
                pairs += 1
    assert pairs > 5000


@pytest.mark.parametrize("model", ["A10", "L4", "L40S", "H200-SXM-141GB", "MI300X"])
def test_current_parts_are_modelled_from_their_datasheets(catalogue: Catalogue, model: str) -> None:
    profile = catalogue.profile(model)
    assert profile.modelled
    assert "datasheet" in MODELLED_SPECS[model]["spec_source"] or "data sheet" in MODELLED_SPECS[model]["spec_source"]
    assert profile.peak_power_w == MODELLED_SPECS[model]["tdp_w"]
    assert catalogue.throughput(model, "resnet50-bs64") > 0


def test_a_nameplate_is_modelled_by_the_rule_the_catalogues_entries_follow(catalogue: Catalogue) -> None:
    figures = {k: MODELLED_SPECS["L40S"][k] for k in NAMEPLATE_FIELDS}
    extended = catalogue.with_nameplates({"my-L40S": figures})
    mine, listed = extended.profile("my-L40S"), catalogue.profile("L40S")
    assert mine.modelled
    assert mine.from_nameplate
    assert not listed.from_nameplate
    assert (mine.idle_power_w, mine.peak_power_w, mine.memory_gb) == (listed.idle_power_w, 350.0, 48.0)
    assert mine.throughput.keys() == listed.throughput.keys()
    for key, rate in listed.throughput.items():
        assert mine.throughput[key] == pytest.approx(rate, rel=1e-5)  # the file rounds speedups to 6 places
    assert catalogue.with_nameplates({}) is catalogue


@pytest.mark.parametrize(
    ("model", "figures", "message"),
    [
        ("L40S", {"kind": "gpu"}, "is in the catalogue"),
        ("x", {"kind": "gpu", "memory_gb": 8}, "missing ['memory_bandwidth_gbs', 'peak_tflops', 'tdp_w']"),
        ("x", {"kind": "npu", "memory_gb": 8, "memory_bandwidth_gbs": 1, "peak_tflops": 1, "tdp_w": 1}, "'npu'"),
        ("x", {"kind": "gpu", "memory_gb": 8, "memory_bandwidth_gbs": 1, "peak_tflops": 0, "tdp_w": 1}, "above 0"),
        (
            "x",
            {"kind": "gpu", "memory_gb": 8, "memory_bandwidth_gbs": 1, "peak_tflops": 1, "tdp_w": 1, "fp8": 2},
            "fp8",
        ),
    ],
)
def test_a_bad_nameplate_is_refused_with_a_reason(
    catalogue: Catalogue, model: str, figures: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        catalogue.with_nameplates({model: figures})
