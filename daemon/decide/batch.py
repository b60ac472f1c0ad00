"""One batch's decisions: feasible rows and scores per task shape, kept exact through the batch.

``PlaceBatch`` and a scheduling pass decide many tasks under one hold of the daemon's lock. Most
tasks share a few shapes, so :class:`BatchScores` computes a shape's feasible rows and scores once
and rescores only the rows the batch's own bindings changed: the same decisions as one task at a
time (tests: batch equals sequential), at a fraction of the cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.decide.framework import BatchChooser, Policy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.tables import Rows
from hlb.v1 import events_pb2 as ev

ShapeKey = tuple[object, ...]
MAX_CACHED_SHAPES = 16


def _shape(spec: ev.TaskSpec, policy: Policy, plain: bool = False) -> ShapeKey | None:
    """What a row-local policy's scores depend on, or None for a task whose scores depend on more
    (its dependencies' placements). ``plain``: the spec names no lists (``Task.plain``)."""
    lists: tuple[tuple[object, ...], ...] = ((), (), ())
    if not plain:
        if spec.dependencies:
            return None
        kinds, models, preferred = spec.allowed_kinds, spec.allowed_models, spec.preferred_models
        if kinds or models or preferred:  # most specs name none: no copy (a batch asks per task)
            lists = (tuple(kinds), tuple(models), tuple(preferred))
    return (
        *policy.task_key(spec),
        spec.workload_class,
        spec.kind,
        spec.num_devices,
        spec.device_share_milli,
        spec.memory_per_device_gb,
        spec.work_ref_s,
        *lists,
    )


@dataclass
class _Shape:
    """One task shape's feasible rows (ascending) and their scores, with the rows bound since."""

    spec: ev.TaskSpec
    score: Callable[[Rows], NDArray[np.float64]]  # the policy's batch_scorer for the shape
    rows: Rows
    scores: NDArray[np.float64]
    upper_bounds: bool  # a stale score bounds the true one from above (see BatchScores)
    stale: set[int] = field(default_factory=set)  # device rows bound since ``scores`` were computed


class BatchScores:
    """Feasible rows and their scores per task shape, kept exact through one batch.

    A policy may decide a shape's tasks its own way instead (``Policy.batch_chooser``: the GNN's
    scores computed ahead); then it is told of every binding, and whether it was its own answer.

    Within a batch (one lock hold) the only changes are the batch's own bindings, which only take
    memory and capacity: rows never become feasible, and only the rows just bound change score or
    drop out. For a task its policy scores row by row (``Policy.row_local_for``), rescoring those
    rows gives exactly what a full pass would.

    Rescoring is lazy: a binding only marks its rows stale in every shape, and a shape's stale rows
    are checked and rescored together (one vectorized call) when a task of that shape needs them.
    When the policy declares that a binding never raises a row's score
    (``Policy.lowers_scores_for``), a stale score is an upper bound of the true one, so a
    one-device task whose best score is on a row that is not stale takes that row without any
    rescoring: no other row can beat it, nor tie it from an earlier position.
    """

    def __init__(self, graph: InfraGraph, policy: Policy) -> None:
        self.graph = graph
        self.policy = policy
        self.entries: dict[ShapeKey, _Shape] = {}
        # With the default choose_gang a task of one device takes the first of the best scores.
        self.first_best = type(policy).choose_gang is Policy.choose_gang
        self.choosers: dict[ShapeKey, BatchChooser | None] = {}
        self.answered: BatchChooser | None = None  # the chooser that answered the last ``choose``

    def choose(self, spec: ev.TaskSpec, plain: bool = False) -> tuple[Rows, Rows, float] | None:
        """(feasible rows, gang, mean score) as ``feasible_rows`` and ``choose_gang`` would give them
        now; None for a task whose scores depend on more than its shape (not cached). ``plain``:
        the spec names no lists (``Task.plain``)."""
        self.answered = None
        key = _shape(spec, self.policy, plain)
        if key is None:
            return None
        if key in self.choosers:
            chooser = self.choosers[key]
        else:
            chooser = self.choosers[key] = self.policy.batch_chooser(spec, self.graph)
        if chooser is not None:
            self.answered = chooser
            return chooser.choose(spec)
        if not self.policy.row_local_for(spec):  # not in the key: a service's filter reads its labels
            return None
        entry = self.entries.get(key)
        if entry is None:
            rows = self.graph.feasible_rows(spec)
            scorer = self.policy.batch_scorer(spec, self.graph)
            bounds = self.first_best and self.policy.lowers_scores_for(spec)
            entry = _Shape(spec, scorer, rows, np.array(scorer(rows), dtype=np.float64), bounds)
            if len(self.entries) >= MAX_CACHED_SHAPES:
                del self.entries[next(iter(self.entries))]
            self.entries[key] = entry
        elif entry.stale:
            if entry.upper_bounds and spec.num_devices <= 1 and len(entry.rows):
                best = int(entry.scores.argmax())
                if int(entry.rows[best]) not in entry.stale:
                    return entry.rows, entry.rows[best : best + 1], float(entry.scores[best])
            self._refresh(entry)
        if self.first_best and spec.num_devices <= 1:  # choose_gang's answer, without its call
            if not len(entry.rows):
                return entry.rows, entry.rows, 0.0
            best = int(entry.scores.argmax())
            return entry.rows, entry.rows[best : best + 1], float(entry.scores[best])
        gang, score = self.policy.choose_gang(spec, self.graph, entry.rows, entry.scores)
        return entry.rows, gang, score

    def bound(self, changed: Sequence[int]) -> None:
        """The batch bound ``changed`` device rows: their scores are stale in every shape."""
        for entry in self.entries.values():
            entry.stale.update(changed)
        for chooser in self.choosers.values():
            if chooser is not None:
                chooser.bound(changed, chooser is self.answered)
        self.answered = None

    def _refresh(self, entry: _Shape) -> None:
        """Recheck and rescore the entry's stale rows; drop those that no longer fit."""
        rows = entry.rows
        if len(entry.stale) == 1:  # the common case (one device bound since): a slice, no masks
            row = entry.stale.pop()
            i = int(rows.searchsorted(row))
            if i == len(rows) or rows[i] != row:
                return
            one = rows[i : i + 1]
            if self.graph.room(entry.spec, one)[0]:
                entry.scores[i : i + 1] = entry.score(one)
            else:
                entry.rows, entry.scores = np.delete(rows, i), np.delete(entry.scores, i)
            return
        changed = np.fromiter(sorted(entry.stale), dtype=np.int64, count=len(entry.stale))
        entry.stale.clear()
        if not len(rows):
            return
        at: NDArray[np.intp] = rows.searchsorted(changed)
        at = at[(at < len(rows)) & (rows[np.minimum(at, len(rows) - 1)] == changed)]
        if not len(at):
            return
        ok = self.graph.room(entry.spec, rows[at])
        if ok.any():
            entry.scores[at[ok]] = entry.score(rows[at[ok]])
        if not ok.all():
            keep = np.ones(len(rows), dtype=np.bool_)
            keep[at[~ok]] = False
            entry.rows, entry.scores = rows[keep], entry.scores[keep]


__all__ = ["BatchScores", "ShapeKey"]
