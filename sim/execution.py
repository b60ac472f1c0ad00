"""How fast a task runs where: the simulator's execution model, from the device catalogue alone.

Units: s, steps/s, ms.

- A task's work is ``steps = work_ref_s * throughput(reference, class, 1)``. Its gang runs at
  ``min over the gang's models of throughput(model, class, gang, consolidated)`` steps/s, where
  consolidated means every member on one host (Gavel's measured figures; a spread gang whose
  class has no spread figure runs at half the consolidated rate, an assumption).
- Co-location: a device shared by ``k`` running tasks gives task ``a`` the fraction
  ``(2 / k) * mean over the others b of pair(a, b)`` of its isolated speed, where ``pair`` is
  Gavel's measured space-sharing factor (0.5, time sharing, when the pair was not measured). For
  ``k = 2`` that is the measured pair. A gang runs at its slowest member's fraction.
- Shares of a device (``Task.device_share_milli``, docs/fractional.md): a task that asks for a
  share runs at that share of its device's isolated rate (on a partition, at the partition's
  compute share), scaled down in proportion where the shares running on a time-sliced device add
  up to more than one device (:meth:`ExecutionModel.share_fraction`). Interference (hidden truth,
  ``HiddenConfig.share_interference``, on by default): on a shared device (never a partition:
  MIG isolates them) each co-runner ``b`` further slows task ``a`` to ``1 - (s_b / 1000) * loss(a,
  b)`` of that, with ``loss = max(0, 1 - 2 * pair(a, b))``: Gavel's measured pair (one-device
  gangs) against the even split that time slicing gives (0.5), scaled by how much of the device
  ``b`` holds; a pair Gavel did not measure loses the mean of the measured losses on that model
  (:meth:`ExecutionModel.share_interference`). Whole-device tasks follow the rule above.
- Inference services (``latency_slo_ms > 0``): they live ``labels["duration_s"]`` seconds when
  given (else they run their work like any task). Per-request latency is the M/M/1 response time
  ``S / (1 - rho)`` with ``S`` the request's run time on its device (slowed by co-location) and
  ``rho = rate * S``; the SLO is missed if that latency ever exceeds ``latency_slo_ms``.
- A task can run on a model when its kind, allow-lists and memory fit and its class has a
  throughput there at its gang size (Gavel measures some classes as unable to run on some devices).

Hidden truth (:mod:`hlb.sim.hidden`, off by default): a job's speed multiplier scales every rate
above (and so its ideal run time); a device's speed scales the rate of what runs on it (a gang
runs at its slowest member's speed; :mod:`hlb.sim.attempts`); and with link sharing a spread gang
whose hosts' uplinks also carry other spread gangs runs slower (:func:`shared_uplink_rate`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from hlb.daemon.state.task import REQUEST_RATE_LABEL, REQUEST_WORK_LABEL
from hlb.sim.catalogue import Catalogue
from hlb.sim.result import TaskRecord
from hlb.sim.workloads import Task

TIME_SHARING_FACTOR = 0.5  # co-location fraction of a pair Gavel did not measure
SPREAD_FALLBACK_FACTOR = 0.5  # spread gang of a class with no spread figure: this share of consolidated


class ExecutionModel:
    """Run rates, ideal run times and co-location fractions of tasks on the catalogue's devices.

    ``job_speed``: the hidden speed multiplier of each job (absent: 1, as catalogued).
    """

    def __init__(
        self,
        catalogue: Catalogue,
        job_speed: Mapping[str, float] | None = None,
        share_offers: Mapping[str, tuple[bool, int]] | None = None,
    ) -> None:
        self.catalogue = catalogue
        self._job_speed = dict(job_speed or {})
        self._pair_cache: dict[tuple[str, str, int, str, int], float] = {}
        # Per model, whether the cluster has a shareable device of it and its largest partition's
        # compute share (milli-devices; 0: none): how fast a share can run at best (ideal_s).
        self._share_offers = dict(share_offers) if share_offers is not None else None
        self._loss_cache: dict[tuple[str, str, str], float] = {}
        self._mean_loss: dict[str, float] = {}

    def steps(self, task: Task) -> float:
        """The task's work in steps of its class."""
        return task.work_ref_s * self.catalogue.throughput(self.catalogue.reference_model, task.workload_class, 1)

    def gang_rate(self, task: Task, model: str, consolidated: bool) -> float:
        """Steps/s of ``task``'s gang on devices of ``model``, alone; 0 when it cannot run there."""
        cat = self.catalogue
        rate = cat.throughput(model, task.workload_class, task.num_devices, consolidated)
        if rate <= 0 and not consolidated:
            rate = SPREAD_FALLBACK_FACTOR * cat.throughput(model, task.workload_class, task.num_devices, True)
        return self._for_job(task, rate)

    def best_rate(self, task: Task, model: str) -> float:
        """The fastest gang rate (steps/s) of ``task`` on devices of ``model``, either placement."""
        g = task.num_devices
        cat = self.catalogue
        consolidated = cat.throughput(model, task.workload_class, g, True)
        return self._for_job(task, max(consolidated, cat.throughput(model, task.workload_class, g, False)))

    def _for_job(self, task: Task, rate: float) -> float:
        speed = self._job_speed.get(task.job_id)
        return rate if speed is None else rate * speed

    def network_s_per_step(self, task: Task, models: Iterable[str]) -> float:
        """Of a spread gang's step on ``models``, the time (s) Gavel's figures put on the network.

        Gavel measured each gang both consolidated (one host) and spread (one device per host);
        the difference of the step times, ``1 / spread - 1 / consolidated``, is what crossing the
        hosts' uplinks costs (0 when spread is as fast). The whole step when there is no
        consolidated figure.
        """
        models = list(models)
        spread = min(self.gang_rate(task, m, consolidated=False) for m in models)
        together = min(self.gang_rate(task, m, consolidated=True) for m in models)
        if spread <= 0:
            return 0.0
        if together <= 0:
            return 1.0 / spread
        return max(0.0, 1.0 / spread - 1.0 / together)

    def model_fits(self, task: Task, model: str) -> bool:
        """Whether ``task``'s kind, allow-lists and memory admit devices of ``model``."""
        profile = self.catalogue.profile(model)
        return (
            # The catalogue names training and inference; batch stages run where training runs.
            (task.kind if task.kind != "batch_stage" else "training") in profile.task_kinds
            and (not task.allowed_kinds or profile.kind in task.allowed_kinds)
            and (not task.allowed_models or model in task.allowed_models)
            and task.memory_per_device_gb <= profile.memory_gb
        )

    def runnable_models(self, task: Task, cluster_models: Sequence[str]) -> list[str]:
        """The cluster's models on which ``task`` fits and its class runs at its gang size."""
        return [m for m in cluster_models if self.model_fits(task, m) and self.best_rate(task, m) > 0]

    def ideal_s(self, task: Task, cluster_models: Sequence[str]) -> float:
        """Run time (s) on its fastest feasible devices of the cluster, alone; inf when none."""
        lifetime = service_lifetime_s(task)
        if lifetime is not None:
            return lifetime
        steps = self.steps(task)
        rates = [
            self.best_rate(task, m) * self._best_fraction(task, m) for m in cluster_models if self.model_fits(task, m)
        ]
        best = max(rates, default=0.0)
        return steps / best if best > 0 else math.inf

    def _best_fraction(self, task: Task, model: str) -> float:
        """The most of a device of ``model`` a task gets: all of it for whole devices; for a share,
        its share on a shareable device or the compute share of the largest partition that takes it."""
        share = task.device_share_milli
        if not share:
            return 1.0
        if self._share_offers is None:
            return share / 1000.0
        shareable, largest = self._share_offers.get(model, (False, 0))
        return max(share / 1000.0 if shareable else 0.0, largest / 1000.0 if largest >= share else 0.0)

    def new_record(self, task: Task, cluster_models: Sequence[str]) -> TaskRecord:
        """The record of a task not yet submitted, with its ideal run time on this cluster."""
        ideal = self.ideal_s(task, cluster_models)
        fixed = service_lifetime_s(task) is not None
        # Device-seconds at full speed (the makespan bound's work): a share holds part of a device.
        whole = replace(task, device_share_milli=0) if task.device_share_milli else task
        device_ideal = ideal if whole is task else self.ideal_s(whole, cluster_models)
        return TaskRecord(
            task_id=task.id,
            job_id=task.job_id,
            kind=task.kind,
            workload_class=task.workload_class,
            num_devices=task.num_devices,
            arrival_s=task.arrival_s,
            dependencies=tuple(d.task_id for d in task.dependencies),
            ideal_s=ideal,
            min_device_s=0.0 if fixed or not math.isfinite(ideal) else task.num_devices * device_ideal,
            latency_slo_ms=task.latency_slo_ms,
            deadline_s=task.deadline_s,
            job_speed=self._job_speed.get(task.job_id, 1.0),
        )

    def colocation_fraction(self, model: str, task: Task, others: Sequence[Task]) -> float:
        """The share of its isolated speed ``task`` keeps on a device of ``model`` shared with ``others``."""
        if not others:
            return 1.0
        pairs = [self.pair(model, task, b) for b in others]
        return 2.0 / (len(others) + 1) * sum(pairs) / len(pairs)

    @staticmethod
    def share_fraction(task: Task, partition_milli: int, others: Sequence[Task]) -> float:
        """The share of its device's isolated speed a task that asks for a share keeps: the whole
        of a partition of ``partition_milli`` (its compute share; 0: not a partition), else its own
        share, times ``min(1, 1000 / shares running there)`` (time slicing past one device)."""
        if partition_milli:
            return partition_milli / 1000.0
        running = task.device_share_milli + sum(o.device_share_milli for o in others)
        return task.device_share_milli / 1000.0 * min(1.0, 1000.0 / running)

    def share_interference(self, model: str, task: Task, others: Sequence[Task]) -> float:
        """The share of its rate a task holding a share keeps on a shared device of ``model`` with
        ``others`` (shares or not) running there: the product over them of ``1 - (s_b / 1000) *
        loss(task, b)`` (the module's rule). 1 alone."""
        kept = 1.0
        for other in others:
            held = (other.device_share_milli or 1000) / 1000.0
            kept *= 1.0 - held * self._loss(model, task.workload_class, other.workload_class)
        return kept

    def _loss(self, model: str, a: str, b: str) -> float:
        key = (model, a, b)
        loss = self._loss_cache.get(key)
        if loss is None:
            factor = self.catalogue.colocation_factors(model, a, b, 1)[0]
            loss = max(0.0, 1.0 - 2.0 * factor) if factor > 0 else self._mean_measured_loss(model)
            self._loss_cache[key] = loss
        return loss

    def _mean_measured_loss(self, model: str) -> float:
        """The mean loss over the one-device pairs Gavel measured on ``model``'s co-location source."""
        source = self.catalogue.profile(model).colocation_model
        mean = self._mean_loss.get(source)
        if mean is None:
            losses = [
                max(0.0, 1.0 - 2.0 * factor)
                for (a, b, gang) in self.catalogue.colocation.get(source, {})
                if gang == 1
                for factor in self.catalogue.colocation_factors(source, a, b, 1)
                if factor > 0
            ]
            mean = self._mean_loss[source] = sum(losses) / len(losses) if losses else 0.0
        return mean

    def pair(self, model: str, a: Task, b: Task) -> float:
        """The share of its isolated speed ``a`` keeps sharing a device of ``model`` with ``b`` alone."""
        key = (model, a.workload_class, a.num_devices, b.workload_class, b.num_devices)
        cached = self._pair_cache.get(key)
        if cached is None:
            gang = a.num_devices if a.num_devices == b.num_devices else 1
            factor = self.catalogue.colocation_factors(model, a.workload_class, b.workload_class, gang)[0]
            if factor <= 0 and gang != 1:
                factor = self.catalogue.colocation_factors(model, a.workload_class, b.workload_class, 1)[0]
            cached = self._pair_cache[key] = factor if factor > 0 else TIME_SHARING_FACTOR
        return cached

    def colocation_gain(self, models: Iterable[str]) -> float:
        """An upper bound on the summed kept fractions of the tasks sharing one device (>= 1).

        For each pair of classes on ``models``, the largest fraction each side keeps at any gang
        size (0.5 where unmeasured), summed; the k-task rule never exceeds the pair bound.
        """
        best: dict[tuple[str, str, str], list[float]] = {}
        sources = {self.catalogue.profile(m).colocation_model for m in set(models)}
        for source in sorted(sources):
            for a, b, gang in self.catalogue.colocation.get(source, {}):
                fa, fb = self.catalogue.colocation_factors(source, a, b, gang)
                low, high = sorted((a, b))
                key = (source, low, high)
                sides = best.setdefault(key, [TIME_SHARING_FACTOR, TIME_SHARING_FACTOR])
                first, second = (fa, fb) if a <= b else (fb, fa)
                sides[0], sides[1] = max(sides[0], first), max(sides[1], second)
        return max([1.0] + [a + b for a, b in best.values()])

    def service_latency(self, task: Task, base_rate: float, factor: float) -> tuple[float, float, float]:
        """A service's per-request latency (ms, M/M/1), its load ``rho`` and its request rate (1/s),
        running at ``base_rate`` steps/s slowed to ``factor`` of that by co-location."""
        reference_rate = self.catalogue.throughput(self.catalogue.reference_model, task.workload_class, 1)
        request_ms = _label_float(task, REQUEST_WORK_LABEL, 1000.0 / reference_rate)
        rate_per_s = _label_float(task, REQUEST_RATE_LABEL, 0.0)
        speed = base_rate / reference_rate * factor if reference_rate > 0 else 0.0
        service_ms = request_ms / speed if speed > 0 else math.inf
        rho = rate_per_s * service_ms / 1000.0
        latency_ms = service_ms / (1.0 - rho) if rho < 1.0 else math.inf
        return latency_ms, rho, rate_per_s


def shared_uplink_rate(rate: float, network_s_per_step: float, gangs: int) -> float:
    """A spread gang's rate (steps/s) when ``gangs`` spread gangs (itself included) share an uplink.

    Each gets a fair share, ``1 / gangs``, of the uplink, so the network part of its step
    (:meth:`ExecutionModel.network_s_per_step`) takes ``gangs`` times as long:
    ``1 / (1 / rate + (gangs - 1) * network_s_per_step)``. ``rate`` unchanged for one gang.
    """
    if gangs <= 1 or rate <= 0:
        return rate
    return 1.0 / (1.0 / rate + (gangs - 1) * network_s_per_step)


def service_lifetime_s(task: Task) -> float | None:
    """A service's fixed lifetime (label ``duration_s``), or None for a task that runs its work."""
    if task.latency_slo_ms <= 0 or not task.labels.get("duration_s"):
        return None
    return float(task.labels["duration_s"])


def _label_float(task: Task, key: str, default: float) -> float:
    value = task.labels.get(key)
    return float(value) if value else default
