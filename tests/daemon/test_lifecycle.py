"""The model lifecycle as a specification: a bundle on the models topic is shadowed, tried in the
canary cell, then promoted or rolled back; other cells follow the verdicts and never let a
candidate decide; a bundle that does not match its manifest is refused. Driven with an in-memory
bus, a clock of the test's and a twin of the daemon's models (``Models``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from hlb.daemon.bus.seam import MemoryBus, RawEvent
from hlb.daemon.config import Settings
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.errors import BundleError
from hlb.daemon.runtime.lifecycle import DaemonModels, Finished, LifecycleMetrics, ModelLifecycle
from hlb.daemon.runtime.models import (
    ModelCatalog,
    bundle_records,
    control_record,
    decide_by_hand,
    part_key,
)
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev
from hlb.v1 import models_pb2 as mp
from tests.daemon.clock import Clock
from tests.daemon.test_gnn_policy import cluster

TOPIC = "hlb.models"
WINDOW = 6


class TwinModels:
    """The daemon's models as the lifecycle sees them: a folder's version is its card's."""

    def __init__(self, running: str = "v0") -> None:
        self.running = running
        self.candidate: str | None = None
        self.ran: list[str] = []  # every version made the running one, in order
        self.broken: set[str] = set()  # versions (and "v0", model.path's) that do not load
        self.prior = False
        self.arrived = 0  # the last Task.arrival given (Feed numbers its tasks so)
        self.live: dict[str, int] = {}  # tasks not yet ended (queued or placed): their Task.arrival

    @staticmethod
    def version_of(directory: Path | None) -> str:
        return "v0" if directory is None else str(json.loads((directory / "card.json").read_text())["version"])

    def running_version(self) -> str:
        return "" if self.prior else self.running

    def try_candidate(self, directory: Path) -> str:
        version = self.version_of(directory)
        if version in self.broken:
            raise BundleError("model_corrupt: does not load")
        self.candidate = version
        return version

    def drop_candidate(self) -> None:
        self.candidate = None

    def run(self, directory: Path | None) -> str:
        version = self.version_of(directory)
        if version in self.broken:
            raise BundleError("model_corrupt: does not load")
        self.running, self.prior = version, False
        self.ran.append(version)
        return version

    def run_prior(self, reason: str) -> None:
        self.prior = True

    def arrivals(self) -> int:
        return self.arrived

    def live_between(self, first: int, last: int) -> set[str]:
        return {task for task, arrival in self.live.items() if first < arrival <= last}


def publish_bundle(bus: MemoryBus, version: str, at_ms: int = 1, chunk: int = 7, *, skip_shadow: bool = False) -> None:
    """A bundle whose files are a few bytes each, cut in parts of ``chunk`` bytes (several per file)."""
    files = {
        "encoder.onnx": f"encoder weights of {version}".encode(),
        "scorer.onnx": f"scorer weights of {version}".encode(),
        "card.json": json.dumps({"version": version}).encode(),
    }
    records = bundle_records(version, files, {"version": version}, chunk, "the learner", at_ms, skip_shadow=skip_shadow)
    for key, value in records:
        bus.publish(TOPIC, key, value)


def make(
    tmp_path: Path, bus: MemoryBus, cell: str = "c1", canary_cell: str | None = None, models: TwinModels | None = None
) -> tuple[ModelLifecycle, TwinModels]:
    settings = Settings(
        bus="memory",
        cell=cell,
        state_dir=tmp_path / cell,
        learning={
            "auto_models": True,
            "shadow_tasks": WINDOW,
            "canary_tasks": WINDOW,
            "canary_cell": canary_cell,
            "jct_tolerance": 0.05,
        },
    )
    twin = models or TwinModels()
    return ModelLifecycle(settings, twin, bus, clock=Clock(), metrics=LifecycleMetrics()), twin


