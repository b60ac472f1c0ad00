"""What the soak of ``hlb bench soak`` sends and reads: valid tasks through Kafka and gRPC, their
lifecycle as executors report it, telemetry, hostile records and requests (``Traffic``), and the
ledger and dead letters followed as they come (``Executor``, ``dead_letter_sources``), with the
records the checks read (``TaskRecord``, ``Sent``, ``Decided``, ``DeadLetter``).
"""

from __future__ import annotations

import contextlib
import heapq
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from hlb.bench.soak_rig import CELL
from hlb.daemon.config import LimitsSettings, Topics
from hlb.sim.agent import inventory_events
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

RPC_TIMEOUT_S = 30.0
KAFKA_LOG_LEVEL = 2  # librdkafka's own log: critical only (the broker restart is on purpose)
YEAR_3000_MS = 32_503_680_000_000
GARBAGE = b"\xff" * 1_020_000  # not protobuf; above librdkafka's default record limit (1,000,000 bytes)
HUGE_TEXT = "j" * 1_000_100  # a job_id a thousand times over limits.text_bytes
WORKLOADS = ("resnet50", "lm-bs20", "cyclegan", "a3c")
# Statuses a client cannot tell from a lost answer: such a task is looked up at the end.
AMBIGUOUS = frozenset({"DEADLINE_EXCEEDED", "UNKNOWN", "INTERNAL", "CANCELLED"})
# Hostile records on the input topics and hostile requests, each sent in turn.
HOSTILE_RECORDS = (
    "garbage_1mb", "huge_job_id", "too_many_labels", "long_model", "future_telemetry",
    "truncated_protobuf", "random_bytes", "long_id",
)  # fmt: skip
HOSTILE_REQUESTS = ("huge_job_id", "undecodable_bytes", "oversized_batch", "too_many_labels")


class Decided(NamedTuple):
    """One placement record read off the ledger topic."""

    sequence: int
    task_id: str
    device_ids: tuple[str, ...]
    decided_at_ms: int


class Sent(NamedTuple):
    """What the soak published at one offset: its kind, the task it is about, and, for a hostile
    record, the dead-letter reasons it may get."""

    kind: str
    task_id: str = ""
    hostile_reasons: frozenset[str] = frozenset()


class DeadLetter(NamedTuple):
    reason: str
    source_topic: str
    source_offset: int
    message: str


@dataclass
class TaskRecord:
    """One valid task the soak submitted, and what became of it as the soak saw it."""

    task_id: str
    origin: str  # "kafka" | "place" | "batch"
    memory_gb: float
    answer: str = ""  # gRPC: "placed", "pending" or the status code's name; Kafka: ""
    detail: str = ""  # a refusal's details
    answered: Decided | None = None  # the placement a gRPC answer carried
    resolved: str = ""  # an ambiguous answer, looked up at the end: "placed" | "pending" | "NOT_FOUND"
    offset: int = -1  # Kafka: its offset on the tasks topic, once delivered
    tasks_index: int = -1  # Kafka: its rank among the soak's records on the tasks topic
    end_ms: int = 0  # when its end event (finished, failed, cancelled) was published; 0: none

    @property
    def answer_lost(self) -> bool:
        """Whether its gRPC answer is a status that does not say whether it was decided."""
        return self.answer in AMBIGUOUS


def now_ms() -> int:
    return int(time.time() * 1000)


# -- sending -----------------------------------------------------------------------------------


