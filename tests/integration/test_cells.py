"""Several ``hlb serve`` instances sharing the cells through one real broker (docs/design.md §9).

Three instances of one group split six cells (one partition each). One is killed with SIGKILL
under a steady stream of submissions: its cells move to the others, which rebuild them from the
ledger and the replayed inputs; every task is placed exactly once, each cell's ledger numbers
run without gaps, and decisions in the moved cells resume within a bounded pause, measured here
(the group notices a dead static member after ``session.timeout.ms``, 6 s in this test).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from hlb.bench.cells import (
    CellCluster,
    CellLoad,
    LedgerReader,
    pick_cells,
    small_task,
)
from hlb.daemon.cells.bus import ensure_cell_topics
from hlb.daemon.cells.plan import shard_of
from hlb.daemon.config import KafkaSettings
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

PARTITIONS = 6
DEVICES_PER_CELL = 16
SESSION_TIMEOUT_S = 6.0
# Generous: the group waits the session timeout, then the new owner fences the old producer,
# reads the ledger back and replays its inputs on a shared 2-core machine.
PAUSE_BOUND_S = SESSION_TIMEOUT_S + 40.0


def shards_by_owner(owners: dict[int, str]) -> dict[str, list[int]]:
    by_owner: dict[str, list[int]] = {}
    for shard, owner in sorted(owners.items()):
        by_owner.setdefault(owner, []).append(shard)
    return by_owner


def largest_gap_s(times_ms: Sequence[int]) -> float:
    """The longest time between consecutive decisions (seconds)."""
    ordered = sorted(times_ms)
    return max((b - a for a, b in itertools.pairwise(ordered)), default=0) / 1000.0


@pytest.fixture
def cluster(kafka_bootstrap: str, tmp_path: Path) -> Iterator[CellCluster]:
    cells = CellCluster(kafka_bootstrap, tmp_path, PARTITIONS, session_timeout_ms=int(SESSION_TIMEOUT_S * 1000))
    yield cells
    cells.stop_all()


def test_killed_instance_cells_move_and_every_task_is_placed_once(cluster: CellCluster, kafka_bootstrap: str) -> None:
    cells = pick_cells(PARTITIONS, PARTITIONS)
    for name in ("a", "b", "c"):
        cluster.start(name)
    before = cluster.wait_all_served(owners=3)
    load = CellLoad(kafka_bootstrap, cluster.topics)
    for cell in cells:
        load.inventory(cell, DEVICES_PER_CELL)
    load.flush()
    reader = LedgerReader(kafka_bootstrap, cluster.topics["placements"], PARTITIONS)
    victim = "b"
    moved = {p for p, owner in before.items() if owner == victim}
    assert moved, f"the victim owns no partition: {before}"

    submitted: list[str] = []
    kill_ms = 0
    for i in range(600):  # about 40 submissions/s for 15 s, the kill after 4 s
        task_id = f"t{i:04d}"
        load.submit(cells[i % PARTITIONS], small_task(task_id))
        submitted.append(task_id)
        if i == 160:
            load.flush()
            cluster.instances[victim].kill()
            kill_ms = int(time.time() * 1000)
        time.sleep(0.025)
        reader.poll(0)
    load.flush()
    reader.wait_for(submitted, timeout_s=120.0)

    twice = sorted(t for t, ps in reader.by_task.items() if len(ps) > 1)
    assert not twice, f"placed more than once: {twice[:5]}"
    assert set(reader.by_task) == set(submitted)
    for cell in cells:
        sequences = sorted(p.sequence for p in reader.placements if p.cell == cell)
        assert sequences == list(range(1, len(sequences) + 1)), f"cell {cell}: ledger numbers with gaps"

    after = cluster.wait_all_served(owners=2)
    assert all(after[p] != victim for p in range(PARTITIONS)), f"partitions still with the dead owner: {after}"
    assert {after[p] for p in set(range(PARTITIONS)) - moved} == {before[p] for p in set(range(PARTITIONS)) - moved}
    pauses = {}
    for cell in cells:
        shard = shard_of(cell, PARTITIONS)
        decided = [p.decided_at_ms for p in reader.placements if p.cell == cell]
        pauses[cell] = largest_gap_s(decided)
        assert any(t > kill_ms for t in decided), f"cell {cell}: no decision after the kill"
        if shard in moved:
            assert pauses[cell] <= PAUSE_BOUND_S, f"cell {cell}: decisions paused {pauses[cell]:.1f} s"
    moved_cells = sorted(c for c in cells if shard_of(c, PARTITIONS) in moved)
    print(
        f"\ncells: before {shards_by_owner(before)}, after {shards_by_owner(after)}; "
        f"largest pause in a moved cell {max(pauses[c] for c in moved_cells):.2f} s "
        f"(others {max(pauses[c] for c in cells if c not in moved_cells):.2f} s)"
    )


def test_any_instance_answers_for_any_cell(cluster: CellCluster, kafka_bootstrap: str) -> None:
    cells = pick_cells(PARTITIONS, PARTITIONS)
    first, second = cluster.start("a"), cluster.start("b")
    owners = cluster.wait_all_served(owners=2)
    load = CellLoad(kafka_bootstrap, cluster.topics)
    for cell in cells:
        load.inventory(cell, DEVICES_PER_CELL)
    load.flush()
    elsewhere = next(c for c in cells if owners[shard_of(c, PARTITIONS)] == "b")  # asked at "a"
    with grpc.insecure_channel(first.target) as channel:
        stub = api_grpc.SchedulerStub(channel)

        task = small_task("remote-1")  # one spec: a retry of the same task is the same request

        def place() -> api.PlaceResponse:
            return stub.Place(api.PlaceRequest(cell=elsewhere, task=task), timeout=10.0)

        deadline = time.monotonic() + 60.0
        while True:  # the owner may still be replaying the inventory: UNAVAILABLE until then
            try:
                answer = place()
                if answer.HasField("placement"):
                    break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            assert time.monotonic() < deadline, "no placement for a forwarded Place"
            time.sleep(0.2)
        assert answer.placement.cell == elsewhere
        assert all(d.startswith(f"{elsewhere}/") for d in answer.placement.device_ids)

        # The owner answers the lookup too, asked at either instance, with the same decision.
        got = stub.GetPlacement(api.GetPlacementRequest(cell=elsewhere, task_id="remote-1"), timeout=10.0)
        assert got.placement == answer.placement
        state = stub.GetClusterState(api.GetClusterStateRequest(cell=elsewhere), timeout=10.0)
        assert state.instance == "b"
        assert state.devices == DEVICES_PER_CELL
        listed = {o.shard: o.instance for o in state.shards}
        assert listed == owners

        # A cell that collides with another on its partition is unknown, and says where it would be.
        collider = next(
            f"x{i}" for i in range(10_000) if shard_of(f"x{i}", PARTITIONS) == shard_of(cells[0], PARTITIONS)
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.Place(api.PlaceRequest(cell=collider, task=small_task("collider-1")), timeout=10.0)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert cells[0] in (caught.value.details() or "")
        with pytest.raises(grpc.RpcError) as caught:
            stub.Place(api.PlaceRequest(cell="c" * 200, task=small_task("long-1")), timeout=10.0)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reader = LedgerReader(kafka_bootstrap, cluster.topics["placements"], PARTITIONS)
    reader.wait_for(["remote-1"], timeout_s=30.0)
    assert len(reader.by_task["remote-1"]) == 1
    reader.close()
    assert first.alive()
    assert second.alive()


def test_a_cell_lands_where_hlb_expects_it(kafka_bootstrap: str, tmp_path: Path) -> None:
    """librdkafka's default partitioner puts key ``cell`` on ``shard_of(cell)``: the contract that
    lets any instance route a request without asking the broker."""
    cluster = CellCluster(kafka_bootstrap, tmp_path, PARTITIONS)
    ensure_cell_topics(KafkaSettings(bootstrap_servers=kafka_bootstrap), [cluster.topics["tasks"]], [], PARTITIONS)
    landed: dict[str, int] = {}
    producer = Producer({"bootstrap.servers": kafka_bootstrap})  # the default partitioner, as kcat's
    cells = [f"rack-{i}-{'x' * (i % 7)}" for i in range(64)]
    for cell in cells:
        producer.produce(cluster.topics["tasks"], key=cell.encode(), value=b"")
    assert producer.flush(30) == 0
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "landing", "enable.auto.commit": False})
    reader.assign([TopicPartition(cluster.topics["tasks"], p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    deadline = time.monotonic() + 30.0
    while len(landed) < len(cells) and time.monotonic() < deadline:
        for message in reader.consume(100, 0.5):
            if message.error() is None:
                landed[(message.key() or b"").decode()] = message.partition() or 0
    reader.close()
    assert sorted(landed) == sorted(cells)
    assert landed == {cell: shard_of(cell, PARTITIONS) for cell in landed}
    assert len(set(landed.values())) == PARTITIONS
