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
``levels`` bindings of the batch's task shape (:class:`~daemon.graph.Occupancy`), in one scorer
run, and then decides each task from those tables: the shortlist is the best ``k`` of the window
by the prior after the bindings so far, which is the shortlist over every feasible row as long as
its worst member still beats the best row outside the window (priors only fall with bindings).
When it does not, or a row used up its levels, or another shape's binding touched the window, the
window is drawn again from the graph as it is then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from daemon.graph import InfraGraph, Occupancy, Rows
from daemon.policy import GANG_POOL_FACTOR, Scores
from hlb.v1 import events_pb2 as ev

Index = NDArray[np.intp]
# (rows, occupancy) -> scores [N]; the learned scorer returns None when it cannot score now.
PriorScorer = Callable[[Rows, Occupancy | None], Scores]
LearnedScorer = Callable[[Rows, Occupancy | None], Scores | None]

WINDOW_FACTOR = 2  # a batch scores ahead a window of this many times k rows
LEVELS = 8  # ... each for the next this many bindings


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
        self._build()

    def choose(self, spec: ev.TaskSpec) -> tuple[Rows, Rows, float] | None:
        if not self.failed and (self.touched or self.used_up):
            self._build()
        for _ in range(2):
            if self.failed:
                return None
            if self._shortlist_holds():
                if not self.in_shortlist.any():  # no row has room: nothing is feasible now
                    self.last = None
                    return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), 0.0
                best = int(np.argmax(np.where(self.in_shortlist, self.learned, -np.inf)))  # the first: lowest row
                self.last = best
                return self.rows, self.window_rows[best : best + 1], float(self.learned[best])
            self._build()
        return None  # not reached: a fresh window always holds the shortlist

    def bound(self, rows: Sequence[int], own: bool) -> None:
        self.changed.update(rows)
        if own and self.last is not None:
            i = self.last
            self.level[i] += 1
            if self.level[i] >= self.levels:
                self.used_up = True
            else:
                level = self.level[i]
                self.ranked[i] = self.prior_table[level, i] if self.room_table[level, i] else -np.inf
                self.learned[i] = self.learned_table[level, i]
                self._fell(i)
        elif np.isin(np.asarray(rows), self.window_rows).any():
            self.touched = True
        self.last = None

    def _fell(self, i: int) -> None:
        """Row ``i`` of the shortlist lost prior (or room): the best row of the window outside the
        shortlist takes its place when it now ranks higher (the shortlist stays the window's best k)."""
        ranked = self.ranked
        outside = np.where(self.in_shortlist, -np.inf, ranked)
        j = int(np.argmax(outside))  # the first best: the lowest row
        if outside[j] > ranked[i] or (outside[j] == ranked[i] > -np.inf and j < i):
            self.in_shortlist[i], self.in_shortlist[j] = False, True
        elif ranked[i] == -np.inf:  # no room left, and no row to take its place
            self.in_shortlist[i] = False

    def _shortlist_holds(self) -> bool:
        """Whether the window's best k are the best k of every feasible row: the window holds every
        such row, or its k-th best still ranks above the best row outside it."""
        if self.outside is None:
            return True
        if np.count_nonzero(self.in_shortlist) < self.k:
            return False
        values = np.where(self.in_shortlist, self.ranked, np.inf)
        worst_prior = float(values.min())
        outside_prior, outside_row = self.outside
        if worst_prior != outside_prior:
            return worst_prior > outside_prior
        worst = len(values) - 1 - int(values[::-1].argmin())  # the last of the worst: the highest row
        return int(self.window_rows[worst]) < outside_row

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
        self.outside: tuple[float, int] | None = None
        if len(picked) < len(self.rows):
            rest = np.ones(len(self.rows), dtype=np.bool_)
            rest[picked] = False
            others = np.flatnonzero(rest)
            j = others[int(np.argmax(self.prior[others]))]
            self.outside = (float(self.prior[j]), int(self.rows[j]))
        n, m = len(self.window_rows), spec.memory_per_device_gb
        steps = [Occupancy.of(graph, self.window_rows)]
        for _ in range(self.levels - 1):
            steps.append(steps[-1].after(m))
        occupancy = Occupancy.concat(steps)
        rows = np.tile(self.window_rows, self.levels)
        learned = self.learned_of(rows, occupancy) if n else np.zeros(0)
        if learned is None:
            self.failed = True
            learned = np.zeros(len(rows))
        self.room_table = graph.room(spec, rows, occupancy).reshape(self.levels, n)
        self.prior_table = self.prior_of(rows, occupancy).reshape(self.levels, n)
        self.learned_table = np.asarray(learned, dtype=np.float64).reshape(self.levels, n)
        self.level = np.zeros(n, dtype=np.int64)
        # The window's priors now, -inf for a row without room. [M]
        self.ranked: Scores = np.where(self.room_table[0], self.prior_table[0], -np.inf)
        self.learned = self.learned_table[0].copy()
        self.in_shortlist = np.zeros(n, dtype=np.bool_)
        self.in_shortlist[top_rows(self.ranked, min(self.k, int(self.room_table[0].sum())))] = True
        self.used_up = False
        self.touched = False
        self.last = None


__all__ = ["LEVELS", "ShortlistBatch", "shortlist", "top_rows"]
