"""The policies ``hlb eval`` runs: the daemon's presets by name, rule ablations, and the simulator's own.

``gnn`` and ``rules`` run the rules of ``scheduler.rules``; each also comes with rules off
(:data:`RULE_VARIANTS`), so that what each rule contributes, and what the learned scorer adds to
the same rules, is measured. ``lookahead`` is the simulator's oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hlb.daemon.config import DEFAULT_MODEL_DIR, ModelRefreshSettings, ModelSettings, RulesSettings
from hlb.daemon.decide.framework import ObjectiveWeights, Policy
from hlb.daemon.decide.presets import POLICY_NAMES, make_policy
from hlb.daemon.state.profiles import profiles_of

# Policies the simulator provides on top of the daemon's: the lookahead oracle, and the rules told
# the exact device speeds whatever ``profiles`` the others are told (the upper bound of a better
# run-time prediction, ``oracle-speeds``).
SIM_POLICIES = ("lookahead", "oracle-speeds")
# The presets that run the rules (``scheduler.rules``), each also with rules off, to measure what
# each contributes: ``gnn`` (the daemon's GNN, run from its ONNX files as hlb serve runs them) and
# ``rules`` (hetero-greedy: the same rules and physical prior without the learned scorer). Without
# wait_for_faster no task waits, gangs included.
RULE_VARIANTS: dict[str, dict[str, Any]] = {
    "": {},
    "-no-wait": {"wait_for_faster": False},
    "-fifo": {"queue_order": "arrival"},
    "-shortest-first": {"queue_order": "shortest-first"},
    "-no-wait-fifo": {"wait_for_faster": False, "queue_order": "arrival"},
    "-no-fit": {"fit_services": False},
    "-no-gang-wait": {"gang_wait_factor": 0.0},
    "-no-rules": {"wait_for_faster": False, "queue_order": "arrival", "fit_services": False, "gang_wait_factor": 0.0},
}
GNN_VARIANTS = tuple(f"gnn{suffix}" for suffix in RULE_VARIANTS)
RULES_VARIANTS = tuple(f"rules{suffix}" for suffix in RULE_VARIANTS if suffix != "-no-rules")
# The GNN trained and run without message passing (every neighbour list empty), with the rules:
# what the graph adds to the learned prediction. Its model ships beside the GNN's.
NO_GRAPH = "gnn-no-graph"
NO_GRAPH_MODEL_DIR = DEFAULT_MODEL_DIR.parent / "model-no-graph"
# The GNN with the rules reading its expected run time (model.estimate: mean) instead of the median.
EXPECTED = "gnn-expected"
LEARNED_POLICIES = (*GNN_VARIANTS, NO_GRAPH, EXPECTED)


@dataclass(frozen=True)
class LookaheadSettings:
    """How much the ``lookahead`` policy may do per decision (:class:`hlb.sim.lookahead.LookaheadPolicy`):
    ``candidates`` gangs rolled out (the base's and ones drawn from the best of each model), each
    until ``horizon_tasks`` more tasks have arrived (0: no such bound) and for at most ``horizon_s``."""

    candidates: int = 3
    horizon_tasks: int = 16
    horizon_s: float = 6 * 3600.0


def make_sim_policy(
    name: str,
    seed: int = 0,
    model: str | None = None,
    refresh_rows: int = 1,
    weights: ObjectiveWeights | None = None,
    profiles: str = "exact",
    lookahead: LookaheadSettings | None = None,
) -> Policy:
    """A daemon policy by name (``POLICY_NAMES``, ``gnn``), or one the simulator adds (``lookahead``).

    ``weights``: the objective weights of the policies that weigh objectives (hetero-greedy, HEFT
    and the GNN; ``scheduler.weights`` in the daemon); the others, and the lookahead teacher,
    ignore them. Default: completion time alone. ``profiles``: what the policies that estimate run
    times are told of device speeds (``scheduler.profiles``: exact, coarse or nameplate).

    ``gnn`` is the daemon's :class:`hlb.daemon.decide.gnn.scorer.GnnScorer` over the ONNX files in ``model``
    (the shipped model when None; ``GNN_VARIANTS`` the same with other settings; ``gnn-no-graph``
    the model trained without message passing, shipped in :data:`NO_GRAPH_MODEL_DIR`), re-encoding
    whenever the graph changed; it loads them on its
    first decision, and a decision it would leave to hetero-greedy's fallback is a RuntimeError
    (:func:`_refuse_fallback`), so an evaluation never reports the fallback as the GNN.
    :func:`check_gnn_model` tells before any run whether the files load.
    """
    if name == "lookahead":
        from hlb.sim.lookahead import LookaheadPolicy

        bounds = lookahead or LookaheadSettings()
        return LookaheadPolicy(
            k=bounds.candidates, horizon_s=bounds.horizon_s, horizon_tasks=bounds.horizon_tasks, seed=seed
        )
    told = profiles_of(profiles)
    if name == "oracle-speeds":
        return make_policy("rules", weights, profiles=profiles_of("exact"))
    if name == "rules-table":
        return make_policy("rules-table", weights, profiles=told)
    if name in LEARNED_POLICIES:
        if name == NO_GRAPH and model is None:
            model = str(NO_GRAPH_MODEL_DIR)
        settings = _gnn_settings(model, refresh_rows, estimate="mean" if name == EXPECTED else "median")
        return make_policy(
            "gnn", weights, model=settings, rules=_rules(name), on_fallback=_refuse_fallback, profiles=told
        )
    if name in RULES_VARIANTS:
        return make_policy("rules", weights, rules=_rules(name), profiles=told)
    if name not in POLICY_NAMES:
        names = ", ".join((*POLICY_NAMES, *RULES_VARIANTS, "rules-table", *LEARNED_POLICIES, *SIM_POLICIES))
        raise ValueError(f"unknown policy {name!r}: one of {names}")
    return make_policy(name, weights=weights, seed=seed, profiles=told)


def _rules(name: str) -> RulesSettings:
    """The rules of variant ``name`` (``gnn`` or ``rules`` with a :data:`RULE_VARIANTS` suffix)."""
    if name in (NO_GRAPH, EXPECTED):
        return RulesSettings()
    return RulesSettings(**RULE_VARIANTS[name.removeprefix("gnn").removeprefix("rules")])


def _gnn_settings(
    model: str | None, refresh_rows: int = 1, estimate: Literal["median", "mean"] = "median"
) -> ModelSettings:
    """The daemon's ``model`` settings for the files in ``model``, re-encoding in sync mode."""
    return ModelSettings(
        path=Path(model) if model else None,
        watch=False,
        refresh=ModelRefreshSettings(mode="sync", min_changed_rows=refresh_rows),
        estimate=estimate,
    )


def check_gnn_model(model: str | None) -> None:
    """ValueError naming the folder unless the GNN's files in ``model`` (None: shipped) load."""
    from hlb.daemon.decide.gnn.inference import ModelError, load_model

    directory = _gnn_settings(model).directory
    try:
        load_model(directory)
    except (ModelError, OSError) as error:
        raise ValueError(f"policy gnn: the model in {directory} does not load: {error}") from None


def _refuse_fallback(reason: str) -> None:
    raise RuntimeError(f"policy gnn would fall back to hetero-greedy ({reason}); the run would not measure the GNN")