class Feed:
    """Reads the topic into a lifecycle as its thread does, and finishes tasks."""

    def __init__(self, lifecycle: ModelLifecycle, bus: MemoryBus) -> None:
        self.lifecycle, self.bus, self.read, self.serial, self.arrived = lifecycle, bus, 0, 0, 0

    def step(self) -> None:
        records = self.bus.read_all(TOPIC)
        self.lifecycle.receive(records[self.read :])
        self.read = len(records)
        self.lifecycle.step()

    def tasks(
        self,
        count: int,
        decided_by: str,
        running: float,
        candidate: float | None,
        jct_s: float = 100.0,
        arrival: int | None = None,
    ) -> None:
        """``count`` tasks finish; each arrived just before it finished unless ``arrival`` says when."""
        for _ in range(count):
            self.serial += 1
            if arrival is None:
                self.arrived += 1
            errors = {"running": running, "profiles": 0.8}
            if candidate is not None:
                errors["candidate"] = candidate
            models = self.lifecycle.models
            if isinstance(models, TwinModels):
                models.arrived = max(models.arrived, self.arrived)
            task = Finished(f"t{self.serial}", decided_by, errors, jct_s, self.arrived if arrival is None else arrival)
            self.lifecycle.finished(task)
            self.step()


def in_canary(tmp_path: Path) -> tuple[MemoryBus, ModelLifecycle, TwinModels, Feed]:
    """v0 decided a window of tasks (error 0.5, JCT 100 s), then v1 was published, shadowed for a
    window (error 0.3) and now decides as the canary."""
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus)
    feed = Feed(lifecycle, bus)
    feed.tasks(WINDOW, "v0", running=0.5, candidate=None)
    publish_bundle(bus, "v1")
    feed.step()
    feed.tasks(WINDOW, "v0", running=0.5, candidate=0.3)
    assert lifecycle.state().candidate_stage == "canary"
    return bus, lifecycle, models, feed


def verdicts(bus: MemoryBus) -> dict[str, str]:
    catalog = ModelCatalog.read(bus.read_all(TOPIC))
    return {version: catalog.verdict(version) for version in catalog.verdicts}


def steps(lifecycle: ModelLifecycle) -> list[tuple[str, str]]:
    return [(s.step, s.version) for s in lifecycle.state().steps]


def test_a_better_candidate_goes_from_shadow_to_canary_to_promoted(tmp_path: Path) -> None:
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus)
    feed = Feed(lifecycle, bus)
    feed.tasks(WINDOW, "v0", running=0.5, candidate=None, jct_s=100.0)  # the running model's record before
    publish_bundle(bus, "v1")
    feed.step()
    assert lifecycle.state().candidate_stage == "shadow"
    assert models.candidate == "v1"
    assert models.running == "v0"

    feed.tasks(WINDOW - 1, "v0", running=0.5, candidate=0.2)
    assert lifecycle.state().candidate_stage == "shadow"  # one task short of the window
    feed.tasks(1, "v0", running=0.5, candidate=0.2)
    state = lifecycle.state()
    assert (state.candidate_stage, state.running_version, state.last_good_version) == ("canary", "v1", "v0")
    assert models.ran == ["v1"]

    feed.tasks(3, "v0", running=0.9, candidate=None, arrival=feed.arrived)  # placed by v0 before the switch
    feed.tasks(WINDOW, "v1", running=0.2, candidate=None, jct_s=95.0)
    state = lifecycle.state()
    assert (state.running_version, state.running_stage, state.candidate_version) == ("v1", "promoted", "")
    assert (tmp_path / "c1" / "models" / "v1" / "card.json").is_file()
    assert verdicts(bus) == {"v1": "promoted"}
    assert [s for s, v in steps(lifecycle) if v == "v1"] == [
        "received",
        "shadow",
        "shadow_passed",
        "canary",
        "promoted",
    ]
    assert lifecycle.metrics.steps.labels(step="promoted")._value.get() == 1
    assert lifecycle.metrics.canary_jct.labels(model="candidate")._value.get() == pytest.approx(95.0)
    assert lifecycle.metrics.canary_jct.labels(model="last_good")._value.get() == pytest.approx(100.0)
    feed.step()  # its own verdict read back from the topic changes nothing
    assert models.ran == ["v1"]


def test_a_worse_candidate_is_refused_in_shadow_and_never_decides(tmp_path: Path) -> None:
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus)
    feed = Feed(lifecycle, bus)
    publish_bundle(bus, "v1")
    feed.step()
    feed.tasks(WINDOW, "v0", running=0.5, candidate=0.5)  # as good is not better
    assert models.ran == []
    assert models.candidate is None
    assert lifecycle.state().candidate_version == ""
    assert verdicts(bus) == {"v1": "refused"}
    assert not (tmp_path / "c1" / "models" / "v1").exists()
    assert steps(lifecycle)[-1][0] == "refused"
    assert "0.5000 against the running model's 0.5000" in lifecycle.state().steps[-1].reason
    feed.tasks(WINDOW, "v0", running=0.5, candidate=None)
    assert lifecycle.state().candidate_version == ""  # not tried again


