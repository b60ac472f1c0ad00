"""Device catalogue: per-(workload class, device model) throughput, memory and power.

The catalogue is data, ``sim/data/devices.json`` (fields, units and sources in
``sim/data/README.md``). It is BUILT from the public data in ``../shared/data``
(:mod:`hlb.sim.catalogue_sources`: what is measured, what is modelled and how) by

    python -m hlb.sim.catalogue build     # writes sim/data/devices.json
    python -m hlb.sim.catalogue check     # exit 1 when the checked-in file differs from a rebuild

and the built file is checked in, so the package works without ``../shared``. This module loads
it (:func:`load_catalogue`) for the simulator. The daemon, which must not import the simulator,
reads a digest of it: relative throughputs per device model,

    python -m hlb.sim.catalogue profiles [--check]   # writes (or checks) daemon/data/profiles.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from hlb.sim.catalogue_sources import (
    CATALOGUE_FORMAT,
    EFFICIENCY_BY_KIND,
    GANG_SIZES,
    PLACEMENTS,
    build_document,
    modelled_speedup,
)

DEFAULT_CATALOGUE_PATH = Path(__file__).parent / "data" / "devices.json"
DEFAULT_PROFILES_PATH = Path(__file__).resolve().parent.parent / "daemon" / "data" / "profiles.json"
PROFILES_FORMAT = "hlb-device-profiles/1"


def shared_data_dir() -> Path:
    """The public data folder: ``$HLB_SHARED_DATA``, else ``shared/data`` beside the repository."""
    override = os.environ.get("HLB_SHARED_DATA")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "data"


@dataclass(frozen=True)
class WorkloadClass:
    """A Gavel job type: a model, batch size and dataset, with an assumed memory footprint."""

    id: str
    gavel_job_type: str
    family: str
    batch_size: int  # 0 when Gavel names none (CycleGAN, A3C)
    dataset: str
    gang_sizes: tuple[int, ...]
    memory_gb: float


@dataclass(frozen=True)
class DeviceProfile:
    """One device model: spec figures, power, and throughput in steps/s per class and gang.

    ``throughput[(class_id, gang_size, placement)]`` is the gang's total steps/s, isolated;
    placement is ``"consolidated"`` (one host) or ``"spread"`` (one device per host).
    0.0 or a missing key means the class cannot run there.
    """

    model: str
    kind: str  # gpu, tpu, fpga, asic
    source: str  # measured or modelled
    memory_gb: float
    memory_bandwidth_gbs: float
    peak_tflops: float
    idle_power_w: float
    peak_power_w: float
    task_kinds: tuple[str, ...]
    throughput: Mapping[tuple[str, int, str], float]
    colocation_model: str  # whose co-location pairs apply (its own, or the reference's)
    from_nameplate: bool = False  # modelled from an inventory's nameplate, not a catalogue entry

    @property
    def modelled(self) -> bool:
        return self.source == "modelled"


@dataclass(frozen=True)
class Catalogue:
    """The loaded catalogue: workload classes, device profiles and co-location pairs."""

    reference_model: str
    classes: Mapping[str, WorkloadClass]
    profiles: Mapping[str, DeviceProfile]
    # colocation[model][(class_a, class_b, gang)] = (steps/s of a, steps/s of b) when sharing
    colocation: Mapping[str, Mapping[tuple[str, str, int], tuple[float, float]]]
    idle_fraction: float = 0.0  # idle power over TDP (the file's idle_power_rule)

    def with_nameplates(self, nameplates: Mapping[str, Mapping[str, Any]]) -> Catalogue:
        """This catalogue and a modelled profile per nameplate (model -> :data:`NAMEPLATE_FIELDS`),
        by the catalogue's modelling rule (:func:`nameplate_profile`); itself when there is none."""
        if not nameplates:
            return self
        profiles = dict(self.profiles)
        for model, nameplate in nameplates.items():
            known = self.profiles.get(model)
            if known is not None and not known.from_nameplate:
                raise ValueError(
                    f"device model {model!r} is in the catalogue: use its entry, or name the nameplate otherwise"
                )
            profile = nameplate_profile(self, model, nameplate)
            if known is not None and known != profile:
                raise ValueError(f"device model {model!r} is described by two different nameplates")
            profiles[model] = profile
        return Catalogue(self.reference_model, self.classes, profiles, self.colocation, self.idle_fraction)

    def profile(self, model: str) -> DeviceProfile:
        try:
            return self.profiles[model]
        except KeyError:
            raise KeyError(f"device model {model!r} is not in the catalogue") from None

    def throughput(self, model: str, class_id: str, gang_size: int = 1, consolidated: bool = True) -> float:
        """Total steps/s of a gang of ``gang_size`` devices of ``model``; 0.0 when infeasible."""
        placement = "consolidated" if consolidated or gang_size == 1 else "spread"
        return self.profile(model).throughput.get((class_id, gang_size, placement), 0.0)

    def runtime_s(
        self, work_ref_s: float, class_id: str, model: str, gang_size: int = 1, consolidated: bool = True
    ) -> float:
        """Run time (s) of a task whose work is ``work_ref_s`` seconds on one reference V100.

        The task's steps are ``work_ref_s * throughput(ref, class, 1)``; inf when infeasible.
        """
        rate = self.throughput(model, class_id, gang_size, consolidated)
        if rate <= 0.0:
            return math.inf
        return work_ref_s * self.throughput(self.reference_model, class_id, 1) / rate

    def colocation_factors(self, model: str, class_a: str, class_b: str, gang_size: int = 1) -> tuple[float, float]:
        """Fraction of isolated throughput each of two co-located classes keeps on ``model``.

        Modelled devices use the reference V100's measured factors. (0.0, 0.0) when the pair was
        not measured or cannot share a device.
        """
        source = self.profile(model).colocation_model
        pair = self.colocation[source].get((class_a, class_b, gang_size))
        if pair is None:
            return (0.0, 0.0)
        alone_a = self.throughput(source, class_a, gang_size)
        alone_b = self.throughput(source, class_b, gang_size)
        if alone_a <= 0.0 or alone_b <= 0.0:
            return (0.0, 0.0)
        return (pair[0] / alone_a, pair[1] / alone_b)