class Traffic:
    """The soak's producer and gRPC client: valid tasks, their lifecycle, telemetry, hostile input.

    One idempotent producer publishes everything, so each topic (one partition) keeps the order in
    which the soak published; ``tasks_index`` counts the soak's records on the tasks topic.
    """

    def __init__(self, bootstrap: str, topics: Topics, target: str, rng: np.random.Generator) -> None:
        self.topics = topics
        self.rng = rng
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "linger.ms": 5,
                "message.max.bytes": 2_000_000,  # the garbage record is above librdkafka's default
                "message.timeout.ms": 300_000,  # outlives the broker restart
                "log_level": KAFKA_LOG_LEVEL,
            }
        )
        megabytes = 16 * 1024 * 1024
        self.channel = grpc.insecure_channel(
            target,
            options=[("grpc.max_send_message_length", megabytes), ("grpc.max_receive_message_length", megabytes)],
        )
        self.stub = api_grpc.SchedulerStub(self.channel)
        self.inventory = inventory_events(CELL)
        self.devices = [e.device_upsert for e in self.inventory if e.HasField("device_upsert")]
        self.tasks: dict[str, TaskRecord] = {}
        self.sent: dict[tuple[str, int], Sent] = {}
        self.counts: Counter[str] = Counter()
        self.undelivered: Counter[str] = Counter()
        self.hostile_requests: list[tuple[str, str]] = []
        self.tasks_index = 0
        self.serial = 0
        self.finishing: list[str] = []  # placed tasks that will finish: what new tasks may depend on

    # publishing

    def publish(self, topic_name: str, value: bytes, sent: Sent) -> int:
        """Queue one record; returns its rank among the soak's records on the tasks topic (-1 elsewhere)."""
        topic = getattr(self.topics, topic_name)
        index = -1
        if topic_name == "tasks":
            index, self.tasks_index = self.tasks_index, self.tasks_index + 1

        def delivered(error: Any, message: Any) -> None:
            if error is not None:
                self.undelivered[sent.kind] += 1
                return
            self.sent[(topic, message.offset())] = sent
            record = self.tasks.get(sent.task_id) if sent.kind == "submitted" else None
            if record is not None:
                record.offset = message.offset()

        deadline = time.monotonic() + 60.0
        while True:
            try:
                self.producer.produce(topic, value=value, key=CELL.encode(), on_delivery=delivered)
                break
            except BufferError:  # the local queue is full (the broker is away): wait for room
                if time.monotonic() > deadline:
                    raise
                self.producer.poll(0.05)
        self.producer.poll(0)
        self.counts[f"records.{topic_name}"] += 1
        return index

    def inventory_and_metrics(self) -> None:
        for event in self.inventory:
            event.event_time_ms = now_ms()
            self.publish("telemetry", event.SerializeToString(), Sent("inventory"))
        self.metrics()

    def metrics(self) -> None:
        """One metrics batch for every device: load and power vary; no memory in use is reported
        (reservations alone decide what fits, which is what the capacity check reads)."""
        batch = ev.MetricsBatch()
        for device in self.devices:
            batch.devices.append(
                ev.DeviceMetrics(
                    device_id=device.id,
                    utilization=float(self.rng.uniform(0, 1)),
                    power_w=float(self.rng.uniform(device.idle_power_w, device.peak_power_w)),
                    temperature_c=float(self.rng.uniform(30, 80)),
                    health=ev.HEALTH_HEALTHY,
                )
            )
        event = ev.TelemetryEvent(cell=CELL, event_time_ms=now_ms(), source="soak", metrics_batch=batch)
        self.publish("telemetry", event.SerializeToString(), Sent("metrics"))
        self.counts["metrics_batches"] += 1

    # valid tasks

    def new_spec(self, prefix: str) -> ev.TaskSpec:
        """A task that fits the cluster: 1 or 2 devices of any kind, GPUs or TPUs, 1-8 GB each;
        one in ten depends on a placed task that will finish."""
        self.serial += 1
        rng = self.rng
        kinds = [[], [], [ev.DEVICE_KIND_GPU], [ev.DEVICE_KIND_TPU]][int(rng.choice(4, p=[0.3, 0.3, 0.35, 0.05]))]
        spec = ev.TaskSpec(
            id=f"{prefix}{self.serial:06d}",
            job_id=f"job-{self.serial // 8:05d}",
            kind=ev.TASK_KIND_TRAINING,
            workload_class=WORKLOADS[int(rng.integers(len(WORKLOADS)))],
            num_devices=2 if rng.random() < 0.15 else 1,
            memory_per_device_gb=float(rng.integers(1, 9)),
            work_ref_s=float(rng.uniform(1, 20)),
            allowed_kinds=kinds,
            priority=int(rng.integers(0, 3)),
            submit_time_ms=now_ms(),
            labels={"origin": prefix},
        )
        if self.finishing and rng.random() < 0.1:
            upstream = self.finishing[-50:][int(rng.integers(min(50, len(self.finishing))))]
            spec.dependencies.add(task_id=upstream, transfer_gb=0.5)
        return spec

    def submit_kafka(self, count: int) -> None:
        for _ in range(count):
            spec = self.new_spec("k")
            record = self.tasks[spec.id] = TaskRecord(spec.id, "kafka", spec.memory_per_device_gb)
            event = ev.TaskEvent(cell=CELL, event_time_ms=now_ms(), source="soak", submitted=spec)
            record.tasks_index = self.publish("tasks", event.SerializeToString(), Sent("submitted", spec.id))
            self.counts["submitted.kafka"] += 1

    def place(self) -> str:
        """One gRPC Place of a new task; returns the answer ("placed", "pending" or a status code)."""
        spec = self.new_spec("g")
        record = self.tasks[spec.id] = TaskRecord(spec.id, "place", spec.memory_per_device_gb)
        self.counts["submitted.place"] += 1
        try:
            reply = self.stub.Place(api.PlaceRequest(task=spec), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            record.answer, record.detail = exc.code().name, str(exc.details() or "")
            return record.answer
        self._answered(record, reply)
        return record.answer

    def place_batch(self, size: int) -> str:
        """One gRPC PlaceBatch of ``size`` new tasks; returns the status code's name."""
        specs = [self.new_spec("b") for _ in range(size)]
        records = [TaskRecord(s.id, "batch", s.memory_per_device_gb) for s in specs]
        self.tasks.update((r.task_id, r) for r in records)
        self.counts["place_batch_calls"] += 1
        self.counts["submitted.batch"] += size
        try:
            reply = self.stub.PlaceBatch(api.PlaceBatchRequest(tasks=specs), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            for record in records:
                record.answer, record.detail = exc.code().name, str(exc.details() or "")
            return exc.code().name
        for record, result in zip(records, reply.results, strict=True):
            self._answered(record, result)
        return "OK"

    @staticmethod
    def _answered(record: TaskRecord, reply: api.PlaceResponse) -> None:
        if reply.HasField("placement"):
            record.answer, record.answered = "placed", decided(reply.placement)
        else:
            record.answer = "pending"

    def lifecycle(self, kind: str, task_id: str, device_ids: tuple[str, ...]) -> None:
        """A placed task's started event, or its end: finished, failed or cancelled."""
        event = ev.TaskEvent(cell=CELL, event_time_ms=now_ms(), source="soak")
        if kind == "started":
            event.started.CopyFrom(ev.TaskStarted(task_id=task_id, device_ids=device_ids))
        elif kind == "finished":
            event.finished.CopyFrom(ev.TaskFinished(task_id=task_id))
        elif kind == "failed":
            event.failed.CopyFrom(ev.TaskFailed(task_id=task_id, reason="soak: failed on purpose"))
        else:
            event.cancelled.CopyFrom(ev.EntityRef(id=task_id))
        if kind != "started":
            self.tasks[task_id].end_ms = now_ms()  # before the record exists: the daemon cannot have it earlier
        self.publish("tasks", event.SerializeToString(), Sent(kind, task_id))
        self.counts[f"lifecycle.{kind}"] += 1

    def resolve(self, record: TaskRecord) -> None:
        """Look up a task whose answer was lost (an ambiguous status): placed, pending or unknown."""
        try:
            reply = self.stub.GetPlacement(api.GetPlacementRequest(task_id=record.task_id), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            record.resolved = exc.code().name
            return
        record.resolved = "placed" if reply.HasField("placement") else "pending"

    # hostile input

    def hostile_record(self, kind: str) -> None:
        """One record that must go to the dead-letter topic with the reasons given, and stop nothing."""
        self.serial += 1
        name = f"x{self.serial:06d}"
        topic, reasons = "tasks", frozenset({"too_large"})
        if kind == "garbage_1mb":
            value, reasons = GARBAGE, frozenset({"decode"})
        elif kind == "huge_job_id":
            value = self._task_event(ev.TaskSpec(id=name, job_id=HUGE_TEXT, memory_per_device_gb=1))
        elif kind == "too_many_labels":
            labels = {f"k{i}": "v" for i in range(LimitsSettings().labels + 1)}
            value = self._task_event(ev.TaskSpec(id=name, labels=labels, memory_per_device_gb=1))
        elif kind == "long_model":
            value = self._task_event(ev.TaskSpec(id=name, allowed_models=["m" * 2_000], memory_per_device_gb=1))
        elif kind == "future_telemetry":
            report = ev.DeviceMetrics(device_id=self.devices[0].id, utilization=0.5, health=ev.HEALTH_HEALTHY)
            event = ev.TelemetryEvent(cell=CELL, event_time_ms=YEAR_3000_MS, source="soak", device_metrics=report)
            topic, value, reasons = "telemetry", event.SerializeToString(), frozenset({"clock_skew"})
        elif kind == "truncated_protobuf":
            whole = self._task_event(self.new_spec("t"))
            head = len(ev.TaskEvent(cell=CELL, event_time_ms=1, source="soak").SerializeToString())
            value, reasons = whole[: int(self.rng.integers(head + 1, len(whole)))], frozenset({"decode"})
        elif kind == "random_bytes":
            value, reasons = self._undecodable(), frozenset({"decode", "empty"})
        else:  # long_id
            value, reasons = (
                self._task_event(ev.TaskSpec(id="x" * 300, memory_per_device_gb=1)),
                frozenset({"invalid_id"}),
            )
        self.publish(topic, value, Sent(kind, hostile_reasons=reasons))
        self.counts[f"hostile_records.{kind}"] += 1

    @staticmethod
    def _task_event(spec: ev.TaskSpec) -> bytes:
        return ev.TaskEvent(cell=CELL, event_time_ms=1, source="soak", submitted=spec).SerializeToString()

    def _undecodable(self) -> bytes:
        """Random bytes from which protobuf reads no task event (bounded: most draws qualify)."""
        for _ in range(1000):
            value = self.rng.bytes(int(self.rng.integers(1, 200)))
            if value.lstrip()[:1] == b"{":
                continue  # the daemon reads these as JSON
            try:
                event = ev.TaskEvent.FromString(value)
            except Exception:
                return value
            if event.WhichOneof("payload") is None:
                return value
        return b"\xff" * 16

    def hostile_request(self, kind: str) -> None:
        """One gRPC request over a limit or not protobuf at all: refused, INVALID_ARGUMENT."""
        self.serial += 1
        name = f"y{self.serial:06d}"
        try:
            if kind == "huge_job_id":
                self.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id=name, job_id=HUGE_TEXT)), timeout=RPC_TIMEOUT_S)
            elif kind == "undecodable_bytes":
                raw = self.channel.unary_unary("/hlb.v1.Scheduler/Place", None, None)  # bytes in, bytes out
                raw(b"\xff" * 64, timeout=RPC_TIMEOUT_S)
            elif kind == "oversized_batch":
                specs = [ev.TaskSpec(id=f"{name}-{i}") for i in range(LimitsSettings().batch_tasks + 1)]
                self.stub.PlaceBatch(api.PlaceBatchRequest(tasks=specs), timeout=RPC_TIMEOUT_S)
            else:  # too_many_labels
                labels = {f"k{i}": "v" for i in range(LimitsSettings().labels + 1)}
                self.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id=name, labels=labels)), timeout=RPC_TIMEOUT_S)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        self.hostile_requests.append((kind, code))
        self.counts[f"hostile_requests.{kind}"] += 1

    def close(self) -> None:
        self.channel.close()