def test_better_in_shadow_but_worse_in_canary_is_rolled_back_within_one_window(tmp_path: Path) -> None:
    bus, lifecycle, models, feed = in_canary(tmp_path)
    assert lifecycle.state().candidate_stage == "canary"
    feed.tasks(WINDOW - 1, "v1", running=0.9, candidate=None)
    assert lifecycle.state().candidate_stage == "canary"  # judged on the whole window only
    feed.tasks(1, "v1", running=0.9, candidate=None)
    state = lifecycle.state()
    assert (state.running_version, state.running_stage, state.candidate_version) == ("v0", "last_good", "")
    assert models.ran == ["v1", "v0"]
    assert verdicts(bus) == {"v1": "rolled_back"}
    assert "its error is higher" in next(s.reason for s in state.steps if s.step == "rolled_back")
    assert not (tmp_path / "c1" / "models" / "v1").exists()  # what may run is kept, nothing else
    feed.tasks(WINDOW, "v0", running=0.5, candidate=None)
    assert models.ran == ["v1", "v0"]  # never tried again


def test_a_bundle_that_skips_its_shadow_is_still_judged_by_its_canary(tmp_path: Path) -> None:
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus)
    feed = Feed(lifecycle, bus)
    feed.tasks(WINDOW, "v0", running=0.5, candidate=None)
    publish_bundle(bus, "v1", skip_shadow=True)
    feed.step()
    state = lifecycle.state()
    assert (state.candidate_stage, state.running_version, state.last_good_version) == ("canary", "v1", "v0")
    assert [s for s, v in steps(lifecycle) if v == "v1"] == ["received", "shadow_passed", "canary"]
    assert "shadow skipped: the learner vouched" in lifecycle.state().steps[-2].reason
    feed.tasks(WINDOW, "v1", running=0.9, candidate=None)
    assert verdicts(bus) == {"v1": "rolled_back"}
    assert (lifecycle.state().running_version, models.ran) == ("v0", ["v1", "v0"])


def test_outside_the_canary_cell_a_bundle_that_skips_its_shadow_is_shadowed(tmp_path: Path) -> None:
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus, cell="c2", canary_cell="c1")
    feed = Feed(lifecycle, bus)
    publish_bundle(bus, "v1", skip_shadow=True)
    feed.step()
    feed.tasks(3 * WINDOW, "v0", running=0.5, candidate=0.1)
    assert (lifecycle.state().running_version, lifecycle.state().candidate_stage) == ("v0", "shadow")
    assert models.ran == []


def test_a_shard_is_the_canary_only_once_it_knows_its_cell_is_the_canary_cell(tmp_path: Path) -> None:
    """A shard learns its cell from its partition's records: until then it only shadows."""
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus, cell="default", canary_cell="c1")
    shard_cell = [""]
    lifecycle.cell = lambda: shard_cell[0]
    feed = Feed(lifecycle, bus)
    publish_bundle(bus, "v1", skip_shadow=True)
    feed.step()
    assert (lifecycle.state().candidate_stage, models.ran) == ("shadow", [])
    shard_cell[0] = "c1"  # its first record named its cell
    feed.tasks(WINDOW, "v0", running=0.5, candidate=0.3)
    assert (lifecycle.state().candidate_stage, models.ran) == ("canary", ["v1"])
    feed.tasks(WINDOW, "v1", running=0.3, candidate=None)
    assert verdicts(bus) == {"v1": "promoted"}
    assert ModelCatalog.read(bus.read_all(TOPIC)).verdicts["v1"].by == "cell c1"


