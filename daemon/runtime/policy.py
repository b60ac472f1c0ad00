"""The configured policy's life in the daemon: built from the ``scheduler`` settings (a preset,
``hlb.daemon.decide.presets``), its model loaded and warmed up on the graph before it decides,
reloaded on SIGHUP, its refresh thread stopped when it is replaced or the daemon stops. Only a
policy that scores with the GNN has a model; for every other one these are no-ops. The rest of the
runtime reaches the policies through this module alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from hlb.daemon.config import ModelSettings, Settings
from hlb.daemon.decide.framework import Policy
from hlb.daemon.decide.gnn.scorer import GnnScorer
from hlb.daemon.decide.presets import gnn_scorer, make_policy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import profiles_of

# Called with the reason each time the GNN's fallback decides (``DaemonMetrics.record_fallback``).
OnFallback = Callable[[str], None]


def build_policy(settings: Settings, on_fallback: OnFallback) -> Policy:
    """The preset ``scheduler.policy`` names; the GNN refreshes as ``model.refresh`` says."""
    s = settings.scheduler
    return make_policy(
        s.policy,
        s.weights.model_dump(),
        s.seed,
        model=settings.model,
        rules=s.rules,
        mode=None,
        on_fallback=on_fallback,
        profiles=profiles_of(s.profiles),
    )


def model_scorer(policy: Policy) -> GnnScorer | None:
    """The GNN ``policy`` decides with, if any."""
    return gnn_scorer(policy)


def shadow_scorer(settings: Settings, model_dir: Path) -> GnnScorer | None:
    """The GNN ``settings`` configure, with the model in ``model_dir`` (a shadow candidate; it
    decides nothing and counts no fallbacks); None when the policy has no GNN."""
    shadowed = settings.model_copy(update={"model": settings.model.model_copy(update={"path": model_dir})})
    return gnn_scorer(build_policy(shadowed, lambda reason: None))


def start_policy(policy: Policy, graph: InfraGraph, lock: threading.RLock) -> None:
    """Load and warm up the GNN's model on ``graph`` and start its refresh thread."""
    scorer = gnn_scorer(policy)
    if scorer is not None:
        scorer.start(graph, lock)


def stop_policy(policy: Policy) -> None:
    scorer = gnn_scorer(policy)
    if scorer is not None:
        scorer.stop()


def configure_model(policy: Policy, model: ModelSettings) -> None:
    """New model settings: the running GNN loads and checks the model before it switches; raises
    (keeping the running model) when the new one is unusable."""
    scorer = gnn_scorer(policy)
    if scorer is not None:
        scorer.configure(model)


def has_model(policy: Policy) -> bool:
    return gnn_scorer(policy) is not None


def reload_model_files(policy: Policy) -> None:
    """Look at the GNN's model files again (SIGHUP) and switch to them if they changed."""
    scorer = gnn_scorer(policy)
    if scorer is not None:
        scorer.reload_model(True)


def model_provider(policy: Policy) -> str:
    """The onnxruntime execution provider the GNN's model runs on; empty without one."""
    scorer = gnn_scorer(policy)
    return scorer.provider if scorer is not None else ""
