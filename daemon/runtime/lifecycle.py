"""The model lifecycle (``learning.auto_models``): every new bundle on the models topic is shadowed,
tried in one cell, then promoted or rolled back (docs/learning.md, "The model lifecycle").

1. **received**: a bundle whose manifest arrives is assembled and checked (every part there, each
   SHA-256 as its manifest says; ``hlb.daemon.runtime.models``), written under
   ``state_dir/models/<version>`` in one rename, then loaded and warmed up on the graph as a hot
   reload does. A bundle that fails any of it is **refused** here, its reason logged.
2. **shadow**: it scores beside the running model and decides nothing (``hlb.daemon.record.shadow``)
   until ``learning.shadow_tasks`` finished tasks were scored by both; it is **refused** unless its
   mean |error| there is below the running model's. A bundle published with ``--skip-shadow``
   (its publisher vouches for it) goes to its canary at once in the canary cell.
3. **canary**: in the canary cell only (``learning.canary_cell``, by default the daemon's own
   ``cell``) it becomes the running model; the model it replaced is kept as *last good*. A daemon
   of another cell keeps shadowing it and waits for the canary cell's verdict.
4. Once the first ``learning.canary_tasks`` tasks to arrive after the switch have finished (all
   of them, not the first to finish: those are the short ones), it is **promoted** when their mean
   |error| is no higher than the last good model's over the last ``canary_tasks`` tasks that model
   decided before the switch, and their mean JCT (submit to finish) is not longer than that
   model's by more than ``learning.jct_tolerance`` beyond doubt (95%, one-sided), the last good
   model's JCT taken over the last ``canary_tasks`` arrivals before the switch once they have all
   finished (those still running or queued at the switch included, as the candidate's long tasks
   are); else it is
   **rolled back** (at once when its first ``canary_tasks`` tasks to finish, whenever they
   arrived, erred more than the last good model: the error tells a bad model before its window
   is over): the last good model runs again, or the
   profiles alone (zero correction) when that does not load. Either verdict is published on the
   topic, so every cell installs a promoted version and never a rolled-back one.

What every cell runs follows the topic (``ModelCatalog.target``): a pinned version (nothing is
tried or promoted while a pin stands), else the newest promoted one, else ``model.path``'s model.
Run times and JCTs come from the task events' own times, so a driver with its own clock is
measured by it. Each step is logged, counted (``hlb_model_steps_total{step}``) and listed in
``GetClusterState``; the windows' errors and JCTs are gauges (docs/monitoring.md).

:class:`ModelLifecycle` is the state machine: fed records (``receive``) and finished tasks
(``finished``), it acts in :meth:`ModelLifecycle.step` through a :class:`Models` (the daemon's is
:class:`DaemonModels`), so a test drives it with an in-memory bus and a clock of its own.
:class:`LifecycleThread` runs it in the daemon.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from hlb.daemon.bus.seam import EventSource, Publisher, RawEvent
from hlb.daemon.config import Settings
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.errors import BundleError
from hlb.daemon.record.shadow import Observe, Shadow
from hlb.daemon.runtime.models import ModelCatalog, install_bundle, publish_control
from hlb.daemon.runtime.policy import model_scorer, shadow_scorer
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.v1 import models_pb2 as mp
from hlb.v1 import scheduler_pb2 as api

log = structlog.get_logger(__name__)
T = TypeVar("T")

STEPS = (
    "received",
    "refused_bundle",
    "refused",
    "shadow",
    "shadow_passed",
    "canary",
    "promoted",
    "rolled_back",
    "prior",
    "installed",
    "pinned",
    "unpinned",
    "superseded",
)
KEPT_STEPS = 32  # steps GetClusterState lists
AFTER_WINDOW_WAIT = 4  # windows of later tasks that finish before a canary is judged on fewer tasks
RECENT_WINDOWS = 4  # windows of the running model's finished tasks kept for the JCT window at a switch
RELOADED = "\0reloaded"  # applied_target after a reload: no version is installed, model.path's runs


@dataclass(frozen=True)
class Finished:
    """One finished task as the lifecycle counts it."""

    task_id: str
    decided_by: str  # the model version its placement names; empty when no model decided it
    errors: dict[str, float]  # Shadow.compare's: running, candidate, profiles (those that predicted)
    jct_s: float | None  # submit to finish by the events' times; None without a submit time
    arrival: int = 0  # Task.arrival: the canary counts the tasks that arrived after its switch


class Models(Protocol):
    """What the lifecycle does to the daemon's models (:class:`DaemonModels`; tests have a twin)."""

    def running_version(self) -> str:
        """The version of the model that decides now; empty while the profiles alone decide."""
        ...

    def try_candidate(self, directory: Path) -> str:
        """Load and warm up ``directory``'s model in the shadow slot; its version. Raises when it
        does not load (the slot stays empty)."""
        ...

    def drop_candidate(self) -> None: ...

    def run(self, directory: Path | None) -> str:
        """Make ``directory``'s model (None: ``model.path``'s) the running one, loaded and warmed
        before it decides; its version. Raises, the running model kept, when it does not load."""
        ...

    def arrivals(self) -> int:
        """The last ``Task.arrival`` given so far (:attr:`InfraGraph.arrivals`)."""
        ...

    def live_between(self, first: int, last: int) -> set[str]:
        """The ids of the tasks not yet ended (queued or placed) whose ``Task.arrival`` is in
        (``first``, ``last``]."""
        ...

    def run_prior(self, reason: str) -> None:
        """Decide with the profiles alone (zero correction) from now on."""
        ...