def test_the_last_good_models_tasks_still_running_at_the_switch_count_in_its_jct(tmp_path: Path) -> None:
    """The last tasks to finish before the switch are the last good model's short ones: its long
    ones, among the same last arrivals, still run, and some wait in its queue. Its JCT waits for
    them, as the candidate's does for its own long tasks; judged without them, a faster candidate
    looked slower."""
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus)
    feed = Feed(lifecycle, bus)
    feed.tasks(WINDOW, "v0", running=0.5, candidate=None, jct_s=100.0)
    publish_bundle(bus, "v1")
    feed.step()
    feed.tasks(WINDOW - 1, "v0", running=0.5, candidate=0.3, jct_s=100.0)
    # Three more arrivals: two that v0 placed on slow devices run on through the switch, one
    # waits in the queue and is placed by v1 after it.
    long_tasks = {f"long{k}": feed.arrived + 1 + k for k in range(3)}
    feed.arrived += 3
    models.live = dict(long_tasks)
    feed.tasks(1, "v0", running=0.5, candidate=0.3, jct_s=100.0)  # the shadow's last: the switch
    assert lifecycle.state().candidate_stage == "canary"
    feed.tasks(WINDOW, "v1", running=0.3, candidate=None, jct_s=150.0)  # 50% longer than v0's short ones
    assert verdicts(bus) == {}  # its window is over, the last good model's is not
    for (task, arrival), (decided_by, jct_s) in zip(
        long_tasks.items(), [("v0", 1000.0), ("v0", 1000.0), ("v1", 2000.0)], strict=True
    ):
        lifecycle.finished(Finished(task, decided_by, {"running": 0.5, "profiles": 0.8}, jct_s, arrival))
        feed.step()
    assert verdicts(bus) == {"v1": "promoted"}
    reason = next(s.reason for s in lifecycle.state().steps if s.step == "promoted")
    # The three late tasks and the shadow's last three: (2 * 1000 + 2000 + 3 * 100) / 6.
    assert f"JCT 716.7 s on {WINDOW} of the last {WINDOW} arrivals before it" in reason


def test_a_longer_jct_in_canary_rolls_back_even_with_a_lower_error(tmp_path: Path) -> None:
    bus, lifecycle, _models, feed = in_canary(tmp_path)
    feed.tasks(WINDOW, "v1", running=0.3, candidate=None, jct_s=106.0)  # 6% longer, over the 5% allowed
    assert verdicts(bus) == {"v1": "rolled_back"}
    assert "JCT is more than 5% longer" in next(s.reason for s in lifecycle.state().steps if s.step == "rolled_back")


def test_the_canary_counts_only_the_tasks_that_arrived_after_its_switch(tmp_path: Path) -> None:
    """A task that waited in the queue under the last good model carries that wait in its JCT: the
    candidate decided it, but the canary window leaves it out."""
    bus, lifecycle, _models, feed = in_canary(tmp_path)
    switched_at = feed.arrived
    assert lifecycle.state().candidate_stage == "canary"
    feed.tasks(WINDOW, "v1", running=0.3, candidate=None, jct_s=500.0, arrival=switched_at - 1)  # queued before
    assert lifecycle.state().candidate_stage == "canary"  # none of them counted
    feed.tasks(WINDOW, "v1", running=0.3, candidate=None, jct_s=100.0)
    assert verdicts(bus) == {"v1": "promoted"}


def test_the_canary_waits_for_every_task_of_its_window_not_the_first_to_finish(tmp_path: Path) -> None:
    """Judged on its first tasks to finish (the short ones, some of which arrived after the window),
    a candidate whose window runs long would pass. The window is the first canary_tasks arrivals
    after the switch, all of them finished."""
    bus, lifecycle, _models, feed = in_canary(tmp_path)
    assert lifecycle.state().candidate_stage == "canary"
    start = feed.arrived  # the window: arrivals start + 1 .. start + WINDOW
    for k in range(1, WINDOW - 1):  # all but the last two of the window finish
        feed.tasks(1, "v1", running=0.3, candidate=None, jct_s=120.0, arrival=start + k)
    for k in range(WINDOW):  # short tasks that arrived after the window finish before its last two
        feed.tasks(1, "v1", running=0.3, candidate=None, jct_s=20.0, arrival=start + WINDOW + k + 1)
    assert lifecycle.state().candidate_stage == "canary"  # (4 x 120 + 2 x 20) / 6 would have passed
    feed.tasks(1, "v1", running=0.3, candidate=None, jct_s=130.0, arrival=start + WINDOW - 1)
    assert verdicts(bus) == {}
    feed.tasks(1, "v1", running=0.3, candidate=None, jct_s=130.0, arrival=start + WINDOW)
    assert verdicts(bus) == {"v1": "rolled_back"}  # 123 s on average, over 105 beyond doubt
    reason = next(s.reason for s in lifecycle.state().steps if s.step == "rolled_back")
    assert f"JCT 123.3 s on {WINDOW} tasks" in reason
    assert "JCT is more than 5% longer" in reason


