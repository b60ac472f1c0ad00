"""The runs behind the experiments over the completion-time correction (hlb.export.head_runs)."""

from __future__ import annotations

import numpy as np

from hlb.export.head_runs import HEAD_DIM, against_zeros, mean_jct, start_worker
from hlb.export.recipe import TINY_STAGES


def test_each_correction_is_compared_with_zeros_on_the_same_runs() -> None:
    stage = TINY_STAGES[0]
    seeds = [900, 901, 902]
    strong = (np.random.default_rng(0).standard_normal(HEAD_DIM) * 100.0).tolist()
    result = against_zeros([[0.0] * HEAD_DIM, strong], seeds, workers=1, stages=[stage])

    start_worker()  # the same runs in this process, one by one
    zeros = np.array([mean_jct(([0.0] * HEAD_DIM, stage, seed)) for seed in seeds])
    learned = np.array([mean_jct((strong, stage, seed)) for seed in seeds])
    assert result["seeds"] == seeds
    assert result["zeros_jct_s"] == [zeros.tolist()]
    assert not np.array_equal(learned, zeros)  # the correction reaches the decisions

    same, other = result["against_zeros"]
    assert same["per_stage"][stage.label()] == {"pct": 0.0, "se_pct": 0.0}
    assert same["both_pct"] == 0.0
    ratio = learned / zeros
    assert other["per_stage"][stage.label()]["pct"] == round(float(ratio.mean() - 1) * 100, 2)
    assert other["both_pct"] == round(float(np.exp(np.log(ratio).mean()) - 1) * 100, 2)
