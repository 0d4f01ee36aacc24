"""The monitoring component (k8s/components/monitoring), checked offline: the alerts a job needs exist and
explain themselves, alerts and dashboard use only metrics we export, every query is valid PromQL, and the
alerts fire (and stay quiet) on synthetic series under ``promtool test rules`` (Debian's ``prometheus``,
installed as root when missing)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from .k8s_support import (
    K8S,
    exported_metric_names,
    metric_names_in,
)

MONITORING = K8S / "components" / "monitoring"
RULES = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "dashboards" / "elastic-runner.json"
# The manifests' own margin: the agent needs this long after its workers stopped.
AGENT_EXIT_MARGIN_SECONDS = 15

# -- monitoring ----------------------------------------------------------------------------------


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["spec"]["groups"]


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_required_alerts_exist_and_explain_themselves() -> None:
    rules = alerts()
    required = {"ElasticRunnerNoProgress", "ElasticRunnerRestartsRising", "ElasticRunnerSnapshotStale",
                "ElasticRunnerWorldSizeBelowMin"}
    assert required <= rules.keys()
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert {"summary", "description"} <= rule["annotations"].keys(), name
        assert re.search(r"by \(namespace, training_job", rule["expr"]), f"{name} must be per job"


def test_alerts_and_dashboard_use_only_exported_metrics() -> None:
    exported = exported_metric_names()
    used = {name: metric_names_in(r["expr"]) for name, r in alerts().items()}
    used |= {f"panel {title!r}": metric_names_in(expr) for title, expr in dashboard_exprs()}
    unknown = {where: sorted(names - exported) for where, names in used.items() if names - exported}
    assert not unknown, f"metrics nobody exports: {unknown}"
    assert all(used.values()), "every alert and panel reads an elastic_runner metric"


def test_the_dashboard_shows_throughput_loss_world_size_restarts_snapshot_age_and_recovery() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(expr for _, expr in dashboard_exprs())
    for metric in ("elastic_runner_samples_total", "elastic_runner_loss", "elastic_runner_world_size",
                   "elastic_runner_restarts_total", "elastic_runner_last_snapshot_timestamp_seconds",
                   "elastic_runner_recovery_duration_seconds"):
        assert metric in exprs, metric
    assert "time() - max by (training_job) (elastic_runner_last_snapshot_timestamp_seconds" in exprs, "snapshot age"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "training_job"} <= variables
    for title, expr in dashboard_exprs():
        if "elastic_runner_" in expr:
            assert 'namespace="$namespace", training_job=~"$training_job"' in expr, f"panel {title!r} ignores the variables"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"] if p["type"] != "row")


def promql_rule_file(tmp_path: Path, with_annotations: bool = True) -> Path:
    groups = copy.deepcopy(rule_groups())
    if not with_annotations:
        for group in groups:
            for rule in group["rules"]:
                rule.pop("annotations", None)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def test_alert_rules_and_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    # Dashboard queries as recording rules, with Grafana's variables filled in, so promtool parses them too.
    panels = [{"record": f"dashboard:panel_{i}", "expr": expr.replace("$__rate_interval", "1m")
               .replace("$namespace", "ml").replace("$training_job", ".+")}
              for i, (_, expr) in enumerate(dashboard_exprs())]
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": panels}]}))
    result = subprocess.run([promtool, "check", "rules", str(promql_rule_file(tmp_path)), str(tmp_path / "dashboard.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


JOB = 'namespace="ml",training_job="digits"'


def series(metric: str, values: str, **labels: str) -> dict[str, str]:
    extra = "".join(f',{k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{JOB}{extra}}}", "values": values}


def fired(severity: str, **labels: str) -> dict[str, Any]:
    """An alert of the test job firing, with its labels (alertname is implied)."""
    return {"exp_labels": {"namespace": "ml", "training_job": "digits", "severity": severity, **labels}}


def case(alert: str, input_series: list[dict[str, str]], expectations: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One promtool test: the series, then for each eval time the alerts expected to fire."""
    return {"interval": "1m", "input_series": input_series,
            "alert_rule_test": [{"eval_time": t, "alertname": alert, "exp_alerts": exp} for t, exp in expectations.items()]}