@lru_cache(maxsize=1)
def shipped_catalogue() -> Catalogue:
    """The package's catalogue, loaded once per process (read only, shared by its callers)."""
    return load_catalogue()


def load_catalogue(path: Path = DEFAULT_CATALOGUE_PATH) -> Catalogue:
    """Load a catalogue file written by ``python -m hlb.sim.catalogue build``."""
    document = json.loads(path.read_text())
    if document.get("format") != CATALOGUE_FORMAT:
        raise ValueError(f"{path}: format is {document.get('format')!r}, expected {CATALOGUE_FORMAT!r}")
    classes = {
        entry["id"]: WorkloadClass(
            id=entry["id"],
            gavel_job_type=entry["gavel_job_type"],
            family=entry["family"],
            batch_size=int(entry["batch_size"]),
            dataset=entry["dataset"],
            gang_sizes=tuple(entry["gang_sizes"]),
            memory_gb=float(entry["memory_gb"]),
        )
        for entry in document["workload_classes"]
    }
    profiles: dict[str, DeviceProfile] = {}
    colocation: dict[str, dict[tuple[str, str, int], tuple[float, float]]] = {}
    for entry in document["devices"]:
        profiles[entry["model"]] = _profile_from_entry(entry, document["reference_model"])
        if isinstance(entry.get("colocation_steps_per_s"), dict):
            colocation[entry["model"]] = _colocation_from_entry(entry["colocation_steps_per_s"])
    idle_fraction = float(document["idle_power_rule"]["idle_fraction"])
    return Catalogue(document["reference_model"], classes, profiles, colocation, idle_fraction)


# What a nameplate gives: kind (gpu, tpu, fpga, asic), memory (GB), memory bandwidth (GB/s), dense
# peak TFLOPS at the training precision, TDP (W); task_kinds is optional (default: both).
NAMEPLATE_FIELDS: tuple[str, ...] = ("kind", "memory_gb", "memory_bandwidth_gbs", "peak_tflops", "tdp_w")


