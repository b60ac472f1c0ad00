"""SIGKILL under load: the restarted daemon loses no task, places none twice, and ends in the
same state as a daemon that was never interrupted.

The same seeded scenario runs twice against the real broker, each on its own topics: once with
``hlb serve`` left alone, once with it killed (SIGKILL) mid-stream and restarted, more than once.
The load generator plays agent and executor in lock step: it submits a task, waits until the
task's placement is in the ledger topic, reports it started, and now and then reports an earlier
task finished; metrics batches flow on the telemetry topic throughout. Lock step makes each
decision depend on the events before it only, and the metrics are decision-neutral (see
``Load.metrics``), so the two runs must decide identically and their canonical state dumps
(``hlb.daemon.record.statedump``: every device, host, switch, link and task by id with all its columns,
the queue and the ledger's size) must be equal. Event times come from a logical clock so that
the dumps compare byte for byte. A dump, not ``GetClusterState``: a summary of counts and
means could hide a reservation on the wrong device. The daemon decides with the ``rules`` preset:
the GNN's run times also depend on when its background thread last refreshed the embeddings,
which no two runs share, so its decisions are not a function of the events alone
(``test_faults_model`` runs the GNN).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.conftest import spawn_serve
from tests.integration.load import (
    DEVICES,
    HOSTS,
    DaemonConfig,
    LedgerFollower,
    Load,
    assert_exactly_once,
    fresh_topics,
    small_tasks,
    wait_until,
)

pytestmark = pytest.mark.kafka

LONG = os.environ.get("HLB_FAULTS_LONG") == "1"
STEPS = 300 if LONG else 48
KILLS = (40, 90, 150, 200, 260) if LONG else (15, 31)
SEED = 9
EPOCH_MS = 1_700_000_000_000  # in the past: telemetry dated ahead of the daemon's clock is refused


def run_scenario(root: Path, bootstrap: str, kill_at: tuple[int, ...]) -> tuple[dict[str, Any], list[ev.Placement]]:
    """Run the seeded scenario; returns the final state dump and the ledger topic's records."""
    topics = fresh_topics()
    config = DaemonConfig(root, bootstrap, topics, scheduler={"policy": "rules"})
    clock = itertools.count(EPOCH_MS)
    load = Load(bootstrap, topics, seed=SEED, clock_ms=lambda: next(clock))
    daemon = config.start()
    ledger = LedgerFollower(bootstrap, topics.placements)
    try:
        load.inventory()
        load.flush()
        wait_until(
            lambda: (daemon.cluster_state().devices, daemon.cluster_state().hosts) == (len(DEVICES), len(HOSTS)),
            30,
            "the inventory to be applied",
        )
        rng = np.random.default_rng(SEED)
        specs = small_tasks(rng, "k", STEPS, submit_time_ms=EPOCH_MS)
        running: list[str] = []
        finished: list[str] = []
        for step, spec in enumerate(specs):
            if step % 4 == 0:
                load.metrics()
            load.submit(spec)
            load.flush()
            if step in kill_at:  # the submission is in the log; the daemon may be deciding it now
                daemon.kill()
                daemon = config.start()
            placement = ledger.wait_for([spec.id], 60)[spec.id]
            load.started(spec.id, placement.device_ids)
            running.append(spec.id)
            if len(running) > 10 and rng.random() < 0.6:
                done = running.pop(int(rng.integers(len(running))))
                load.finished(done)
                finished.append(done)
        load.flush()
        expected = dict.fromkeys(running, "running") | dict.fromkeys(finished, "finished")

        differ: dict[str, Any] = {}

        def settled() -> bool:
            state = daemon.dump()
            tasks = {t: v["state"] for t, v in state["tasks"].items()}
            differ.clear()
            differ.update(
                {t: (tasks.get(t), expected.get(t)) for t in tasks.keys() | expected if tasks.get(t) != expected.get(t)}
            )
            return not differ and state["newest_telemetry_ms"] == load.last_metrics_ms

        try:
            wait_until(settled, 60, "the daemon to apply every event published", step_s=0.2)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; task states (daemon, expected) that differ: {dict(list(differ.items())[:10])}"
            ) from None
        state = daemon.dump()
        state.pop("ingest")  # counters, not state: a replay counts events again
        records = KafkaBus(KafkaSettings(bootstrap_servers=bootstrap)).read_all(topics.placements)
        assert daemon.terminate() == 0, daemon.log()[-5000:]
        assert_exactly_once([ev.Placement.FromString(r.value or b"") for r in records], [s.id for s in specs])
        return state, [ev.Placement.FromString(r.value or b"") for r in records]
    finally:
        ledger.close()
        config.stop_all()


