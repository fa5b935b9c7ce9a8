"""Shared helpers for the deploy checks: where the tools are, rendered overlays, the Dockerfile.

Imported by the tests as ``deploy_support`` (pytest puts this folder on sys.path); its
fixtures are re-exported by conftest.py.

The check tools live in their own virtual environment (checkov pins many dependencies), made
by .ci/run: ``.venv-deploy/bin/{checkov,hadolint,kubernetes-validate,python}`` plus Debian's
kubectl 1.20 unpacked to ``.venv-deploy/bin/kubectl``. ``LUTB_DEPLOY_TOOLS`` points elsewhere.
A missing tool fails the test when ``CI`` is set, and skips it otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("single", "expert-parallel")
TOOLS_DIR = Path(os.environ.get("LUTB_DEPLOY_TOOLS", REPO / ".venv-deploy" / "bin"))


def require_tool(name: str) -> Path:
    """Path of a deploy-check tool; fails under CI, skips locally, when it is not installed."""
    path = TOOLS_DIR / name
    if path.exists() and os.access(path, os.X_OK):
        return path
    message = f"{name} not found in {TOOLS_DIR} (bash .ci/run installs it; LUTB_DEPLOY_TOOLS overrides the folder)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def run_tool(argv: list[str | Path], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=REPO, **kwargs)


def render(kubectl: Path, overlay: str) -> str:
    proc = run_tool([kubectl, "kustomize", DEPLOY / "overlays" / overlay], timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="session")
def kubectl() -> Path:
    path = require_tool("kubectl")
    proc = run_tool([path, "version", "--client"], timeout=30)
    assert proc.returncode == 0, proc.stderr
    return path


@pytest.fixture(scope="session")
def rendered(kubectl: Path) -> dict[str, str]:
    """Overlay name -> its rendering by the CI renderer (Debian's kubectl 1.20)."""
    return {name: render(kubectl, name) for name in OVERLAYS}


@pytest.fixture(scope="session")
def manifests(rendered: dict[str, str]) -> dict[str, list[dict]]:
    """Overlay name -> rendered objects."""
    return {name: [d for d in yaml.safe_load_all(text) if d] for name, text in rendered.items()}


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str) -> dict:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def workload(objs: list[dict]) -> dict:
    found = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    assert len(found) == 1, f"expected one Deployment or StatefulSet, found {[o['kind'] for o in found]}"
    return found[0]


def config_data(objs: list[dict]) -> dict[str, str]:
    """The lutb-config ConfigMap's data (its name carries a generated hash suffix)."""
    maps = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].startswith("lutb-config")]
    assert len(maps) == 1
    return maps[0]["data"]


# --- Dockerfile -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


def dockerfile_instructions(path: Path = REPO / "Dockerfile") -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, backslash continuations joined."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = " ".join(p for p in pending if p)
        pending = []
        keyword, _, args = text.partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def exec_form(args: str) -> list[str]:
    """The JSON array of an exec-form instruction (ENTRYPOINT, CMD)."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def env_assignments(instructions: list[Instruction], stage: int = -1) -> dict[str, str]:
    """ENV key=value pairs of one build stage (default: the last, i.e. the image)."""
    stages: list[list[Instruction]] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append(ins)
    env: dict[str, str] = {}
    for ins in stages[stage]:
        if ins.keyword == "ENV":
            for key, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S+)', ins.args):
                env[key] = value.strip('"')
    return env
