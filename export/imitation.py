"""Imitation with DAgger: the student learns the lookahead oracle's gangs on the states it reaches.

The lookahead oracle (:class:`hlb.sim.lookahead.LookaheadPolicy`) is the teacher. Iteration ``i`` runs
episodes in which every decision is labelled with the teacher's gang (:class:`DaggerPolicy`), and
the teacher's gang is carried out with probability ``beta_i`` (1 in the first iteration, halving
after), the student's otherwise, so later data comes from the states the student itself reaches.
The student is trained on all data so far: cross-entropy between the softmax of its scores over
the feasible devices and the teacher's gang, uniform over its rows (:func:`imitation_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from hlb.daemon.decide.framework import Policy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.export.student import Decision, TorchGnnPolicy, index_of
from hlb.sim.lookahead import LookaheadPolicy
from hlb.sim.simulator import Simulation
from hlb.v1 import events_pb2 as ev


class DaggerPolicy(Policy):
    """Labels every decision with the teacher's gang; carries out the teacher's with probability beta."""

    name = "gnn-dagger"

    def __init__(self, student: TorchGnnPolicy, teacher: LookaheadPolicy, beta: float, seed: int) -> None:
        self.student = student
        self.teacher = teacher
        self.beta = beta
        self.rng = np.random.default_rng(seed)
        self.data: list[Decision] = []

    def attach(self, sim: Simulation) -> None:
        self.teacher.attach(sim)
        self.student.attach(sim)

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        return self.teacher.score(spec, graph, rows)

    def choose_gang(
        self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: NDArray[np.float64] | None = None
    ) -> tuple[Rows, float]:
        gang = max(1, spec.num_devices)
        if len(feasible) < gang:
            return np.empty(0, dtype=np.int64), 0.0
        teacher_rows, teacher_score = self.teacher.choose_gang(spec, graph, feasible)
        if len(feasible) >= 2:
            self.data.append(self.student.decision(spec, graph, feasible, index_of(feasible, teacher_rows)))
        if self.rng.random() < self.beta:
            return teacher_rows, teacher_score
        return self.student.choose_gang(spec, graph, feasible)

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        self.teacher.placed(spec, graph, rows)

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        return self.teacher.rank(graph, tasks)


def imitation_loss(scores: Tensor, chosen: NDArray[np.int64]) -> Tensor:
    """Cross-entropy of softmax(scores) against the uniform distribution over the chosen rows."""
    log_p = torch.log_softmax(scores, dim=0)
    return -log_p[torch.from_numpy(chosen)].mean()
