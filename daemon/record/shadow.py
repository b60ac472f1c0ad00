"""Shadow scoring: a candidate model beside the running one, compared on the tasks as they finish.

With ``learning.shadow_model``, the daemon loads a second GNN (:class:`~hlb.daemon.decide.gnn.scorer.GnnScorer`,
its embeddings refreshed from its own thread as the running one's are) that decides nothing. When
a task the ``gnn`` policy placed finishes, :class:`Shadow` compares what each model predicts for
it with what happened: the label is ``hlb train``'s, ``log(prior run time / observed run time)``
on the gang's slowest device by the profiles (docs/gnn.md, "What the model predicts"); each
model's error is ``|label - predicted log speed ratio|`` there, and the profiles' own error is
``|label|``. Each is observed in ``hlb_shadow_abs_error{model="running"|"candidate"|"profiles"}``,
and a candidate that predicts better shows a lower mean there, on the same tasks.

The run time is the task's, by the times its started and finished events carry (the clock's
for an event that carries none; ``Scheduler.finish_listeners``), so a driver with its own clock (the
simulator, a test) is measured by that clock. The model lifecycle (``hlb.daemon.runtime.lifecycle``)
calls :meth:`Shadow.compare` itself, with the errors it returns.

The comparison runs when the finish is applied, under the daemon's lock (ingest's path, not a
request's): one head run of a model per task shape and embedding refresh, then array look-ups.
A model that does not serve (the candidate failed to load, or the running one is degraded) is
left out of that task's comparison; the others still count.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import structlog

from hlb.daemon.decide.gnn.scorer import GnnScorer
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import on_one_host
from hlb.daemon.state.tables import Rows
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

MODELS = ("running", "candidate", "profiles")  # hlb_shadow_abs_error's model label
Observe = Callable[[str, float], None]  # (model, absolute error in log speed ratio)


class Shadow:
    """Compares ``candidate`` with the running scorer on each finished task (module docstring).
    ``attach`` it to the running scorer (again after a reload builds a new one). Without a
    candidate it scores the running model and the profiles alone."""

    def __init__(self, candidate: GnnScorer | None, observe: Observe) -> None:
        self.candidate = candidate
        self.observe = observe
        self.compared = 0
        self._running: GnnScorer | None = None

    def attach(self, running: GnnScorer) -> None:
        """Listen to ``running``'s finished tasks (and no longer to the one before)."""
        if self._running is not None and self.finished in self._running.finish_listeners:
            self._running.finish_listeners.remove(self.finished)
        self._running = running
        running.finish_listeners.append(self.finished)

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        if self._running is not None:
            self.compare(self._running, spec, graph, rows, ran_s)

    def compare(
        self, running: GnnScorer, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float
    ) -> dict[str, float]:
        """Each model's absolute error on one finished task (observed, and returned by model name;
        a model that does not serve is left out); empty when the task cannot be labelled."""
        if not len(rows) or spec.work_ref_s <= 0 or not (ran_s > 0 and np.isfinite(ran_s)):
            return {}
        prior_s = running.fallback.profiles.gang_runtime_s(graph, rows, spec)
        slowest = int(np.argmax(prior_s))
        label = float(np.log(prior_s[slowest] / ran_s))
        gang, consolidated = len(rows), on_one_host(graph, rows)
        candidate = self.candidate
        if candidate is not None and candidate.mode == "sync":  # no refresh thread (a simulation): re-encode
            candidate.refresh_if_changed(graph)
        bounding = rows[slowest : slowest + 1]
        errors = {"profiles": abs(label)}
        for name, scorer in (("running", running), ("candidate", candidate)):
            if scorer is None:
                continue
            predicted = scorer.log_ratios(spec, graph, bounding, gang, consolidated)
            if predicted is not None and np.isfinite(predicted[0, 0]):
                errors[name] = abs(label - float(predicted[0, 0]))
        for name, error in errors.items():
            self.observe(name, error)
        self.compared += 1
        return errors


__all__ = ["MODELS", "Shadow"]
