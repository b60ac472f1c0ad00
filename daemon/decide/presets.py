"""Presets: the policies ``scheduler.policy`` and ``hlb eval`` name, each a scorer with its plugins.

- a baseline (:data:`POLICY_NAMES`): its scorer alone (``hlb.daemon.decide.scorers``; ``fgd``, the
  FGD-style fragmentation baseline for shared devices: ``hlb.daemon.decide.fgd``);
- ``rules``: hetero-greedy with the rules of ``scheduler.rules`` as plugins
  (``hlb.daemon.decide.rules``);
- ``rules-table``: the same, its run-time estimates corrected online by the runs it sees, per
  (workload family, device model, gang) and per device (``hlb.daemon.state.observed``): the
  non-graph control a learned model is measured against;
- ``gnn``: the GNN's scorer (``hlb.daemon.decide.gnn.scorer``) with the same rules, which run only
  while the model decides (hetero-greedy alone decides meanwhile).

``rules`` and ``gnn`` differ in the scorer alone: same rules, same physical prior, so comparing
them measures what the learned part adds. Turning a rule off in ``scheduler.rules`` is an ablation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hlb.daemon.config import ModelRefreshSettings, ModelSettings, RulesSettings
from hlb.daemon.decide.fgd import FragmentationGradient
from hlb.daemon.decide.framework import ObjectiveWeights, PluginPolicy, Policy
from hlb.daemon.decide.gnn.scorer import GnnScorer, RefreshMode
from hlb.daemon.decide.rules import rule_plugins
from hlb.daemon.decide.scorers import BestFit, Heft, HeteroGreedy, LeastLoaded, RandomPolicy, RoundRobin
from hlb.daemon.state.observed import ObservedSpeeds
from hlb.daemon.state.profiles import DeviceProfiles, default_profiles

POLICY_NAMES = ("random", "round-robin", "least-loaded", "best-fit", "hetero-greedy", "heft", "fgd")
PRESETS = (*POLICY_NAMES, "rules", "rules-table", "gnn")


def with_rules(label: str, scorer: Policy, rules: RulesSettings, profiles: DeviceProfiles) -> PluginPolicy:
    """``scorer`` with the plugins ``rules`` turn on, named ``label`` while they run."""
    queue_order, filters, scores, permits = rule_plugins(rules, profiles)
    return PluginPolicy(
        label,
        scorer,
        queue_order=queue_order,
        filters=filters,
        scores=scores,
        permits=permits,
        wait_on_shared=rules.wait_on_shared,
    )


def make_policy(
    name: str,
    weights: ObjectiveWeights | Mapping[str, float] | None = None,
    seed: int = 0,
    model: ModelSettings | None = None,
    rules: RulesSettings | None = None,
    *,
    mode: RefreshMode | None = "sync",
    on_fallback: Callable[[str], None] | None = None,
    profiles: DeviceProfiles | None = None,
) -> Policy:
    """The preset called ``name`` (one of :data:`PRESETS`); ``ValueError`` for any other.

    ``gnn`` scores with the ``model`` settings (default: the model shipped in the package,
    re-encoded after every change, so each decision sees the graph as it is) in ``mode`` (None: the
    settings' own; ``sync`` re-encodes the graph it is given when that changed, as the simulator
    and ``hlb eval`` need); ``on_fallback`` counts decisions its fallback makes. ``profiles``: the
    device speeds the scorers that estimate run times are told (default: the shipped, exact ones;
    ``hlb.daemon.state.profiles.profiles_of``).
    """
    w = ObjectiveWeights.of(weights)
    rules = rules or RulesSettings()
    if name == "gnn":
        exact = ModelSettings(refresh=ModelRefreshSettings(mode="sync", min_changed_rows=1))
        scorer = GnnScorer(model or exact, w, mode=mode, on_fallback=on_fallback, profiles=profiles)
        return with_rules("gnn", scorer, rules, scorer.estimates)
    if name == "rules":
        greedy = HeteroGreedy(w, profiles)
        return with_rules("rules", greedy, rules, greedy.profiles)
    if name == "rules-table":
        table = HeteroGreedy(w, ObservedSpeeds(profiles or default_profiles()))
        return with_rules("rules-table", table, rules, table.profiles)
    if name == "random":
        return RandomPolicy(seed)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "best-fit":
        return BestFit()
    if name == "hetero-greedy":
        return HeteroGreedy(w, profiles)
    if name == "heft":
        return Heft(w, profiles)
    if name == "fgd":
        return FragmentationGradient(w, profiles)
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(PRESETS)}")


def gnn_scorer(policy: Policy) -> GnnScorer | None:
    """The GNN scorer ``policy`` decides with, if any (the daemon loads, reloads and stops it)."""
    scorer = policy.scorer if isinstance(policy, PluginPolicy) else policy
    return scorer if isinstance(scorer, GnnScorer) else None


__all__ = ["POLICY_NAMES", "PRESETS", "gnn_scorer", "make_policy", "with_rules"]
