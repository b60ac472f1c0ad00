"""A task as the daemon knows it: its lifecycle states, its record, and the labels its spec may carry."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

from hlb.v1 import events_pb2 as ev

# Labels an inference service (latency_slo_ms > 0) may carry so that hlb can estimate its request
# latency on each device model: requests per second, and one request's work in reference-device
# milliseconds (as work_ref_s is in seconds). Numbers in (0, 1e9]; checked with the spec.
REQUEST_RATE_LABEL = "request_rate_per_s"
REQUEST_WORK_LABEL = "request_work_ref_ms"
SERVICE_LOAD_LABELS = (REQUEST_RATE_LABEL, REQUEST_WORK_LABEL)


class TaskState(enum.IntEnum):
    PENDING = 0
    PLACED = 1
    RUNNING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def holds_devices(self) -> bool:
        return self in (TaskState.PLACED, TaskState.RUNNING)

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = (TaskState.FINISHED, TaskState.FAILED, TaskState.CANCELLED)  # a tuple: members compare by identity


@dataclass
class Task:
    spec: ev.TaskSpec
    cell: str
    arrival: int  # order of arrival, for FIFO within a priority
    row: int = -1  # row in InfraGraph.task_table while not final
    state: TaskState = TaskState.PENDING
    device_rows: tuple[int, ...] = ()
    device_ids: tuple[str, ...] = ()
    pending_reason: str = "not yet considered"
    lost: int = 0  # placements of the task whose lease expired (hlb.daemon.decide.leases)
    reason_pass: int = 0  # the scheduling pass that wrote pending_reason (Scheduler.pending_reason)
    # The spec names no dependencies, allowed kinds or models, preferred models or labels, as
    # ``check_task_specs`` found (False: not known, so read them). Reading one of these repeated
    # fields costs as much as a few plain ones, and a batch decision would read each several times.
    plain: bool = False

    @property
    def gang_size(self) -> int:
        return max(1, self.spec.num_devices)

    @cached_property
    def fit_key(self) -> tuple[tuple[tuple[int, ...], tuple[str, ...], int, int], float, bool]:
        """What decides whether the task fits, read from its spec once: (allowed kinds, allowed
        models, gang size, share of a device), its memory per device, and whether it has
        dependencies. A scheduling pass reads it for every queued task."""
        spec = self.spec
        shape = (
            tuple(spec.allowed_kinds),
            tuple(spec.allowed_models),
            max(1, spec.num_devices),
            spec.device_share_milli,
        )
        return shape, spec.memory_per_device_gb, bool(spec.dependencies)
