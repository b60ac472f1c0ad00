"""Training rows: a feature record joined with its ledger placement and its task's start and finish,
labelled as hlb train labels a simulated run; records that join no finished run are counted by why."""

from __future__ import annotations

import math

import pytest

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.record.feature_record import log_prior_column
from hlb.daemon.record.training_rows import join, lifecycles, run_time_errors
from hlb.v1 import events_pb2 as ev
from hlb.v1 import learning_pb2 as lrn

COLUMN = log_prior_column() or 0  # the schema lists log_prior_speed (checked below)


def test_the_schema_lists_the_log_of_the_prior_speed() -> None:
    assert log_prior_column() is not None


def prior(log_speed: float) -> list[float]:
    values = [0.0] * len(feat.PRIOR_FEATURES)
    values[COLUMN] = log_speed
    return values


def record(
    sequence: int, task_id: str, gang_log_speeds: list[float], work_ref_s: float = 1000.0
) -> lrn.DecisionFeatures:
    out = lrn.DecisionFeatures(
        record_version=1,
        feature_schema_version=feat.FEATURE_SCHEMA_VERSION,
        cell="c",
        placement_sequence=sequence,
        task_id=task_id,
        shape=lrn.DecisionShape(gang=len(gang_log_speeds), work_ref_s=work_ref_s, kind=ev.TASK_KIND_TRAINING),
        propensity=1.0,
    )
    out.candidates.add(device_id="fast-unchosen", prior_features=prior(5.0), predicted=True, rank=0)
    for g, log_speed in enumerate(gang_log_speeds):
        out.candidates.add(device_id=f"{task_id}-d{g}", prior_features=prior(log_speed), chosen=g + 1, predicted=True)
    return out


def placement(sequence: int, task_id: str, gang: int = 1) -> ev.Placement:
    return ev.Placement(
        sequence=sequence, task_id=task_id, cell="c", device_ids=[f"{task_id}-d{g}" for g in range(gang)]
    )


def started(task_id: str, at_ms: int, sequence: int = 0) -> ev.TaskEvent:
    return ev.TaskEvent(
        cell="c", event_time_ms=at_ms, started=ev.TaskStarted(task_id=task_id, placement_sequence=sequence)
    )


def finished(task_id: str, at_ms: int) -> ev.TaskEvent:
    return ev.TaskEvent(cell="c", event_time_ms=at_ms, finished=ev.TaskFinished(task_id=task_id))


def test_a_finished_run_gives_the_label_of_its_slowest_member_by_the_prior() -> None:
    # A gang of two: log prior speeds 0.0 and -1.0; the second bounds it: (1000 / 2) / e^-1 s.
    joined = join(
        [record(7, "t", [0.0, -1.0])],
        [placement(7, "t", gang=2)],
        [started("t", 10_000, sequence=7), finished("t", 10_000 + 400_000)],
    )
    (row,) = joined.rows
    prior_s = 500.0 / math.exp(-1.0)
    assert row["bounding_device"] == "t-d1"
    assert row["device_ids"] == ["t-d0", "t-d1"]
    assert row["prior_run_s"] == pytest.approx(prior_s)
    assert row["observed_run_s"] == 400.0
    assert row["observed_log_ratio"] == pytest.approx(math.log(prior_s / 400.0), abs=1e-6)
    assert row["kind"] == "TASK_KIND_TRAINING"
    assert row["submitted_ms"] is None  # the topic held no submission
    assert not joined.unjoined


def test_a_row_says_when_its_task_was_first_submitted() -> None:
    def submitted(at_ms: int) -> ev.TaskEvent:
        return ev.TaskEvent(cell="c", event_time_ms=at_ms, submitted=ev.TaskSpec(id="t"))

    events = [submitted(4_000), submitted(6_000), started("t", 9_000, 7), finished("t", 19_000)]
    (row,) = join([record(7, "t", [0.0])], [placement(7, "t")], events).rows
    assert row["submitted_ms"] == 4_000  # a resubmission does not move it
    assert lifecycles(events)[("c", "t")].submitted_ms == 4_000


