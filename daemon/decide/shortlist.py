"""Two-stage ranking: a cheap prior picks a bounded shortlist, the learned scorer ranks only that.

The GNN's scorer is a learned correction over a physical prior (hetero-greedy's estimated finish,
``export/model.py``), so the devices it can prefer are, in practice, among the best by that prior.
The prior is a few vectorized numpy operations over every feasible device; pair features and the
scorer, which cost about 50 times more per candidate, run over the shortlist only:

- the best ``k`` feasible rows by the prior, ties to the lower row (:func:`top_rows`), as the
  scheduler breaks ties everywhere;
- for a gang of ``g``: at least ``GANG_POOL_FACTOR * g`` rows (the pool ``choose_gang`` picks a
  gang from), plus every feasible device on each host the best rows are on, so a gang can still be
  placed on one host (and on one rack, through those hosts).

The shortlist never holds an infeasible device: it is a subset of the feasible rows the graph's
hard-constraint filter returned. ``k`` = 0 (or any ``k`` at least the feasible count) scores every
feasible device, as one-stage ranking did.

:class:`ShortlistBatch` makes the same decisions through a batch (``PlaceBatch``) without one
scorer run per placement: it scores a window of the best rows ahead, for each row the next
``levels`` bindings of the batch's task shape (:class:`~hlb.daemon.state.feasibility.Occupancy`), in one scorer
run, and then decides each task from those tables: the shortlist is the best ``k`` of the window
by the prior after the bindings so far, which is the shortlist over every feasible row as long as
its worst member still beats the best row outside the window (priors only fall with bindings).
When it does not, or a row used up its levels, or another shape's binding touched the window, the
window is drawn again from the graph as it is then.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.decide.framework import GANG_POOL_FACTOR, Scores
from hlb.daemon.state.feasibility import Occupancy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.tables import Rows
from hlb.v1 import events_pb2 as ev

Index = NDArray[np.intp]
# (rows, occupancy) -> scores [N]; the learned scorer returns None when it cannot score now.
PriorScorer = Callable[[Rows, Occupancy | None], Scores]
LearnedScorer = Callable[[Rows, Occupancy | None], Scores | None]

WINDOW_FACTOR = 2  # a batch scores ahead a window of (at first) this many times k rows
LEVELS = 2  # ... each for (at first) the next this many bindings


def top_rows(prior: Scores, k: int) -> Index:
    """Indices of the ``k`` highest priors, equal priors taken in index order; ascending.

    O(N) (a partition, no sort). Shapes: prior [N] -> [min(k, N)].
    """
    n = len(prior)
    if k >= n:
        return np.arange(n)
    if k <= 0:
        return np.empty(0, dtype=np.intp)
    kth = np.partition(prior, n - k)[n - k]  # the k-th highest value
    taken = prior > kth
    ties = np.flatnonzero(prior == kth)[: k - int(taken.sum())]
    taken[ties] = True
    return np.flatnonzero(taken)


def shortlist(graph: InfraGraph, feasible: Rows, prior: Scores, k: int, gang: int) -> Index:
    """Indices into ``feasible`` of the rows to score for a gang of ``gang`` (see the module
    docstring); all of them when ``k`` is 0. Ascending. Shapes: feasible, prior [F] -> [S]."""
    if k <= 0 or k >= len(feasible):
        return np.arange(len(feasible))
    if gang <= 1:
        return top_rows(prior, k)
    best = top_rows(prior, max(k, GANG_POOL_FACTOR * gang))
    hosts = graph.devices.host[feasible]
    return np.flatnonzero(np.isin(hosts, hosts[best]))


class ShortlistBatch:
    """One-device decisions for one task shape through a batch: those of the two-stage ranking
    task by task, from tables scored ahead (see the module docstring).

    ``prior`` and ``learned`` score rows under an :class:`Occupancy` (None: the graph's own);
    ``learned`` returns None when the model cannot score, and then this chooser steps aside
    (:meth:`choose` returns None) for the rest of the batch.

    The window starts at ``WINDOW_FACTOR * k`` rows, each scored for ``levels`` bindings, and grows
    where it proved too small: the whole window doubles when the batch's bindings pushed its
    shortlist below a row outside it (many devices with equal priors: each binding moves one row
    out), and when a row took every binding it was scored for, the shortlist's rows are scored for
    twice as many more from the graph as it is then (shared devices taking many tasks). Each decision
    between draws takes a few heap operations, not a pass over the window: heaps hold the window's
    rows outside the shortlist by prior (which do not change while outside), and the shortlist's
    worst prior and best learned score (an entry is checked against the row's current value when it
    comes to the top, and dropped when stale).
    """

    def __init__(
        self,
        spec: ev.TaskSpec,
        graph: InfraGraph,
        k: int,
        prior: PriorScorer,
        learned: LearnedScorer,
        levels: int = LEVELS,
    ) -> None:
        self.spec = spec
        self.graph = graph
        self.prior_of = prior
        self.learned_of = learned
        self.levels = max(1, levels)
        self.rows = graph.feasible_rows(spec)  # within a batch no row becomes feasible
        self.k = k if k > 0 else max(1, len(self.rows))
        self.window = WINDOW_FACTOR * self.k
        self.prior = prior(self.rows, None)
        self.changed: set[int] = set()  # rows bound since ``self.prior`` was computed for them
        self.touched = False  # another shape bound a row of the window
        self.failed = False
        self.last: int | None = None  # window index of the last answer
        self.draws = 0  # scorer runs: windows drawn and rows scored deeper
        self._build()

    def choose(self, spec: ev.TaskSpec) -> tuple[Rows, Rows, float] | None:
        if not self.failed and self.touched:
            self._build()
        for _ in range(2):
            if self.failed:
                return None
            if self._shortlist_holds():
                if not self.members:  # no row has room: nothing is feasible now
                    self.last = None
                    return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), 0.0
                best = self._best_learned()
                self.last = best
                return self.rows, self.window_rows[best : best + 1], self.learned[best]
            self.window *= 2
            self._build()
        return None  # not reached: a fresh window always holds the shortlist

    def bound(self, rows: Sequence[int], own: bool) -> None:
        self.changed.update(rows)
        if own and self.last is not None:
            i = self.last
            level = self.level[i] + 1
            if level == self._depth(i):  # used up: its next levels from the graph now
                if not self._deepen(i):
                    self.last = None
                    return
                level = 0
            self.level[i] = level
            deeper = self.deeper.get(i)
            if deeper is None:  # the window's tables: [levels, M], flat
                at = level * len(self.level) + i
                room, prior, learned = self.room_table[at], self.prior_table[at], self.learned_table[at]
            else:
                room, prior, learned = deeper[0][level], deeper[1][level], deeper[2][level]
            self.ranked[i] = prior if room else -math.inf
            self.learned[i] = learned
            self._fell(i)
        elif not self.touched and any(row in self.window_set for row in rows):
            self.touched = True
        self.last = None

    def _deepen(self, i: int) -> bool:
        """Row ``i`` took every binding its tables were scored for: score it, and with it every row
        of the shortlist (the rows the next bindings go to), for twice as many bindings, from the
        graph as it is now (which holds the bindings so far). False when the model cannot score."""
        rows = [j for j, member in enumerate(self.in_shortlist) if member]
        if i not in rows:
            rows.append(i)
        room, prior, learned = self._score_levels(self.window_rows[rows], 2 * self._depth(i))
        if learned is None:
            self.failed = True
            return False
        tables = zip(room.T.tolist(), prior.T.tolist(), learned.T.tolist(), strict=True)
        for j, table in zip(rows, tables, strict=True):  # level 0 is each row's present: read on from 1
            self.deeper[j] = table
            self.level[j] = 0
        return True

    def _depth(self, i: int) -> int:
        """Bindings row ``i``'s tables were scored for."""
        deeper = self.deeper.get(i)
        return self.levels if deeper is None else len(deeper[1])

    def _score_levels(self, rows: Rows, levels: int) -> tuple[NDArray[np.bool_], Scores, Scores | None]:
        """Room, prior and learned score of ``rows`` now and after each of the next ``levels`` - 1
        bindings of this shape: [levels, len(rows)] each; learned None when the model cannot score."""
        graph, spec = self.graph, self.spec
        steps = [Occupancy.of(graph, rows)]
        for _ in range(levels - 1):
            steps.append(steps[-1].after(spec.memory_per_device_gb))
        occupancy = Occupancy.concat(steps)
        tiled = np.tile(rows, levels)
        shape = (levels, len(rows))
        learned = self.learned_of(tiled, occupancy) if len(rows) else np.zeros(0)
        scored = None if learned is None else np.asarray(learned, dtype=np.float64).reshape(shape)
        self.draws += 1
        return graph.room(spec, tiled, occupancy).reshape(shape), self.prior_of(tiled, occupancy).reshape(shape), scored

    def _fell(self, i: int) -> None:
        """Row ``i`` of the shortlist lost prior (or room): the best row of the window outside the
        shortlist takes its place when it now ranks higher (the shortlist stays the window's best k)."""
        ranked, outside = self.ranked, self.outside_heap
        if outside:
            value, j = -outside[0][0], outside[0][1]  # the first best: the lowest row
            if value > ranked[i] or (value == ranked[i] and j < i):
                heapq.heappop(outside)
                self._leave(i)
                self._join(j)
                return
        if ranked[i] == -math.inf:  # no room left, and no row to take its place
            self._leave(i)
        else:
            self._enter(i)  # still a member: its new values

    def _join(self, i: int) -> None:
        self.in_shortlist[i] = True
        self.members += 1
        self._enter(i)

    def _enter(self, i: int) -> None:
        heapq.heappush(self.worst_heap, (self.ranked[i], -i))
        heapq.heappush(self.learned_heap, (-self.learned[i], i))

    def _leave(self, i: int) -> None:
        self.in_shortlist[i] = False
        self.members -= 1
        if self.ranked[i] > -math.inf:
            heapq.heappush(self.outside_heap, (-self.ranked[i], i))

    def _best_learned(self) -> int:
        """The shortlist's row of the highest learned score, the first (lowest row) of equals."""
        heap, learned, member = self.learned_heap, self.learned, self.in_shortlist
        while True:
            value, i = heap[0]
            if member[i] and -value == learned[i]:
                return i
            heapq.heappop(heap)  # left the shortlist, or scored anew since

    def _shortlist_holds(self) -> bool:
        """Whether the window's best k are the best k of every feasible row: the window holds every
        such row, or its k-th best still ranks above the best row outside it."""
        if self.outside is None:
            return True
        if self.members < self.k:
            return False
        heap, ranked, member = self.worst_heap, self.ranked, self.in_shortlist
        while True:
            worst_prior, minus = heap[0]
            if member[-minus] and worst_prior == ranked[-minus]:
                break
            heapq.heappop(heap)
        outside_prior, outside_row = self.outside
        if worst_prior != outside_prior:
            return worst_prior > outside_prior
        # the last of the worst (the highest row) against the best outside
        return int(self.window_rows[-minus]) < outside_row

    def _build(self) -> None:
        """Draw the window from the graph as it is now and score its rows' next levels."""
        graph, spec = self.graph, self.spec
        if self.changed:  # bound since: rescore those rows, drop the ones without room
            changed = np.fromiter(sorted(self.changed), dtype=np.int64, count=len(self.changed))
            self.changed.clear()
            at = np.searchsorted(self.rows, changed)
            at = at[(at < len(self.rows)) & (self.rows[np.minimum(at, len(self.rows) - 1)] == changed)]
            if len(at):
                ok = graph.room(spec, self.rows[at])
                self.prior[at[ok]] = self.prior_of(self.rows[at[ok]], None)
                keep = np.ones(len(self.rows), dtype=np.bool_)
                keep[at[~ok]] = False
                self.rows, self.prior = self.rows[keep], self.prior[keep]
        picked = top_rows(self.prior, self.window)
        self.window_rows = self.rows[picked]
        self.window_set = set(self.window_rows.tolist())
        self.outside: tuple[float, int] | None = None
        if len(picked) < len(self.rows):
            rest = np.ones(len(self.rows), dtype=np.bool_)
            rest[picked] = False
            others = np.flatnonzero(rest)
            j = others[int(np.argmax(self.prior[others]))]
            self.outside = (float(self.prior[j]), int(self.rows[j]))
        n = len(self.window_rows)
        room, prior, learned = self._score_levels(self.window_rows, self.levels)
        if learned is None:
            self.failed = True
            learned = np.zeros((self.levels, n))
        # Lists: a decision reads single values, which lists give without numpy's per-call cost.
        self.room_table: list[bool] = room.ravel().tolist()
        self.prior_table: list[float] = prior.ravel().tolist()
        self.learned_table: list[float] = learned.ravel().tolist()
        self.deeper: dict[int, tuple[list[bool], list[float], list[float]]] = {}  # rows scored deeper since
        self.level = [0] * n
        # The window's priors now, -inf for a row without room. [M]
        first = np.where(room[0], prior[0], -np.inf)
        self.ranked: list[float] = first.tolist()
        self.learned: list[float] = self.learned_table[:n]
        chosen = top_rows(first, min(self.k, int(room[0].sum())))
        self.in_shortlist = [False] * n
        self.members = 0
        self.worst_heap: list[tuple[float, int]] = []
        self.learned_heap: list[tuple[float, int]] = []
        for i in chosen.tolist():
            self._join(i)
        ranked = self.ranked
        self.outside_heap = [(-ranked[i], i) for i in range(n) if not self.in_shortlist[i] and ranked[i] > -math.inf]
        heapq.heapify(self.outside_heap)
        self.touched = False
        self.last = None


__all__ = ["LEVELS", "ShortlistBatch", "shortlist", "top_rows"]
