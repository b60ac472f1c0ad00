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

Each model's prediction is the one it made from the inputs of the moment the task was placed
(:meth:`Shadow.decided`, told of every placement before its devices hold the task:
``Scheduler.place_listeners``), as the decision
itself read them: by the time the task finishes its device holds it, and the cluster around it
has moved, so a prediction made then would be for inputs no decision ever sees (a head fitted on
a few hundred live rows read them as another device: 0.74 against 0.06 on its validation rows). A
task placed before the shadow listened (a restart) is predicted when it finishes.

The predictions are kept under the daemon's lock on the placement's path: a look-up in each
model's predictions for the task's shape (one head run per shape and embedding refresh) for the
gang's bounding device. The comparison runs when the finish is applied (ingest's path).
A model that does not serve (the candidate failed to load, or the running one is degraded) is
left out of that task's comparison; the others still count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import structlog

from hlb.daemon.decide.gnn.scorer import GnnScorer
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import on_one_host
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

MODELS = ("running", "candidate", "profiles")  # hlb_shadow_abs_error's model label
KEPT_PREDICTIONS = 1_000_000  # tasks placed and not ended whose predictions are kept (oldest dropped)
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
        # task id -> (its device rows, each model's predicted log speed ratio at the decision)
        self._at_decision: OrderedDict[str, tuple[tuple[int, ...], dict[str, float]]] = OrderedDict()

    def attach(self, running: GnnScorer) -> None:
        """Listen to ``running``'s finished tasks (and no longer to the one before)."""
        if self._running is not None and self.finished in self._running.finish_listeners:
            self._running.finish_listeners.remove(self.finished)
        self._running = running
        running.finish_listeners.append(self.finished)

    def listen(self, scheduler: Scheduler, running: Callable[[], GnnScorer | None]) -> None:
        """Keep the predictions of each of ``scheduler``'s placements (:meth:`decided`), the running
        model being ``running()``'s at that moment (a reload may have replaced it)."""
        scheduler.place_listeners.append(lambda task, rows: self.decided(running(), task.spec, scheduler.graph, rows))
        scheduler.end_listeners.append(self.ended)

    def ended(self, task: Task) -> None:
        """A task ended: a failed or cancelled one is never compared, so its predictions go."""
        self._at_decision.pop(task.spec.id, None)

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        if self._running is not None:
            self.compare(self._running, spec, graph, rows, ran_s)

    def decided(self, running: GnnScorer | None, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        """A task was placed on ``rows``: keep each model's prediction for its bounding device now."""
        if running is None or not len(rows) or spec.work_ref_s <= 0:
            return
        predicted = self._predict(running, spec, graph, rows)
        self._at_decision[spec.id] = (tuple(rows.tolist()), predicted)
        self._at_decision.move_to_end(spec.id)
        while len(self._at_decision) > KEPT_PREDICTIONS:
            self._at_decision.popitem(last=False)

    def _predict(self, running: GnnScorer, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> dict[str, float]:
        """Each serving model's predicted log speed ratio for ``spec`` on its gang's bounding device."""
        prior_s = running.fallback.profiles.gang_runtime_s(graph, rows, spec)
        slowest = int(np.argmax(prior_s))
        gang, consolidated = len(rows), on_one_host(graph, rows)
        candidate = self.candidate
        if candidate is not None and candidate.mode == "sync":  # no refresh thread (a simulation): re-encode
            candidate.refresh_if_changed(graph)
        bounding = rows[slowest : slowest + 1]
        out: dict[str, float] = {}
        for name, scorer in (("running", running), ("candidate", candidate)):
            if scorer is None:
                continue
            predicted = scorer.log_ratios(spec, graph, bounding, gang, consolidated)
            if predicted is not None and np.isfinite(predicted[0, 0]):
                out[name] = float(predicted[0, 0])
        return out

    def compare(
        self, running: GnnScorer, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float
    ) -> dict[str, float]:
        """Each model's absolute error on one finished task (observed, and returned by model name;
        a model that did not serve is left out); empty when the task cannot be labelled."""
        kept = self._at_decision.pop(spec.id, None)
        if not len(rows) or spec.work_ref_s <= 0 or not (ran_s > 0 and np.isfinite(ran_s)):
            return {}
        prior_s = running.fallback.profiles.gang_runtime_s(graph, rows, spec)
        label = float(np.log(prior_s[int(np.argmax(prior_s))] / ran_s))
        if kept is not None and kept[0] == tuple(rows.tolist()):
            predicted = kept[1]
        else:  # placed before this shadow listened: predicted from the inputs of now
            predicted = self._predict(running, spec, graph, rows)
        errors = {"profiles": abs(label)}
        errors.update({name: abs(label - value) for name, value in predicted.items()})
        for name, error in errors.items():
            self.observe(name, error)
        self.compared += 1
        return errors


__all__ = ["MODELS", "Shadow"]