@dataclass
class Trial:
    """A candidate being tried: its stage and the finished tasks counted in its window."""

    version: str
    directory: Path
    stage: str = "shadow"  # shadow, then canary (in the canary cell)
    shadow: list[tuple[float, float]] = field(default_factory=list)  # (running, candidate) errors
    passed_shadow: bool = False
    canary: list[Finished] = field(default_factory=list)
    baseline: list[Finished] = field(default_factory=list)  # the last good model's, before the switch
    # The JCT window of the last good model: the last canary_tasks arrivals before the switch,
    # counted as they finish, before or after it, so that its long tasks count as the candidate's
    # do (the last tasks to finish before the switch are the short ones), and so do those still
    # queued at the switch, whose wait its queue made (the candidate places them, and they are
    # not in its window); ``jct_pending``: those not ended at the switch.
    jct_window: list[Finished] = field(default_factory=list)
    jct_pending: set[str] = field(default_factory=set)
    # The last Task.arrival before the switch: a task that waited in the queue under the last good
    # model carries that wait in its JCT, so the canary counts only tasks that arrived after it.
    first_arrival: int = -1
    # Tasks the candidate decided that arrived after its window (the first canary_tasks arrivals
    # after the switch) and finished: they bound the wait for a window task that never finishes.
    after_window: int = 0
    first_errors: list[float] = field(default_factory=list)  # of its first canary_tasks tasks to finish


