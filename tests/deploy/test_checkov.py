"""Static security scan (checkov) of the rendered manifests and the Dockerfile.

No finding may fail. Accepted findings are skipped where they arise, with a reason:
- manifests: ``checkov.io/skipN: CHECK_ID=reason`` annotations on the workload;
- Dockerfile: ``# checkov:skip=CHECK_ID: reason`` comments.
ACCEPTED lists them, so a new skip (or a skip that stops being needed) shows up here.
"""

from __future__ import annotations

import json
import re

import pytest

from deploy_support import OVERLAYS, REPO, require_tool, run_tool

# (framework, check id, resource) -> why it is accepted; the reason itself is in the manifest.
ACCEPTED = {
    ("kubernetes", "CKV_K8S_43", "Deployment.lutb-moe.lutb-experts"),  # image by tag, digest at release
    ("kubernetes", "CKV_K8S_43", "StatefulSet.lutb-moe.lutb-experts"),  # same
}


def _checkov(target_args: list[str]) -> list[dict]:
    checkov = require_tool("checkov")
    # --skip-download: fully offline (no guideline or policy download from the vendor's API).
    proc = run_tool([checkov, *target_args, "--skip-download", "--output", "json"], timeout=240)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    reports = json.loads(proc.stdout)
    return reports if isinstance(reports, list) else [reports]


@pytest.fixture(scope="module")
def reports(rendered, tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("rendered")
    for overlay in OVERLAYS:
        (folder / f"{overlay}.yaml").write_text(rendered[overlay])
    return _checkov(["--directory", str(folder), "--framework", "kubernetes"]) + _checkov(
        ["--file", str(REPO / "Dockerfile"), "--framework", "dockerfile"]
    )


def test_scanned_both_frameworks(reports) -> None:
    summary = {r["check_type"]: r["summary"] for r in reports}
    assert set(summary) == {"kubernetes", "dockerfile"}
    assert summary["kubernetes"]["resource_count"] >= 2 * 8
    for kind, s in summary.items():
        assert s["parsing_errors"] == 0, kind
        assert s["passed"] > 20, kind  # the scan really looked at something


def test_no_failed_checks(reports) -> None:
    failed = [
        f"{r['check_type']}: {c['check_id']} {c['check_name']} on {c['resource']} ({c['file_path']}:{c['file_line_range']})"
        for r in reports
        for c in r["results"]["failed_checks"]
    ]
    assert not failed, "\n".join(failed)


def test_only_accepted_findings_skipped_with_reasons(reports) -> None:
    skipped = {
        (r["check_type"], c["check_id"], c["resource"]): c["check_result"].get("suppress_comment", "")
        for r in reports
        for c in r["results"]["skipped_checks"]
    }
    assert set(skipped) == ACCEPTED
    for key, reason in skipped.items():
        assert len(reason) > 20, f"{key}: skip without a reason"


def test_skip_annotations_in_sources_have_reasons() -> None:
    for path in sorted((REPO / "deploy").rglob("*.yaml")):
        for check, reason in re.findall(r"checkov\.io/skip\d+: (CKV2?_[A-Z0-9_]+)=(.*)", path.read_text()):
            assert len(reason.strip()) > 20, f"{path}: {check} skipped without a reason"
