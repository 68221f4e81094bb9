"""What the monitoring tests share: the Prometheus binaries, the alert rules and dashboard of
``deploy/``, and the metric names a PromQL expression reads compared with those lbd exports."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from lbd.metrics import Metrics
from lbd.services.channel.follower import FollowerStats

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ALERTS = DEPLOY / "prometheus" / "lbd-alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "lbd-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "lbd-dashboard.json"

GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
"""Grafana's built-in variables, as a value PromQL accepts where they stand (a duration)."""

_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"and", "or", "unless", "bool", "offset", "inf", "nan"}
)


def binary(name: str) -> str:
    """The path of ``name`` (``promtool``, ``prometheus``); the test is skipped without it,
    and fails instead under CI (``CI=true``), where ``make test`` installs it."""
    found = shutil.which(name)
    if found is not None:
        return found
    why = f"{name} not found: install Debian's prometheus package (apt-get install prometheus)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why}; under CI it must be there (make test installs it)")
    pytest.skip(why)


def exported_names() -> set[str]:
    """Every series name a sidecar's ``/metrics`` can carry: counters as ``_total``,
    histograms as ``_bucket``, ``_sum`` and ``_count``."""
    metrics = Metrics()
    metrics.track_follower(FollowerStats())  # what build_sidecar adds
    names: set[str] = set()
    for family in metrics.registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not its functions, keywords or labels)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)  # label matchers, ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        word = match.group()
        if word.lower() in _KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue  # a keyword or a function
        names.add(word)
    return names


def alert_rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    """Every alerting rule of a rules file, in order."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"] if "alert" in rule]


def write_rules_with_for(out: Path, hold: str, path: Path = ALERTS) -> Path:
    """A copy of the rules file with every ``for`` set to ``hold``: the same expressions, for a
    test that cannot wait minutes (written as JSON, which Prometheus reads as YAML)."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    for group in data["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = hold
    out.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return out


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard."""
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included, rows excluded."""
    out = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def promql(expr: str, variables: dict[str, str]) -> str:
    """A panel's expression with the dashboard's variables replaced by a value, as Grafana
    sends it; AssertionError for a variable the dashboard does not define."""
    known = {**GRAFANA_VARIABLES, **{f"${name}": value for name, value in variables.items()}}
    for name in sorted(known, key=len, reverse=True):  # $__rate_interval before $__range
        expr = expr.replace(name, known[name])
    assert "$" not in expr, f"unknown variable in {expr!r}"
    return expr