def test_alerts_fire_when_they_should_and_only_then(promtool: str, tmp_path: Path) -> None:
    step, restarts = "elastic_runner_step", "elastic_runner_restarts_total"
    snapshot = "elastic_runner_last_snapshot_timestamp_seconds"
    agents, world = "elastic_runner_agent_remaining_restarts", "elastic_runner_world_size"
    tests = [
        # Steps advance for 30 minutes, then stop.
        case("ElasticRunnerNoProgress", [series(step, "0+10x30 300x40", pod="p0", rank="0")],
             {"40m": [], "60m": [fired("critical")]}),
        # Crash-looping: every attempt resumes at step 200 and dies around 300.
        case("ElasticRunnerNoProgress", [series(step, " ".join(["200+10x10"] * 6), pod="p0", rank="0")],
             {"60m": [fired("critical")]}),
        # Healthy, also across a restart of one rank (its step restarts from the snapshot).
        case("ElasticRunnerNoProgress", [series(step, "0+10x70", pod="p0", rank="0"),
                                         series(step, "0+10x20 150+10x50", pod="p1", rank="1")],
             {"60m": []}),
        # One pod's workers fail 5 times within an hour.
        case("ElasticRunnerRestartsRising", [series(restarts, "0x30 1x5 2x5 3x5 4x5 5x20", pod="p0", rank="0")],
             {"20m": [], "60m": [fired("warning")]}),
        # Two group-wide restarts: every pod restarts twice. Counted per pod, not summed.
        case("ElasticRunnerRestartsRising", [series(restarts, "0x30 1x15 2x25", pod=f"p{i}", rank=str(i)) for i in range(4)],
             {"60m": []}),
        # Snapshots each minute until 20 min, then none; rank 1 never writes one (0).
        case("ElasticRunnerSnapshotStale", [series(snapshot, "0+60x20 1200x40", pod="p0", rank="0"),
                                            series(snapshot, "0x60", pod="p1", rank="1")],
             {"30m": [], "50m": [fired("warning")]}),
        case("ElasticRunnerSnapshotStale", [series(snapshot, "0+60x60", pod="p0", rank="0")], {"50m": []}),
        case("ElasticRunnerSnapshotFailing", [series("elastic_runner_snapshot_failures_total", "0x10 1x20", pod="p0", rank="0")],
             {"5m": [], "20m": [fired("warning")]}),
        # Two agents up, no worker: waiting for the minimum number of pods.
        case("ElasticRunnerWorldSizeBelowMin", [series(agents, "100x30", pod="p0"), series(agents, "100x30", pod="p1")],
             {"5m": [], "20m": [fired("critical")]}),
        case("ElasticRunnerWorldSizeBelowMin", [series(agents, "100x30", pod="p0"), series(world, "1x30", pod="p0", rank="0")],
             {"20m": []}),
        # 4 ranks, then 2 for 40 minutes.
        case("ElasticRunnerWorldSizeDegraded", [series(world, "4x30 2x40", pod="p0", rank="0")],
             {"45m": [], "65m": [fired("info")]}),
        # Rank 1 named a straggler from minute 10 on; rank 0 never.
        case("ElasticRunnerStraggler", [series("elastic_runner_straggler", "0x10 1x30", pod="p1", rank="1"),
                                        series("elastic_runner_straggler", "0x40", pod="p0", rank="0")],
             {"15m": [], "30m": [fired("warning", pod="p1")]}),
        case("ElasticRunnerRestartBudgetLow", [series(agents, "100x10 5x10", pod="p0")],
             {"5m": [], "15m": [fired("warning", pod="p0")]}),
    ]
    tested = {t["alert_rule_test"][0]["alertname"] for t in tests}
    assert tested == set(alerts()), f"alerts without a test: {set(alerts()) - tested}"
    rules = promql_rule_file(tmp_path, with_annotations=False)
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m",
                                                         "tests": tests}))
    result = subprocess.run([promtool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


