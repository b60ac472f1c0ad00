"""What a training run is: the curriculum, the seeds and every setting, as :class:`TrainConfig`.

Training uses the training workload families and seeds only (:data:`TRAIN_FAMILIES`, seeds from
:data:`TRAIN_SEED_BASE`); ``hlb eval`` reports on seeds 0.. and on other families, and validation
runs on seeds of their own (:data:`VALIDATION_SEED_BASE`). A curriculum (:data:`DEFAULT_STAGES`)
grows cluster size, job count and load stage by stage. :data:`PRESETS` are the recipes that
``hlb train --preset`` names; :func:`parse_stage` and :func:`check_stages` check ``--stage``.
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
    """One curriculum step: a cluster, a workload family, a load and a job count."""

    cluster: str
    workload: str
    load: float
    jobs: int

    def label(self) -> str:
        return f"{self.workload}@{self.cluster} load {self.load:g} x{self.jobs}"


DEFAULT_STAGES: tuple[Stage, ...] = (
    Stage("mixed:32", "gavel", 0.8, 120),
    Stage("mixed:64", "pipelines", 0.8, 80),
    Stage("mixed:64", "gavel", 0.8, 200),
)
TINY_STAGES: tuple[Stage, ...] = (Stage("mixed:8", "gavel", 0.8, 12),)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (written into the checkpoint's description)."""

    stages: tuple[Stage, ...] = DEFAULT_STAGES
    dagger_iterations: int = 3
    dagger_episodes: int = 2  # per stage and iteration
    imitation_epochs: int = 3  # passes over the aggregated data per DAgger iteration
    rl_iterations: int = 2
    rl_workloads: int = 2  # workloads per RL iteration (the last stages of the curriculum)
    rl_episodes: int = 3  # episodes per workload (the baseline's sample)
    temperature: float = 0.5  # of the sampled policy during RL
    learning_rate: float = 1e-3
    rl_learning_rate: float = 2e-4
    # PPO's clip of the probability ratio against the sampling model in REINFORCE's updates (0: plain
    # REINFORCE). Unclipped, 24 iterations from the untrained model (0.696 of hetero-greedy's
    # validation JCT) swung between 0.709 and 2.467, an iteration's hundreds of optimizer steps
    # pushing the sampled decisions far from the probabilities they were drawn with; clipped at 0.2
    # the same run stayed within about 1% of epoch 0 (docs/train/reinforce24-rules.jsonl, -ppo.jsonl).
    rl_clip: float = 0.2
    batch_decisions: int = 16  # decisions per optimizer step
    max_samples: int = 20_000  # the DAgger data set keeps at most this many (the newest)
    validation_seeds: int = 1  # per stage
    # A later epoch replaces best.pt only when its validation ratio is at least this share below the
    # best so far. The validation runs are few, and a smaller lead is their noise: an epoch 0.02%
    # ahead of epoch 0 on its three runs was 0.9% and 6.2% behind it on ten validation seeds per stage.
    min_improvement: float = 0.02
    teacher_k: int = 3
    teacher_horizon_s: float = 6 * 3600.0
    hidden: int = 32
    rounds: int = 2
    seed: int = 0
    # The daemon's rules the student decides by in REINFORCE and validation (scheduler.rules:
    # wait_for_faster, gang_wait_factor, queue_order, fit_services); DAgger follows the teacher,
    # which neither waits nor reorders.
    wait_for_faster: bool = True
    gang_wait_factor: float = 0.5
    queue_order: str = "shortest-first"
    fit_services: bool = True

    def describe(self) -> str:
        stages = "; ".join(s.label() for s in self.stages)
        rules = (
            f"wait_for_faster {str(self.wait_for_faster).lower()}, gang_wait_factor {self.gang_wait_factor:g}, "
            f"queue_order {self.queue_order}, fit_services {str(self.fit_services).lower()}"
        )
        clip = f" (PPO clip {self.rl_clip:g})" if self.rl_clip > 0 else ""
        return (
            f"hlb train: DAgger x{self.dagger_iterations} from lookahead(k={self.teacher_k}, "
            f"{self.teacher_horizon_s / 3600:g} h), then REINFORCE x{self.rl_iterations}{clip}; families "
            f"{', '.join(TRAIN_FAMILIES)}; seeds >= {TRAIN_SEED_BASE}; curriculum: {stages}; {rules}; seed {self.seed}"
        )


PRESETS: dict[str, TrainConfig] = {
    "default": TrainConfig(),
    "tiny": TrainConfig(
        stages=TINY_STAGES,
        dagger_iterations=1,
        dagger_episodes=1,
        imitation_epochs=1,
        rl_iterations=1,
        rl_workloads=1,
        rl_episodes=2,
        validation_seeds=1,
        teacher_k=2,
        teacher_horizon_s=1800.0,
        hidden=8,
        rounds=1,
    ),
}


# -- command-line checks (export/train_cli.py) ---------------------------------------------------


def parse_stage(text: str) -> Stage:
    """``CLUSTER/WORKLOAD/LOAD/JOBS``, e.g. ``mixed:64/gavel/0.8/200``; ValueError naming the problem."""
    parts = text.split("/")
    if len(parts) != 4:
        raise ValueError(f"stage {text!r}: expected CLUSTER/WORKLOAD/LOAD/JOBS, e.g. mixed:64/gavel/0.8/200")
    cluster, workload, load, jobs = parts
    try:
        stage = Stage(cluster, workload, float(load), int(jobs))
    except ValueError:
        raise ValueError(f"stage {text!r}: LOAD must be a number and JOBS an integer") from None
    if not stage.load > 0 or stage.jobs < 1:
        raise ValueError(f"stage {text!r}: LOAD must be > 0 and JOBS >= 1")
    return stage


def check_stages(stages: Sequence[Stage]) -> None:
    """ValueError unless every stage is a training family on a cluster that can be built."""
    if not stages:
        raise ValueError("no curriculum stages")
    catalogue = load_catalogue()
    for stage in stages:
        if stage.workload not in TRAIN_FAMILIES:
            raise ValueError(
                f"stage {stage.label()}: train on the training families only ({', '.join(TRAIN_FAMILIES)}); "
                "the others are held out for hlb eval"
            )
        build_cluster(stage.cluster, catalogue)