class LifecycleMetrics:
    """``hlb_model_*`` on the daemon's registry (docs/monitoring.md)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.steps = Counter(
            "hlb_model_steps", "Steps of the model lifecycle (learning.auto_models), by step.", ["step"], registry=r
        )
        for step in STEPS:
            self.steps.labels(step=step)
        self.shadow_error = Gauge(
            "hlb_model_shadow_abs_error",
            "Mean |error| in log speed ratio over the candidate's shadow window so far, of the running model and"
            " the candidate (the same tasks; hlb_shadow_abs_error's label).",
            ["model"],
            registry=r,
        )
        self.canary_error = Gauge(
            "hlb_model_canary_abs_error",
            "Mean |error| in log speed ratio of the candidate over the tasks it decided in its canary so far, and"
            " of the last good model over the tasks it decided before the switch.",
            ["model"],
            registry=r,
        )
        self.canary_jct = Gauge(
            "hlb_model_canary_jct_seconds",
            "Mean JCT (submit to finish, by event times) of the same tasks as hlb_model_canary_abs_error.",
            ["model"],
            registry=r,
        )
        self.window = Gauge(
            "hlb_model_window_tasks",
            "Finished tasks counted in the candidate's window so far, by stage (shadow, canary).",
            ["stage"],
            registry=r,
        )


class ModelLifecycle:
    """The state machine of the module docstring. ``receive`` and ``finished`` may be called from
    any thread; ``step`` acts, from one thread (it loads models: never under the daemon's lock)."""

    def __init__(
        self,
        settings: Settings,
        models: Models,
        publisher: Publisher,
        *,
        clock: Callable[[], float] = time.time,
        metrics: LifecycleMetrics | None = None,
        cell: Callable[[], str] | None = None,
    ) -> None:
        self.settings = settings
        # The cell this daemon decides for (a shard's is known only once it is given its partition).
        self.cell: Callable[[], str] = cell or (lambda: settings.cell)
        self.models = models
        self.publisher = publisher
        self.clock = clock
        self.metrics = metrics or LifecycleMetrics()
        learning = settings.learning
        self.shadow_tasks, self.canary_tasks, self.tolerance = (
            learning.shadow_tasks,
            learning.canary_tasks,
            learning.jct_tolerance,
        )
        self.canary_cell = learning.canary_cell or settings.cell
        self.root = settings.state_dir / "models"
        self.catalog = ModelCatalog()
        self.trial: Trial | None = None
        self.running_stage = "configured"
        self.running_directory: Path | None = None  # None: model.path's
        self.last_good: tuple[str, Path | None, str] | None = None  # version, folder, running stage
        self.applied_target: str | None = None  # the topic's target last installed (None: model.path's)
        self.refused: set[str] = set()  # versions this daemon refused or rolled back: never tried again
        self.steps: deque[api.ModelStep] = deque(maxlen=KEPT_STEPS)
        self._baseline: deque[Finished] = deque(maxlen=self.canary_tasks)
        self._recent: deque[Finished] = deque(maxlen=RECENT_WINDOWS * self.canary_tasks)
        self._inbox: deque[Finished] = deque()
        self._records: deque[RawEvent] = deque()
        self._guard = threading.Lock()  # one change at a time: step() and policy_reloaded()
        self._shown = api.ModelLifecycle(running_stage="configured", canary_cell=self.canary_cell)
        self.wake = threading.Event()

    @property
    def in_canary_cell(self) -> bool:
        return self.canary_cell == self.cell()

    # -- inputs (any thread) ---------------------------------------------------------------

    def receive(self, records: Sequence[RawEvent]) -> None:
        """Records of the models topic, in order."""
        self._records.extend(records)
        self.wake.set()

    def finished(self, task: Finished) -> None:
        """A task finished (called under the daemon's lock: only queued here)."""
        self._inbox.append(task)
        self.wake.set()

    def policy_reloaded(self) -> None:
        """A reload (SIGHUP: the scheduler or model section) replaced the running model with
        ``model.path``'s: the topic's target is installed again at the next step, and a candidate
        being tried starts over from its shadow."""
        with self._guard:
            trial, self.trial = self.trial, None
            if trial is not None:
                self.models.drop_candidate()
                self._step("superseded", trial.version, "the policy was reloaded; tried again from its shadow")
            self.applied_target = RELOADED
            self.running_stage, self.running_directory = "configured", None
            self._baseline.clear()
            self._recent.clear()
            self._show()
        self.wake.set()

    # -- acting ------------------------------------------------------------------------------

    def step(self) -> None:
        """Fold what arrived and take every step it calls for."""
        records = _drain(self._records)
        if records:
            self.catalog.update(records)
        with self._guard:
            self._follow_topic()
            for task in _drain(self._inbox):
                self._count(task)
            self._start_trial()
            self._show()

    def _follow_topic(self) -> None:
        """Apply the verdicts and the pin on the topic: what every cell runs, and this trial's end."""
        catalog, trial = self.catalog, self.trial
        if trial is not None:
            verdict = catalog.verdicts.get(trial.version)
            if verdict is not None and verdict.action in (mp.ModelControl.ROLLED_BACK, mp.ModelControl.REFUSED):
                if trial.stage == "canary":
                    self._roll_back(trial, f"rolled back on the topic by {verdict.by}: {verdict.reason}", publish=False)
                else:
                    self._end_trial(trial, "refused", f"{verdict.by}: {verdict.reason}")
            elif verdict is not None and verdict.action == mp.ModelControl.PROMOTED and trial.stage == "canary":
                self._promoted(trial, f"promoted on the topic by {verdict.by}: {verdict.reason}", publish=False)
        target = catalog.target()
        if target == self.applied_target:
            return
        pinned = catalog.pinned
        trial = self.trial
        if trial is not None and trial.version != target:
            if trial.stage == "canary":
                self._roll_back(trial, f"the fleet moves to {target or 'model.path'}", publish=False)
            else:
                self._end_trial(trial, "superseded", f"the fleet moves to {target or 'model.path'}")
        elif trial is not None:  # the version tried here was promoted or pinned elsewhere
            self._end_trial(trial, "installed", "promoted or pinned on the topic", keep=True)
        if pinned is None and self.running_stage == "pinned" and target is None:
            self._step("unpinned", self.models.running_version(), "the pin was lifted")
        self._install(target, "pinned" if pinned is not None else "promoted")

    def _install(self, version: str | None, stage: str) -> None:
        """Run the topic's target (None: ``model.path``'s model)."""
        self.applied_target = version
        if version is not None and version == self.models.running_version():
            self.running_stage = stage
            self._step(stage, version, "already running")
            return
        try:
            directory = None if version is None else self._bundle(version)
            running = self.models.run(directory)
        except Exception as exc:
            self._step("refused", version or "", f"cannot run it: {exc}")
            return
        self.running_directory, self.running_stage = directory, (stage if version is not None else "configured")
        self._baseline.clear()
        self._recent.clear()
        self._step("installed" if stage != "pinned" else "pinned", running, f"the topic's {stage} version")

    def _bundle(self, version: str) -> Path:
        """The bundle of ``version`` assembled, checked and written under the state directory."""
        return install_bundle(self.root, version, self.catalog.assemble(version))

    def _start_trial(self) -> None:
        if self.catalog.pinned is not None:
            return
        running = self.models.running_version()
        waiting = [v for v in self.catalog.candidates() if v not in self.refused and v != running]
        if not waiting:
            return
        version = waiting[-1]  # the newest: an older one waiting is superseded by it
        trial = self.trial
        if trial is not None:
            # Outside the canary cell a trial only shadows until the canary cell's verdict: a newer
            # bundle replaces it (that verdict still installs it if it is promoted). In the canary
            # cell a trial runs to its verdict, or bundles published often would starve each other.
            if self.in_canary_cell or version == trial.version:
                return
            self._end_trial(trial, "superseded", f"a newer bundle: {version}")
        self._step("received", version, "a new bundle on the models topic")
        try:
            directory = self._bundle(version)
        except (BundleError, OSError) as exc:
            self.refused.add(version)
            self._step("refused_bundle", version, str(exc))
            return
        try:
            loaded = self.models.try_candidate(directory)
        except Exception as exc:
            self.refused.add(version)
            self._step("refused_bundle", version, f"does not load: {exc}")
            return
        if loaded != version:
            self.models.drop_candidate()
            self.refused.add(version)
            self._step("refused_bundle", version, f"the files are version {loaded!r}, the manifest says {version!r}")
            return
        self.trial = Trial(version, directory)
        manifest = self.catalog.manifests.get(version)
        if manifest is not None and manifest.skip_shadow and self.in_canary_cell:
            self._step("shadow_passed", version, f"shadow skipped: {manifest.published_by or 'its publisher'} vouched")
            self._to_canary(self.trial)
            return
        self._step("shadow", version, f"scored beside {running or 'the profiles'} for {self.shadow_tasks} tasks")

    def _count(self, task: Finished) -> None:
        trial = self.trial
        if trial is not None and trial.stage == "canary":
            if task.task_id in trial.jct_pending:  # a task of the last good model's JCT window
                trial.jct_pending.discard(task.task_id)
                trial.jct_window.append(task)
                if not trial.jct_pending and len(trial.canary) >= self.canary_tasks:
                    self._judge_canary(trial)
                return
            if task.decided_by == trial.version and "running" in task.errors and task.arrival > trial.first_arrival:
                if task.arrival <= trial.first_arrival + self.canary_tasks:
                    trial.canary.append(task)
                    self.metrics.window.labels(stage="canary").set(len(trial.canary))
                    self._show_canary(trial)
                else:
                    trial.after_window += 1
                # Its error tells a bad model before its window is over: rolled back as soon as its
                # first canary_tasks tasks to finish, whenever they arrived, err more than the last
                # good model's did.
                if len(trial.first_errors) < self.canary_tasks:
                    trial.first_errors.append(task.errors["running"])
                    if len(trial.first_errors) == self.canary_tasks and self._early_error(trial):
                        return
                # The whole window: judged on its first tasks to finish, the short ones, the
                # candidate's JCT would look better than it is. A window task that never finishes
                # (cancelled, or decided without a prediction) is waited for until AFTER_WINDOW_WAIT
                # windows of later tasks finished (a long task may outlast one).
                if (len(trial.canary) >= self.canary_tasks and not trial.jct_pending) or (
                    trial.canary and trial.after_window >= AFTER_WINDOW_WAIT * self.canary_tasks
                ):
                    self._judge_canary(trial)
            return
        if task.decided_by == self.models.running_version() and _error(task) is not None:
            self._baseline.append(task)
            self._recent.append(task)
        # What runs now, on the same task: the running model, or the profiles while none serves.
        reference = task.errors.get("running", task.errors.get("profiles"))
        if trial is None or "candidate" not in task.errors or reference is None:
            return
        trial.shadow.append((reference, task.errors["candidate"]))
        pairs = np.asarray(trial.shadow).reshape(-1, 2)
        self.metrics.window.labels(stage="shadow").set(len(pairs))
        if len(pairs):
            self.metrics.shadow_error.labels(model="running").set(float(pairs[:, 0].mean()))
            self.metrics.shadow_error.labels(model="candidate").set(float(pairs[:, 1].mean()))
        if len(pairs) >= self.shadow_tasks and not trial.passed_shadow:
            self._judge_shadow(trial, float(pairs[:, 0].mean()), float(pairs[:, 1].mean()), len(pairs))

    def _judge_shadow(self, trial: Trial, running: float, candidate: float, tasks: int) -> None:
        said = f"mean |error| {candidate:.4f} against the running model's {running:.4f} on {tasks} tasks"
        if not candidate < running:
            self._end_trial(trial, "refused", f"shadow: {said}")
            if self.in_canary_cell:
                self._publish(mp.ModelControl.REFUSED, trial.version, f"shadow: {said}")
            return
        trial.passed_shadow = True
        self._step("shadow_passed", trial.version, said)
        if not self.in_canary_cell:
            self._step("shadow", trial.version, f"waiting for the canary cell {self.canary_cell}'s verdict")
            return
        self._to_canary(trial)

    def _to_canary(self, trial: Trial) -> None:
        """In the canary cell: ``trial`` becomes the running model, the one it replaces last good."""
        previous, directory, stage = self.models.running_version(), self.running_directory, self.running_stage
        try:
            self.models.drop_candidate()
            self.models.run(trial.directory)
        except Exception as exc:
            self._end_trial(trial, "refused", f"cannot run it: {exc}")
            return
        self.last_good = (previous, directory, stage)
        trial.first_arrival = self.models.arrivals()
        trial.stage = "canary"
        trial.baseline = list(self._baseline)
        since = trial.first_arrival - self.canary_tasks
        trial.jct_window = [
            t for t in self._recent if t.decided_by == previous and since < t.arrival <= trial.first_arrival
        ]
        trial.jct_pending = self.models.live_between(since, trial.first_arrival)
        self.running_stage = "canary"
        self._show_canary(trial)
        self._step(
            "canary", trial.version, f"deciding in cell {self.canary_cell}; last good {previous or 'the profiles'}"
        )

    def _show_canary(self, trial: Trial) -> None:
        windows = (("candidate", trial.canary, trial.canary), ("last_good", trial.baseline, trial.jct_window))
        for model, errors, jcts in windows:
            error, _ = _means(errors)
            _, jct = _means(jcts)
            if error is not None:
                self.metrics.canary_error.labels(model=model).set(error)
            if jct is not None:
                self.metrics.canary_jct.labels(model=model).set(jct)

    def _early_error(self, trial: Trial) -> bool:
        """Roll ``trial`` back if its first tasks to finish erred more than the last good model;
        whether it did."""
        error, (good_error, _) = float(np.mean(trial.first_errors)), _means(trial.baseline)
        if good_error is None or error <= good_error:
            return False
        said = (
            f"canary: mean |error| {_num(error)} on its first {len(trial.first_errors)} tasks to finish; last good "
            f"{_num(good_error)} on {len(trial.baseline)} tasks before the switch: its error is higher"
        )
        self._roll_back(trial, said, publish=True)
        return True

    def _judge_canary(self, trial: Trial) -> None:
        error, jct = _means(trial.canary)
        good_error, _ = _means(trial.baseline)
        _, good_jct = _means(trial.jct_window)
        said = (
            f"canary: mean |error| {_num(error)}, JCT {_s(jct)} on {len(trial.canary)} tasks; last good "
            f"{_num(good_error)} on {len(trial.baseline)} tasks before the switch, JCT {_s(good_jct)} on "
            f"{len(trial.jct_window)} of the last {self.canary_tasks} arrivals before it"
        )
        worse: list[str] = []
        if good_error is not None and error is not None and error > good_error:
            worse.append("its error is higher")
        longer = _jct_excess(trial.canary, trial.jct_window, self.tolerance)
        if longer is not None and longer > 0:
            worse.append(f"its JCT is more than {self.tolerance:.0%} longer (by {_s(longer)} at least, 95% one-sided)")
        if good_error is None:
            worse.append("the last good model decided no task to compare with")
        if worse:
            self._roll_back(trial, f"{said}: {' and '.join(worse)}", publish=True)
        else:
            self._promoted(trial, said, publish=True)

    def _promoted(self, trial: Trial, reason: str, *, publish: bool) -> None:
        self.trial = None
        self.running_directory, self.running_stage = trial.directory, "promoted"
        self.applied_target = trial.version  # the verdict coming back from the topic changes nothing
        self._baseline.clear()
        self._recent.clear()
        self._step("promoted", trial.version, reason)
        if publish:
            self._publish(mp.ModelControl.PROMOTED, trial.version, reason)

    def _roll_back(self, trial: Trial, reason: str, *, publish: bool) -> None:
        """Back to the last good model; to the profiles alone when it does not load."""
        self.trial = None
        self.refused.add(trial.version)
        _, directory, stage = self.last_good or ("", None, "configured")
        self._step("rolled_back", trial.version, reason)
        if publish:
            self._publish(mp.ModelControl.ROLLED_BACK, trial.version, reason)
        try:
            if stage == "prior":
                raise BundleError("the profiles alone decided before the canary")
            self.models.run(directory)
            self.running_directory, self.running_stage = directory, "last_good"
            self._step("installed", self.models.running_version(), "the last good model again")
            self._remove(trial.directory)
        except Exception as exc:  # its folder stays: the GNN still names it, refused (not watched again)
            self.models.run_prior(f"rolled back from {trial.version}: {exc}")
            self.running_directory, self.running_stage = None, "prior"
            self._step("prior", "", f"the profiles alone (zero correction): {exc}")
        self._baseline.clear()
        self._recent.clear()

    def _end_trial(self, trial: Trial, step: str, reason: str, *, keep: bool = False) -> None:
        self.trial = None
        self.models.drop_candidate()
        if not keep:
            self.refused.add(trial.version)
            self._remove(trial.directory)
        self._step(step, trial.version, reason)

    def _remove(self, directory: Path) -> None:
        """Delete a refused or rolled-back bundle's folder (not the running model's): the state
        directory keeps what may run. Installed again from the topic if it is promoted later."""
        if directory != self.running_directory and directory.parent == self.root:
            shutil.rmtree(directory, ignore_errors=True)

    def _publish(self, action: mp.ModelControl.Action.ValueType, version: str, reason: str) -> None:
        by = f"cell {self.cell()}"
        publish_control(self.settings, action, version, reason, publisher=self.publisher, by=by)

    def _step(self, step: str, version: str, reason: str) -> None:
        self.metrics.steps.labels(step=step).inc()
        self.steps.append(api.ModelStep(at_ms=int(self.clock() * 1000), step=step, version=version, reason=reason))
        log.info("model lifecycle", step=step, version=version, reason=reason, cell=self.cell())

    # -- what GetClusterState shows -------------------------------------------------------------

    def state(self) -> api.ModelLifecycle:
        """The lifecycle as the last step left it (a copy; never waits for a step, which may be
        loading a model: ``GetClusterState`` answers from the event loop)."""
        shown = api.ModelLifecycle()
        shown.CopyFrom(self._shown)
        return shown

    def _show(self) -> None:
        """Take the state ``state`` returns (called with ``_guard`` held, at the end of each change)."""
        trial = self.trial
        shown = api.ModelLifecycle(
            running_version=self.models.running_version(),
            running_stage=self.running_stage,
            last_good_version=self.last_good[0] if self.last_good else "",
            pinned_version=self.catalog.pinned or "",
            canary_cell=self.canary_cell,
            steps=list(self.steps),
        )
        if trial is not None:
            shown.candidate_version, shown.candidate_stage = trial.version, trial.stage
            if trial.stage == "canary":
                shown.window_done, shown.window_tasks = len(trial.canary), self.canary_tasks
            else:
                shown.window_done, shown.window_tasks = len(trial.shadow), self.shadow_tasks
        self._shown = shown


def _drain(queue: deque[T]) -> list[T]:
    out: list[T] = []
    while queue:
        out.append(queue.popleft())
    return out


def _error(task: Finished) -> float | None:
    """The deciding model's error on ``task``: the running model's, or the profiles' when no model decided."""
    if task.decided_by:
        return task.errors.get("running")
    return task.errors.get("profiles")


def _means(tasks: Sequence[Finished]) -> tuple[float | None, float | None]:
    errors = [e for e in map(_error, tasks) if e is not None]
    jcts = [t.jct_s for t in tasks if t.jct_s is not None]
    return (float(np.mean(errors)) if errors else None, float(np.mean(jcts)) if jcts else None)


Z_ONE_SIDED_95 = 1.645


def _jct_excess(canary: Sequence[Finished], baseline: Sequence[Finished], tolerance: float) -> float | None:
    """The lower bound (95%, one-sided, normal approximation) of how far the canary's mean JCT
    exceeds the last good model's times ``1 + tolerance``, in seconds; above zero: longer beyond
    doubt. JCTs of a few dozen tasks spread widely (long tasks beside short ones), so a plain
    comparison of two means would roll back good models and promote bad ones by chance. None
    when either side has no JCT."""
    a = np.asarray([t.jct_s for t in canary if t.jct_s is not None], dtype=np.float64)
    b = np.asarray([t.jct_s for t in baseline if t.jct_s is not None], dtype=np.float64) * (1 + tolerance)
    if not len(a) or not len(b):
        return None
    spread = np.sqrt((a.var(ddof=1) / len(a) if len(a) > 1 else 0.0) + (b.var(ddof=1) / len(b) if len(b) > 1 else 0.0))
    return float(a.mean() - b.mean() - Z_ONE_SIDED_95 * spread)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _s(value: float | None) -> str:
    return "- (no submit times)" if value is None else f"{value:.1f} s"


# -- in the daemon -------------------------------------------------------------------------------


class DaemonModels:
    """:class:`Models` on the daemon's running GNN: the candidate loads in the shadow slot
    (``hlb.daemon.record.shadow``), the running model is switched as a hot reload switches it
    (``GnnScorer.configure``: loaded and warmed up on the graph before it decides)."""

    def __init__(self, settings: Settings, scheduler: Scheduler, lock: threading.RLock, observe: Observe) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.lock = lock
        self.shadow = Shadow(None, observe)
        self.shadow.listen(scheduler, lambda: model_scorer(scheduler.policy))

    def running_version(self) -> str:
        scorer = model_scorer(self.scheduler.policy)
        return scorer.model_version if scorer is not None else ""

    def try_candidate(self, directory: Path) -> str:
        candidate = shadow_scorer(self.settings, directory)
        if candidate is None:
            raise BundleError("the policy has no GNN (scheduler.policy gnn)")
        candidate.start(self.scheduler.graph, self.lock)  # loaded and warmed up, or degraded
        if not candidate.ready:
            candidate.stop()
            raise BundleError(candidate.degraded)
        with self.lock:
            previous, self.shadow.candidate = self.shadow.candidate, candidate
        if previous is not None:
            previous.stop()
        return candidate.model_version

    def drop_candidate(self) -> None:
        with self.lock:
            candidate, self.shadow.candidate = self.shadow.candidate, None
        if candidate is not None:
            candidate.stop()

    def run(self, directory: Path | None) -> str:
        scorer = model_scorer(self.scheduler.policy)
        if scorer is None:
            raise BundleError("the policy has no GNN (scheduler.policy gnn)")
        model = self.settings.model
        if directory is not None:
            model = model.model_copy(update={"path": directory})
        if model.directory == scorer.settings.directory and scorer.ready:
            return scorer.model_version
        scorer.configure(model)  # raises ModelError, the running model kept
        if not scorer.ready:
            scorer.reload_model(retry=True)
        if not scorer.ready:
            raise BundleError(scorer.degraded)
        return scorer.model_version

    def arrivals(self) -> int:
        return self.scheduler.graph.arrivals

    def live_between(self, first: int, last: int) -> set[str]:
        with self.lock:  # the graph keeps ended tasks for a while (scheduler.keep_ended_s): not live
            tasks = self.scheduler.graph.tasks.values()
            return {t.spec.id for t in tasks if first < t.arrival <= last and not t.state.is_final}

    def run_prior(self, reason: str) -> None:
        scorer = model_scorer(self.scheduler.policy)
        if scorer is not None:
            scorer.serve_prior(reason)

    def finished(self, task: Task, rows: Rows, ran_s: float, ended_s: float) -> Finished | None:
        """``Scheduler.finish_listeners``' call, under the daemon's lock: the task as counted."""
        running = model_scorer(self.scheduler.policy)
        if running is None:
            return None
        errors = self.shadow.compare(running, task.spec, self.scheduler.graph, rows, ran_s)
        placement = self.scheduler.ledger.get(task.spec.id)
        decided_by = placement.model_version if placement is not None else ""
        submitted = task.spec.submit_time_ms
        jct = ended_s - submitted / 1000.0 if submitted > 0 else None
        return Finished(task.spec.id, decided_by, errors, jct, task.arrival)


class LifecycleThread(threading.Thread):
    """Reads the models topic and runs :meth:`ModelLifecycle.step` until stopped."""

    def __init__(self, lifecycle: ModelLifecycle, source: EventSource, poll_s: float = 0.5) -> None:
        super().__init__(name="model-lifecycle", daemon=True)
        self.lifecycle = lifecycle
        self.source = source
        self.poll_s = poll_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        failing = False
        while not self._stop_event.is_set():
            try:
                records = self.source.next_batch(1000, self.poll_s)
                if records:
                    self.lifecycle.receive(records)
                self.lifecycle.step()
                failing = False
            except Exception:
                if not failing:
                    log.exception("model lifecycle step failed; retrying")
                failing = True
                self._stop_event.wait(1.0)
        self.source.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop_event.set()
        self.join(timeout_s)


__all__ = ["DaemonModels", "Finished", "LifecycleMetrics", "LifecycleThread", "ModelLifecycle", "Models"]