def test_a_canary_that_errs_more_is_rolled_back_before_its_window_is_over(tmp_path: Path) -> None:
    bus, lifecycle, _models, feed = in_canary(tmp_path)
    start = feed.arrived
    feed.tasks(1, "v1", running=0.9, candidate=None, arrival=start + 1)  # the window's first; the rest run long
    feed.arrived = start + WINDOW
    feed.tasks(WINDOW - 2, "v1", running=0.9, candidate=None)  # later arrivals, finished first
    assert lifecycle.state().candidate_stage == "canary"
    feed.tasks(1, "v1", running=0.9, candidate=None)
    assert verdicts(bus) == {"v1": "rolled_back"}
    reason = next(s.reason for s in lifecycle.state().steps if s.step == "rolled_back")
    assert f"0.9000 on its first {WINDOW} tasks to finish" in reason


def test_a_canary_jct_longer_only_by_chance_is_not_rolled_back(tmp_path: Path) -> None:
    """A mean JCT over the tolerance whose interval reaches it: not longer beyond doubt."""
    bus = MemoryBus()
    lifecycle, _models = make(tmp_path, bus)
    feed = Feed(lifecycle, bus)
    publish_bundle(bus, "v1")
    feed.step()
    for jct in (50.0, 150.0) * (WINDOW // 2):  # the last good model's window: its shadow's tasks
        feed.tasks(1, "v0", running=0.5, candidate=0.3, jct_s=jct)
    assert lifecycle.state().candidate_stage == "canary"
    for jct in (60.0, 160.0) * (WINDOW // 2):  # 110 s on average, 10% longer, as widely spread
        feed.tasks(1, "v1", running=0.3, candidate=None, jct_s=jct)
    assert verdicts(bus) == {"v1": "promoted"}


def test_a_window_task_that_never_finishes_is_waited_for_four_more_windows(tmp_path: Path) -> None:
    bus, lifecycle, _models, feed = in_canary(tmp_path)
    start = feed.arrived
    for k in range(1, WINDOW):  # the window's last task is cancelled: it never finishes
        feed.tasks(1, "v1", running=0.3, candidate=None, jct_s=90.0, arrival=start + k)
    feed.arrived = start + WINDOW
    feed.tasks(4 * WINDOW - 1, "v1", running=0.3, candidate=None, jct_s=90.0)
    assert lifecycle.state().candidate_stage == "canary"
    feed.tasks(1, "v1", running=0.3, candidate=None, jct_s=90.0)
    assert verdicts(bus) == {"v1": "promoted"}
    assert f"on {WINDOW - 1} tasks" in next(s.reason for s in lifecycle.state().steps if s.step == "promoted")


def test_a_rollback_whose_last_good_model_does_not_load_ends_on_the_prior(tmp_path: Path) -> None:
    _bus, lifecycle, models, feed = in_canary(tmp_path)
    models.broken.add("v0")  # the last good model's files are gone meanwhile
    feed.tasks(WINDOW, "v1", running=0.9, candidate=None)
    state = lifecycle.state()
    assert models.prior
    assert (state.running_version, state.running_stage) == ("", "prior")
    assert steps(lifecycle)[-1] == ("prior", "")


def test_a_cell_that_is_not_the_canary_cell_never_lets_the_candidate_decide(tmp_path: Path) -> None:
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus, cell="c2", canary_cell="c1")
    feed = Feed(lifecycle, bus)
    publish_bundle(bus, "v1")
    feed.step()
    feed.tasks(5 * WINDOW, "v0", running=0.5, candidate=0.1)  # far better, for five windows
    state = lifecycle.state()
    assert (state.running_version, state.candidate_stage) == ("v0", "shadow")
    assert models.ran == []
    assert verdicts(bus) == {}
    assert "shadow_passed" in [s for s, _ in steps(lifecycle)]

    key, value = control_record(mp.ModelControl.PROMOTED, "v1", "cell c1", "canary passed", 5)
    bus.publish(TOPIC, key, value)  # the canary cell's verdict
    feed.step()
    assert (lifecycle.state().running_version, lifecycle.state().running_stage) == ("v1", "promoted")
    assert models.ran == ["v1"]


def test_another_cell_never_installs_a_version_rolled_back_in_the_canary(tmp_path: Path) -> None:
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus, cell="c2", canary_cell="c1")
    feed = Feed(lifecycle, bus)
    publish_bundle(bus, "v1")
    feed.step()
    feed.tasks(WINDOW, "v0", running=0.5, candidate=0.1)
    key, value = control_record(mp.ModelControl.ROLLED_BACK, "v1", "cell c1", "canary: its error is higher", 5)
    bus.publish(TOPIC, key, value)
    feed.step()
    feed.tasks(WINDOW, "v0", running=0.5, candidate=None)
    assert models.ran == []
    assert models.candidate is None
    assert lifecycle.state().candidate_version == ""


