"""Run-time estimates corrected by the GNN: the device profiles' speeds times the ratio it predicts.

:class:`LearnedSpeeds` is the profiles the ``gnn`` preset estimates with: every consumer of
estimates (hetero-greedy's earliest finish, the rules, the expected ends of placed tasks) reads
``profiled speed * exp(predicted log ratio)`` for the devices the model has embedded, and the
profiled speed alone for any other (a device added since the last refresh, or no model loaded).
The predictions come from :meth:`hlb.daemon.decide.gnn.scorer.GnnScorer.speed_factors`, one head run
per task shape over every embedded device, kept until the embeddings change (a gather per estimate).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles
from hlb.daemon.state.tables import Rows
from hlb.v1 import events_pb2 as ev

# (spec, graph, rows, gang, consolidated) -> per row [C, 2]: predicted log speed ratio and log
# standard deviation, NaN for a row the model has no embedding of; None: no prediction at all.
Predictor = Callable[[ev.TaskSpec, InfraGraph, Rows, int, bool], "NDArray[np.float64] | None"]
# (spec, graph, gang, consolidated) -> the predicted speed ratio of every device row [capacity], 1
# for a row without an embedding; None: no prediction at all.
Factors = Callable[[ev.TaskSpec, InfraGraph, int, bool], "NDArray[np.float64] | None"]


class LearnedSpeeds(DeviceProfiles):
    """``base`` times the predicted speed ratio (see the module docstring)."""

    def __init__(self, base: DeviceProfiles, factors: Factors, predict: Predictor, version: Callable[[], int]) -> None:
        self.__dict__.update(base.__dict__)  # the base's tables and its caches of profiled rates
        self.base = base
        self._factors = factors
        self._predict = predict
        self._version = version

    @property
    def version(self) -> int:
        """Changes with every new set of embeddings: caches of estimates must be rebuilt."""
        return self._version() + self.base.version

    def device_speedups(
        self, graph: InfraGraph, rows: Rows, spec: ev.TaskSpec, gang: int | None = None, consolidated: bool = True
    ) -> NDArray[np.float64]:
        base = self.base.device_speedups(graph, rows, spec, gang, consolidated)
        size = max(1, spec.num_devices) if gang is None else max(1, gang)
        factors = self._factors(spec, graph, size, consolidated)
        if factors is None:
            return base
        corrected: NDArray[np.float64] = base * factors[rows]
        return corrected

    def log_sigma(
        self, graph: InfraGraph, rows: Rows, spec: ev.TaskSpec, gang: int | None = None, consolidated: bool = True
    ) -> NDArray[np.float64] | None:
        """The model's standard deviation of each row's log speed (NaN where it has none); None
        without a model. [C] -> [C]."""
        size = max(1, spec.num_devices) if gang is None else max(1, gang)
        predicted = self._predict(spec, graph, rows, size, consolidated)
        return None if predicted is None else predicted[:, 1]

    def observe(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        self.base.observe(spec, graph, rows, ran_s)


__all__ = ["Factors", "LearnedSpeeds", "Predictor"]
