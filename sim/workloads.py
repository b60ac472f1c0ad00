"""Workload generators: Gavel-style jobs, Philly-derived jobs, task DAGs and inference services.

Every generator is pure: it takes a seed or a ``numpy.random.Generator`` and returns a list of
:class:`Task` sorted by arrival time (``arrival_s``, seconds from the start of the workload);
the same seed gives the same list. A task's work is ``work_ref_s``: its run time in seconds on
ONE reference V100 at full speed (``Catalogue.runtime_s`` scales it to a device model and gang).

Gavel's durations are the run time of the whole gang on V100s, consolidated (Gavel's
``scheduler/utils.py::generate_job`` computes ``num_steps = run_time * throughput[v100][(type,
scale_factor)]``), so a gang job's work is ``duration_s * tput(v100, class, g) / tput(v100,
class, 1)``.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hlb.daemon.state.task import REQUEST_RATE_LABEL, REQUEST_WORK_LABEL
from hlb.sim.catalogue import Catalogue, WorkloadClass, shared_data_dir
from hlb.sim.catalogue_sources import GANG_SIZES
from hlb.sim.topology import DEVICE_KINDS
from hlb.v1 import events_pb2

TASK_KINDS: dict[str, events_pb2.TaskKind.ValueType] = {
    "training": events_pb2.TASK_KIND_TRAINING,
    "inference": events_pb2.TASK_KIND_INFERENCE,
    "batch_stage": events_pb2.TASK_KIND_BATCH_STAGE,
}
PHILLY_SAMPLE_PATH = Path(__file__).parent / "data" / "philly" / "philly_sample.csv"

# Gavel's trace generator (scheduler/utils.py, _generate_duration and _generate_scale_factor):
# duration 60 * 10**U(1.5, 3) s with probability 0.8, else 60 * 10**U(3, 4) s; scale factor
# 1 (r < 0.7), 2 (r < 0.8), 4 (r < 0.95), else 8 for r ~ U(0, 1). (The msr traces shipped in
# shared/data/gavel are Philly-mapped, not drawn this way: their gangs go up to 64.)
GAVEL_SHORT_PROBABILITY = 0.8
GAVEL_SHORT_LOG10_MINUTES = (1.5, 3.0)
GAVEL_LONG_LOG10_MINUTES = (3.0, 4.0)
GAVEL_SCALE_FACTORS: tuple[int, ...] = (1, 2, 4, 8)
GAVEL_SCALE_FACTOR_PROBABILITIES: tuple[float, ...] = (0.7, 0.1, 0.15, 0.05)


Seed = int | np.random.Generator


def as_generator(seed: Seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


@dataclass(frozen=True)
class Dependency:
    """This task needs ``transfer_gb`` GB of the output of task ``task_id``."""

    task_id: str
    transfer_gb: float


@dataclass(frozen=True)
class Task:
    """One schedulable task (a gang); a job is the set of tasks sharing ``job_id``."""

    id: str
    job_id: str
    arrival_s: float
    kind: str  # training, inference or batch_stage
    workload_class: str
    num_devices: int
    memory_per_device_gb: float
    work_ref_s: float
    priority: int = 0
    latency_slo_ms: float = 0.0
    deadline_s: float = 0.0  # seconds from the start of the workload; 0: none
    dependencies: tuple[Dependency, ...] = ()
    allowed_kinds: tuple[str, ...] = ()
    allowed_models: tuple[str, ...] = ()
    preferred_models: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    # A share of one device per gang member, milli-devices 1..1000 (0: whole devices), with its
    # memory (memory_per_device_gb > 0): TaskSpec.device_share_milli, docs/fractional.md.
    device_share_milli: int = 0

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task {self.id!r}: kind {self.kind!r} is not one of {sorted(TASK_KINDS)}")
        if self.num_devices < 1 or self.work_ref_s < 0 or self.memory_per_device_gb < 0 or self.arrival_s < 0:
            raise ValueError(f"task {self.id!r}: gang, work, memory and arrival must be positive")
        if not 0 <= self.device_share_milli <= 1000:
            raise ValueError(f"task {self.id!r}: device_share_milli {self.device_share_milli} is outside 0..1000")
        if self.device_share_milli and self.memory_per_device_gb <= 0:
            raise ValueError(f"task {self.id!r}: a share of a device needs memory_per_device_gb > 0")
        unknown = set(self.allowed_kinds) - set(DEVICE_KINDS)
        if unknown:
            raise ValueError(f"task {self.id!r}: unknown device kinds {sorted(unknown)}")

    def to_task_spec(self, epoch_ms: int = 0) -> events_pb2.TaskSpec:
        """The hlb.v1 TaskSpec, with times as Unix ms counted from ``epoch_ms``."""
        return events_pb2.TaskSpec(
            id=self.id,
            job_id=self.job_id,
            kind=TASK_KINDS[self.kind],
            workload_class=self.workload_class,
            num_devices=self.num_devices,
            memory_per_device_gb=self.memory_per_device_gb,
            work_ref_s=self.work_ref_s,
            allowed_kinds=[DEVICE_KINDS[k] for k in self.allowed_kinds],
            allowed_models=list(self.allowed_models),
            preferred_models=list(self.preferred_models),
            priority=self.priority,
            deadline_ms=epoch_ms + round(self.deadline_s * 1000) if self.deadline_s > 0 else 0,
            latency_slo_ms=self.latency_slo_ms,
            dependencies=[
                events_pb2.Dependency(task_id=d.task_id, transfer_gb=d.transfer_gb) for d in self.dependencies
            ],
            labels=dict(self.labels),
            submit_time_ms=epoch_ms + round(self.arrival_s * 1000),
            device_share_milli=self.device_share_milli,
        )


def work_ref_s(catalogue: Catalogue, class_id: str, gang_size: int, gang_runtime_s: float) -> float:
    """Work (one-V100 seconds) of a job that runs ``gang_runtime_s`` on ``gang_size`` V100s."""
    reference = catalogue.reference_model
    return (
        gang_runtime_s
        * catalogue.throughput(reference, class_id, gang_size)
        / catalogue.throughput(reference, class_id, 1)
    )


def poisson_arrivals(rng: np.random.Generator, count: int, rate_per_s: float, start_s: float = 0.0) -> np.ndarray:
    """Arrival times (s), shape [count]: cumulative exponential gaps of mean 1 / rate_per_s."""
    return start_s + np.cumsum(rng.exponential(1.0 / rate_per_s, size=count))


def gavel_mean_device_seconds(multi_gpu: bool = True) -> float:
    """E[gang size * duration_s] of Gavel's generator, in closed form (device-seconds per job).

    E[10**U(a, b)] = (10**b - 10**a) / ((b - a) ln 10); gang size and duration are independent.
    """

    def mean_pow10(low: float, high: float) -> float:
        return (10**high - 10**low) / ((high - low) * math.log(10))

    short = mean_pow10(*GAVEL_SHORT_LOG10_MINUTES)
    long = mean_pow10(*GAVEL_LONG_LOG10_MINUTES)
    mean_duration_s = 60.0 * (GAVEL_SHORT_PROBABILITY * short + (1 - GAVEL_SHORT_PROBABILITY) * long)
    mean_gang = (
        sum(g * p for g, p in zip(GAVEL_SCALE_FACTORS, GAVEL_SCALE_FACTOR_PROBABILITIES, strict=True))
        if multi_gpu
        else 1.0
    )
    return mean_gang * mean_duration_s


def gavel_jobs(
    seed: Seed,
    num_jobs: int,
    catalogue: Catalogue,
    load: float,
    capacity_devices: float,
    multi_gpu: bool = True,
) -> list[Task]:
    """Jobs drawn as Gavel's generator draws them, arriving as a Poisson process at ``load``.

    ``load`` is offered device-seconds per second over ``capacity_devices`` devices (1.0: the
    cluster would be exactly busy if every job ran on V100s as fast as Gavel's durations say);
    the arrival rate is ``load * capacity_devices / E[gang * duration]``. The job type is uniform
    over the classes that support the drawn gang size, as Gavel draws it.
    """
    if load <= 0 or capacity_devices <= 0:
        raise ValueError("load and capacity_devices must be > 0")
    rng = as_generator(seed)
    rate_per_s = load * capacity_devices / gavel_mean_device_seconds(multi_gpu)
    arrivals = poisson_arrivals(rng, num_jobs, rate_per_s)
    classes = sorted(catalogue.classes.values(), key=lambda c: c.id)
    tasks = []
    for index in range(num_jobs):
        gang = int(rng.choice(GAVEL_SCALE_FACTORS, p=GAVEL_SCALE_FACTOR_PROBABILITIES)) if multi_gpu else 1
        low, high = GAVEL_SHORT_LOG10_MINUTES if rng.random() < GAVEL_SHORT_PROBABILITY else GAVEL_LONG_LOG10_MINUTES
        duration_s = 60.0 * 10 ** rng.uniform(low, high)
        job = (f"gavel-{index:06d}", float(arrivals[index]), gang, duration_s)
        tasks.append(gavel_training_task(rng, catalogue, classes, *job))
    return tasks


def gavel_training_task(
    rng: np.random.Generator,
    catalogue: Catalogue,
    classes: Sequence[WorkloadClass],
    job_id: str,
    arrival_s: float,
    gang: int,
    duration_s: float,
    share_milli: int = 0,
) -> Task:
    """A Gavel-style training job's one task (``<job_id>/train``): its class drawn uniformly among
    ``classes`` that support ``gang``, as Gavel draws it, with the work that takes ``duration_s``
    on ``gang`` V100s; asking for ``share_milli`` of a device (0: whole), it has that share of the
    work, so that it runs ``duration_s`` on its share."""
    candidates = [c for c in classes if gang in c.gang_sizes]
    chosen = candidates[int(rng.integers(len(candidates)))]
    work = work_ref_s(catalogue, chosen.id, gang, duration_s)
    return Task(
        id=f"{job_id}/train",
        job_id=job_id,
        arrival_s=arrival_s,
        kind="training",
        workload_class=chosen.id,
        num_devices=gang,
        memory_per_device_gb=chosen.memory_gb,
        work_ref_s=work * share_milli / 1000.0 if share_milli else work,
        labels={"gang_runtime_v100_s": repr(duration_s)},
        device_share_milli=share_milli,
    )


# ---------------------------------------------------------------- Philly-derived jobs


@dataclass(frozen=True)
class PhillyTable:
    """Philly job sizes and durations (Pollux's ``philly.csv``), shapes [n] each."""

    submit_s: np.ndarray  # seconds since the earliest submission in the table
    duration_s: np.ndarray
    num_gpus: np.ndarray


def load_philly_table(path: Path = PHILLY_SAMPLE_PATH) -> PhillyTable:
    """Read ``timestamp,duration,num_gpus,gpu_time,cluster`` rows; rows missing a field are skipped.

    The default is the shipped sample (every 40th row of the full file); pass
    :func:`shared_philly_csv` for all 82,247 rows.
    """
    submit: list[float] = []
    duration: list[float] = []
    gpus: list[int] = []
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if not (row.get("timestamp") and row.get("duration") and row.get("num_gpus")):
                continue
            submit.append(np.datetime64(row["timestamp"].replace(" ", "T"), "s").astype(np.int64).item())
            duration.append(float(row["duration"]))
            gpus.append(int(float(row["num_gpus"])))
    submit_array = np.array(submit, dtype=np.float64)
    return PhillyTable(submit_array - submit_array.min(), np.array(duration), np.array(gpus, dtype=np.int64))


def shared_philly_csv() -> Path:
    return shared_data_dir() / "pollux-osdi21" / "philly.csv"


def philly_jobs(
    seed: Seed,
    num_jobs: int,
    catalogue: Catalogue,
    table: PhillyTable,
    load: float | None = None,
    capacity_devices: float | None = None,
    min_duration_s: float = 60.0,
) -> list[Task]:
    """Jobs with Philly's sizes and durations, mapped onto Gavel classes.

    Rows with ``duration >= min_duration_s`` (Pollux's filter) and a gang size the catalogue
    knows (1, 2, 4, 8) are eligible. With ``load`` and ``capacity_devices``, rows are drawn
    uniformly with replacement and arrive as a Poisson process at that load (device-seconds per
    second over the capacity, the eligible rows' mean gang * duration); otherwise a window of
    ``num_jobs`` consecutive submissions is replayed at its recorded times. The class is uniform
    over those supporting the gang, and the Philly duration is the gang's run time on V100s.
    """
    rng = as_generator(seed)
    eligible = np.flatnonzero((table.duration_s >= min_duration_s) & np.isin(table.num_gpus, GANG_SIZES))
    if eligible.size == 0:
        raise ValueError("no eligible Philly rows")
    if load is not None:
        if capacity_devices is None or load <= 0 or capacity_devices <= 0:
            raise ValueError("a target load needs capacity_devices; both must be > 0")
        rows = rng.choice(eligible, size=num_jobs)
        mean_device_s = float(np.mean(table.duration_s[eligible] * table.num_gpus[eligible]))
        arrivals = poisson_arrivals(rng, num_jobs, load * capacity_devices / mean_device_s)
    else:
        ordered = eligible[np.argsort(table.submit_s[eligible], kind="stable")]
        if num_jobs > ordered.size:
            raise ValueError(f"the table has only {ordered.size} eligible rows")
        start = int(rng.integers(ordered.size - num_jobs + 1))
        rows = ordered[start : start + num_jobs]
        arrivals = table.submit_s[rows] - table.submit_s[rows[0]]
    classes = sorted(catalogue.classes.values(), key=lambda c: c.id)
    tasks = []
    for index, (row, arrival) in enumerate(zip(rows, arrivals, strict=True)):
        gang = int(table.num_gpus[row])
        candidates = [c for c in classes if gang in c.gang_sizes]
        chosen = candidates[int(rng.integers(len(candidates)))]
        job_id = f"philly-{index:06d}"
        tasks.append(
            Task(
                id=f"{job_id}/train",
                job_id=job_id,
                arrival_s=float(arrival),
                kind="training",
                workload_class=chosen.id,
                num_devices=gang,
                memory_per_device_gb=chosen.memory_gb,
                work_ref_s=work_ref_s(catalogue, chosen.id, gang, float(table.duration_s[row])),
                labels={"philly_row": str(int(row))},
            )
        )
    return tasks


# ---------------------------------------------------------------- DAG workloads


def training_pipelines(
    seed: Seed, num_jobs: int, catalogue: Catalogue, mean_interarrival_s: float = 600.0
) -> list[Task]:
    """Data preparation -> training -> evaluation chains with transfers on the edges.

    Training is drawn as in :func:`gavel_jobs`. Preparation (a single-device batch stage) does
    5-20% of training's work and hands over a dataset shard of 10**U(0, 2) GB; evaluation does
    2-10% and receives a checkpoint of 10**U(-1, 1) GB. Stages inherit the job's class (they run
    the same model's input pipeline and forward pass). Modelled shapes, not measured ones.
    """
    rng = as_generator(seed)
    arrivals = poisson_arrivals(rng, num_jobs, 1.0 / mean_interarrival_s)
    training = gavel_jobs(rng, num_jobs, catalogue, load=1.0, capacity_devices=1.0)
    tasks: list[Task] = []
    for index, (arrival, train) in enumerate(zip(arrivals, training, strict=True)):
        job_id = f"pipeline-{index:06d}"
        prep_work_s = train.work_ref_s * rng.uniform(0.05, 0.2)
        shard_gb = float(10 ** rng.uniform(0.0, 2.0))
        eval_work_s = train.work_ref_s * rng.uniform(0.02, 0.1)
        checkpoint_gb = float(10 ** rng.uniform(-1.0, 1.0))
        main = replace(train, id=f"{job_id}/train", job_id=job_id, arrival_s=float(arrival), labels={})
        tasks += [
            replace(main, id=f"{job_id}/prep", kind="batch_stage", num_devices=1, work_ref_s=prep_work_s),
            replace(main, dependencies=(Dependency(f"{job_id}/prep", shard_gb),)),
            replace(
                main,
                id=f"{job_id}/eval",
                kind="batch_stage",
                num_devices=1,
                work_ref_s=eval_work_s,
                dependencies=(Dependency(main.id, checkpoint_gb),),
            ),
        ]
    return tasks


# Inference pipeline: a detector feeds an embedding model and a captioning model; a ranker
# joins both. Classes are the gang-1 Gavel classes closest to each role.
_INFERENCE_PIPELINE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("detect", "resnet50-bs16", ()),
    ("embed", "resnet18-bs16", ("detect",)),
    ("caption", "transformer-bs16", ("detect",)),
    ("rank", "recommendation-bs512", ("embed", "caption")),
)


def inference_pipelines(
    seed: Seed, num_jobs: int, catalogue: Catalogue, mean_interarrival_s: float = 300.0
) -> list[Task]:
    """Batch-inference DAGs (detect -> {embed, caption} -> rank), a fork and a join.

    Each stage serves 10**U(2, 4) batches (work = batches / V100 steps/s); each edge moves
    10**U(-2, 0) GB. Modelled shapes.
    """
    rng = as_generator(seed)
    arrivals = poisson_arrivals(rng, num_jobs, 1.0 / mean_interarrival_s)
    reference = catalogue.reference_model
    tasks: list[Task] = []
    for index, arrival in enumerate(arrivals):
        job_id = f"inference-pipeline-{index:06d}"
        for stage, class_id, parents in _INFERENCE_PIPELINE:
            batches = float(10 ** rng.uniform(2.0, 4.0))
            transfers = [float(10 ** rng.uniform(-2.0, 0.0)) for _ in parents]
            tasks.append(
                Task(
                    id=f"{job_id}/{stage}",
                    job_id=job_id,
                    arrival_s=float(arrival),
                    kind="inference",
                    workload_class=class_id,
                    num_devices=1,
                    memory_per_device_gb=catalogue.classes[class_id].memory_gb,
                    work_ref_s=batches / catalogue.throughput(reference, class_id, 1),
                    dependencies=tuple(
                        Dependency(f"{job_id}/{p}", gb) for p, gb in zip(parents, transfers, strict=True)
                    ),
                )
            )
    return tasks


INFERENCE_SERVICE_CLASSES: tuple[str, ...] = (
    "resnet50-bs16",
    "resnet18-bs16",
    "transformer-bs16",
    "lm-bs5",
    "recommendation-bs512",
)


def inference_services(
    seed: Seed, num_services: int, catalogue: Catalogue, mean_interarrival_s: float = 900.0
) -> list[Task]:
    """Long-running inference services with latency SLOs (one replica each, kind inference).

    A service serves one batch per request. Its request work on a V100 is one step
    (``1000 / steps_per_s`` ms); its SLO is 2, 3 or 5 times that (``latency_slo_ms``); it lives
    10**U(3, 4.5) s and receives requests at a rate that keeps a V100 U(0.2, 0.7) busy. Its
    ``work_ref_s`` is the total request work (rate * lifetime * request work). The lifetime,
    rate and request work are labels (``duration_s``, ``request_rate_per_s``,
    ``request_work_ref_ms``). Modelled shapes.
    """
    rng = as_generator(seed)
    arrivals = poisson_arrivals(rng, num_services, 1.0 / mean_interarrival_s)
    reference = catalogue.reference_model
    tasks: list[Task] = []
    for index, arrival in enumerate(arrivals):
        class_id = INFERENCE_SERVICE_CLASSES[int(rng.integers(len(INFERENCE_SERVICE_CLASSES)))]
        request_work_ms = 1000.0 / catalogue.throughput(reference, class_id, 1)
        duration_s = float(10 ** rng.uniform(3.0, 4.5))
        rate_per_s = float(rng.uniform(0.2, 0.7)) * 1000.0 / request_work_ms
        slo_ms = request_work_ms * float(rng.choice([2.0, 3.0, 5.0]))
        tasks.append(
            service_task(
                f"service-{index:06d}",
                float(arrival),
                catalogue,
                class_id,
                duration_s,
                rate_per_s,
                request_work_ms,
                slo_ms,
            )
        )
    return tasks


def service_task(
    job_id: str,
    arrival_s: float,
    catalogue: Catalogue,
    class_id: str,
    lifetime_s: float,
    rate_per_s: float,
    request_work_ms: float,
    slo_ms: float,
    share_milli: int = 0,
) -> Task:
    """One inference service (its one replica, ``<job_id>/serve``): it lives ``lifetime_s``, gets
    ``rate_per_s`` requests of ``request_work_ms`` each (reference-device ms), which are its labels,
    and its work is their total; ``share_milli``: the share of a device it asks for (0: whole)."""
    return Task(
        id=f"{job_id}/serve",
        job_id=job_id,
        arrival_s=arrival_s,
        kind="inference",
        workload_class=class_id,
        num_devices=1,
        memory_per_device_gb=catalogue.classes[class_id].memory_gb,
        work_ref_s=rate_per_s * lifetime_s * request_work_ms / 1000.0,
        priority=1,
        latency_slo_ms=slo_ms,
        labels={
            "duration_s": repr(lifetime_s),
            REQUEST_RATE_LABEL: repr(rate_per_s),
            REQUEST_WORK_LABEL: repr(request_work_ms),
        },
        device_share_milli=share_milli,
    )


def merge_workloads(*workloads: Sequence[Task]) -> list[Task]:
    """Several workloads as one, ordered by arrival (ties keep the given order); ids must differ."""
    merged = sorted((t for w in workloads for t in w), key=lambda t: t.arrival_s)
    ids = [t.id for t in merged]
    if len(ids) != len(set(ids)):
        raise ValueError("task ids collide between workloads")
    return merged


# ---------------------------------------------------------------- fractional requests

# Alibaba's 2023 GPU-sharing trace (cluster-trace-gpu-v2023, openb_pod_list_default.csv: 8,152 pods
# on about 6,200 GPUs; the trace of the FGD paper, USENIX ATC'23). FRACTIONAL_SHARE: the share of
# the pods using a GPU that ask for a fraction of one (41%, docs/simulator.md). The share
# (gpu_milli) and GPU-count distributions are tallied from one window of the file (pods
# openb-pod-4254 to openb-pod-4479: 226 pods, 189 using a GPU; docs/simulator.md says how far
# they carry): counts per value.
FRACTIONAL_SHARE = 0.41
FRACTIONAL_SHARE_COUNTS: dict[int, int] = {
    470: 36, 810: 26, 650: 14, 320: 12, 460: 7, 220: 4, 160: 4, 480: 1, 110: 1, 590: 1,
}  # fmt: skip
WHOLE_GPU_COUNTS: dict[int, int] = {1: 79, 2: 1, 4: 1, 8: 2}
# Of the fractional requests, the share that are inference services (latency SLOs), the rest
# training-like batch work: an assumption (about a third of the window's fractional pods are
# latency-sensitive, QoS LS).
FRACTIONAL_SERVICE_SHARE = 1.0 / 3.0


def fractional_jobs(
    seed: Seed, num_jobs: int, catalogue: Catalogue, load: float, capacity_devices: float
) -> list[Task]:
    """A workload of fractional and whole-device requests as the 2023 GPU-sharing trace has them.

    Each job is, with probability :data:`FRACTIONAL_SHARE`, a request for a share of one device
    (``device_share_milli`` drawn from :data:`FRACTIONAL_SHARE_COUNTS`), else a gang of whole
    devices (:data:`WHOLE_GPU_COUNTS`). A fractional request is an inference service with
    probability :data:`FRACTIONAL_SERVICE_SHARE` (a class of :data:`INFERENCE_SERVICE_CLASSES`,
    lifetime 10**U(3, 4.5) s, its request rate keeping its share U(0.2, 0.7) busy, its SLO 2, 3
    or 5 times a request's run time on its share of a V100), else a one-device training job of
    Gavel's durations run on its share (its work is the share times Gavel's duration). Whole
    gangs are Gavel's jobs with the trace's GPU counts. Memory is the class's (catalogue). Arrivals
    are Poisson, stretched to ``load`` (:func:`hlb.sim.scenarios.at_load`'s rule: offered work over
    capacity). Modelled shapes apart from the tallied distributions.
    """
    if load <= 0 or capacity_devices <= 0:
        raise ValueError("load and capacity_devices must be > 0")
    rng = as_generator(seed)
    shares = np.array(sorted(FRACTIONAL_SHARE_COUNTS), dtype=np.int64)
    share_p = np.array([FRACTIONAL_SHARE_COUNTS[int(s)] for s in shares], dtype=np.float64)
    gangs = np.array(sorted(WHOLE_GPU_COUNTS), dtype=np.int64)
    gang_p = np.array([WHOLE_GPU_COUNTS[int(g)] for g in gangs], dtype=np.float64)
    classes = sorted(catalogue.classes.values(), key=lambda c: c.id)
    reference = catalogue.reference_model
    arrivals = poisson_arrivals(rng, num_jobs, 1.0)
    tasks: list[Task] = []
    for index in range(num_jobs):
        low, high = GAVEL_SHORT_LOG10_MINUTES if rng.random() < GAVEL_SHORT_PROBABILITY else GAVEL_LONG_LOG10_MINUTES
        duration_s = 60.0 * 10 ** rng.uniform(low, high)
        fractional = rng.random() < FRACTIONAL_SHARE
        share = int(rng.choice(shares, p=share_p / share_p.sum())) if fractional else 0
        service = fractional and rng.random() < FRACTIONAL_SERVICE_SHARE
        if service:
            job_id = f"fractional-service-{index:06d}"
            class_id = INFERENCE_SERVICE_CLASSES[int(rng.integers(len(INFERENCE_SERVICE_CLASSES)))]
            request_work_ms = 1000.0 / catalogue.throughput(reference, class_id, 1)
            lifetime_s = float(10 ** rng.uniform(3.0, 4.5))
            on_share_ms = request_work_ms * 1000.0 / share
            rate_per_s = float(rng.uniform(0.2, 0.7)) * 1000.0 / on_share_ms
            slo_ms = on_share_ms * float(rng.choice([2.0, 3.0, 5.0]))
            arrival_s = float(arrivals[index])
            args = (catalogue, class_id, lifetime_s, rate_per_s, request_work_ms, slo_ms, share)
            tasks.append(service_task(job_id, arrival_s, *args))
            continue
        gang = 1 if fractional else int(rng.choice(gangs, p=gang_p / gang_p.sum()))
        job = (f"fractional-{index:06d}", float(arrivals[index]), gang, duration_s, share)
        tasks.append(gavel_training_task(rng, catalogue, classes, *job))
    return tasks
