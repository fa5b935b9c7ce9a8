"""Validate rendered manifests offline; run by tests/deploy with the deploy-tools venv's Python.

    python validate_k8s.py RENDERED.yaml VERSION [VERSION ...]

Built-in kinds go through kubernetes-validate's bundled OpenAPI schemas in strict mode
(unknown fields are errors). Custom resources have no bundled schema: kinds listed in
CRD_SCHEMAS are checked against the small schemas vendored under ./schemas; any other
custom kind is an error, so a new CRD cannot slip through unvalidated.
Prints one JSON object {"checked": [...], "errors": [...]} and exits 1 if there are errors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): SCHEMAS / "podmonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): SCHEMAS / "prometheusrule-monitoring-v1.json",
}


def main(path: str, versions: list[str]) -> int:
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    checked: list[str] = []
    errors: list[str] = []
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key in CRD_SCHEMAS:
            schema = json.loads(CRD_SCHEMAS[key].read_text())
            for err in jsonschema.Draft202012Validator(schema).iter_errors(doc):
                errors.append(f"{name}: {'.'.join(map(str, err.path))}: {err.message}")
            checked.append(f"{name} (vendored CRD schema)")
            continue
        for version in versions:
            try:
                got = kubernetes_validate.validate(doc, version, strict=True)
                checked.append(f"{name} (kubernetes {got}, strict)")
            except kubernetes_validate.ValidationError as err:
                errors.append(f"{name} against {version}: {'.'.join(map(str, err.path))}: {err.message}")
            except kubernetes_validate.SchemaNotFoundError as err:
                errors.append(f"{name}: no schema for {key} in kubernetes {version} ({err})")
    print(json.dumps({"checked": checked, "errors": errors}, indent=1))
    return 1 if errors or not checked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
