"""``hlb eval-packing``: requests that only arrive, the FGD paper's protocol."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hlb.cli import main
from hlb.sim.packing import STRETCH, PackingSpec, inflated, request_gpus, run_one
from hlb.sim.workloads import Dependency, Task

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _task(index: int, *, share: int = 0, gang: int = 1, labels: dict[str, str] | None = None) -> Task:
    return Task(
        id=f"t{index}",
        job_id=f"j{index}",
        arrival_s=100.0 * index,
        kind="training",
        workload_class="resnet18",
        num_devices=gang,
        memory_per_device_gb=4.0,
        work_ref_s=60.0,
        device_share_milli=share,
        labels=labels or {},
        deadline_s=5000.0,
    )


def test_inflated_takes_requests_until_they_ask_for_the_capacity_one_a_second_stretched() -> None:
    tasks = [_task(0, share=500), _task(1, gang=2), _task(2, share=250, labels={"duration_s": "10.0"}), _task(3)]
    out = inflated(tasks, capacity_gpus=3.0, upto=0.9)
    assert [t.id for t in out] == ["t0", "t1", "t2"]  # 0.5 + 2 + 0.25 reaches 2.7: the one that does is in
    out = inflated(tasks, capacity_gpus=3.0, upto=1.0)
    assert [t.id for t in out] == ["t0", "t1", "t2", "t3"]
    assert [t.arrival_s for t in out] == [1.0, 2.0, 3.0, 4.0]
    assert all(t.work_ref_s == 60.0 * STRETCH and t.deadline_s == 0.0 for t in out)
    assert out[2].labels["duration_s"] == repr(10.0 * STRETCH)
    assert [request_gpus(t) for t in out] == [0.5, 2.0, 0.25, 1.0]


def test_inflated_refuses_too_few_requests_and_dependencies() -> None:
    with pytest.raises(ValueError, match="raise --jobs"):
        inflated([_task(0, share=500)], capacity_gpus=4.0, upto=1.0)
    child = Task(
        id="c",
        job_id="j",
        arrival_s=0.0,
        kind="training",
        workload_class="resnet18",
        num_devices=1,
        memory_per_device_gb=4.0,
        work_ref_s=60.0,
        dependencies=(Dependency("t0", 1.0),),
    )
    with pytest.raises(ValueError, match="never ends"):
        inflated([_task(0), child], capacity_gpus=4.0, upto=1.0)


@pytest.mark.parametrize("policy", ["fgd", "rules"])
def test_a_run_only_fills_the_cluster_and_reads_the_curve(policy: str) -> None:
    run = run_one(PackingSpec("shared:16", "fractional", 64, 1.0, policy, 3, None, "nameplate"))
    arrived = np.asarray(run["curve"]["arrived"])
    unallocated = np.asarray(run["curve"]["unallocated"])
    assert arrived[-1] >= 1.0 > arrived[-2]  # stops once the requests ask for the GPUs
    # Nothing ends, so what is allocated never shrinks, and it never exceeds the GPUs.
    assert np.all(np.diff(unallocated) <= 1e-9)
    assert np.all(unallocated >= -1e-9)
    assert unallocated[0] < 1.0  # the first request found room
    metrics = run["metrics"]
    assert metrics["unallocated_at_1"] == pytest.approx(unallocated[-1])
    assert 0.0 <= metrics["unallocated_at_1"] <= 1.0
    assert metrics["requests"] == len(arrived)
    waiting = metrics["waiting_requests"]
    assert waiting >= 0
    assert (waiting == 0) == (metrics["waiting_gpus"] == 0)


def test_eval_packing_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "packing"
    flags = ["--cluster", "shared:16", "--jobs", "64", "--seeds", "2", "--policies", "fgd,least-loaded"]
    assert main(["eval-packing", *flags, "--workers", "1", "--out", str(out)]) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["format"] == "hlb-packing-results/1"
    assert len(document["runs"]) == 4
    assert set(document["summary"]) == {"fgd", "least-loaded"}
    markdown = (out / "results.md").read_text()
    assert "| fgd | 2 |" in markdown
    assert "Minus fgd, seed by seed" in markdown
    assert "| least-loaded | 2 |" in markdown
    assert (out / "unallocated_vs_arrived.png").read_bytes().startswith(PNG_MAGIC)
    assert "unallocated, 100% arrived" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cluster", "mixed:8"], "no shared or partitioned device"),
        (["--upto", "3"], "--upto needs"),
        (["--workload", "nope"], "unknown workload"),
        (["--workload", "pipelines", "--cluster", "shared:16"], "never ends"),
        (["--cluster", "shared:16", "--jobs", "2"], "raise --jobs"),
        (["--policies", "nope", "--cluster", "shared:16"], "nope"),
    ],
)
def test_bad_arguments_are_clear_errors(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval-packing", *flags, "--seeds", "1", "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_one_seed_has_no_interval_and_still_writes_strict_json(tmp_path: Path) -> None:
    out = tmp_path / "one"
    flags = ["--cluster", "shared:16", "--jobs", "64", "--seeds", "1", "--policies", "fgd"]
    assert main(["eval-packing", *flags, "--workers", "1", "--out", str(out)]) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["summary"]["fgd"]["unallocated_at_1"]["ci95"] is None  # nan, written as null
    assert "| fgd | 1 |" in (out / "results.md").read_text()
