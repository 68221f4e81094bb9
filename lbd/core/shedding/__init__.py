"""Shedding: which bundles the leader moves off which brokers, and why.

Two strategies with one signature (:data:`~lbd.core.shedding.model.Strategy`):
``transfer_shedder`` (Pulsar's TransferShedder, the default) and ``threshold_shedder`` (Pulsar's
older ThresholdShedder, kept for comparison). :mod:`lbd.core.shedding.scenario` reads and writes
the load snapshots they run over.
"""

from collections.abc import Mapping

from lbd.core.shedding.model import (
    DecisionReason,
    LoadSnapshot,
    ShedderState,
    SheddingResult,
    SkipReason,
    Strategy,
    UnloadDecision,
    UsableLoad,
    mean_and_std,
    usable_load,
)
from lbd.core.shedding.scenario import Scenario, parse_scenario, scenario_to_json
from lbd.core.shedding.threshold import threshold_shed
from lbd.core.shedding.transfer import transfer_shed

STRATEGIES: Mapping[str, Strategy] = {
    "transfer_shedder": transfer_shed,
    "threshold_shedder": threshold_shed,
}
"""The strategies by their configuration name (DESIGN §7)."""

DEFAULT_STRATEGY = "transfer_shedder"

__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "DecisionReason",
    "LoadSnapshot",
    "Scenario",
    "ShedderState",
    "SheddingResult",
    "SkipReason",
    "Strategy",
    "UnloadDecision",
    "UsableLoad",
    "mean_and_std",
    "parse_scenario",
    "scenario_to_json",
    "threshold_shed",
    "transfer_shed",
    "usable_load",
]
