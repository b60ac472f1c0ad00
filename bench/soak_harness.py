"""The timeline of ``hlb bench soak`` (``hlb.bench.soak``): ``run_soak`` starts a local broker, the
state volume and ``hlb serve`` (``hlb.bench.soak_rig``), drives the traffic
(``hlb.bench.soak_traffic``) through the phases below, drains, and returns what it saw
(``Observed``), which ``hlb.bench.soak`` checks.

Phases, as shares of ``duration_s``: bursts past the queue bound at 10% and 45%; the broker
stopped at 25% and started again ``broker_down_s`` later; from 70% (once the broker is back) the
state volume full for ``disk_full_s``. The traffic goes on past ``duration_s`` until the phases
have run their course, at most their durations and four minutes more. Every loop is bounded in
count and in time.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from hlb.bench.soak_rig import BrokerRestart, ServeProcess, StateVolume, write_config
from hlb.bench.soak_traffic import (
    HOSTILE_RECORDS,
    HOSTILE_REQUESTS,
    RPC_TIMEOUT_S,
    DeadLetter,
    Decided,
    Executor,
    Sent,
    TaskRecord,
    Traffic,
    dead_letter_sources,
    decided,
    follower,
)
from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings, SchedulerSettings, Topics
from hlb.sim.kafka_local import LocalBroker, free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api

TICK_S = 0.02
BURSTS = (0.10, 0.45)  # shares of the duration
BROKER_RESTART_AT = 0.25
DISK_FULL_AT = 0.70


@dataclass(frozen=True)
class SoakOptions:
    duration_s: float = 600.0  # of mixed traffic; the drain and the checks come after
    seed: int = 0
    rate_per_s: float = 5.0  # valid tasks submitted per second, bursts aside
    max_pending: int = 200  # the daemon's scheduler.max_pending
    policy: str = "gnn"
    hold_s: tuple[float, float] = (0.5, 4.0)  # how long a placed task runs (uniform)
    hostile_every_s: float = 2.0  # one hostile record and one hostile request this often
    broker_down_s: float = 10.0  # the broker stays stopped this long
    disk_full_s: float = 30.0  # the state directory stays full this long
    tmpfs_mb: int = 64
    snapshot_interval_s: float = 5.0
    drain_s: float = 180.0  # at most this long after the traffic for every accepted task to be placed
    work_dir: Path | None = None  # default: a new temporary folder
    keep: bool = False  # keep the work folder (logs, config); it is kept anyway when a check fails


@dataclass
class Observed:
    """Everything the checks read."""

    options: SoakOptions
    tasks: dict[str, TaskRecord]
    placements: list[Decided]  # the ledger topic, read to its end after the daemon stopped
    dead_letters: list[DeadLetter]  # the dead-letter topic, likewise
    sent: dict[tuple[str, int], Sent]  # (topic, offset) -> what the soak published there
    topics: Topics
    device_memory_gb: dict[str, float]
    max_tasks_per_device: int
    hostile_requests: list[tuple[str, str]]  # (kind, status code's name)
    counts: Counter[str]  # traffic by kind
    phases: dict[str, Any]
    daemon: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    work_dir: Path | None = None


class Soak:
    """The soak's parts and its timeline: ``start``, ``traffic_phase``, ``drain``, ``finish``, ``observe``."""

    def __init__(self, options: SoakOptions, work: Path, broker: LocalBroker, volume: StateVolume) -> None:
        self.options = options
        self.broker = broker
        self.volume = volume
        self.rng = np.random.default_rng(options.seed)
        run = uuid.uuid4().hex[:8]
        self.topics = Topics(**{name: f"soak-{run}.{name}" for name in Topics.model_fields})
        ports = free_port(), free_port()
        scheduler = {"policy": options.policy, "max_pending": options.max_pending}
        config = write_config(work, self.topics, volume.state_dir, ports, scheduler, options.snapshot_interval_s)
        target = f"127.0.0.1:{ports[0]}"
        self.daemon = ServeProcess(config, work / "serve.log", broker.bootstrap, target, ports[1])
        self.traffic = Traffic(broker.bootstrap, self.topics, target, self.rng)
        ledger = follower(broker.bootstrap, self.topics.placements)
        self.executor = Executor(ledger, self.traffic, self.rng, options.hold_s)
        self.dead_consumer = follower(broker.bootstrap, self.topics.dlq)
        self.refused_at: set[tuple[str, int]] = set()  # dead letters' sources seen so far
        self.restart = BrokerRestart(broker, options.broker_down_s)
        self.disk = DiskPhase(self, options.disk_full_s)
        self.health: list[tuple[float, str]] = []  # (seconds into the traffic, status) at each change
        self.rss_kb: list[int] = []
        self.notes: list[str] = []
        self.phases: dict[str, Any] = {}
        self.t0 = time.monotonic()
        self._bursts = [share * options.duration_s for share in BURSTS]
        self._credit = {"kafka": 0.0, "place": 0.0}
        self._next = {"batch": 0.0, "metrics": 0.0, "hostile": 0.0, "health": 0.0, "rss": 0.0}
        self._hostile = 0

    def start(self) -> None:
        self.daemon.spawn()
        self.daemon.wait_serving(180.0)
        self.traffic.inventory_and_metrics()
        deadline = time.monotonic() + 60.0
        while self._devices_known() < len(self.traffic.devices):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the inventory was not applied within 60 s; see {self.daemon.log_path}")
            self.traffic.producer.poll(0.1)
        self.rss_kb.append(self.daemon.memory_kb("VmRSS"))

    def _devices_known(self) -> int:
        try:
            state = self.traffic.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0)
        except grpc.RpcError:
            return 0
        return int(state.devices)

    # -- the traffic -------------------------------------------------------------------------

    def traffic_phase(self) -> None:
        o = self.options
        hard_stop = o.duration_s + o.broker_down_s + o.disk_full_s + 240.0
        self.t0 = last = time.monotonic()
        while True:
            now = time.monotonic()
            t, dt, last = now - self.t0, now - last, now
            if t >= o.duration_s and self._restart_done() and self.disk.done:
                break
            if t > hard_stop:
                self.notes.append(f"the phases had not run their course {hard_stop:.0f} s in; stopped there")
                break
            if not self.daemon.alive():
                self.notes.append(f"hlb serve exited with {self.daemon.returncode} at {t:.1f} s")
                break
            if t < o.duration_s:
                self._submit(t, dt)
            self._every_so_often(t)
            self._phases(t)
            self.pump()
            time.sleep(TICK_S)
        self.phases["disk_full"] = self.disk.report()
        self.phases["traffic_s"] = round(time.monotonic() - self.t0, 1)

    def _submit(self, t: float, dt: float) -> None:
        """Valid tasks at ``rate_per_s``: 55% through Kafka, 20% by Place, 25% in PlaceBatch calls
        every 4 s; and the bursts."""
        rate, credit, traffic = self.options.rate_per_s, self._credit, self.traffic
        credit["kafka"] = min(credit["kafka"] + dt * rate * 0.55, 50.0)
        credit["place"] = min(credit["place"] + dt * rate * 0.2, 5.0)
        traffic.submit_kafka(int(credit["kafka"]))
        credit["kafka"] -= int(credit["kafka"])
        while credit["place"] >= 1:
            credit["place"] -= 1
            traffic.place()
        if t >= self._next["batch"]:
            self._next["batch"] = t + 4.0
            traffic.place_batch(max(1, round(rate * 0.25 * 4.0)))
        if self._bursts and t >= self._bursts[0]:
            self._bursts.pop(0)
            self.burst()

    def burst(self) -> None:
        """More tasks at once than the queue may hold: through Kafka, then one PlaceBatch."""
        self.traffic.submit_kafka(self.options.max_pending + 100)
        self.traffic.counts["bursts"] += 1
        for _ in range(50):  # up to a second for ingest to fill the queue
            self.pump()
            time.sleep(TICK_S)
        self.traffic.place_batch(max(1, self.options.max_pending // 2))

    def _every_so_often(self, t: float) -> None:
        """Hostile input, metrics, health and memory samples, each on its own period."""
        due = self._next
        if t >= due["hostile"]:
            due["hostile"] = t + self.options.hostile_every_s
            self.traffic.hostile_record(HOSTILE_RECORDS[self._hostile % len(HOSTILE_RECORDS)])
            self.traffic.hostile_request(HOSTILE_REQUESTS[self._hostile % len(HOSTILE_REQUESTS)])
            self._hostile += 1
        if t >= due["metrics"]:
            due["metrics"] = t + 1.0
            self.traffic.metrics()
        if t >= due["health"] or self.disk.active:
            due["health"] = t + 1.0
            self.sample_health(t)
        if t >= due["rss"]:
            due["rss"] = t + 2.0
            self.rss_kb.append(self.daemon.memory_kb("VmRSS"))

    def _phases(self, t: float) -> None:
        d = self.options.duration_s
        if self.restart.ident is None and t >= BROKER_RESTART_AT * d:
            self.phases["broker_restart"] = {"at_s": round(t, 2), "down_s": self.options.broker_down_s}
            self.restart.start()
        if self._restart_done() and "back_at_s" not in self.phases["broker_restart"]:
            self._note_restart()
        if t >= DISK_FULL_AT * d and self._restart_done():
            self.disk.step(t, self.health[-1][1] if self.health else "")

    def _restart_done(self) -> bool:
        return self.restart.ident is not None and not self.restart.is_alive()

    def _note_restart(self) -> None:
        phase, restart = self.phases["broker_restart"], self.restart
        if restart.error:
            phase.update(error=restart.error, back_at_s=None)
            return
        phase["stopped_at_s"] = round(restart.stopped_at - self.t0, 2)
        phase["back_at_s"] = round(restart.started_at - self.t0, 2)
        phase["outage_s"] = round(restart.started_at - restart.stopped_at, 2)
        phase["tasks_index_when_back"] = self.traffic.tasks_index

    def sample_health(self, t: float) -> str:
        status = self.daemon.health()
        if not self.health or self.health[-1][1] != status:
            self.health.append((round(t, 2), status))
        return status

    def pump(self) -> None:
        """Deliver, follow the ledger and the dead letters, and act on placements."""
        self.traffic.producer.poll(0)
        self.executor.poll(time.monotonic())
        self.refused_at.update(dead_letter_sources(self.dead_consumer))

    # -- the end -----------------------------------------------------------------------------

    def outstanding(self) -> list[str]:
        """Tasks accepted as far as the soak knows that have no placement yet."""
        left = []
        for record in self.traffic.tasks.values():
            if record.task_id in self.executor.placed:
                continue
            if record.origin == "kafka":
                if (self.topics.tasks, record.offset) not in self.refused_at:
                    left.append(record.task_id)
            elif record.answer in ("placed", "pending"):
                left.append(record.task_id)
        return left

    def drain(self) -> None:
        """No new tasks: telemetry and the executors go on until every accepted task is placed."""
        started = time.monotonic()
        deadline = started + self.options.drain_s
        left = self.outstanding()
        while left and time.monotonic() < deadline and self.daemon.alive():
            self.traffic.metrics()
            self.sample_health(time.monotonic() - self.t0)
            for _ in range(50):  # a second
                self.pump()
                time.sleep(TICK_S)
            left = self.outstanding()
        self.phases["drain"] = {"took_s": round(time.monotonic() - started, 1), "left": len(left), "e_g": left[:5]}

    def finish(self) -> dict[str, Any]:
        """The daemon at the end: serving, staleness not pinned, memory, metrics; then SIGTERM."""
        out: dict[str, Any] = {"alive_at_end": self.daemon.alive()}
        if not out["alive_at_end"]:
            out["exit_code"] = self.daemon.returncode
        else:
            time.sleep(1.5)  # no telemetry for 1.5 s: staleness must show it
            self.pump()
            out.update(self._state_at_end())
            for record in self.traffic.tasks.values():
                if record.answer_lost:
                    self.traffic.resolve(record)
            out["rss_mb_start"] = round(self.rss_kb[0] / 1024, 1) if self.rss_kb else None
            out["rss_mb_end"] = round(self.daemon.memory_kb("VmRSS") / 1024, 1)
            out["peak_rss_mb"] = round(self.daemon.memory_kb("VmHWM") / 1024, 1)
            try:
                out["metrics"] = selected_metrics(self.daemon.scrape())
            except OSError as exc:
                out["metrics"] = {"error": str(exc)}
            out["exit_code"] = self.daemon.terminate()
        out["log_errors"] = dict(self.daemon.log_errors().most_common(10))
        out["health"] = self.health
        return out

    def _state_at_end(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        stub = self.traffic.stub
        with contextlib.suppress(grpc.RpcError):
            state = stub.GetClusterState(api.GetClusterStateRequest(), timeout=10.0)
            out.update(
                staleness_ms=round(state.staleness_ms), pending_tasks=state.pending_tasks,
                last_sequence=state.last_sequence, policy=state.policy, degraded=state.degraded,
            )  # fmt: skip
        out["health_at_end"] = self.sample_health(time.monotonic() - self.t0)
        probe = self.traffic.new_spec("probe")
        try:
            reply = stub.Place(api.PlaceRequest(task=probe, dry_run=True), timeout=RPC_TIMEOUT_S)
            out["dry_run_place_at_end"] = "placed" if reply.HasField("placement") else "pending"
        except grpc.RpcError as exc:
            out["dry_run_place_at_end"] = exc.code().name
        return out

    def observe(self, daemon: dict[str, Any]) -> Observed:
        """Read the ledger and the dead letters to their ends and gather what the checks need."""
        undelivered = self.traffic.producer.flush(120.0)
        if undelivered:
            self.notes.append(f"{undelivered} records of the soak's were never delivered")
        self.traffic.counts.update({f"undelivered.{k}": n for k, n in self.traffic.undelivered.items()})
        bus = KafkaBus(KafkaSettings(bootstrap_servers=self.broker.bootstrap))
        ledger = bus.read_all(self.topics.placements, timeout_s=120.0)
        dead = []
        for record in bus.read_all(self.topics.dlq, timeout_s=120.0):
            headers = {k: v.decode("utf-8", "replace") for k, v in record.headers}
            source = headers.get("hlb.source.topic", ""), int(headers.get("hlb.source.offset", "-1"))
            dead.append(DeadLetter(headers.get("hlb.error.reason", ""), *source, headers.get("hlb.error.message", "")))
        return Observed(
            options=self.options,
            tasks=self.traffic.tasks,
            placements=[decided(ev.Placement.FromString(r.value or b"")) for r in ledger],
            dead_letters=dead,
            sent=self.traffic.sent,
            topics=self.topics,
            device_memory_gb={d.id: d.memory_gb for d in self.traffic.devices},
            max_tasks_per_device=SchedulerSettings().max_tasks_per_device,  # the soak keeps the default
            hostile_requests=self.traffic.hostile_requests,
            counts=self.traffic.counts,
            phases=self.phases,
            daemon=daemon,
            notes=self.notes,
        )

    def close(self) -> None:
        self.traffic.close()
        for consumer in (self.executor.consumer, self.dead_consumer):
            with contextlib.suppress(Exception):
                consumer.close()
        self.daemon.kill()


class DiskPhase:
    """The full disk: fill the state volume; keep it full until ``full_s`` after the daemon says
    NOT_SERVING (``NOTICE_S`` at most for that); free it; wait for SERVING, at most
    ``RECOVERY_S``. While the disk is full, a PlaceBatch every half second: until NOT_SERVING it
    pushes decisions at the journal (which writes small records into the page it holds already,
    so it is the file's growth that meets the full disk); after, it is what the refusal answers,
    whenever the daemon noticed (on a loaded machine that can be after the rest of the traffic
    stopped)."""

    NOTICE_S = 60.0
    RECOVERY_S = 60.0

    def __init__(self, soak: Soak, full_s: float) -> None:
        self.soak = soak
        self.full_s = full_s
        self.state = "waiting"  # -> full -> freed -> done, or -> skipped
        self.facts: dict[str, Any] = {}
        self._next_push = 0.0
        self._answers_before: Counter[str] = Counter()

    @property
    def done(self) -> bool:
        return self.state in ("done", "skipped")

    @property
    def active(self) -> bool:
        return self.state in ("full", "freed")

    def step(self, t: float, health: str) -> None:
        """Move on as the time ``t`` and the daemon's ``health`` (sampled just before) say."""
        facts, volume = self.facts, self.soak.volume
        if self.state == "waiting":
            if not volume.mounted:
                self.state = "skipped"
                return
            self._answers_before = self._answers()
            facts.update(at_s=round(t, 2), tmpfs_mb=volume.size_mb, ballast_mb=round(volume.fill() / 2**20, 1))
            self.state = "full"
        elif self.state == "full":
            if "not_serving_after_s" not in facts and health == "NOT_SERVING":
                facts["not_serving_after_s"] = round(t - facts["at_s"], 2)
            if t >= self._next_push:
                self._next_push = t + 0.5
                self.soak.traffic.place_batch(max(8, min(32, self.soak.options.max_pending // 4)))
            full_for = t - facts["at_s"]
            noticed = facts.get("not_serving_after_s")
            if full_for >= self.full_s + (noticed if noticed is not None else self.NOTICE_S):
                volume.free()
                facts["freed_at_s"] = round(t, 2)
                self.state = "freed"
        elif self.state == "freed":
            if health == "SERVING":
                facts["serving_again_after_s"] = round(t - facts["freed_at_s"], 2)
                self.state = "done"
            elif t - facts["freed_at_s"] > self.RECOVERY_S:
                self.state = "done"
        if self.state == "done" and "answers" not in facts:
            facts["answers"] = dict(self._answers() - self._answers_before)

    def _answers(self) -> Counter[str]:
        """gRPC answers to valid tasks so far, by kind (placed, pending, or a status)."""
        return Counter(r.answer for r in self.soak.traffic.tasks.values() if r.origin != "kafka")

    def report(self) -> dict[str, Any]:
        if self.state == "skipped" or not self.soak.volume.mounted:
            return {"skipped": self.soak.volume.skipped or "the state volume is not mounted"}
        return self.facts if self.done else {**self.facts, "unfinished": self.state}


def selected_metrics(samples: dict[str, float]) -> dict[str, float]:
    """The daemon's counters that say what the soak did to it."""
    wanted = (
        "hlb_decisions_withdrawn_total", "hlb_journal_sync_failures_total", "hlb_snapshot_failures_total",
        "hlb_events_rejected_total", "hlb_dlq_records_total", "hlb_rpc_requests_total", "hlb_placements_total",
        "hlb_events_applied_total", "hlb_serving", "hlb_journal_writable", "hlb_pending_tasks",
    )  # fmt: skip
    return {name: value for name, value in sorted(samples.items()) if name.split("{")[0] in wanted}


def run_soak(options: SoakOptions, progress: Callable[[str], None] = lambda _: None) -> Observed:
    """Start a broker, the state volume and ``hlb serve``; run the soak; stop and clean up in
    every case (daemon killed, volume unmounted, broker stopped and its data removed)."""
    work = Path(options.work_dir) if options.work_dir else Path(tempfile.mkdtemp(prefix="hlb-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    broker = LocalBroker(work / "broker")
    volume = StateVolume(work / "volume", options.tmpfs_mb)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, work / "broker" / "data", True)
        cleanup.callback(broker.stop)
        progress("starting the broker")
        broker.start()
        cleanup.callback(volume.unmount)
        volume.mount()
        soak = Soak(options, work, broker, volume)
        cleanup.callback(soak.close)
        progress(f"starting hlb serve (policy {options.policy}); its log: {soak.daemon.log_path}")
        soak.start()
        progress(f"traffic for {options.duration_s:.0f} s")
        soak.traffic_phase()
        progress("draining")
        soak.drain()
        daemon = soak.finish()
        if soak.restart.ident is not None:  # started, and done unless the daemon stopped early
            soak.restart.join(180.0)
        observed = soak.observe(daemon)
        observed.work_dir = work
        return observed
    raise AssertionError("unreachable: the ExitStack re-raises")
