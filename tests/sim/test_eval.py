"""``hlb eval`` end to end on a tiny cluster, and its statistics."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
from scipy import stats

from hlb.cli import main
from hlb.daemon.decide.framework import ObjectiveWeights, PluginPolicy
from hlb.daemon.decide.scorers import HeteroGreedy
from hlb.sim import eval as eval_command
from hlb.sim.eval import parse_weights
from hlb.sim.policies import make_sim_policy
from hlb.sim.report import confidence_interval, paired, paired_markdown

FIXTURES = Path(__file__).parent / "fixtures"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _evaluate(out: Path, *flags: str) -> dict[str, Any]:
    """``hlb eval FLAGS --out OUT``, which must succeed; its results.json."""
    assert main(["eval", *flags, "--out", str(out)]) == 0
    document: dict[str, Any] = json.loads((out / "results.json").read_text())
    return document


def test_confidence_interval_is_students_t() -> None:
    mean, half = confidence_interval([1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0)
    assert half == pytest.approx(stats.t.ppf(0.975, 2) * 1.0 / 3**0.5)
    assert confidence_interval([5.0])[0] == 5.0


def test_eval_writes_json_markdown_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    document = _evaluate(
        out, "--cluster", "mixed:8", "--workload", "gavel", "--jobs", "8", "--load", "0.5,0.9",
        "--policies", "least-loaded", "--seeds", "2", "--workers", "2",
    )  # fmt: skip
    assert document["format"] == "hlb-eval-results/1"
    assert document["cluster"]["devices"] == 8
    assert "A100-SXM4-80GB" in document["cluster"]["modelled"]
    assert len(document["runs"]) == 4
    assert {(s["load"], s["policy"], s["n"]) for s in document["summary"]} == {
        (0.5, "least-loaded", 2),
        (0.9, "least-loaded", 2),
    }
    jct = document["summary"][0]["metrics"]["jct_mean_s"]
    assert jct["mean"] > 0
    assert jct["ci95"] >= 0
    markdown = (out / "results.md").read_text()
    assert "| least-loaded | 2 |" in markdown
    assert "Modelled" in markdown
    for name in ("jct_cdf_gavel_0.5.png", "timeline_gavel_0.9.png", "jct_vs_load_gavel.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)
    assert "| least-loaded |" in capsys.readouterr().out
    # The tables again from results.json alone: the same files.
    written = {name: (out / name).read_text() for name in ("results.json", "results.md")}
    (out / "results.md").unlink()
    assert main(["eval", "--rewrite-tables", "--out", str(out)]) == 0
    assert {name: (out / name).read_text() for name in written} == written
    (out / "results.json").write_text('{"format": "something else"}')
    assert main(["eval", "--rewrite-tables", "--out", str(out)]) == 2
    assert "not an hlb eval results file" in capsys.readouterr().err


def test_eval_replays_an_inventory_and_a_trace_file(tmp_path: Path) -> None:
    out = tmp_path / "replay"
    document = _evaluate(
        out, "--inventory", str(FIXTURES / "small_inventory.json"), "--trace", str(FIXTURES / "small_trace.jsonl"),
        "--policies", "least-loaded,lookahead", "--seeds", "1", "--workers", "1",
    )  # fmt: skip
    finished = {r["policy"]: r["metrics"]["jobs_finished"] for r in document["runs"]}
    assert finished == {"least-loaded": 3, "lookahead": 3}
    cost = document["runs"][1]["metrics"]
    assert cost["lookahead_rollouts_per_decision"] >= 2
    assert cost["lookahead_ms_per_decision"] > 0
    assert "## What the lookahead cost" in (out / "results.md").read_text()
    assert (out / "jct_cdf_small_trace.png").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policies", "no-such-policy"], "unknown policy 'no-such-policy'"),
        (["--workload", "no-such-workload"], "unknown workload"),
        (["--cluster", "mixed:x"], "expected NAME:DEVICES"),
        (["--load", "0"], "loads > 0"),
        (["--refresh-rows", "0", "--policies", "gnn"], "--refresh-rows needs at least 1"),
        (["--estimate-error", "nan"], "--estimate-error needs a sigma from 0 to 5"),
        (["--estimate-bias", "0"], "--estimate-bias needs a factor from 0.01 to 100"),
        (["--estimate-bias", "inf"], "--estimate-bias needs a factor from 0.01 to 100"),
        (["--estimate-limits", "4,2"], "--estimate-limits needs positive hours in ascending order, got '4,2'"),
        (["--estimate-limits", "1,x"], "--estimate-limits needs hours separated by commas, got '1,x'"),
    ],
)
def test_bad_arguments_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["eval", "--jobs", "2", "--seeds", "1", "--out", str(tmp_path / "x"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


TRACE = str(FIXTURES / "small_trace.csv")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--trace", TRACE, "--jobs", "5"], "--jobs applies to generated workloads only"),
        (["--workload", TRACE, "--jobs", "5"], "--jobs applies to generated workloads only"),
        (["--window", "0:1"], "--window applies to trace files only"),
        (["--tasks", "0:3"], "--tasks applies to trace files only"),
        (["--load-basis", "fit", "--load", "0.5"], "--load-basis applies to trace files only"),
        (["--trace", TRACE, "--load-basis", "all"], "--load-basis defines the load --load rescales a trace to"),
        (["--trace", TRACE, "--window", "0:1", "--tasks", "0:2"], "--window and --tasks both choose"),
        (["--trace", TRACE, "--window", "2:1"], "--window needs START:END with 0 <= START < END, got '2:1'"),
        (["--trace", TRACE, "--tasks", "9:12"], "the trace has 5 tasks; the range starts at 9"),
        (["--trace", TRACE, "--load", "5"], "by the fit basis this window holds at most a load of"),
        (["--cluster", "mixed:8", "--inventory", "x.json"], "--cluster and --inventory both name the cluster"),
        (["--workload", "gavel", "--trace", TRACE], "--workload and --trace both name the workload"),
        (["--sample-seed", "3"], "--sample-seed draws the hosts of --sample-devices"),
        (["--sample-devices", "9", "--cluster", "mixed:8"], "a sample needs 1 to 8 devices"),
        (["--model", "somewhere"], "--model is for the GNN policies"),
        (["--model-no-graph", "somewhere"], "--model-no-graph is for policy gnn-no-graph"),
        (["--refresh-rows", "4"], "--refresh-rows is for the GNN policies"),
        (["--weights", "energy=1", "--policies", "random,best-fit"], "--weights: none of random, best-fit"),
        (["--lookahead-candidates", "2"], "--lookahead-candidates is for policy lookahead"),
        (["--lookahead-horizon-tasks", "2"], "--lookahead-horizon-tasks is for policy lookahead"),
        (["--policies", "lookahead", "--lookahead-candidates", "0"], "lookahead needs --lookahead-candidates >= 1"),
    ],
)
def test_an_option_that_does_not_apply_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["eval", "--seeds", "1", "--out", str(tmp_path / "x"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_rewrite_tables_refuses_the_options_of_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--rewrite-tables", "--load", "0.5", "--jobs", "3", "--out", str(tmp_path)]) == 2
    assert "--rewrite-tables runs nothing, so --load, --jobs would be ignored" in capsys.readouterr().err


def test_a_trace_window_is_replayed_at_a_load_with_its_definition_and_the_seeds_effect(tmp_path: Path) -> None:
    out = tmp_path / "replay"
    lines: list[str] = []
    args = [
        "--cluster", "mixed:16", "--sample-devices", "8", "--trace", TRACE, "--tasks", "1:5", "--load", "0.1",
        "--policies", "least-loaded", "--seeds", "2", "--workers", "1", "--no-hidden", "--longest", "1",
    ]  # fmt: skip
    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    assert eval_command.run(parser.parse_args([*args, "--out", str(out)]), progress=lines.append) == 0
    document = json.loads((out / "results.json").read_text())
    (about,) = document["replays"]
    assert about["tasks"] == 4
    assert about["part"] == "tasks 1 to 4 in arrival order"
    assert about["load_basis"] == "fit"
    assert about["load_after"]["fit"] == pytest.approx(0.1)
    assert document["cluster"]["sample"]["devices_asked"] == 8
    assert 4 <= document["cluster"]["devices"] <= 12
    assert document["seed_effect"].endswith("A seed draws only telemetry noise.")
    assert "recorded load" in lines[0]
    assert lines[1] == document["seed_effect"]
    assert len([line for line in lines if line.startswith("[")]) == 2
    metrics = document["runs"][0]["metrics"]
    assert 0 < metrics["utilization_arrivals"] <= 1
    assert metrics["energy_kwh_busy"] > 0
    markdown = (out / "results.md").read_text()
    assert "load by `fit`" in markdown
    assert "## Device time by model" in markdown
    assert "utilization, arrival window" in markdown


@pytest.mark.parametrize(
    ("name", "wait", "order", "fit", "gang_factor"),
    [
        ("gnn", True, "whole-first", True, 0.5),
        ("gnn-no-wait", False, "whole-first", True, 0.5),
        ("gnn-fifo", True, "arrival", True, 0.5),
        ("gnn-shortest-first", True, "shortest-first", True, 0.5),
        ("gnn-no-wait-fifo", False, "arrival", True, 0.5),
        ("gnn-no-fit", True, "whole-first", False, 0.5),
        ("gnn-no-gang-wait", True, "whole-first", True, 0.0),
        ("gnn-no-rules", False, "arrival", False, 0.0),
    ],
)
def test_the_gnn_variants_run_the_shipped_model_with_their_settings(
    name: str, wait: bool, order: str, fit: bool, gang_factor: float
) -> None:
    from hlb.daemon.decide.framework import PluginPolicy
    from hlb.daemon.decide.gnn.scorer import GnnScorer

    policy = make_sim_policy(name, refresh_rows=256)
    assert isinstance(policy, PluginPolicy)
    assert isinstance(policy.scorer, GnnScorer)
    assert policy.scorer.settings.refresh.min_changed_rows == 256
    assert policy.scorer.mode == "sync"
    assert (policy.queue_order.name if policy.queue_order is not None else "arrival") == order
    assert [f.name for f in policy.filters] == (["service-fit"] if fit else [])
    assert [s.name for s in policy.scores] == ["fragmentation"]
    permits = ["gang-wait"] if wait and gang_factor > 0 else []
    permits += ["service-wait"] if wait and fit else []
    permits += ["faster-device"] if wait else []
    assert [p.name for p in policy.permits] == permits
    gang = [p for p in policy.permits if p.name == "gang-wait"]
    assert all(getattr(p, "factor", None) == gang_factor for p in gang)


def test_weights_reach_the_policies_that_weigh_objectives_and_the_results(tmp_path: Path) -> None:
    from hlb.daemon.decide.presets import gnn_scorer

    weights = parse_weights("completion_time=1, energy=2.5")
    assert weights == ObjectiveWeights(completion_time=1.0, utilization=0.0, energy=2.5)
    assert parse_weights("energy=1") == ObjectiveWeights(completion_time=0.0, energy=1.0)  # unnamed: 0
    greedy = make_sim_policy("hetero-greedy", weights=weights)
    assert isinstance(greedy, HeteroGreedy)
    assert greedy.weights == weights
    gnn = gnn_scorer(make_sim_policy("gnn-no-wait", weights=weights))
    assert gnn is not None
    assert (gnn.weights, gnn.fallback.weights) == (weights, weights)
    rules = make_sim_policy("rules-no-wait", weights=weights)
    assert isinstance(rules, PluginPolicy)
    assert isinstance(rules.scorer, HeteroGreedy)
    assert rules.scorer.weights == weights
    default = gnn_scorer(make_sim_policy("gnn"))
    assert default is not None
    assert default.weights == ObjectiveWeights()  # default: completion time alone

    out = tmp_path / "weighted"
    document = _evaluate(
        out, "--cluster", "mixed:8", "--workload", "gavel", "--jobs", "6", "--policies", "hetero-greedy",
        "--seeds", "1", "--workers", "1", "--weights", "completion_time=1,energy=2.5",
    )  # fmt: skip
    assert document["weights"] == {"completion_time": 1.0, "utilization": 0.0, "energy": 2.5}
    assert "Objective weights completion_time=1, energy=2.5" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("energy", "'energy': expected NAME=WEIGHT"),
        ("energy=x", "energy: 'x' is not a number"),
        ("energy=-1", "energy: -1 is not in [0, 1000]"),
        ("energy=nan", "energy: nan is not in [0, 1000]"),
        ("energy=1e9", "is not in [0, 1000]"),
        ("energy=1,energy=2", "energy named twice"),
        ("energy=0", "at least one weight above 0"),
        ("speed=1", "unknown objective weights ['speed']"),
    ],
)
def test_bad_weights_are_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--jobs", "2", "--seeds", "1", "--weights", value, "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _run(policy: str, seed: int, jct: float, slo: float = math.nan) -> dict[str, Any]:
    metrics = {"jct_mean_s": jct, "jct_p99_s": 10.0 * jct, "energy_kwh": 100.0, "slo_attainment": slo}
    return {"workload": "mixed", "load": 0.8, "policy": policy, "seed": seed, "metrics": metrics}


def test_paired_compares_each_gnn_variant_with_the_best_baseline_seed_by_seed() -> None:
    runs = [
        *(_run("hetero-greedy", s, jct, 0.9) for s, jct in enumerate((100.0, 200.0, 400.0))),
        *(_run("least-loaded", s, jct, 0.5) for s, jct in enumerate((150.0, 300.0, 600.0))),
        *(_run("gnn", s, jct, 1.0) for s, jct in enumerate((90.0, 160.0, 360.0))),  # -10%, -20%, -10%
        *(_run("lookahead", s, 1.0) for s in range(3)),  # the oracle is no baseline
        *(_run("gnn-no-fit", s, 100.0) for s in range(2)),  # seeds both ran only
    ]
    gnn, no_fit = paired(runs)
    assert (gnn["policy"], gnn["baseline"], gnn["n"]) == ("gnn", "hetero-greedy", 3)
    mean, half = confidence_interval([-0.1, -0.2, -0.1])
    assert gnn["change"]["jct_mean_s"] == {"mean": pytest.approx(mean), "ci95": pytest.approx(half)}
    assert gnn["change"]["jct_p99_s"]["mean"] == pytest.approx(mean)
    assert gnn["change"]["energy_kwh"] == {"mean": 0.0, "ci95": 0.0}
    assert gnn["change"]["slo_attainment"]["mean"] == pytest.approx(0.1)
    assert (no_fit["n"], no_fit["change"]["jct_mean_s"]["mean"]) == (2, pytest.approx(-0.25))
    markdown = paired_markdown([gnn, no_fit])
    assert "### mixed, load 0.8: per seed" in markdown
    interval = f"{100 * mean:+.1f}% [{100 * (mean - half):+.1f}, {100 * (mean + half):+.1f}]"
    assert f"| gnn | hetero-greedy | 3 | {interval} |" in markdown
    assert "| +0.100 [" in markdown  # SLO attainment: a difference, not a ratio
    assert "| gnn-no-fit | hetero-greedy | 2 | -25.0% [" in markdown
    assert "| n/a |" in markdown  # no SLO attainment without services
    assert paired([_run("hetero-greedy", 0, 1.0)]) == []  # no GNN: nothing to compare


def test_paired_takes_the_run_time_error_of_colocated_tasks_as_a_difference_on_shared_devices() -> None:
    def run(policy: str, seed: int, error: float, colocated: float) -> dict[str, Any]:
        metrics = _run(policy, seed, 100.0)["metrics"] | {"runtime_error": error, "runtime_error_colocated": colocated}
        return {"workload": "fractional", "load": 3.0, "policy": policy, "seed": seed, "metrics": metrics}

    runs = [
        *(run("rules-table", s, 0.4, c) for s, c in enumerate((0.5, 0.7, 0.6))),
        *(run("gnn", s, 0.3, c) for s, c in enumerate((0.3, 0.4, 0.5))),  # -0.2, -0.3, -0.1
    ]
    [against_table] = paired(runs)
    assert against_table["baseline"] == "rules-table"
    mean, half = confidence_interval([-0.2, -0.3, -0.1])
    change = against_table["change"]["runtime_error_colocated"]
    assert change == {"mean": pytest.approx(mean), "ci95": pytest.approx(half)}
    assert against_table["change"]["runtime_error"]["mean"] == pytest.approx(-0.1)
    markdown = paired_markdown([against_table])
    assert "| run-time error, co-located tasks (difference) |" in markdown
    assert f"| {mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}] |" in markdown
    # Without co-located tasks (whole devices), no column for them.
    plain = paired([r | {"metrics": r["metrics"] | {"runtime_error_colocated": math.nan}} for r in runs])
    assert "co-located" not in paired_markdown(plain)


def test_paired_measures_a_learned_policy_against_both_controls_and_the_oracle_gap() -> None:
    runs = [
        *(_run("hetero-greedy", s, jct) for s, jct in enumerate((50.0, 60.0))),  # best, but not a control
        *(_run("rules", s, jct) for s, jct in enumerate((100.0, 200.0))),
        *(_run("rules-table", s, jct) for s, jct in enumerate((95.0, 190.0))),
        *(_run("oracle-speeds", s, jct) for s, jct in enumerate((80.0, 160.0))),
        *(_run("gnn", s, jct) for s, jct in enumerate((85.0, 175.0))),
    ]
    against_rules, against_table = paired(runs)
    assert (against_rules["baseline"], against_table["baseline"]) == ("rules", "rules-table")
    assert against_rules["oracle_gap"] == pytest.approx(60.0 / 300.0)  # 1 - 240 / 300 of the mean JCTs
    assert against_rules["gap_closed"] == pytest.approx(40.0 / 60.0)  # (300 - 260) / (300 - 240)
    assert "oracle_gap" not in against_table
    markdown = paired_markdown([against_rules, against_table])
    assert "| 20.0% | 67% |" in markdown


def test_the_model_is_also_measured_against_its_ablation_without_the_graph() -> None:
    runs = [
        *(_run("rules", s, jct) for s, jct in enumerate((100.0, 200.0))),
        *(_run("gnn", s, jct) for s, jct in enumerate((80.0, 150.0))),
        *(_run("gnn-no-graph", s, jct) for s, jct in enumerate((100.0, 150.0))),
    ]
    rows = paired(runs)
    assert [(r["policy"], r["baseline"]) for r in rows] == [
        ("gnn", "rules"),
        ("gnn-no-graph", "rules"),
        ("gnn", "gnn-no-graph"),
    ]
    mean, half = confidence_interval([-0.2, 0.0])
    assert rows[-1]["change"]["jct_mean_s"] == {"mean": pytest.approx(mean), "ci95": pytest.approx(half)}
    assert "| gnn | gnn-no-graph | 2 | -10.0% [" in paired_markdown(rows)


def test_a_device_described_by_nameplate_runs_and_is_labelled_modelled(tmp_path: Path) -> None:
    link = {"kind": "pcie", "bandwidth_gbps": 256, "latency_us": 1.5}
    nameplate = {"kind": "gpu", "memory_gb": 48, "memory_bandwidth_gbs": 1000, "peak_tflops": 250, "tdp_w": 300}
    inventory = {
        "format": "hlb-inventory/1",
        "nameplates": {"Acme-X1": nameplate},
        "switches": [{"id": "rack"}],
        "hosts": [
            {"id": "h", "rack": "rack", "uplink": link, "devices": [{"model": "Acme-X1", "count": 4}]},
            {"id": "v", "rack": "rack", "uplink": link, "devices": [{"model": "V100-SXM2-16GB", "count": 4}]},
        ],
    }
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps(inventory))
    out = tmp_path / "nameplate"
    document = _evaluate(out, "--inventory", str(path), "--trace", TRACE, "--policies", "hetero-greedy", "--seeds", "1")
    assert document["cluster"]["modelled"] == ["Acme-X1"]
    assert document["cluster"]["from_nameplate"] == ["Acme-X1"]
    assert document["runs"][0]["metrics"]["time_share:Acme-X1"] > 0
    assert "Acme-X1 from the inventory's nameplate" in (out / "results.md").read_text()
