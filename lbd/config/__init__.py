"""lbd's settings (DESIGN §9): typed sections, loaded from a TOML file, ``LBD_*`` environment
variables and flags, with every problem reported at once.

This is the settings layer, not the core: the core takes its knobs as the dataclasses of
:mod:`lbd.core.settings`, which the ``to_core()`` methods of the sections build.
"""

from lbd.config.flags import add_cluster_flags, settings_from_args
from lbd.config.invariants import INVARIANTS, Invariant, Problem, check_invariants
from lbd.config.loader import ENV_ALIASES, SettingsError, load_settings
from lbd.config.render import render_defaults, render_values
from lbd.config.schema import (
    AssignmentSettings,
    BrokerSettings,
    CheckpointSettings,
    ClusterSettings,
    EtcdSettings,
    GrpcSettings,
    HistorySettings,
    LoadReportSettings,
    LoggingSettings,
    MetricsSettings,
    MonitorSettings,
    PulsarSettings,
    Section,
    Settings,
    SheddingSettings,
    SplitSettings,
)

__all__ = [
    "ENV_ALIASES",
    "INVARIANTS",
    "AssignmentSettings",
    "BrokerSettings",
    "CheckpointSettings",
    "ClusterSettings",
    "EtcdSettings",
    "GrpcSettings",
    "HistorySettings",
    "Invariant",
    "LoadReportSettings",
    "LoggingSettings",
    "MetricsSettings",
    "MonitorSettings",
    "Problem",
    "PulsarSettings",
    "Section",
    "Settings",
    "SettingsError",
    "SheddingSettings",
    "SplitSettings",
    "add_cluster_flags",
    "check_invariants",
    "load_settings",
    "render_defaults",
    "render_values",
    "settings_from_args",
]