def test_sigkill_mid_stream_loses_nothing_places_nothing_twice_and_recovers_the_same_graph(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    uninterrupted, reference_ledger = run_scenario(tmp_path / "uninterrupted", kafka_bootstrap, kill_at=())
    killed, ledger = run_scenario(tmp_path / "killed", kafka_bootstrap, kill_at=KILLS)

    assert len(ledger) == STEPS
    decided = {p.task_id: list(p.device_ids) for p in ledger}
    assert decided == {p.task_id: list(p.device_ids) for p in reference_ledger}, "a restart changed a decision"
    for part in ("devices", "hosts", "switches", "links", "tasks", "queue", "ledger"):
        assert killed[part] == uninterrupted[part], f"{part} differ after recovery"
    assert killed == uninterrupted
    # The scenario exercised what it claims: tasks holding devices and tasks that ended.
    states = [t["state"] for t in killed["tasks"].values()]
    assert states.count("running") > 5
    assert states.count("finished") > 5
    assert sum(d["reserved_gb"] for d in killed["devices"].values()) > 0


@pytest.mark.parametrize("sync", ["fsync", "write"])
def test_a_placement_answered_just_before_sigkill_is_kept_exactly_after_restart(
    tmp_path: Path, kafka_bootstrap: str, sync: str
) -> None:
    """Place and PlaceBatch answer, then SIGKILL at once: the ledger records may not have reached the
    broker yet. The restarted daemon must know every answer as given (the journal, whether answers
    wait for its fsync or for its write), and the ledger topic must end with each exactly once."""
    topics = fresh_topics()
    config = DaemonConfig(tmp_path, kafka_bootstrap, topics, journal={"sync": sync})
    load = Load(kafka_bootstrap, topics, seed=SEED)
    daemon = config.start()
    ledger = LedgerFollower(kafka_bootstrap, topics.placements)
    try:
        load.inventory()
        load.flush()
        wait_until(lambda: daemon.cluster_state().devices == len(DEVICES), 30, "the inventory to be applied")
        rng = np.random.default_rng(SEED)
        singles = small_tasks(rng, "one", 10)
        batch = small_tasks(rng, "many", 60)
        answered: dict[str, list[str]] = {}
        with grpc.insecure_channel(daemon.target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            for spec in singles:
                reply = stub.Place(api.PlaceRequest(task=spec), timeout=10)
                answered[spec.id] = list(reply.placement.device_ids)
            results = stub.PlaceBatch(api.PlaceBatchRequest(tasks=batch), timeout=30).results
            daemon.kill()  # no time for the producer to deliver what it holds
        answered |= {s.id: list(r.placement.device_ids) for s, r in zip(batch, results, strict=True)}
        # Only placements are answers to keep; a pending task may be placed anywhere later.
        answered = {task_id: devices for task_id, devices in answered.items() if devices}
        assert len(answered) >= 30, "the test cluster has room for most tasks"

        daemon = config.start()
        with grpc.insecure_channel(daemon.target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            for spec in [s for s in [*singles, *batch] if s.id in answered]:
                kept = stub.GetPlacement(api.GetPlacementRequest(task_id=spec.id), timeout=10)
                assert list(kept.placement.device_ids) == answered[spec.id], f"{spec.id} placed differently"
                again = stub.Place(api.PlaceRequest(task=spec), timeout=10)  # a client retrying
                assert list(again.placement.device_ids) == answered[spec.id]
        ledger.wait_for(answered, 60)
        assert daemon.terminate() == 0, daemon.log()[-5000:]
        records = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap)).read_all(topics.placements)
        placements = [ev.Placement.FromString(r.value or b"") for r in records]
        # Every answer in the ledger topic once (a task pending at the kill may be placed since).
        assert_exactly_once(placements, answered.keys() | {p.task_id for p in placements})
        decided = {p.task_id: list(p.device_ids) for p in placements}
        assert {t: decided[t] for t in answered} == answered
    finally:
        ledger.close()
        config.stop_all()


def test_a_restarted_daemon_decides_nothing_before_its_replay_reaches_the_start_watermarks(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    """The inputs hold the inventory and a long run of metrics: a client that keeps calling Place from
    the moment the daemon starts gets UNAVAILABLE (or no connection) until the replay has caught up,
    and its first answer is a decision on the whole cluster."""
    topics = fresh_topics()
    config = DaemonConfig(tmp_path, kafka_bootstrap, topics)
    env = {**os.environ, "HLB_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap}
    config_path = config.write()
    # The topics as an operator makes them before anything is published (the inventory compacted).
    made = subprocess.run(
        [sys.executable, "-m", "hlb.cli", "topics", "--config", str(config_path), "create"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    load = Load(kafka_bootstrap, topics, seed=SEED)
    load.inventory()
    for _ in range(5000):  # replay takes a while: the daemon is asked long before it has caught up
        load.metrics()
    load.flush()
    spec = small_tasks(np.random.default_rng(SEED), "first", 1)[0]
    process = spawn_serve(config_path, tmp_path / "serve.log", env)
    refusals: list[tuple[grpc.StatusCode, str]] = []
    try:
        # Reconnect at once while the daemon starts (gRPC's default backoff would skip the window).
        fast = [
            ("grpc.initial_reconnect_backoff_ms", 20),
            ("grpc.min_reconnect_backoff_ms", 20),
            ("grpc.max_reconnect_backoff_ms", 50),
        ]
        with grpc.insecure_channel(f"127.0.0.1:{config.port}", options=fast) as channel:
            stub = api_grpc.SchedulerStub(channel)
            deadline = time.monotonic() + 120
            while True:
                assert time.monotonic() < deadline, f"no answer; refusals: {refusals[-3:]}"
                assert process.poll() is None, (tmp_path / "serve.log").read_text()[-5000:]
                try:
                    reply = stub.Place(api.PlaceRequest(task=spec), timeout=5)
                    break
                except grpc.RpcError as exc:
                    refusals.append((exc.code(), exc.details() or ""))
                    time.sleep(0.01)
            assert reply.HasField("placement"), reply.pending.reason
            state = stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
            assert (state.devices, state.hosts) == (len(DEVICES), len(HOSTS))
        assert {code for code, _ in refusals} == {grpc.StatusCode.UNAVAILABLE}, refusals[-3:]
        assert any("replaying the inputs" in details for _, details in refusals), refusals[:5]
    finally:
        process.kill()
        process.wait(30)
