"""The learner's replay (hlb.export.replay): the validation window's tasks on a cluster calibrated
from the logged runs, each arm's predictions deciding under the same policy. Heads here are plain
functions of the device, so the replay's own logic is what is tested."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.record.feature_record import log_prior_column
from hlb.export.replay import Calibration, replay

COLUMN = log_prior_column() or 0
# Two device models the profiles rank fast (log speed 1) and slow (0); on this cluster the "fast"
# ones run at 0.2 of the reference, a task of 100 s taking 500 s there, and the "slow" ones as profiled.
PRIOR = {"fast": 1.0, "slow": 0.0}
TRUTH = {"fast": math.log(0.2) - 1.0, "slow": 0.0}
DEVICES = [("f0", "fast"), ("f1", "fast"), ("s0", "slow"), ("s1", "slow")]


def row(i: int, device: str, model: str, label: float, gang: int = 1, **extra: Any) -> dict[str, Any]:
    prior = [0.0] * len(feat.PRIOR_FEATURES)
    prior[COLUMN] = PRIOR[model]
    index = [d for d, _ in DEVICES].index(device)
    return {
        "decided_at_ms": 1_000_000 + 60_000 * i,
        "workload_class": "resnet50",
        "kind": "TASK_KIND_TRAINING",
        "gang": gang,
        "consolidated": False,
        "work_ref_s": 100.0 * gang,
        "shape_features": [0.0, 1.0],
        "device_ids": [device],
        "device_models": [model],
        "bounding_device": device,
        "prior_features": prior,
        "observed_log_ratio": label,
        "device_embedding": [float(index)],  # the fake heads read the device from it
        "context": [0.0],
    } | extra


def window(n: int, start: int = 0, gang: int = 1) -> list[dict[str, Any]]:
    """``n`` tasks a minute apart, over every device in turn, labelled with the truth."""
    out = []
    for i in range(start, start + n):
        device, model = DEVICES[i % len(DEVICES)]
        out.append(row(i, device, model, TRUTH[model], gang))
    return out


def head_of(log_ratio: dict[str, float]) -> Any:
    """A head that predicts ``log_ratio`` of each device's model, whatever the task."""
    by_index = np.asarray([log_ratio[model] for _, model in DEVICES])

    def head(
        shape_x: NDArray[np.float32], emb: NDArray[np.float32], prior: NDArray[np.float32], context: NDArray[np.float32]
    ) -> NDArray[np.float64]:
        assert prior.shape[:2] == (len(shape_x), len(emb))
        return np.tile(by_index[emb[:, 0].astype(int)], (len(shape_x), 1))

    return head


KNOWS = head_of(TRUTH)
ZERO = head_of({"fast": 0.0, "slow": 0.0})


def NO_TABLE(model: str, workload_class: str) -> float:  # noqa: N802 - a constant of the tests
    return 0.0


def test_a_head_that_knows_the_truth_replays_faster_than_the_profiles() -> None:
    """A task a minute on four devices: the profiles expect 37 s on a "fast" device and keep
    queueing there (500 s each); the truth's favourites take 100 s and keep up."""
    result = replay(window(40), window(60, start=40), {"candidate": KNOWS, "running": ZERO}, NO_TABLE)
    assert (result.tasks, result.devices, result.left_out) == (60, 4, {})
    jct = result.jct_mean_s
    assert jct["running"] == jct["profiles"] == jct["table"]  # all three predict the profiles here
    assert jct["candidate"] < jct["running"] / 2
    change = result.candidate_vs_running
    assert change["low"] <= change["mean"] <= change["high"] < 0
    assert change["mean"] == pytest.approx(jct["candidate"] / jct["running"] - 1, abs=1e-6)
    # The other way round, the same replay says the candidate is slower, beyond doubt.
    worse = replay(window(40), window(60, start=40), {"candidate": ZERO, "running": KNOWS}, NO_TABLE)
    assert worse.candidate_vs_running["low"] > 0


