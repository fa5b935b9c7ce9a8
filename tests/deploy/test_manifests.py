"""Kubernetes manifests: every overlay renders with Debian's kubectl 1.20 (kustomize v2),
validates offline against the Kubernetes OpenAPI schemas, and keeps the operational rules
(probes, shutdown timing, security context, GPU, read-only checkpoint, pinned images)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy_support import (
    DEPLOY,
    OVERLAYS,
    REPO,
    TOOLS_DIR,
    by_kind,
    config_data,
    one,
    render,
    require_tool,
    run_tool,
    workload,
)

# Oldest Kubernetes these manifests target (the pod-index label used by expert-parallel is
# beta, on by default, from 1.28; native gRPC probes are GA from 1.27), and the newest schema
# kubernetes-validate bundles.
K8S_VERSIONS = ("1.28", "1.37")
STARTUP_BUDGET_S = 20 * 60
PRESTOP_SLEEP_S = 5
IMAGE = "ghcr.io/lutb-moe/lutb-moe"


def _containers(obj: dict) -> list[dict]:
    return obj["spec"]["template"]["spec"]["containers"]


def _container(obj: dict) -> dict:
    containers = _containers(obj)
    assert [c["name"] for c in containers] == ["lutb"]
    return containers[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_expected_objects(manifests, overlay) -> None:
    kinds = sorted(o["kind"] for o in manifests[overlay])
    common = ["ConfigMap", "NetworkPolicy", "PersistentVolumeClaim", "PodMonitor", "PrometheusRule", "Service",
              "ServiceAccount"]
    extra = ["Deployment"] if overlay == "single" else ["PodDisruptionBudget", "StatefulSet"]
    assert kinds == sorted(common + extra)
    for obj in manifests[overlay]:
        assert obj["metadata"].get("namespace") == "lutb-moe", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "lutb-moe"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_validates_against_kubernetes_schemas(rendered, overlay, tmp_path) -> None:
    """Strict OpenAPI validation (unknown fields fail) of built-in kinds for every version in
    K8S_VERSIONS; PodMonitor against the vendored schema (see validate_k8s.py)."""
    python = require_tool("python")
    out = tmp_path / f"{overlay}.yaml"
    out.write_text(rendered[overlay])
    proc = run_tool([python, Path(__file__).with_name("validate_k8s.py"), out, *K8S_VERSIONS])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '"errors": []' in proc.stdout


def test_validator_rejects_a_broken_manifest(rendered, tmp_path) -> None:
    """The validation above can fail: a misspelt field and a mistyped CRD field are caught."""
    python = require_tool("python")
    broken = rendered["expert-parallel"].replace("readOnlyRootFilesystem:", "readOnlyRootFileSystem:")
    broken = broken.replace("interval: 15s", "interval: 15")
    out = tmp_path / "broken.yaml"
    out.write_text(broken)
    proc = run_tool([python, Path(__file__).with_name("validate_k8s.py"), out, K8S_VERSIONS[0]])
    assert proc.returncode == 1
    assert "readOnlyRootFileSystem" in proc.stdout
    assert "podMetricsEndpoints.0.interval" in proc.stdout


def test_renders_the_same_with_a_current_kustomize(manifests) -> None:
    """The old-syntax kustomizations mean the same to a current kubectl (kustomize v5).

    Opportunistic: uses a kubectl on PATH other than the CI renderer; none is installed by
    .ci/run, so without one this skips (the required rendering is done by Debian's 1.20).
    """
    modern = shutil.which("kubectl")
    if modern is None or Path(modern).resolve() == (TOOLS_DIR / "kubectl").resolve():
        pytest.skip("no second kubectl on PATH to cross-check against")
    version = subprocess.run([modern, "version", "--client"], capture_output=True, text=True, timeout=30).stdout
    for overlay in OVERLAYS:
        text = render(Path(modern), overlay)
        objs = [d for d in yaml.safe_load_all(text) if d]

        def normal(items: list[dict]) -> list[str]:
            # generated ConfigMap names carry a hash whose algorithm changed between versions
            dumped = [yaml.safe_dump(o, sort_keys=True) for o in items]
            return sorted(re.sub(r"lutb-config-[a-z0-9]{10}", "lutb-config", d) for d in dumped)

        assert normal(objs) == normal(manifests[overlay]), f"{overlay} differs under {version}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_the_pods(manifests, overlay) -> None:
    objs = manifests[overlay]
    wl = workload(objs)
    pod_labels = wl["spec"]["template"]["metadata"]["labels"]

    def selects(match: dict) -> bool:
        return bool(match) and all(pod_labels.get(k) == v for k, v in match.items())

    assert selects(wl["spec"]["selector"]["matchLabels"])
    assert selects(one(objs, "Service")["spec"]["selector"])
    assert selects(one(objs, "PodMonitor")["spec"]["selector"]["matchLabels"])
    assert selects(one(objs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"])
    for pdb in by_kind(objs, "PodDisruptionBudget"):
        assert selects(pdb["spec"]["selector"]["matchLabels"])
    assert wl["spec"]["template"]["spec"]["serviceAccountName"] == one(objs, "ServiceAccount")["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_agree_with_configuration(manifests, overlay) -> None:
    objs = manifests[overlay]
    cfg = config_data(objs)
    container = _container(workload(objs))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": int(cfg["LUTB_PORT"]), "metrics": int(cfg["LUTB_METRICS_PORT"])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe
    svc_ports = {p["name"]: p for p in one(objs, "Service")["spec"]["ports"]}
    assert svc_ports["grpc"]["port"] == ports["grpc"] and svc_ports["grpc"]["targetPort"] == "grpc"
    assert [e["port"] for e in one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"]] == ["metrics"]
    policy_ports = {p["port"] for rule in one(objs, "NetworkPolicy")["spec"]["ingress"] for p in rule["ports"]}
    assert policy_ports == set(ports.values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_probes(manifests, overlay) -> None:
    container = _container(workload(manifests[overlay]))
    startup = container["startupProbe"]
    assert set(startup) >= {"grpc", "periodSeconds", "failureThreshold"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= STARTUP_BUDGET_S
    # Readiness follows the expert service itself: NOT_SERVING while draining.
    assert container["readinessProbe"]["grpc"].get("service") == "lutb.v1.ExpertService"
    assert container["livenessProbe"]["grpc"].get("service", "") == ""
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(container[probe]) & {"httpGet", "exec", "tcpSocket"} == set(), probe


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_prestop_and_drain(manifests, overlay) -> None:
    objs = manifests[overlay]
    pod = workload(objs)["spec"]["template"]["spec"]
    container = _container(workload(objs))
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_SLEEP_S)]
    drain = float(config_data(objs)["LUTB_SHUTDOWN_GRACE_S"])
    assert pod["terminationGracePeriodSeconds"] >= PRESTOP_SLEEP_S + drain + 10


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_context(manifests, overlay) -> None:
    wl = workload(manifests[overlay])
    pod = wl["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod.get("hostNetwork") is not True and pod.get("hostPID") is not True and pod.get("hostIPC") is not True
    sc = _container(wl)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 10001  # the UID the Dockerfile creates
    assert sc["allowPrivilegeEscalation"] is False
    assert sc.get("privileged", False) is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_volumes_checkpoint_read_only_and_tmp_writable(manifests, overlay) -> None:
    objs = manifests[overlay]
    wl = workload(objs)
    volumes = {v["name"]: v for v in wl["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in _container(wl)["volumeMounts"]}
    claim = volumes[mounts["/checkpoints"]["name"]]["persistentVolumeClaim"]
    assert claim["readOnly"] is True and mounts["/checkpoints"]["readOnly"] is True
    assert claim["claimName"] == one(objs, "PersistentVolumeClaim")["metadata"]["name"]
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert not mounts["/tmp"].get("readOnly", False)
    assert config_data(objs)["LUTB_DEMO_DIR"].startswith("/tmp/")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_gpu_and_bounded_resources(manifests, overlay) -> None:
    resources = _container(workload(manifests[overlay]))["resources"]
    assert str(resources["requests"]["nvidia.com/gpu"]) == "1"
    assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
    for key in ("cpu", "memory", "ephemeral-storage"):
        assert key in resources["requests"] and key in resources["limits"], key


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_pinned(manifests, overlay) -> None:
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    for obj in manifests[overlay]:
        if "template" not in obj.get("spec", {}):
            continue
        spec = obj["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            image = c["image"]
            name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
            assert tag and tag != "latest" and "/" not in tag, image
            assert image in (f"{IMAGE}:{version}",) or "@sha256:" in image, image


def test_expert_parallel_shard_from_pod_ordinal(manifests) -> None:
    objs = manifests["expert-parallel"]
    sts = one(objs, "StatefulSet")
    env = _container(sts)["env"]
    names = [e["name"] for e in env]
    # Kubernetes expands $(POD_INDEX) only from variables defined earlier in the list.
    assert names.index("POD_INDEX") < names.index("LUTB_CHECKPOINT")
    pod_index = env[names.index("POD_INDEX")]["valueFrom"]["fieldRef"]["fieldPath"]
    assert pod_index == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env[names.index("LUTB_CHECKPOINT")]["value"] == "/checkpoints/shard-$(POD_INDEX)"
    assert "LUTB_CHECKPOINT" not in config_data(objs)  # env would win anyway; keep one source
    # Headless Service named as the StatefulSet's serviceName: pods resolve as
    # lutb-experts-N.lutb-experts.
    svc = one(objs, "Service")
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] == sts["metadata"]["name"] == "lutb-experts"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_single_is_one_deployment_behind_a_cluster_ip(manifests) -> None:
    objs = manifests["single"]
    dep = one(objs, "Deployment")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert one(objs, "Service")["spec"].get("clusterIP") != "None"
    env = {e["name"]: e.get("value") for e in _container(dep)["env"]}
    assert env["LUTB_CHECKPOINT"] == "/checkpoints"


def test_overlays_share_one_pod_shape(manifests) -> None:
    """The Deployment and the StatefulSet are written out separately (kustomize v2 has no
    components); everything but the checkpoint env and sizing must stay identical."""

    def shape(overlay: str) -> dict:
        container = dict(_container(workload(manifests[overlay])))
        container.pop("env")
        container.pop("resources")
        container["startupProbe"] = {k: v for k, v in container["startupProbe"].items() if k != "failureThreshold"}
        pod = dict(workload(manifests[overlay])["spec"]["template"]["spec"])
        pod.pop("topologySpreadConstraints", None)
        pod["containers"] = [container]
        return pod

    assert shape("single") == shape("expert-parallel")


def test_manifest_sources_are_plain_yaml() -> None:
    """Every file under deploy/ parses, and no `latest` tag hides in comments or patches."""
    for path in sorted(DEPLOY.rglob("*.yaml")):
        list(yaml.safe_load_all(path.read_text()))
        assert not re.search(r":latest\b", path.read_text()), path
