"""Shedding: which bundles the leader moves off which brokers, and why.

The strategies share one signature (:data:`~lbd.core.shedding.model.Strategy`) and are listed
by name in :data:`STRATEGIES`: ``cluster_planner`` (lbd's own, the default: docs/balancing.md),
``transfer_shedder`` (Pulsar's TransferShedder), ``threshold_shedder`` (Pulsar's older
ThresholdShedder, kept for comparison) and ``avg_shedder`` (Pulsar's AvgShedder, PIP-364).
:mod:`lbd.core.shedding.scenario` reads and writes the load snapshots they run over.
"""

from collections.abc import Mapping

from lbd.core.shedding.avg import avg_shed
from lbd.core.shedding.model import (
    DecisionReason,
    HitCounts,
    LoadSnapshot,
    PastMove,
    ShedderState,
    SheddingResult,
    SkipReason,
    Strategy,
    UnloadDecision,
    UsableLoad,
    mean_and_std,
    usable_load,
)
from lbd.core.shedding.planner import plan_shed
from lbd.core.shedding.scenario import Scenario, parse_scenario, scenario_to_json
from lbd.core.shedding.threshold import threshold_shed
from lbd.core.shedding.transfer import transfer_shed

STRATEGIES: Mapping[str, Strategy] = {
    "transfer_shedder": transfer_shed,
    "threshold_shedder": threshold_shed,
    "cluster_planner": plan_shed,
    "avg_shedder": avg_shed,
}
"""The strategies by their configuration name (DESIGN §7)."""

DEFAULT_STRATEGY = "cluster_planner"

__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "DecisionReason",
    "HitCounts",
    "LoadSnapshot",
    "PastMove",
    "Scenario",
    "ShedderState",
    "SheddingResult",
    "SkipReason",
    "Strategy",
    "UnloadDecision",
    "UsableLoad",
    "avg_shed",
    "mean_and_std",
    "parse_scenario",
    "plan_shed",
    "scenario_to_json",
    "threshold_shed",
    "transfer_shed",
    "usable_load",
]