def test_runs_last_as_the_calibrated_truth_says_and_tasks_wait_for_a_faster_device() -> None:
    """One task at a time, far apart: each runs alone on the device its arm predicts fastest, for
    the truth's time there (100 s on a "slow" device, 500 s on a "fast" one)."""
    tasks = [row(10 * i, *DEVICES[i % 4], TRUTH[DEVICES[i % 4][1]]) for i in range(8)]
    result = replay([], tasks, {"candidate": KNOWS, "running": ZERO}, NO_TABLE)
    assert result.jct_mean_s["candidate"] == pytest.approx(100.0)
    assert result.jct_mean_s["running"] == pytest.approx(500.0)
    # Four tasks at once on two devices the candidate knows are fast: the third and fourth wait
    # for them (100 s more) rather than take a "fast" one (500 s).
    burst = [row(0, *DEVICES[i], TRUTH[DEVICES[i][1]]) for i in range(4)]
    assert replay([], burst, {"candidate": KNOWS, "running": ZERO}, NO_TABLE).jct_mean_s["candidate"] == 150.0


def test_a_gang_takes_its_best_devices_and_runs_at_its_slowest_members_pace() -> None:
    tasks = [row(10 * i, *DEVICES[i % 4], TRUTH[DEVICES[i % 4][1]], gang=3) for i in range(4)]
    result = replay([], tasks, {"candidate": KNOWS, "running": ZERO}, NO_TABLE)
    # Three devices of four: at least one "fast" one, at 500 s a member's share of 100 s.
    assert result.jct_mean_s["candidate"] == pytest.approx(500.0)


def test_the_truth_falls_back_from_the_device_to_its_model_then_the_training_rows_then_the_profiles() -> None:
    validation = [row(0, "f0", "fast", -2.0), row(1, "f0", "fast", -1.0), row(2, "s0", "slow", 0.5)]
    training = [row(0, "f1", "fast", 9.0), row(0, "s1", "slow", 0.3)]
    truth = Calibration(validation, training)
    assert truth.log_ratio("f0", "fast", "resnet50") == -1.5  # its own rows' median
    assert truth.log_ratio("f1", "fast", "resnet50") == -1.5  # none of its own: its model's, in the window
    assert truth.log_ratio("f1", "fast", "lm") == -1.5  # its model's over every class
    assert truth.log_ratio("x", "other", "resnet50") == 0.0  # nothing known: the profiles
    assert Calibration([], training).log_ratio("s0", "slow", "resnet50") == 0.3  # the training rows'


def test_tasks_arrive_when_submitted_where_the_rows_say() -> None:
    # Submitted together, decided a minute apart: in the replay they compete for the one device the
    # candidate likes best.
    tasks = [row(i, *DEVICES[i % 4], TRUTH[DEVICES[i % 4][1]], submitted_ms=1_000_000) for i in range(4)]
    together = replay([], tasks, {"candidate": KNOWS, "running": ZERO}, NO_TABLE).jct_mean_s["candidate"]
    apart = replay([], [{**t, "submitted_ms": None} for t in tasks], {"candidate": KNOWS, "running": ZERO}, NO_TABLE)
    assert together == 150.0
    assert apart.jct_mean_s["candidate"] == 100.0


def test_a_device_without_prior_features_for_a_shape_is_not_offered_and_a_task_without_enough_is_left_out() -> None:
    lm = [row(i, *DEVICES[i % 2], TRUTH["fast"], workload_class="lm") for i in range(2)]  # only "fast" devices ran lm
    tasks = [*lm, *(row(10 + i, *DEVICES[i % 4], TRUTH[DEVICES[i % 4][1]]) for i in range(4))]
    gang_lm = row(20, "f0", "fast", TRUTH["fast"], gang=3, workload_class="lm")  # 2 devices know its shape
    result = replay([], [*tasks, gang_lm], {"candidate": KNOWS, "running": ZERO}, NO_TABLE)
    assert result.tasks == 6
    assert result.left_out == {"too_few_devices_with_its_shape": 1}
    # The lm tasks ran on "fast" devices (500 s) though the candidate prefers the others.
    assert result.jct_mean_s["candidate"] == pytest.approx((2 * 500.0 + 4 * 100.0) / 6)