def nameplate_profile(catalogue: Catalogue, model: str, nameplate: Mapping[str, Any]) -> DeviceProfile:
    """A modelled profile from a device's nameplate, by the rule the catalogue's modelled entries
    follow (``sim/data/README.md``, "Modelled devices"): the reference's throughput per class times
    :func:`hlb.sim.catalogue_sources.modelled_speedup`, idle power ``idle_fraction * tdp_w``, peak
    power the TDP, the reference's co-location fractions. ValueError naming what is wrong."""
    missing = [f for f in NAMEPLATE_FIELDS if f not in nameplate]
    unknown = sorted(set(nameplate) - {*NAMEPLATE_FIELDS, "task_kinds"})
    if missing or unknown:
        raise ValueError(
            f"nameplate of {model!r}: needs {', '.join(NAMEPLATE_FIELDS)}; missing {missing}, unknown {unknown}"
        )
    kind = str(nameplate["kind"])
    if kind not in EFFICIENCY_BY_KIND:
        raise ValueError(f"nameplate of {model!r}: kind {kind!r} is not one of {sorted(EFFICIENCY_BY_KIND)}")
    figures = {f: float(nameplate[f]) for f in NAMEPLATE_FIELDS if f != "kind"}
    if not all(math.isfinite(v) and v > 0 for v in figures.values()):
        raise ValueError(f"nameplate of {model!r}: every figure must be a number above 0, got {figures}")
    task_kinds = tuple(str(k) for k in nameplate.get("task_kinds", ("training", "inference")))
    reference = catalogue.profile(catalogue.reference_model)
    reference_spec = {"peak_tflops": reference.peak_tflops, "memory_bandwidth_gbs": reference.memory_bandwidth_gbs}
    spec = {"kind": kind, **figures}
    speedup = {c.id: modelled_speedup(spec, reference_spec, c.family) for c in catalogue.classes.values()}
    return DeviceProfile(
        model=model,
        kind=kind,
        source="modelled",
        memory_gb=figures["memory_gb"],
        memory_bandwidth_gbs=figures["memory_bandwidth_gbs"],
        peak_tflops=figures["peak_tflops"],
        idle_power_w=round(catalogue.idle_fraction * figures["tdp_w"], 1),
        peak_power_w=figures["tdp_w"],
        task_kinds=task_kinds,
        throughput={key: rate * speedup[key[0]] for key, rate in reference.throughput.items()},
        colocation_model=catalogue.reference_model,
        from_nameplate=True,
    )


def _profile_from_entry(entry: Mapping[str, Any], reference_model: str) -> DeviceProfile:
    throughput: dict[tuple[str, int, str], float] = {}
    for placement, per_class in entry["throughput_steps_per_s"].items():
        for class_id, per_gang in per_class.items():
            for gang_size, value in zip(GANG_SIZES, per_gang, strict=True):
                if value is not None:
                    throughput[(class_id, gang_size, placement)] = float(value)
    spec = entry["spec"]
    own_pairs = isinstance(entry.get("colocation_steps_per_s"), dict)
    return DeviceProfile(
        model=entry["model"],
        kind=spec["kind"],
        source=entry["source"],
        memory_gb=float(spec["memory_gb"]),
        memory_bandwidth_gbs=float(spec["memory_bandwidth_gbs"]),
        peak_tflops=float(spec["peak_tflops"]),
        idle_power_w=float(entry["idle_power_w"]),
        peak_power_w=float(entry["peak_power_w"]),
        task_kinds=tuple(entry["task_kinds"]),
        throughput=throughput,
        colocation_model=entry["model"] if own_pairs else reference_model,
    )


def _colocation_from_entry(groups: Mapping[str, Any]) -> dict[tuple[str, str, int], tuple[float, float]]:
    pairs: dict[tuple[str, str, int], tuple[float, float]] = {}
    for gang_key, group in groups.items():
        gang_size = int(gang_key.removeprefix("gang_"))
        names = group["classes"]
        matrix = group["steps_per_s"]
        for i, class_a in enumerate(names):
            for j, class_b in enumerate(names):
                if matrix[i][j] is not None and matrix[j][i] is not None:
                    pairs[(class_a, class_b, gang_size)] = (float(matrix[i][j]), float(matrix[j][i]))
    return pairs


def render_document(document: Mapping[str, Any]) -> str:
    """JSON text with one line per list of scalars, so that the file stays readable and diffable."""
    return _render(document, 0) + "\n"


