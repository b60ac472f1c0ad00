"""What a candidate head would do to job completion times: a replay of the validation window on a
cluster calibrated from the logged runs.

The logs cannot give an off-policy estimate of another model's choices: the policy does not
explore (propensity 1) and a record holds the embeddings of the chosen devices only. So the
learner replays instead (:func:`replay`):

- **The cluster**: every device some usable row ran on as its bounding device, with the mean
  embedding of its rows in the validation window (of its training rows where it ran in none),
  frozen: what the encoder said of it on average over the window the truth is calibrated on. (The
  embedding of its last row alone carries the state of that moment, its co-runners then, and a
  head that reads them applies that moment to the whole replay.)
- **The truth**, calibrated from the validation window's observed runs, which no arm was fitted
  on: a device's log speed ratio is the median label of its own rows there, else that of its
  model and workload class, else of its model (in the window, then in the training rows), else 0
  (the profiles).
- **The tasks**: the validation window's rows, each arriving when it was submitted (when it was
  decided where the topic no longer holds the submission), with its work, shape and the encoder's
  context as logged.
- **The policy**, the same for every arm: each task in arrival order takes the devices with the
  earliest predicted finish (a free device now, a busy one when its queue is predicted to drain:
  waiting for a faster device is allowed), its gang the best ``gang`` of them; it starts when they
  are all actually free and runs as the truth says (a gang at the pace of its slowest member).
- **The arms**: the candidate's head and the running model's head on the frozen embeddings, the
  table estimator (its model's median label), and the profiles alone (log ratio 0).

The estimate is the change of mean JCT of the candidate against the running model over the same
tasks, with a 95% percentile bootstrap interval of the ratio of means over tasks resampled in pairs
(the tasks of one replay are not independent: the interval is narrower than it should be).

What it leaves out: devices that were never the bounding device of a usable row (no embedding, no
calibration), tasks whose shape has no prior features for a device model (no row of that model
with that shape; such a device is not offered to that task), the hosts of consolidated gangs (a
gang takes its best devices wherever they are), and the state the frozen embeddings no longer
describe (a device's utilization and co-runners as they were when it last ran a logged task).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.record.feature_record import log_prior_column

# A head's predicted log speed ratio for each (task, device) pair: the tasks' shape features and
# contexts [T, S] and [T, G], the devices' embeddings [D, E], the pairs' prior features [T, D, P].
HeadFn = Callable[[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]], NDArray[Any]]
ARMS = ("candidate", "running", "table", "profiles")


@dataclass
class ReplayResult:
    """One replay: how many tasks and devices it had, each arm's mean JCT, the candidate's change
    against the running model (``mean``: its mean JCT over theirs, minus 1; ``low``, ``high``: the
    95% interval), and what was left out, by reason."""

    tasks: int
    devices: int
    jct_mean_s: dict[str, float] = field(default_factory=dict)
    candidate_vs_running: dict[str, float] = field(default_factory=dict)
    candidate_vs_table: dict[str, float] = field(default_factory=dict)
    left_out: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "devices": self.devices,
            "jct_mean_s": {k: round(v, 3) for k, v in self.jct_mean_s.items()},
            "candidate_vs_running": self.candidate_vs_running,
            "candidate_vs_table": self.candidate_vs_table,
            "left_out": self.left_out,
        }


def _shape_key(row: dict[str, Any]) -> tuple[str, str, int, bool]:
    return (str(row.get("workload_class", "")), str(row.get("kind", "")), int(row["gang"]), bool(row["consolidated"]))


def _arrival_ms(row: dict[str, Any]) -> int:
    submitted = row.get("submitted_ms")
    return int(submitted) if submitted else int(row["decided_at_ms"])


class Calibration:
    """The replay's truth: each device's log speed ratio per workload class (module docstring)."""

    def __init__(self, validation: Sequence[dict[str, Any]], training: Sequence[dict[str, Any]]) -> None:
        def medians(rows: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, float]:
            groups: dict[Any, list[float]] = defaultdict(list)
            for row in rows:
                groups[key(row)].append(float(row["observed_log_ratio"]))
            return {k: float(np.median(v)) for k, v in groups.items()}

        self.device_class = medians(validation, lambda r: (r["bounding_device"], r.get("workload_class", "")))
        self.model_class = medians(validation, lambda r: (bounding_model(r), r.get("workload_class", "")))
        self.model = medians(validation, bounding_model)
        self.model_trained = medians(training, bounding_model)

    def log_ratio(self, device: str, model: str, workload_class: str) -> float:
        for table, key in (
            (self.device_class, (device, workload_class)),
            (self.model_class, (model, workload_class)),
            (self.model, model),
            (self.model_trained, model),
        ):
            value = table.get(key)
            if value is not None:
                return value
        return 0.0


def bounding_model(row: dict[str, Any]) -> str:
    """The device model of the row's bounding device (the gang's slowest by the profiles)."""
    ids, models = row.get("device_ids") or [], row.get("device_models") or []
    bounding = row.get("bounding_device")
    return str(models[ids.index(bounding)]) if bounding in ids and len(models) == len(ids) else ""


def replay(
    training: Sequence[dict[str, Any]],
    validation: Sequence[dict[str, Any]],
    heads: dict[str, HeadFn],
    table: Callable[[str, str], float],
    resamples: int = 2000,
    seed: int = 0,
) -> ReplayResult:
    """Replay ``validation``'s tasks on the devices of ``training`` and ``validation`` (usable rows,
    in decision order) under each arm (module docstring). ``heads``: the ``candidate`` and
    ``running`` heads; ``table``: the table estimator's log ratio for a (device model, workload
    class)."""
    column = log_prior_column()
    left_out: Counter[str] = Counter()
    embeddings: dict[str, list[list[float]]] = defaultdict(list)
    model_of: dict[str, str] = {}
    priors: dict[tuple[str, tuple[str, str, int, bool]], list[float]] = {}
    for rows in (training, validation):
        window: dict[str, list[list[float]]] = defaultdict(list)
        for row in rows:
            device, model = str(row["bounding_device"]), bounding_model(row)
            window[device].append(row["device_embedding"])
            model_of[device] = model
            priors[(model, _shape_key(row))] = row["prior_features"]
        embeddings.update(window)  # the validation window's where the device ran there
    devices = sorted(embeddings)
    tasks = sorted(validation, key=_arrival_ms)
    if column is None or not devices or not tasks:
        return ReplayResult(len(tasks), len(devices), left_out={"no_prior_column": 1} if column is None else {})
    calibration = Calibration(validation, training)
    models = [model_of[d] for d in devices]
    emb = np.asarray([np.mean(embeddings[d], axis=0) for d in devices], dtype=np.float32)
    # Pairs without prior features for their shape get NaN: the device is not offered to the task.
    width = len(tasks[0]["prior_features"])
    prior = np.full((len(tasks), len(devices), width), np.nan, dtype=np.float32)
    truth = np.zeros((len(tasks), len(devices)))
    for t, row in enumerate(tasks):
        shape = _shape_key(row)
        for d, (device, model) in enumerate(zip(devices, models, strict=True)):
            features = priors.get((model, shape))
            if features is not None:
                prior[t, d] = features
            truth[t, d] = calibration.log_ratio(device, model, str(row.get("workload_class", "")))
    offered = ~np.isnan(prior[:, :, 0])
    runnable = offered.sum(axis=1) >= np.asarray([max(1, int(r["gang"])) for r in tasks])
    left_out["too_few_devices_with_its_shape"] = int((~runnable).sum())
    keep = np.flatnonzero(runnable)
    tasks, prior, truth, offered = [tasks[i] for i in keep], prior[keep], truth[keep], offered[keep]
    if not tasks:
        return ReplayResult(0, len(devices), left_out=dict(left_out))
    shape_x = np.asarray([r["shape_features"] for r in tasks], dtype=np.float32)
    context = np.asarray([r["context"] for r in tasks], dtype=np.float32)
    safe_prior = np.nan_to_num(prior)
    predicted = {
        name: np.asarray(head(shape_x, emb, safe_prior, context), dtype=np.float64) for name, head in heads.items()
    }
    predicted["table"] = np.asarray(
        [[table(m, str(r.get("workload_class", ""))) for m in models] for r in tasks], dtype=np.float64
    )
    predicted["profiles"] = np.zeros(truth.shape)
    log_prior = safe_prior[:, :, column].astype(np.float64)
    jct = {name: _run(tasks, log_prior, offered, predicted[name], truth) for name in ARMS if name in predicted}
    rng = np.random.default_rng(seed)
    return ReplayResult(
        tasks=len(tasks),
        devices=len(devices),
        jct_mean_s={name: float(values.mean()) for name, values in jct.items()},
        candidate_vs_running=_ratio_interval(jct["candidate"], jct["running"], resamples, rng),
        candidate_vs_table=_ratio_interval(jct["candidate"], jct["table"], resamples, rng),
        left_out={k: v for k, v in left_out.items() if v},
    )


def _run(
    tasks: Sequence[dict[str, Any]],
    log_prior: NDArray[np.float64],
    offered: NDArray[np.bool_],
    predicted: NDArray[np.float64],
    truth: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Each task's JCT (s) under one arm's predictions: earliest predicted finish, run as the truth
    says. Shapes: [T, D] each -> [T]."""
    num_devices = log_prior.shape[1]
    free_at = np.zeros(num_devices)  # when each device's queue actually drains (s)
    predicted_free_at = np.zeros(num_devices)  # when the scheduler expects it to
    origin = _arrival_ms(tasks[0]) / 1000.0
    out = np.zeros(len(tasks))
    for t, row in enumerate(tasks):
        now = _arrival_ms(row) / 1000.0 - origin
        gang = max(1, int(row["gang"]))
        work = (float(row["work_ref_s"]) if float(row["work_ref_s"]) > 0 else 1.0) / gang
        expected_run = work / np.exp(log_prior[t] + predicted[t])
        true_run = work / np.exp(log_prior[t] + truth[t])
        # A device known free now starts now; a busy one when the scheduler expects it to drain
        # (now, when that has passed), after a free one that would finish at the same time.
        busy = free_at > now
        expected_start = np.where(busy, np.maximum(now, predicted_free_at), now)
        finish = np.where(offered[t], expected_start + expected_run, np.inf)
        chosen = np.lexsort((busy, finish))[:gang]
        start = max(now, float(free_at[chosen].max()))
        end = start + float(true_run[chosen].max())
        free_at[chosen] = end
        predicted_free_at[chosen] = float(expected_start[chosen].max()) + float(expected_run[chosen].max())
        out[t] = end - now
    return out


def _ratio_interval(
    ours: NDArray[np.float64], theirs: NDArray[np.float64], resamples: int, rng: np.random.Generator
) -> dict[str, float]:
    """``mean(ours) / mean(theirs) - 1`` and its 95% percentile bootstrap interval over tasks
    resampled in pairs."""
    index = rng.integers(0, len(ours), size=(resamples, len(ours)))
    ratios = ours[index].mean(axis=1) / np.maximum(theirs[index].mean(axis=1), 1e-12) - 1.0
    low, high = np.percentile(ratios, [2.5, 97.5])
    mean = float(ours.mean() / max(float(theirs.mean()), 1e-12) - 1.0)
    return {"mean": round(mean, 6), "low": round(float(low), 6), "high": round(float(high), 6)}
