"""``hlb bench latency`` runs end to end at a tiny size and prints its figures as JSON (shape only:
speed is what the command reports, never what a test asserts)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from hlb.bench.cli import machine
from hlb.bench.latency import add_arguments, synthetic_devices
from hlb.cli import main
from hlb.daemon import config
from hlb.daemon.decide.gnn.features import PENDING_ENCODED_MAX, TASK_NEIGHBOURS_MAX
from hlb.daemon.decide.presets import PRESETS


def test_latency_prints_every_figure_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--devices", "20", "--pending", "3", "--calls", "5", "--warmup", "1", "--batch", "4", "--batches", "2"]
    assert main(["bench", "latency", *args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["benchmark"], result["devices"], result["pending"], result["calls"]) == ("latency", 20, 3, 5)
    assert result["floor"]["rpc"] == "grpc.health.v1.Health/Check"
    for name in ("floor", "place_dry_run", "place"):
        assert set(result[name]) >= {"p50_us", "p99_us", "mean_us"}
        assert 0 < result[name]["p50_us"] <= result[name]["p99_us"]
    for name in ("place_dry_run", "place"):
        assert result[name]["p99_over_floor"] > 0
    batch = result["place_batch"]
    assert (batch["batch_size"], batch["batches"], batch["placed"]) == (4, 2, 8)
    assert batch["placements_per_s"] > 0
    assert batch["placements_per_floor_rpc"] > 0
    assert result["journal"] is False
    # The queued tasks stayed queued; 5 + 1 real Place calls and 8 batch tasks were placed.
    assert result["queue_after"] == 3
    assert result["placed_total"] == 14
    assert result["targets"] == {"place_p99_over_floor_max": 2.0, "place_batch_placements_per_s_min": 20000}
    assert set(result["met"]) == {"place_p99", "place_batch"}
    assert result["machine"]["cpus"] == len(os.sched_getaffinity(0))


def _machine_in_a_child(cores: set[int], pipe: Connection) -> None:
    os.sched_setaffinity(0, cores)
    pipe.send(machine())


def test_the_machine_counts_the_cores_a_benchmark_may_use_not_the_machines() -> None:
    """``taskset -c 0`` on a larger machine: the JSON says 1 core, and how many the machine has."""
    first = min(os.sched_getaffinity(0))
    here, there = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_machine_in_a_child, args=({first}, there))
    child.start()
    facts = here.recv()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert facts["cpus"] == 1
    assert facts["cpus_online"] == os.cpu_count()
    assert facts["python"] == platform.python_version()
    assert isinstance(facts["cpu_model"], str)


@pytest.mark.parametrize("sync", ["write", "fsync"])
def test_latency_with_the_journal_answers_the_same(capsys: pytest.CaptureFixture[str], sync: str) -> None:
    args = ["--devices", "20", "--pending", "3", "--calls", "5", "--warmup", "1", "--batch", "4", "--batches", "2"]
    assert main(["bench", "latency", *args, "--journal", "--journal-sync", sync, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["journal"] is True
    assert result["journal_sync"] == sync
    assert result["place_batch"]["placed"] == 8
    assert result["placed_total"] == 14


def test_latency_prints_a_table_without_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--devices", "8", "--pending", "0", "--calls", "3", "--warmup", "0", "--batch", "2", "--batches", "1"]
    assert main(["bench", "latency", *args]) == 0
    out = capsys.readouterr().out
    assert "Health/Check (floor)" in out
    assert "PlaceBatch:" in out


def test_bad_sizes_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "latency", "--devices", "0"]) == 2
    assert "--devices must be at least 1" in capsys.readouterr().err


def test_the_synthetic_cluster_has_hosts_of_eight_in_racks_of_sixteen() -> None:
    events = synthetic_devices(300)
    devices = [e.device_upsert for e in events if e.HasField("device_upsert")]
    hosts = {e.host_upsert.id: e.host_upsert.rack_id for e in events if e.HasField("host_upsert")}
    assert len(devices) == 300
    assert len(hosts) == 38  # ceil(300 / 8)
    assert set(hosts.values()) == {"r0", "r1", "r2"}
    assert {d.host_id for d in devices} == set(hosts)


def test_latency_applies_inventory_sent_again_while_it_measures(
    capsys: pytest.CaptureFixture[str], gnn_model_dir: Path
) -> None:
    args = ["--devices", "24", "--calls", "40", "--warmup", "1", "--batch", "4", "--batches", "2"]
    args += ["--policy", "gnn", "--model", str(gnn_model_dir), "--inventory-per-s", "500"]
    assert main(["bench", "latency", *args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["inventory_per_s"] == 500
    assert result["inventory_applied"] > 0
    assert result["gnn"]["fallback_decisions"] == 0
    assert main(["bench", "latency", "--devices", "8", "--inventory-per-s", "-1"]) == 2
    assert "--inventory-per-s" in capsys.readouterr().err


def test_latency_with_the_gnn_says_which_model_decided(capsys: pytest.CaptureFixture[str], gnn_model_dir: Path) -> None:
    args = ["--devices", "24", "--pending", "2", "--calls", "5", "--warmup", "1", "--batch", "4", "--batches", "2"]
    assert main(["bench", "latency", *args, "--policy", "gnn", "--model", str(gnn_model_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["policy"] == "gnn"
    gnn = result["gnn"]
    assert (gnn["model"], gnn["model_version"], gnn["provider"]) == (
        str(gnn_model_dir),
        "untrained-seed3",
        "CPUExecutionProvider",
    )
    assert gnn["degraded"] == ""
    assert gnn["fallback_decisions"] == 0  # the GNN took every decision
    assert result["place_batch"]["placed"] == 8


def test_benchmarks_without_a_model_and_without_torch_say_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(config, "DEFAULT_MODEL_DIR", tmp_path / "no-model")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert main(["bench", "latency", "--policy", "gnn", "--devices", "8", "--calls", "1"]) == 2
    assert "needs the export extra" in capsys.readouterr().err
    assert main(["bench", "scale", "--devices", "8", "--rss-devices", "0"]) == 2
    assert "needs the export extra" in capsys.readouterr().err


def test_scale_prints_refresh_times_and_the_daemon_rss(capsys: pytest.CaptureFixture[str], gnn_model_dir: Path) -> None:
    args = ["--devices", "40", "80", "--repeats", "2", "--rss-devices", "64", "--model", str(gnn_model_dir)]
    assert main(["bench", "scale", *args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == str(gnn_model_dir)
    assert [s["devices"] for s in result["sizes"]] == [40, 80]
    for size in result["sizes"]:
        # Two separate timings (a refresh, then the inputs alone): no order between them is
        # assumed, a busy machine can stretch either.
        assert 0 < size["refresh_ms"]["p50"] <= size["refresh_ms"]["max"]
        assert size["of_which_inputs_ms"]["p50"] > 0
        assert size["tasks"] == size["devices"] // 5
    rss = result["daemon_rss"]
    assert rss["devices"] == 64
    assert 0 < rss["after_imports_mb"] < rss["rss_mb"] <= rss["peak_rss_mb"]
    assert result["met"] == {}  # the target is for 100,000 devices


def test_scale_with_a_long_queue_or_a_crowded_device_reads_bounded_inputs(
    capsys: pytest.CaptureFixture[str], gnn_model_dir: Path
) -> None:
    args = ["--devices", "40", "--pending", "0", "3000", "--repeats", "1", "--rss-devices", "0"]
    assert main(["bench", "scale", *args, "--model", str(gnn_model_dir), "--json"]) == 0
    empty, long = json.loads(capsys.readouterr().out)["sizes"]
    assert (empty["pending"], long["pending"]) == (0, 3000)
    assert empty["encoded_tasks"] == empty["tasks"] == 8  # a fifth of the devices run a task
    assert long["tasks"] == 3008
    assert long["encoded_tasks"] == 8 + PENDING_ENCODED_MAX
    assert long["inputs_mb"] > empty["inputs_mb"]
    assert main(["bench", "scale", "--devices", "40", "--pending", "-1", "--rss-devices", "0"]) == 2
    assert "--pending" in capsys.readouterr().err
    args = ["--devices", "40", "--one-device-tasks", "100", "--repeats", "1", "--rss-devices", "0"]
    assert main(["bench", "scale", *args, "--model", str(gnn_model_dir), "--json"]) == 0
    (crowded,) = json.loads(capsys.readouterr().out)["sizes"]
    assert crowded["tasks"] == crowded["encoded_tasks"] == 108
    assert crowded["widest_list"] == TASK_NEIGHBOURS_MAX


def test_an_unknown_policy_is_refused_naming_every_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "latency", "--policy", "nope"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"argument --policy: unknown policy 'nope': expected one of {', '.join(PRESETS)}")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert [parser.parse_args(["--policy", name]).policy for name in PRESETS] == list(PRESETS)


def test_queue_prints_each_length_against_the_empty_queue(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--devices", "16", "--pending", "300", "--ops", "5", "--batch", "4"]
    assert main(["bench", "queue", *args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [row["pending"] for row in result["rows"]] == [0, 300]
    empty, long = result["rows"]
    assert empty["ratio_to_empty"]["place_p99_ms"] == 1.0
    assert long["kb_per_queued_task"] >= 0  # memory freed earlier in the process may take them all
    assert all(long[name] > 0 for name in ("place_p99_ms", "place_batch_ms", "submit_mean_ms", "release_pass_ms"))
    assert long["inventory_changed_ms"] > 0
    assert long["inventory_resent_ms"] > 0
    assert long["inventory_speed_changed_ms"] > 0


def test_queue_times_a_start_from_a_snapshot_of_each_queue(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--devices", "16", "--pending", "300", "--ops", "5", "--batch", "4", "--restart"]
    assert main(["bench", "queue", *args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]  # JSON alone: the restore logs no warning
    long = rows[1]
    assert long["restart"]["snapshot_mb"] > rows[0]["restart"]["snapshot_mb"]  # 300 queued tasks more
    assert all(long["restart"][name] >= 0 for name in ("restore_s", "install_s", "first_pass_s"))
    assert long["snapshot_capture_ms"] > 0
