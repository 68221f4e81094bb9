"""The monitoring kit of ``deploy/``: the Prometheus alert rules (checked and unit-tested with
``promtool``) and the Grafana dashboard, whose every expression must parse and read only metrics
lbd exports. A real Prometheus runs the rules in ``tests/e2e/test_prometheus.py``."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus_tools import (
    ALERT_TESTS,
    ALERTS,
    alert_rules,
    binary,
    dashboard,
    exported_names,
    metric_names,
    panels,
    promql,
    write_rules_with_for,
)

PROMTOOL_TIMEOUT_S = 30
RUNBOOK = "docs/operating.md#alerts"
ALERT_NAMES = {
    "LbdNoLeader",
    "LbdStuckBundles",
    "LbdAuditorFindings",
    "LbdLoadStdOverTarget",
    "LbdFenced",
    "LbdFencingRepeated",
    "LbdGovernorBacklog",
}
PANEL_TOPICS = (
    "Leader",
    "Leader term",
    "Owned bundles per broker",
    "Bundles in flight",
    "Load std vs target",
    "Broker resource usage",
    "Unloads by result",
    "Assignments by result",
    "Splits by result",
    "Governor: queued and in flight",
    "Transfer unavailability",
    "Auditor findings by kind",
    "Fencing",
    "Channel publish ops",
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=PROMTOOL_TIMEOUT_S,
        check=False,
    )


# -- the alert rules ---------------------------------------------------------------------------


def test_the_rules_name_the_alerts_of_the_runbook() -> None:
    assert {rule["alert"] for rule in alert_rules()} == ALERT_NAMES


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_each_alert_waits_has_a_severity_and_says_what_to_do(rule: dict[str, Any]) -> None:
    assert rule.get("for"), "an alert without `for` pages on one bad scrape"
    assert rule["labels"]["severity"] in ("warning", "critical")
    notes = rule["annotations"]
    assert notes["summary"] and notes["description"]
    assert notes["runbook_url"] == RUNBOOK


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_each_alert_reads_only_metrics_lbd_exports(rule: dict[str, Any]) -> None:
    names = metric_names(rule["expr"])
    assert names, rule["expr"]
    assert names <= exported_names(), sorted(names - exported_names())


def test_the_metric_name_parser_sees_metrics_only() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(lbd_x_bucket{kind=~"a|b"}[5m] offset 1m)))'
        " > on (job, instance) group_left (kind) lbd_y unless ignoring (state) 1e3 * lbd_z"
    )
    assert metric_names(expr) == {"lbd_x_bucket", "lbd_y", "lbd_z"}


def test_promtool_accepts_the_rules() -> None:
    checked = promtool("check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout


def test_the_rules_unit_tests_pass_in_promtool() -> None:
    tested = promtool("test", "rules", str(ALERT_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_each_alert_is_shown_to_fire_and_not_to_fire() -> None:
    cases = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))["tests"]
    fires, stays_quiet = set(), set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else stays_quiet).add(check["alertname"])
    assert fires == ALERT_NAMES
    assert stays_quiet == ALERT_NAMES


def test_the_quick_copy_for_live_tests_changes_only_the_waits(tmp_path: Path) -> None:
    quick = write_rules_with_for(tmp_path / "quick.yml", "1s")
    rules = alert_rules(quick)
    assert {rule["for"] for rule in rules} == {"1s"}
    assert [rule["expr"] for rule in rules] == [rule["expr"] for rule in alert_rules()]
    checked = promtool("check", "rules", str(quick))
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- the dashboard -----------------------------------------------------------------------------


def board_variables(board: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["current"]["value"] for v in board["templating"]["list"]}


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    assert board["uid"] and board["title"]
    nested = [p for row in board["panels"] if row["type"] == "row" for p in row["panels"]]
    every = [*board["panels"], *nested]
    ids = Counter(p["id"] for p in every)
    assert [i for i, n in ids.items() if n > 1] == []
    for panel in panels(board):
        where = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, where
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, where
        assert panel["targets"], where
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), where


def test_the_dashboard_has_a_panel_for_each_topic() -> None:
    titles = [p["title"] for p in panels(dashboard())]
    for topic in PANEL_TOPICS:
        assert any(t.startswith(topic) for t in titles), topic


def test_every_panel_reads_only_metrics_lbd_exports() -> None:
    exported = exported_names()
    for panel in panels(dashboard()):
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, f"{panel['title']}: {target['expr']}"
            assert names <= exported, f"{panel['title']}: {sorted(names - exported)} unknown"


def test_promtool_parses_every_panel_expression(tmp_path: Path) -> None:
    board = dashboard()
    variables = board_variables(board)
    exprs = [promql(t["expr"], variables) for p in panels(board) for t in p["targets"]]
    rules = [{"record": f"lbd_dashboard_expr_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in checked.stdout
