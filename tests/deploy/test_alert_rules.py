"""deploy/base/prometheusrule.yaml: every metric and label its alert expressions name is one the server exports.

The exported metrics are the table of ``lutb_server.metrics``' docstring ("Every Prometheus metric the server
exports"), plus what front ends and the scrape add: ``lutb_front_end_up{front_end}``, a ``front_end`` label on
every sample with several front ends, and the ``namespace``/``pod`` target labels of the PodMonitor's scrape.
(The manifest's shape is validated against the vendored schema with the rendered overlays, test_manifests.py.)
"""

from __future__ import annotations

import re

import pytest
import yaml

from deploy_support import DEPLOY

import lutb_server.metrics

TARGET_LABELS = {"namespace", "pod"}  # added by the PodMonitor's scrape


def exported_metrics() -> dict[str, set[str]]:
    """Sample name -> its label names, from lutb_server.metrics' docstring table (counters as ``*_total``), whose
    columns the ``===`` rule above its header marks out."""
    lines = (lutb_server.metrics.__doc__ or "").splitlines()
    rule = next(line for line in lines if line.startswith("====="))
    spans = [(m.start(), m.end()) for m in re.finditer(r"=+", rule)]
    (name_at, _), _, (labels_from, labels_to), _ = spans

    def cell(line: str, start: int, end: int | None = None) -> str:
        return line[start:end].strip()

    table: dict[str, set[str]] = {}
    last = None
    for line in lines:
        if line.startswith("=") or not line.strip():
            continue
        name = cell(line, name_at, spans[0][1])
        labels = cell(line, labels_from, labels_to)
        if name.startswith("lutb_"):
            last = name
            table[last] = set()
        elif name or last is None:  # another row (process_*), or prose: the table's rows are over for this name
            last = None
            continue
        table[last] |= {label.strip() for label in labels.split(",") if label.strip()}
    assert "lutb_front_end_up{front_end}" in (lutb_server.metrics.__doc__ or "")
    table["lutb_front_end_up"] = {"front_end"}
    for labels in table.values():
        labels |= {"front_end"} | TARGET_LABELS
    return table


def unknown_names(expr: str, metrics: dict[str, set[str]]) -> list[str]:
    """What ``expr`` names that the server does not export: metrics, and labels in selectors or ``by (...)``."""
    problems = []
    used = re.findall(r"\b(lutb_[a-z0-9_]+)\s*(\{[^}]*\})?", expr)
    for name, selector in used:
        if name not in metrics:
            problems.append(f"metric {name}")
            continue
        for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector):
            if label not in metrics[name]:
                problems.append(f"label {label} of {name}")
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        for label in (g.strip() for g in group.split(",") if g.strip()):
            if not any(label in metrics[name] for name, _ in used if name in metrics):
                problems.append(f"label {label} in by/without")
    return problems


def rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "base" / "prometheusrule.yaml").read_text())
    return [rule for group in doc["spec"]["groups"] for rule in group["rules"]]


def test_the_docstring_table_reads_as_the_registry_names_it() -> None:
    metrics = exported_metrics()
    assert metrics["lutb_grpc_requests_total"] >= {"service", "method", "code"}
    assert metrics["lutb_backend_info"] >= {"backend", "device", "compute_capability", "dtype", "activation", "content_hash"}
    assert metrics["lutb_compute_loop_seconds_total"] >= {"phase"} and "lutb_deadline_dropped_total" in metrics


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_alert_expressions_name_exported_metrics_and_labels(rule: dict) -> None:
    assert unknown_names(rule["expr"], exported_metrics()) == []
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.mark.parametrize("expr, problem", [
    ('sum by (namespace) (rate(lutb_grpc_request_total[5m]))', "metric lutb_grpc_request_total"),
    ('rate(lutb_grpc_requests_total{status="OK"}[5m])', "label status of lutb_grpc_requests_total"),
    ('max by (pod, phase) (lutb_deadline_dropped_total)', "label phase in by/without"),
])
def test_the_check_finds_a_misnamed_metric_or_label(expr: str, problem: str) -> None:
    assert problem in unknown_names(expr, exported_metrics())


def test_phase_values_are_the_compute_loops() -> None:
    """The saturation alert's phase is one the compute loop counter has."""
    for rule in rules():
        for phase in re.findall(r'phase="([a-z_]+)"', rule["expr"]):
            assert phase in lutb_server.metrics.COMPUTE_LOOP_PHASES