def decided(placement: ev.Placement) -> Decided:
    return Decided(placement.sequence, placement.task_id, tuple(placement.device_ids), placement.decided_at_ms)


# -- reading -----------------------------------------------------------------------------------


def follower(bootstrap: str, topic: str) -> Any:
    """A consumer of ``topic``'s one partition from its start, outside any group's offsets."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"soak-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",  # a broker restart may reset the position: start over
            "fetch.wait.max.ms": 10,
            "topic.metadata.refresh.interval.ms": 500,
            "log_level": KAFKA_LOG_LEVEL,
        }
    )
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    return consumer


class Executor:
    """Acts on the ledger as executors would: a placed task starts within 0.3 s and ends after
    ``hold_s`` (finished; one in twenty failed, one in twenty cancelled)."""

    def __init__(self, consumer: Any, traffic: Traffic, rng: np.random.Generator, hold_s: tuple[float, float]) -> None:
        self.consumer = consumer
        self.traffic = traffic
        self.rng = rng
        self.hold_s = hold_s
        self.placed: dict[str, Decided] = {}  # the soak's tasks, by id: the first placement seen
        self.sequences: set[int] = set()
        self.due: list[tuple[float, int, str, str]] = []  # (when, n, event kind, task id)
        self.n = 0

    def poll(self, now: float) -> None:
        for message in self.consumer.consume(1000, 0):
            if message.error() is not None:
                continue  # the broker is away, or the topic is new
            placement = decided(ev.Placement.FromString(message.value() or b""))
            if placement.sequence in self.sequences:
                continue
            self.sequences.add(placement.sequence)
            task_id = placement.task_id
            if task_id not in self.traffic.tasks or task_id in self.placed:
                continue  # the checks read the whole topic at the end
            self.placed[task_id] = placement
            fate = ("finished", "failed", "cancelled")[int(self.rng.choice(3, p=[0.9, 0.05, 0.05]))]
            start = now + float(self.rng.uniform(0.05, 0.3))
            self._at(start, "started", task_id)
            self._at(start + float(self.rng.uniform(*self.hold_s)), fate, task_id)
            if fate == "finished":
                self.traffic.finishing.append(task_id)
        while self.due and self.due[0][0] <= now:
            _, _, kind, task_id = heapq.heappop(self.due)
            self.traffic.lifecycle(kind, task_id, self.placed[task_id].device_ids)

    def _at(self, when: float, kind: str, task_id: str) -> None:
        self.n += 1
        heapq.heappush(self.due, (when, self.n, kind, task_id))


def dead_letter_sources(consumer: Any) -> Iterator[tuple[str, int]]:
    """(source topic, offset) of each dead letter the consumer has for now."""
    for message in consumer.consume(1000, 0):
        if message.error() is None:
            headers = dict(message.headers() or [])
            topic = headers.get("hlb.source.topic", b"").decode("utf-8", "replace")
            with contextlib.suppress(ValueError):
                yield topic, int(headers.get("hlb.source.offset", b"-1"))
