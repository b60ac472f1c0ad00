"""REINFORCE with an input-dependent baseline, its updates kept near the sampling model by PPO's clip.

Each iteration draws a few workloads and runs several episodes of each with the student sampling
its gang (Gumbel-perturbed scores at a temperature, then the usual locality-tiered gang choice).
A decision's return is minus the flow time still to come after it,
``-sum_j max(0, finish_j - max(t, arrival_j))`` over every task (:func:`returns_to_go`); its
baseline is the mean return at the same time over the episodes of the *same* workload (the input),
which removes the variance due to arrivals (:func:`baseline_advantages`). The log-probability of a
gang is Plackett-Luce over the candidates in the order of the perturbed scores
(:func:`plackett_luce_log_prob`). An iteration takes an optimizer step every few decisions, so
later steps see decisions sampled by an older model; PPO's clipped surrogate (``rl_clip``,
:func:`clipped_surrogate`) keeps each step from moving a decision's probability far beyond
``1 ± rl_clip`` times the sampling model's, where plain REINFORCE (``rl_clip`` 0) lets it run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from hlb.export.student import Decision
from hlb.sim.result import SimResult


def plackett_luce_log_prob(scores: Tensor, chosen: NDArray[np.int64], temperature: float) -> Tensor:
    """log P(drawing ``chosen`` in that order without replacement) under softmax(scores / T)."""
    logits = scores / temperature
    mask = torch.zeros_like(logits, dtype=torch.bool)
    total = logits.new_zeros(())
    for index in chosen.tolist():
        total = total + logits[index] - torch.logsumexp(logits.masked_fill(mask, float("-inf")), dim=0)
        mask = mask.clone()
        mask[index] = True
    return total


def clipped_surrogate(log_prob: Tensor, old_log_prob: float, advantage: float, clip: float) -> Tensor:
    """PPO's loss for one decision: ``-min(r A, clip(r, 1 - clip, 1 + clip) A)`` with ``r`` the ratio
    of its probability now to that under the model that sampled it; its gradient is zero once ``r``
    has moved past the clip in the direction the advantage pushes it."""
    ratio = torch.exp(log_prob - old_log_prob)
    return -torch.minimum(ratio * advantage, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantage)


def returns_to_go(result: SimResult, times_s: NDArray[np.float64]) -> NDArray[np.float64]:
    """Minus the flow time (s) still to come after each time: ``-sum max(0, finish - max(t, arrival))``.

    A task that never finished counts until the run's end. Shapes: [N] -> [N].
    """
    arrival = np.array([r.arrival_s for r in result.tasks], dtype=np.float64)
    finish = np.array(
        [r.finish_s if math.isfinite(r.finish_s) else result.end_s for r in result.tasks], dtype=np.float64
    )
    if not len(arrival):
        return np.zeros(len(times_s))
    start = np.maximum(times_s[:, None], arrival[None, :])
    return np.asarray(-np.maximum(0.0, finish[None, :] - start).sum(axis=1), dtype=np.float64)


def baseline_advantages(episodes: Sequence[tuple[list[Decision], SimResult]]) -> tuple[list[Decision], list[float]]:
    """Set each decision's advantage over episodes of one workload; the decisions, and each
    episode's return (s) for an episode that recorded any.

    The input-dependent baseline: the mean return-to-go at the same time over the episodes. An
    advantage is the decision's own return-to-go minus that, over the baseline's largest magnitude.
    """
    decisions: list[Decision] = []
    returns: list[float] = []
    times = np.unique(np.concatenate([[d.time_s for d in rec] for rec, _ in episodes] + [np.zeros(1)]))
    curves = np.stack([returns_to_go(result, times) for _, result in episodes])
    baseline = curves.mean(axis=0)
    scale = float(np.abs(baseline).max()) or 1.0
    for recorded, result in episodes:
        if not recorded:
            continue
        at = np.searchsorted(times, [d.time_s for d in recorded])
        own = returns_to_go(result, times[at])
        for decision, advantage in zip(recorded, (own - baseline[at]) / scale, strict=True):
            decision.advantage = float(advantage)
            decisions.append(decision)
        returns.append(float(returns_to_go(result, np.zeros(1))[0]))
    return decisions, returns