@pytest.mark.parametrize("damage", ["a part changed", "a part missing"])
def test_a_bundle_that_does_not_match_its_manifest_is_refused_and_never_installed(tmp_path: Path, damage: str) -> None:
    bus = MemoryBus()
    publish_bundle(bus, "v1")
    records = bus.read_all(TOPIC)
    broken = part_key("v1", "scorer.onnx", 1)
    kept = [r for r in records if r.key != broken]
    if damage == "a part changed":
        part = mp.ModelPart.FromString(next(r.value for r in records if r.key == broken and r.value))
        part.data = part.data[::-1]
        kept.insert(0, RawEvent(TOPIC, 0, 0, broken, part.SerializeToString()))
    bus = MemoryBus()
    for record in kept:
        bus.publish(TOPIC, record.key, record.value)
    lifecycle, models = make(tmp_path, bus)
    Feed(lifecycle, bus).step()
    assert models.candidate is None
    assert models.ran == []
    assert steps(lifecycle)[-1] == ("refused_bundle", "v1")
    reason = lifecycle.state().steps[-1].reason
    assert ("SHA-256" in reason) if damage == "a part changed" else ("missing" in reason)
    assert not (tmp_path / "c1" / "models" / "v1").exists()


def test_a_bundle_is_assembled_from_parts_across_chunks(tmp_path: Path) -> None:
    bus = MemoryBus()
    publish_bundle(bus, "v1", chunk=5)
    catalog = ModelCatalog.read(bus.read_all(TOPIC))
    assert catalog.manifests["v1"].files[0].parts > 1
    assert catalog.assemble("v1")["scorer.onnx"] == b"scorer weights of v1"


def test_a_pinned_version_runs_and_nothing_is_tried_until_unpinned(tmp_path: Path) -> None:
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus)
    feed = Feed(lifecycle, bus)
    publish_bundle(bus, "v1", at_ms=1)
    publish_bundle(bus, "v2", at_ms=2)
    for key, value in decide_by_hand(ModelCatalog.read(bus.read_all(TOPIC)), "pin", "v1", "by hand", "ops", 10):
        bus.publish(TOPIC, key, value)
    feed.step()
    assert (lifecycle.state().running_version, lifecycle.state().running_stage) == ("v1", "pinned")
    assert lifecycle.state().pinned_version == "v1"
    assert models.candidate is None
    for key, value in decide_by_hand(ModelCatalog.read(bus.read_all(TOPIC)), "unpin", None, "by hand", "ops", 11):
        bus.publish(TOPIC, key, value)
    feed.step()
    assert lifecycle.state().running_version == "v0"
    assert models.candidate == "v2"


def test_rollback_by_hand_ends_a_canary_and_moves_the_fleet_back(tmp_path: Path) -> None:
    bus, lifecycle, _models, feed = in_canary(tmp_path)
    assert lifecycle.state().candidate_stage == "canary"
    for key, value in decide_by_hand(ModelCatalog.read(bus.read_all(TOPIC)), "rollback", None, "paged", "ops", 20):
        bus.publish(TOPIC, key, value)
    feed.step()
    assert (lifecycle.state().running_version, lifecycle.state().candidate_version) == ("v0", "")
    assert verdicts(bus) == {"v1": "rolled_back"}
    with pytest.raises(ValueError, match="nothing to roll back"):
        decide_by_hand(ModelCatalog.read(bus.read_all(TOPIC)), "rollback", None, "again", "ops", 21)


