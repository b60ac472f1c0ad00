"""While decisions cannot be made durable: undoing those the journal could not take, and saying
so once per failure instead of on every retry.

A decision is durable and answered, or not made. When the journal does not take its records (a
full disk, an I/O error), the daemon withdraws every record not committed yet
(``JournaledPublisher.withdraw``; none reached the producer) and undoes their decisions with
``withdraw_decisions``, under its lock: a placement's reservation and ledger entry go and its task
is queued again (it is decided afresh once the journal works); a task submitted through the API
goes altogether (its caller was answered UNAVAILABLE). The sequence numbers of withdrawn
placements are not given out again by this process: a ``WatchPlacements`` stream may have shown
them.

``FailureEpisode`` logs the first failure of a run of failures and the first success after it,
and counts what happens in between: a full disk lasts minutes, its retries run every second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from hlb.daemon.config import Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.record.journal import JournalRecord
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

WITHDRAWN_REASON = "queued again: its placement could not be made durable (the decision journal refused it)"


@dataclass
class Withdrawn:
    """What ``withdraw_decisions`` undid (task ids, oldest first)."""

    placements: list[str] = field(default_factory=list)  # placements undone: the task is queued again
    submissions: list[str] = field(default_factory=list)  # tasks submitted through the API, dropped
    kept: list[str] = field(default_factory=list)  # placements already acted on (a started task): not undone


def withdraw_decisions(scheduler: Scheduler, records: Sequence[JournalRecord], topics: Topics) -> Withdrawn:
    """Undo the decisions of ``records`` (withdrawn from the journal, oldest first) in
    ``scheduler``, newest first. The caller holds the daemon's lock."""
    placements: list[ev.Placement] = []
    submitted: list[str] = []
    for record in records:
        if record.topic == topics.placements:
            placements.append(ev.Placement.FromString(record.value))
        elif record.topic == topics.tasks:
            event = ev.TaskEvent.FromString(record.value)
            if event.HasField("submitted"):
                submitted.append(event.submitted.id)
    done = Withdrawn()
    for placement in reversed(placements):
        undone = scheduler.unplace(placement, WITHDRAWN_REASON)
        if not undone and scheduler.graph.tasks.get(placement.task_id) is not None:
            log.error("a withdrawn placement was acted on already; it stays", task_id=placement.task_id)
        (done.placements if undone else done.kept).append(placement.task_id)
    for task_id in reversed(submitted):
        if scheduler.withdraw_submission(task_id):
            done.submissions.append(task_id)
        elif task_id in scheduler.graph.tasks:
            log.error("a withdrawn submission's task holds devices; it stays", task_id=task_id)
    done.placements.reverse()
    done.kept.reverse()
    done.submissions.reverse()
    return done


class FailureEpisode:
    """A failure that repeats until it stops, logged when it starts and when it ends.

    ``failed`` returns True for the first failure of an episode (logged at error level with
    ``started``); later ones are counted. ``ended`` logs ``ended`` with how many failures and how
    long, once, and returns True when an episode was running.
    """

    def __init__(self, started: str, ended: str, monotonic: Callable[[], float]) -> None:
        self._started = started
        self._ended = ended
        self._monotonic = monotonic
        self.error = ""  # the first failure of the running episode, in words ("" when none runs)
        self.failures = 0
        self._since = 0.0

    @property
    def running(self) -> bool:
        return self.failures > 0

    def failed(self, error: BaseException, **fields: Any) -> bool:
        self.failures += 1
        if self.failures > 1:
            return False
        self.error = describe(error)
        self._since = self._monotonic()
        log.error(self._started, error=self.error, **fields)
        return True

    def ended(self, **fields: Any) -> bool:
        if not self.failures:
            return False
        log.info(self._ended, failures=self.failures, after_s=round(self._monotonic() - self._since, 3), **fields)
        self.failures = 0
        self.error = ""
        return True


def describe(error: BaseException) -> str:
    """An OS error in words without its file name: '[Errno 28] No space left on device'."""
    if isinstance(error, OSError) and error.errno is not None and error.strerror:
        return f"[Errno {error.errno}] {error.strerror}"
    return str(error)
