"""A short soak (``hlb bench soak`` for 30 s) with every phase: valid tasks through Kafka, Place and
PlaceBatch with their lifecycle and telemetry, hostile records and requests, bursts past the queue
bound, a broker restart and, where the test runs as root, a full disk. Every check passes; and
each check fails on what it looks for (made up, without a broker).

The soak starts its own broker (it restarts it), so that test needs Java but not the session's
broker. The full soak (10 minutes) and its figures: docs/reliability.md, "Soak".
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from hlb.bench.soak import check_capacity, check_hostile, check_outcomes, dead_letters_by_source, soak
from hlb.bench.soak_harness import Observed, SoakOptions
from hlb.bench.soak_traffic import HOSTILE_RECORDS, HOSTILE_REQUESTS, DeadLetter, Decided, Sent, TaskRecord
from hlb.daemon.config import Topics
from hlb.sim.kafka_local import java_available


@pytest.mark.kafka
def test_a_short_soak_with_every_phase_passes_every_check(tmp_path: Path) -> None:
    if not java_available():
        pytest.fail("the soak needs Java 17+ to run (and restart) its own Kafka broker")
    options = SoakOptions(
        duration_s=30.0, seed=1, max_pending=80, broker_down_s=3.0, disk_full_s=5.0, drain_s=120.0,
        work_dir=tmp_path / "soak", keep=True,
    )  # fmt: skip
    report = soak(options)

    failed = {name: check for name, check in report["checks"].items() if not check["pass"]}
    log = (tmp_path / "soak" / "serve.log").read_text()[-3000:]
    assert not failed, f"{json.dumps(failed, indent=2)}\nhlb serve's log ends:\n{log}"
    assert report["passed"]

    restart = report["phases"]["broker_restart"]
    assert restart["back_at_s"] > restart["stopped_at_s"] > restart["at_s"]
    assert report["checks"]["broker_restart"]["kafka_tasks_placed_after"] > 0
    disk = report["phases"]["disk_full"]
    if os.geteuid() == 0:
        assert disk["not_serving_after_s"] is not None, disk
        assert disk["serving_again_after_s"] is not None, disk
        assert disk["answers"].get("UNAVAILABLE", 0) > 0, disk
    else:
        assert disk["skipped"].startswith("not root"), disk

    traffic, refused = report["traffic"], report["tasks"]["refused"]
    assert all(traffic[f"hostile_records.{kind}"] > 0 for kind in HOSTILE_RECORDS), traffic
    assert all(traffic[f"hostile_requests.{kind}"] > 0 for kind in HOSTILE_REQUESTS), traffic
    for kind in ("submitted.kafka", "submitted.place", "submitted.batch", "lifecycle.finished", "metrics_batches"):
        assert traffic[kind] > 0, kind
    assert traffic["bursts"] == 2
    assert refused.get("dead letter: queue_full", 0) > 0, refused  # the bursts met the queue's bound
    assert report["daemon"]["peak_rss_mb"] > 0


# -- the checks fail on what they look for ------------------------------------------------------

TOPICS = Topics(**{name: f"t.{name}" for name in Topics.model_fields})


def observed(
    tasks: list[TaskRecord],
    placements: list[Decided],
    dead_letters: list[DeadLetter] | None = None,
    sent: dict[tuple[str, int], Sent] | None = None,
) -> Observed:
    return Observed(
        options=SoakOptions(), tasks={t.task_id: t for t in tasks}, placements=placements,
        dead_letters=dead_letters or [], sent=sent or {}, topics=TOPICS, device_memory_gb={"d0": 16.0, "d1": 16.0},
        max_tasks_per_device=1, hostile_requests=[("huge_job_id", "INVALID_ARGUMENT")], counts=Counter(),
        phases={}, daemon={},
    )  # fmt: skip


def test_a_device_given_again_before_its_task_ended_is_double_booked() -> None:
    first, second = TaskRecord("a", "place", 4.0, answer="placed"), TaskRecord("b", "place", 4.0, answer="placed")
    first.end_ms = 2_000  # published after the second decision (1,500): the device was still held
    placements = [Decided(1, "a", ("d0",), 1_000), Decided(2, "b", ("d0",), 1_500)]
    verdict = check_capacity(observed([first, second], placements))
    assert (verdict["pass"], verdict["double_booked"]) == (False, 1)

    first.end_ms = 1_400  # published before: a reuse, not a double booking
    verdict = check_capacity(observed([first, second], placements))
    assert (verdict["pass"], verdict["double_booked"]) == (True, 0)
    assert (verdict["reuses"], verdict["reuse_gap_ms_min"]) == (1, 100)


def test_more_memory_than_a_device_has_is_double_booked_without_a_task_limit() -> None:
    tasks = [TaskRecord(name, "place", 10.0, answer="placed") for name in ("a", "b")]
    o = observed(tasks, [Decided(1, "a", ("d1",), 1_000), Decided(2, "b", ("d1",), 1_100)])
    o.max_tasks_per_device = 0  # memory alone decides: 10 + 10 GB > 16 GB
    assert check_capacity(o)["double_booked"] == 1


def test_a_task_refused_then_placed_lost_or_never_placed_fails_its_check() -> None:
    refused = TaskRecord("k1", "kafka", 1.0, offset=7)
    accepted = TaskRecord("k2", "kafka", 1.0, offset=8)
    pending = TaskRecord("g1", "place", 1.0, answer="pending")
    unavailable = TaskRecord("g2", "place", 1.0, answer="UNAVAILABLE", detail="the journal cannot be written")
    lost = TaskRecord("k3", "kafka", 1.0)  # never delivered
    letters = [DeadLetter("queue_full", TOPICS.tasks, 7, "")]
    o = observed(
        [refused, accepted, pending, unavailable, lost],
        [Decided(1, "k1", ("d0",), 1), Decided(2, "k2", ("d1",), 2)],
        letters,
    )
    checks = check_outcomes(o, dead_letters_by_source(o))
    assert checks["refused_with_reason"]["refused_then_placed"] == 1  # k1
    assert checks["refused_with_reason"]["unexpected"] == 0  # queue_full and UNAVAILABLE are expected
    assert (checks["accepted_placed_once"]["never_placed"], checks["accepted_placed_once"]["lost_records"]) == (1, 1)


def test_an_answer_the_ledger_contradicts_and_a_sequence_given_twice_fail() -> None:
    task = TaskRecord("g1", "place", 1.0, answer="placed", answered=Decided(3, "g1", ("d0",), 1))
    other = TaskRecord("g2", "place", 1.0, answer="pending")
    o = observed([task, other], [Decided(3, "g1", ("d1",), 1), Decided(3, "g2", ("d0",), 2)])
    checks = check_outcomes(o, dead_letters_by_source(o))
    assert checks["answers_in_ledger"]["contradicted"] == 1
    assert checks["ledger_consistent"]["sequences_reused"] == 1


def test_a_hostile_record_without_its_dead_letter_and_a_valid_one_dead_lettered_fail() -> None:
    sent = {
        (TOPICS.tasks, 1): Sent("garbage_1mb", hostile_reasons=frozenset({"decode"})),
        (TOPICS.tasks, 2): Sent("long_id", hostile_reasons=frozenset({"invalid_id"})),
        (TOPICS.tasks, 3): Sent("finished", "k1"),
    }
    letters = [DeadLetter("too_large", TOPICS.tasks, 1, ""), DeadLetter("inconsistent", TOPICS.tasks, 3, "")]
    o = observed([], [], letters, sent)
    checks = check_hostile(o, dead_letters_by_source(o))
    assert checks["hostile_records_dead_lettered"]["missed"] == 2  # the wrong reason, and none
    assert checks["no_unexpected_dead_letters"]["unexpected"] == 1