def test_run_times_come_from_the_task_events_not_the_daemon_clock() -> None:
    clock = Clock()
    scheduler = Scheduler(cluster(8), LeastLoaded(), PlacementLedger(), "c", clock=clock)
    seen: list[tuple[float, float]] = []

    def listener(task: Task, rows: Rows, ran_s: float, ended_s: float) -> None:
        seen.append((ran_s, ended_s))

    scheduler.finish_listeners.append(listener)
    spec = ev.TaskSpec(id="t", work_ref_s=60.0, memory_per_device_gb=1.0, submit_time_ms=5_000)
    placement = scheduler.place(spec).placement
    assert placement is not None
    started = ev.TaskStarted(task_id="t", placement_sequence=placement.sequence)
    scheduler.apply_task_event(ev.TaskEvent(cell="c", event_time_ms=10_000, started=started))
    clock.t += 3600.0  # the daemon's clock runs on; the driver's events say 250 s passed
    scheduler.apply_task_event(ev.TaskEvent(cell="c", event_time_ms=260_000, finished=ev.TaskFinished(task_id="t")))
    assert seen == [(250.0, 260.0)]
    assert np.isfinite(seen[0][0])


def test_after_a_reload_the_topics_version_is_installed_again_and_a_trial_starts_over(tmp_path: Path) -> None:
    bus = MemoryBus()
    lifecycle, models = make(tmp_path, bus)
    feed = Feed(lifecycle, bus)
    publish_bundle(bus, "v1", at_ms=1)
    key, value = control_record(mp.ModelControl.PROMOTED, "v1", "cell c9", "canary passed", 5)
    bus.publish(TOPIC, key, value)
    publish_bundle(bus, "v2", at_ms=6)
    feed.step()
    assert models.ran == ["v1"]
    assert lifecycle.state().candidate_version == "v2"
    models.running = "v0"  # SIGHUP: the policy built again with model.path's model
    lifecycle.policy_reloaded()
    feed.step()
    state = lifecycle.state()
    assert models.ran == ["v1", "v1"]
    assert (state.running_version, state.running_stage) == ("v1", "promoted")
    assert (state.candidate_version, state.candidate_stage) == ("v2", "shadow")  # from the start of its shadow
    assert ("superseded", "v2") in steps(lifecycle)


def test_the_models_topic_is_planned_compacted_with_auto_models_only() -> None:
    from hlb.daemon.bus.topics import plan, problems

    assert "models" not in [p.role for p in plan(Settings())]
    planned = next(p for p in plan(Settings(learning={"auto_models": True})) if p.role == "models")
    assert (planned.name, planned.partitions, dict(planned.config)) == ("hlb.models", 1, {"cleanup.policy": "compact"})
    assert problems("models", "hlb.models", {"cleanup.policy": "delete"})
    assert not problems("models", "hlb.models", {"cleanup.policy": "compact"})


def test_auto_models_and_a_shadow_model_cannot_both_be_on(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both fill the shadow slot"):
        Settings(learning={"auto_models": True, "shadow_model": tmp_path})


def test_outside_the_canary_cell_a_newer_bundle_replaces_the_one_shadowed_but_not_inside(tmp_path: Path) -> None:
    bus = MemoryBus()
    outside, outside_models = make(tmp_path, bus, cell="c2", canary_cell="c1")
    inside, inside_models = make(tmp_path, bus, cell="c1", canary_cell="c1")
    feeds = [Feed(outside, bus), Feed(inside, bus)]
    publish_bundle(bus, "v1", at_ms=1)
    for feed in feeds:
        feed.step()
    publish_bundle(bus, "v2", at_ms=2)
    for feed in feeds:
        feed.step()
    assert (outside.state().candidate_version, outside_models.candidate) == ("v2", "v2")
    assert ("superseded", "v1") in steps(outside)
    assert (inside.state().candidate_version, inside_models.candidate) == ("v1", "v1")


def test_the_daemons_live_tasks_leave_out_those_that_ended() -> None:
    scheduler = Scheduler(cluster(8), LeastLoaded(), PlacementLedger(), "c", clock=Clock())
    models = DaemonModels(Settings(), scheduler, threading.RLock(), lambda model, error: None)
    for task_id in ("done", "running", "queued"):
        spec = ev.TaskSpec(id=task_id, work_ref_s=60.0, memory_per_device_gb=1.0)
        if task_id == "queued":
            scheduler.apply_task_event(ev.TaskEvent(cell="c", submitted=spec))
        else:
            assert scheduler.place(spec).placement is not None
    scheduler.apply_task_event(ev.TaskEvent(cell="c", event_time_ms=1, finished=ev.TaskFinished(task_id="done")))
    assert "done" in scheduler.graph.tasks  # ended, and still in the graph
    assert models.live_between(-1, models.arrivals()) == {"running", "queued"}
    assert models.live_between(models.arrivals(), models.arrivals() + 10) == set()