def test_records_without_a_finished_run_of_their_placement_are_counted_by_why() -> None:
    records = [
        record(1, "undone", [0.0]),  # its placement never reached the ledger
        record(2, "failed", [0.0]),
        record(3, "running", [0.0]),
        record(4, "unstarted", [0.0]),
        record(5, "replaced", [0.0]),  # lost, then placed again as 6
        record(6, "replaced", [0.0]),
    ]
    placements = [
        placement(s, t) for s, t in [(2, "failed"), (3, "running"), (4, "unstarted"), (5, "replaced"), (6, "replaced")]
    ]
    events = [
        started("failed", 0, 2),
        ev.TaskEvent(cell="c", event_time_ms=5, failed=ev.TaskFailed(task_id="failed")),
        started("running", 0, 3),
        started("replaced", 100, 5),
        ev.TaskEvent(cell="c", lost=ev.PlacementLost(task_id="replaced", placement_sequence=5)),
        started("replaced", 2_000, 6),
        finished("replaced", 12_000),
    ]
    joined = join(records, placements, events)
    assert [(r["task_id"], r["placement_sequence"], r["observed_run_s"]) for r in joined.rows] == [
        ("replaced", 6, 10.0)
    ]
    assert dict(joined.unjoined) == {"not_in_ledger": 1, "failed": 1, "running": 1, "not_started": 1, "lost": 1}


def test_a_record_of_another_feature_schema_is_not_mixed_in() -> None:
    other = record(1, "t", [0.0])
    other.feature_schema_version = feat.FEATURE_SCHEMA_VERSION + 1
    joined = join([other], [placement(1, "t")], [started("t", 0, 1), finished("t", 1000)])
    assert joined.rows == []
    assert dict(joined.unjoined) == {"other_schema": 1}


def test_a_start_that_names_no_placement_counts_for_the_only_one() -> None:
    joined = join([record(3, "t", [0.0])], [placement(3, "t")], [started("t", 1_000), finished("t", 3_500)])
    assert [r["observed_run_s"] for r in joined.rows] == [2.5]


def test_lifecycles_keep_the_first_end_and_every_start_by_placement() -> None:
    lives = lifecycles(
        [
            started("t", 1, 4),
            started("t", 2, 4),
            finished("t", 9),
            ev.TaskEvent(cell="c", failed=ev.TaskFailed(task_id="t")),
        ]
    )
    life = lives[("c", "t")]
    assert life.started_ms == {4: 1}
    assert (life.ended, life.ended_ms) == ("finished", 9)


def test_a_gang_spread_over_hosts_with_a_one_host_prediction_is_not_labelled() -> None:
    spread = record(1, "t", [0.0, 0.0])
    spread.shape.consolidated = True  # the predictions the decision read: the gang on one host
    chosen = [d for d in spread.candidates if d.chosen]
    chosen[0].neighbourhood.host_id, chosen[1].neighbourhood.host_id = "h1", "h2"
    events = [started("t", 0, 1), finished("t", 1000)]
    joined = join([spread], [placement(1, "t", gang=2)], events)
    assert joined.rows == []
    assert dict(joined.unjoined) == {"spread_as_one_host": 1}
    chosen[1].neighbourhood.host_id = "h1"  # on one host after all: labelled
    assert len(join([spread], [placement(1, "t", gang=2)], events).rows) == 1


def test_run_time_errors_compare_the_model_with_the_profiles_per_model_version() -> None:
    rows = [
        {"model_version": "m1", "observed_log_ratio": 1.0, "predicted_log_ratio": 0.8},
        {"model_version": "m1", "observed_log_ratio": -0.5, "predicted_log_ratio": -0.1},
        {"model_version": "m1", "observed_log_ratio": 2.0, "predicted_log_ratio": 2.0},
        {"model_version": "m2", "observed_log_ratio": 0.3, "predicted_log_ratio": 0.0},
    ]
    assert run_time_errors(rows) == {
        "m1": {"rows": 3, "model_error": 0.2, "prior_error": 1.0},
        "m2": {"rows": 1, "model_error": 0.3, "prior_error": 0.3},
    }


def test_a_row_of_layout_3_carries_the_heads_embedding_and_context_and_older_ones_none() -> None:
    events = [started("t", 0, 7), finished("t", 100_000)]
    old = record(7, "t", [0.0, -1.0])
    (row,) = join([old], [placement(7, "t", gang=2)], events).rows
    assert (row["device_embedding"], row["context"]) == (None, None)  # layout 1 (and 2) hold neither

    new = record(7, "t", [0.0, -1.0])
    new.record_version = 3
    new.device_embedding.extend([0.5, -1.2578125, 0.00012350082397460938])  # float16 numbers, exactly
    new.context.extend([0.1, 1 / 3])
    (row,) = join([new], [placement(7, "t", gang=2)], events).rows
    assert row["bounding_device"] == "t-d1"
    assert row["device_embedding"] == [0.5, -1.2578125, 0.00012350082397460938]
    assert row["context"] == [0.1, 0.33333334]  # the shortest decimals of the float32s
    del new.device_embedding[:]  # the bounding device had no embedding: the profiles alone predicted it
    (row,) = join([new], [placement(7, "t", gang=2)], events).rows
    assert (row["device_embedding"], row["context"]) == (None, [0.1, 0.33333334])