def _render(value: Any, depth: int) -> str:
    pad = "  " * (depth + 1)
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        items = [f"{pad}{json.dumps(k)}: {_render(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
    if isinstance(value, list) and any(isinstance(v, Mapping | list) for v in value):
        items = [pad + _render(v, depth + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * depth + "]"
    return json.dumps(value)


# ---------------------------------------------------------------- the daemon's profiles


def profiles_document(catalogue: Catalogue) -> dict[str, Any]:
    """The daemon's device profiles (``daemon/data/profiles.json``) derived from ``catalogue``.

    ``speedup[placement][class]`` lists, per gang size of ``gang_sizes``, the gang's total
    throughput relative to ONE reference device running the same class (null: not measured or
    not runnable), so that a task's run time is ``work_ref_s / speedup``.
    """
    reference = catalogue.profile(catalogue.reference_model)
    models: dict[str, Any] = {}
    for model, profile in catalogue.profiles.items():
        speedup: dict[str, dict[str, list[float | None]]] = {}
        for placement in PLACEMENTS:
            per_class: dict[str, list[float | None]] = {}
            for class_id in catalogue.classes:
                base = reference.throughput.get((class_id, 1, "consolidated"), 0.0)
                row: list[float | None] = []
                for gang_size in GANG_SIZES:
                    value = profile.throughput.get((class_id, gang_size, placement), 0.0)
                    row.append(round(value / base, 6) if value > 0.0 and base > 0.0 else None)
                per_class[class_id] = row
            speedup[placement] = per_class
        models[model] = {
            "kind": profile.kind,
            "source": profile.source,
            "peak_tflops": profile.peak_tflops,
            "memory_gb": profile.memory_gb,
            "idle_power_w": profile.idle_power_w,
            "peak_power_w": profile.peak_power_w,
            "task_kinds": list(profile.task_kinds),
            "speedup": speedup,
        }
    return {
        "format": PROFILES_FORMAT,
        "built_by": "python -m hlb.sim.catalogue profiles",
        "reference_model": catalogue.reference_model,
        "reference_peak_tflops": reference.peak_tflops,
        "gang_sizes": list(GANG_SIZES),
        "fields": {
            "speedup": "per placement (consolidated: one host; spread: one device per host), per workload "
            "class, per gang size: the gang's total throughput / one reference device's; null: unknown",
            "peak_tflops": "dense peak TFLOPS at the device's training precision",
            "power": "idle_power_w and peak_power_w in W",
            "source": "measured (Gavel's throughputs) or modelled (the catalogue's modelling rule)",
            "fallback": "a model not listed runs at peak_tflops / reference_peak_tflops of the reference",
        },
        "classes": {
            class_id: {"family": cls.family, "memory_gb": cls.memory_gb} for class_id, cls in catalogue.classes.items()
        },
        "models": models,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlb.sim.catalogue", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "check", "profiles"])
    parser.add_argument("--shared", type=Path, default=None, help="public data folder (default: ../shared/data)")
    parser.add_argument("--out", type=Path, default=None, help="catalogue file (profiles: the profiles file)")
    parser.add_argument("--check", action="store_true", help="profiles: exit 1 when the file differs")
    args = parser.parse_args(argv)
    if args.command == "profiles":
        return _write_profiles(args.out or DEFAULT_PROFILES_PATH, args.check)
    out: Path = args.out or DEFAULT_CATALOGUE_PATH
    shared = args.shared or shared_data_dir()
    if not (shared / "gavel").is_dir():
        print(f"no public data at {shared} (set HLB_SHARED_DATA)", file=sys.stderr)
        return 2
    text = render_document(build_document(shared))
    if args.command == "build":
        out.write_text(text)
        print(f"wrote {out}")
        return 0
    if out.read_text() != text:
        print(f"{out} differs from a rebuild from {shared}; run: python -m hlb.sim.catalogue build", file=sys.stderr)
        return 1
    print(f"{out} matches a rebuild from {shared}")
    return 0


def _write_profiles(out: Path, check: bool) -> int:
    text = render_document(profiles_document(load_catalogue()))
    if not check:
        out.write_text(text)
        print(f"wrote {out}")
        return 0
    if not out.is_file() or out.read_text() != text:
        print(f"{out} differs from the catalogue; run: python -m hlb.sim.catalogue profiles", file=sys.stderr)
        return 1
    print(f"{out} matches the catalogue")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
