"""What a training run is: the logged simulations, the seeds and every setting, as :class:`TrainConfig`.

Training data come from the training workload families and seeds only (:data:`TRAIN_FAMILIES`,
seeds from :data:`TRAIN_SEED_BASE`); validation examples from seeds of their own
(:data:`VALIDATION_SEED_BASE`); ``hlb eval`` reports on seeds 0.. and on other families.
:data:`PRESETS` are the recipes ``hlb train --preset`` names; :func:`parse_stage` and
:func:`check_stages` check ``--stage``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hlb.sim.catalogue import load_catalogue
from hlb.sim.scenarios import build_cluster

TRAIN_FAMILIES = ("gavel", "pipelines")
TRAIN_SEED_BASE = 1000  # training workloads use seeds >= this; hlb eval reports on 0..
VALIDATION_SEED_BASE = 900  # validation seeds: neither training nor evaluation


@dataclass(frozen=True)
class Stage:
    """Logged simulations of one kind: a cluster, a workload family, a load and a job count."""

    cluster: str
    workload: str
    load: float
    jobs: int
    gangs_only: bool = False  # keep the examples of gangs only (their snapshots cost the most on large clusters)

    def label(self) -> str:
        gangs = ", gangs only" if self.gangs_only else ""
        return f"{self.workload}@{self.cluster} load {self.load:g} x{self.jobs}{gangs}"


# The recipe of the model shipped until 2026-12-07 (preset few-gangs).
FEW_GANG_STAGES: tuple[Stage, ...] = (
    Stage("mixed:64", "gavel", 0.8, 200),
    Stage("mixed:64", "gavel", 1.0, 200),
    Stage("mixed:128", "pipelines", 0.9, 100),
    Stage("gavel:48", "gavel", 0.9, 200),
    # Spread gangs sharing uplinks: a few dozen per simulation at 256 devices, next to none below.
    Stage("mixed:256", "gavel", 0.8, 600, gangs_only=True),
    Stage("mixed:256", "gavel", 1.0, 600, gangs_only=True),
)
# The gangs of the clusters hlb eval runs most: gangs-only simulations on 64 and 128 devices, where
# 8-device gangs mostly run on one host (the stages above hold few of those; docs/gnn.md,
# "More gangs in training").
MORE_GANG_STAGES: tuple[Stage, ...] = (
    Stage("mixed:64", "gavel", 0.9, 600, gangs_only=True),
    Stage("mixed:128", "gavel", 0.9, 600, gangs_only=True),
)
DEFAULT_STAGES: tuple[Stage, ...] = FEW_GANG_STAGES + MORE_GANG_STAGES  # the shipped model's recipe
TINY_STAGES: tuple[Stage, ...] = (Stage("mixed:8", "gavel", 0.8, 12),)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (written into the checkpoint's description)."""

    stages: tuple[Stage, ...] = DEFAULT_STAGES
    episodes: int = 24  # logged simulations per stage, on training seeds
    validation_episodes: int = 3  # per stage, on validation seeds
    explore: float = 0.2  # share of decisions that perturb the estimates (hlb.export.dataset)
    explore_sigma: float = 0.7
    epochs: int = 2
    batch_snapshots: int = 8  # graph snapshots per optimizer step
    learning_rate: float = 2e-3
    weight_decay: float = 1e-5
    hidden: int = 32
    rounds: int = 2
    message_passing: bool = True
    # Weigh each training example by its gang's devices (a gang's estimate decides that many
    # devices' time); False: every finished task weighs one.
    weight_gangs: bool = False
    seed: int = 0

    def describe(self) -> str:
        stages = "; ".join(s.label() for s in self.stages)
        graph = "with message passing" if self.message_passing else "without message passing (gnn-no-graph)"
        if self.weight_gangs:
            graph += ", examples weighted by their gangs' devices"
        return (
            f"speed ratios of executions logged with hidden truth, Gaussian NLL, {graph}; "
            f"{self.episodes} episodes per stage (families {', '.join(TRAIN_FAMILIES)}, seeds >= "
            f"{TRAIN_SEED_BASE}, exploration {self.explore:g} at sigma {self.explore_sigma:g}); {stages}; "
            f"{self.epochs} epochs; seed {self.seed}"
        )


PRESETS: dict[str, TrainConfig] = {
    "default": TrainConfig(),
    "few-gangs": TrainConfig(stages=FEW_GANG_STAGES),
    "tiny": TrainConfig(
        stages=TINY_STAGES, episodes=2, validation_episodes=1, epochs=2, batch_snapshots=4, hidden=8, rounds=1
    ),
}


# -- command-line checks (export/train_cli.py) ---------------------------------------------------


def parse_stage(text: str) -> Stage:
    """``CLUSTER/WORKLOAD/LOAD/JOBS[/gangs]``, e.g. ``mixed:64/gavel/0.8/200`` (``/gangs``: keep the
    examples of gangs only); ValueError naming the problem."""
    parts = text.split("/")
    gangs_only = len(parts) == 5 and parts[4] == "gangs"
    if gangs_only:
        parts = parts[:4]
    if len(parts) != 4:
        raise ValueError(f"stage {text!r}: expected CLUSTER/WORKLOAD/LOAD/JOBS[/gangs], e.g. mixed:64/gavel/0.8/200")
    cluster, workload, load, jobs = parts
    try:
        stage = Stage(cluster, workload, float(load), int(jobs), gangs_only)
    except ValueError:
        raise ValueError(f"stage {text!r}: LOAD must be a number and JOBS an integer") from None
    if not stage.load > 0 or stage.jobs < 1:
        raise ValueError(f"stage {text!r}: LOAD must be > 0 and JOBS >= 1")
    return stage


def check_stages(stages: Sequence[Stage]) -> None:
    """ValueError unless every stage is a training family on a cluster that can be built."""
    if not stages:
        raise ValueError("no stages")
    catalogue = load_catalogue()
    for stage in stages:
        if stage.workload not in TRAIN_FAMILIES:
            raise ValueError(
                f"stage {stage.label()}: train on the training families only ({', '.join(TRAIN_FAMILIES)}); "
                "the others are held out for hlb eval"
            )
        build_cluster(stage.cluster, catalogue)
